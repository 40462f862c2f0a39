"""The small interfaces that collector components implement, and the host they are given.

A receiver starts, produces batches into its consumer, and shuts down. A processor takes a batch and returns one
(or ``None`` to drop it), and may emit batches of its own through its host. An exporter exports and returns an
:class:`ExportResult`; it must never block the caller for long: slow work belongs on its own thread.

Components meet only through these interfaces and :class:`otel_gpu.pdata.Batch`; none imports another.

Example (a receiver that produces one empty log batch when started)::

    from dataclasses import dataclass
    from otel_gpu.component import ComponentFactory, Receiver
    from otel_gpu.pdata import Batch, Signal

    @dataclass
    class HelloConfig:
        def validate(self) -> None: ...

    class HelloReceiver(Receiver):
        def start(self) -> None:
            self.host.consumer(Signal.LOGS).consume(Batch.from_message(Signal.LOGS, Signal.LOGS.request_type()()))

    FACTORY = ComponentFactory("hello", "receiver", HelloConfig, HelloReceiver, signals=(Signal.LOGS,))
"""
from __future__ import annotations

import abc
import collections
import enum
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from otel_gpu.pdata import Batch, Signal, event_name
from otel_gpu.schema import failure as _failure_schema
from otel_gpu.schema import health as _health_schema
from otel_gpu.schema import training as _training_schema

#: Log records that act: the store, the verdict API, the goodput ledger and ``otel-gpu run --restart`` take them as
#: the collector's own word (a failure record stops or restarts a job and runs its exclude hook; a device state puts
#: a node on the drain list; a goodput summary is what the report shows; a restart decision is a job's timeline).
#: Only this collector's processors, or a peer that authenticates as a trusted forwarder, may make them: from any
#: other sender a receiver's output drops them (counted in ``otel_gpu.collector.untrusted``) before any processor.
ACTING_EVENTS: frozenset[str] = frozenset({
    _failure_schema.FAILURE_EVENT.name, _failure_schema.GOODPUT_EVENT.name,
    _health_schema.STATE_CHANGE_EVENT.name, _training_schema.RESTART_EVENT.name})

__all__ = ["ACTING_EVENTS", "ComponentFactory", "ComponentHost", "Consumer", "ExportResult", "Exporter", "Extension",
           "IdentityCache", "Processor", "Receiver", "SelfTelemetry", "NullConsumer", "LogOnce", "TrustedConsumer",
           "drop_acting_records", "run_polling"]


class ExportResult(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # the batch was dropped (counted by the exporter)
    QUEUED = "queued"  # accepted for delivery on the exporter's own thread


class Consumer(Protocol):
    def consume(self, batch: Batch) -> None: ...


class NullConsumer:
    def consume(self, batch: Batch) -> None:
        return None

    def consume_trusted(self, batch: Batch) -> None:
        return None


class TrustedConsumer(Protocol):
    """A receiver's consumer (``host.consumer(signal)`` inside a collector): ``consume`` takes what any sender sent
    (records that act are dropped, see :data:`ACTING_EVENTS`); ``consume_trusted`` what an authenticated trusted
    forwarder sent (kept whole). Only a receiver that authenticated the sender may call ``consume_trusted``."""

    def consume(self, batch: Batch) -> None: ...
    def consume_trusted(self, batch: Batch) -> None: ...


class IdentityCache:
    """What a component derived from a resource's identity (its attributes), remembered for the next batch.

    Keyed by a 16-byte BLAKE2b digest of the resource's encoding, never by the resource itself: a sender's 4 MiB
    resources cost 16 bytes each here, not 4 MiB. At most ``max_entries`` are kept, the least recently used dropped
    first, so that a flood of distinct resources evicts only its own entries and costs a bounded amount of memory
    (honest senders repeat the same few resources and stay cached). Thread-safe (receivers call from many threads).

    Example:
        >>> from opentelemetry.proto.resource.v1.resource_pb2 import Resource
        >>> cache = IdentityCache(max_entries=2)
        >>> r = Resource(); r.attributes.add(key="host.name").value.string_value = "node-1"
        >>> key = cache.key(r); cache.get(key, "?"), cache.put(key, "node-1"), cache.get(key, "?")
        ('?', None, 'node-1')
        >>> len(key)
        16
    """

    __slots__ = ("max_entries", "_entries", "_lock")

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(resource: Any) -> bytes:
        return hashlib.blake2b(resource.SerializeToString(deterministic=True), digest_size=16).digest()

    def get(self, key: bytes, default: Any = None) -> Any:
        with self._lock:
            value = self._entries.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._entries.move_to_end(key)
            return value

    def put(self, key: bytes, value: Any) -> None:
        with self._lock:
            entries = self._entries
            entries[key] = value
            entries.move_to_end(key)
            while len(entries) > self.max_entries:
                entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


_MISSING = object()


def drop_acting_records(batch: Batch) -> tuple[Batch | None, int]:
    """``batch`` without the log records named in :data:`ACTING_EVENTS`, and how many were dropped.

    Traces and metrics pass as they are; a logs batch with none passes unchanged (its wire bytes kept); one with
    only such records becomes ``None``. The check is one event-name look-up per log record.
    """
    if batch.signal is not Signal.LOGS:
        return batch, 0
    message = batch.message
    found = False
    for rl in message.resource_logs:
        for sl in rl.scope_logs:
            for record in sl.log_records:
                if event_name(record) in ACTING_EVENTS:
                    found = True
                    break
            if found:
                break
        if found:
            break
    if not found:
        return batch, 0
    dropped = 0
    for rl in batch.mutable().resource_logs:
        for sl in rl.scope_logs:
            records = sl.log_records
            for i in range(len(records) - 1, -1, -1):
                if event_name(records[i]) in ACTING_EVENTS:
                    del records[i]
                    dropped += 1
    if batch.item_count() == 0:
        return None, dropped
    return batch, dropped


class SelfTelemetry(Protocol):
    """Counters of the collector's own telemetry (schema.collector), keyed by component id and signal."""

    def received(self, component: str, signal: Signal, n: int) -> None: ...
    def refused(self, component: str, signal: Signal, n: int) -> None: ...
    def exported(self, component: str, signal: Signal, n: int) -> None: ...
    def dropped(self, component: str, signal: Signal, n: int) -> None: ...
    def untrusted(self, component: str, signal: Signal, n: int) -> None: ...
    def truncated(self, component: str, signal: Signal, n: int) -> None: ...
    def series_refused(self, component: str, signal: Signal, n: int) -> None: ...
    def queue(self, component: str, size: int, capacity: int) -> None: ...


class LogOnce:
    """Logs a message once per key, so a broken NVML field or backend is reported once, not once per poll."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._seen: set[Any] = set()

    def __call__(self, key: Any, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        self._logger.log(level, msg, *args, **kwargs)  # kwargs: exc_info, stack_info (the runtime passes exc_info)


class ComponentHost:
    """What the runtime gives a component: its id, its downstream consumers per signal, self-telemetry, and the
    shared services (e.g. the Prometheus registry) other components published."""

    def __init__(self, component_id: str, telemetry: SelfTelemetry, consumers: dict[Signal, Consumer] | None = None,
                 services: dict[str, Any] | None = None):
        self.component_id = component_id
        self.telemetry = telemetry
        self._consumers: dict[Signal, Consumer] = consumers if consumers is not None else {}
        self.services: dict[str, Any] = services if services is not None else {}
        self.logger = logging.getLogger(f"otel_gpu.component.{component_id}")
        self.log_once = LogOnce(self.logger)

    def consumer(self, signal: Signal) -> Consumer:
        """Where batches of ``signal`` go next; a null consumer when no pipeline of that signal follows."""
        return self._consumers.get(signal) or NullConsumer()

    def has_consumer(self, signal: Signal) -> bool:
        return signal in self._consumers

    def emit(self, batch: Batch) -> None:
        """Sends a batch the component made itself downstream (processors: after this stage)."""
        self.consumer(batch.signal).consume(batch)


class Component(abc.ABC):
    def __init__(self, config: Any, host: ComponentHost):
        self.config = config
        self.host = host

    def start(self) -> None:  # noqa: B027 - optional hook
        """Acquire resources (sockets, threads). Raise to abort collector start-up with a clear message."""

    def shutdown(self, timeout_s: float = 5.0) -> None:  # noqa: B027 - optional hook
        """Flush and release; must return within ``timeout_s``."""


class Receiver(Component):
    """Produces batches into ``host.consumer(signal)``."""


class Processor(Component):
    @abc.abstractmethod
    def process(self, batch: Batch) -> Batch | None:
        """Returns the batch to pass on (the same, a changed or a new one), or None to drop it."""


class Exporter(Component):
    @abc.abstractmethod
    def export(self, batch: Batch) -> ExportResult:
        """Delivers a batch, or queues it for delivery. Must not block the caller on network I/O."""

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True


class Extension(Component):
    """Runs beside the pipelines (``extensions:``, listed in ``service.extensions``): started first, stopped last.
    ``host.services["ready"]()`` tells whether the collector's pipelines are running."""


@dataclass(frozen=True)
class ComponentFactory:
    """How the runtime builds a component: its type name, kind, config class and constructor.

    ``config_class`` is a dataclass with a default for every field and a ``validate()`` that raises ``ValueError``
    naming the bad key (relative to the component, e.g. ``"interval_s must be > 0 (got -1)"``).
    """

    type: str
    kind: str  # "receiver" | "processor" | "exporter"
    config_class: type
    create: Callable[[Any, ComponentHost], Component]
    signals: Iterable[Signal] = field(default=(Signal.TRACES, Signal.METRICS, Signal.LOGS))
    description: str = ""


def run_polling(host: ComponentHost, interval_s: float, stop: threading.Event, poll: Callable[[], Any],
                signal: Signal = Signal.METRICS) -> None:
    """A polling receiver's loop: calls ``poll()`` every ``interval_s`` until ``stop`` is set and sends the export
    request it returns (None: nothing this time). A failing poll is logged once and the loop goes on; an overrun skips
    the missed ticks rather than bursting."""
    next_t = time.monotonic()
    consumer = host.consumer(signal)
    while not stop.is_set():
        try:
            request = poll()
            if request is not None:
                consumer.consume(Batch.from_message(signal, request))
        except Exception:  # noqa: BLE001 - a receiver never takes the collector down
            host.log_once("poll", logging.ERROR, "%s: poll failed (logged once)", host.component_id, exc_info=True)
        next_t += interval_s
        delay = next_t - time.monotonic()
        if delay < 0:
            next_t, delay = time.monotonic(), 0.0
        stop.wait(delay)
