"""The small interfaces that collector components implement, and the host they are given.

A receiver starts, produces batches into its consumer, and shuts down. A processor takes a batch and returns one
(or ``None`` to drop it), and may emit batches of its own through its host. An exporter exports and returns an
:class:`ExportResult`; it must never block the caller for long: slow work belongs on its own thread.

Components meet only through these interfaces, :class:`otel_gpu.pdata.Batch` and the typed services below; none
imports another. A component that offers something to others publishes it under a :class:`ServiceKey` declared here,
with the Protocol it satisfies; a component that uses it asks for the same key and gets ``None`` when nobody
published one (a feature turns off visibly: the key is an import, not a string). The edges today:

================================ ============================== ===========================================
key                              published by                   read by
================================ ============================== ===========================================
:data:`FAILURE_HISTORY`          the ``store`` exporter         the ``attribution`` processor (recurrence)
:data:`DEVICE_HISTORY`           the ``store`` exporter         the ``health`` processor (states, culprits)
:data:`DEVICE_HEALTH`            the ``health`` processor       the ``attribution`` processor (device context)
:data:`ADMISSION` (many)         the ``memory_limiter``         the ``otlp`` receiver (refuse under pressure)
:data:`READY`                    the collector runtime          the ``health_check`` extension
:data:`SELF_TELEMETRY_REGISTRY`  the collector runtime          the ``prometheus`` exporter (one scrape page)
================================ ============================== ===========================================

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
import builtins
import collections
import enum
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

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

__all__ = ["ACTING_EVENTS", "COMPONENT_STATUS", "ComponentFactory", "ComponentHost", "Consumer", "ExportResult",
           "Exporter", "Extension", "IdentityCache", "Processor", "Receiver", "SelfTelemetry", "NullConsumer", "LogOnce",
           "TrustedConsumer", "drop_acting_records", "run_polling", "ServiceKey", "Services",
           "FailureHistoryService", "DeviceHistoryService", "DeviceHealthService", "AdmissionCheck",
           "FAILURE_HISTORY", "DEVICE_HISTORY", "DEVICE_HEALTH", "ADMISSION", "READY", "SELF_TELEMETRY_REGISTRY"]

T = TypeVar("T")
_logger = logging.getLogger(__name__)


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


class FailureHistoryService(Protocol):
    """How often a failure signature was recorded before (the store's, across jobs and collector restarts)."""

    def recurrence(self, signature: str) -> int: ...


class DeviceHistoryService(Protocol):
    """Device states and how often each device was a failure's culprit (the store's)."""

    def device_states(self) -> list[dict[str, Any]]: ...
    def culprit_counts(self, window_s: float | None = None, *, now: float | None = None,
                       device_ids: list[str] | None = None) -> dict[str, dict[str, Any]]: ...


class DeviceHealthService(Protocol):
    """The health processor's view of a failure's culprit devices: their states, history and evidence."""

    def failure_context(self, *, host: str | None, gpu: str | None, job_id: str, category: str,
                        time_s: float) -> dict[str, Any]: ...


class AdmissionCheck(Protocol):
    """Asked before a receiver accepts a request: None to accept, else the reason to refuse (retry later)."""

    def __call__(self) -> Any: ...


@dataclass(frozen=True, eq=False)
class ServiceKey(Generic[T]):
    """The name of a service one component publishes for others, with the Protocol it satisfies.

    Keys compare by identity: two keys with the same name are two services, and a typo is a NameError at import.
    ``many``: several components may publish (each ``publish`` adds one); ``get`` returns them all, as a tuple.
    """

    name: str
    protocol: Any
    many: bool = False

    def __repr__(self) -> str:
        return f"ServiceKey({self.name!r})"


FAILURE_HISTORY: ServiceKey[FailureHistoryService] = ServiceKey("failure_history", FailureHistoryService)
DEVICE_HISTORY: ServiceKey[DeviceHistoryService] = ServiceKey("device_history", DeviceHistoryService)
DEVICE_HEALTH: ServiceKey[DeviceHealthService] = ServiceKey("device_health", DeviceHealthService)
ADMISSION: ServiceKey[AdmissionCheck] = ServiceKey("admission", AdmissionCheck, many=True)
READY: ServiceKey[Callable[[], bool]] = ServiceKey("ready", Callable)
SELF_TELEMETRY_REGISTRY: ServiceKey[Any] = ServiceKey("self_telemetry_registry", Any)  # a prometheus CollectorRegistry
#: Each a callable -> (component, why it runs degraded, or None): a store that cannot write says so here, for the
#: health check, while the rest of the collector goes on (issue 21).
COMPONENT_STATUS: ServiceKey[Callable[[], tuple[str, str | None]]] = ServiceKey("component_status", Callable, many=True)


class Services:
    """The services components published for each other, by :class:`ServiceKey` (see the module docstring).

    Example:
        >>> services = Services()
        >>> services.get(FAILURE_HISTORY) is None
        True
        >>> class History:
        ...     def recurrence(self, signature): return 2
        >>> services.publish(FAILURE_HISTORY, History())
        >>> services.get(FAILURE_HISTORY).recurrence("sig")
        2
        >>> services.publish(ADMISSION, lambda: None); services.publish(ADMISSION, lambda: "full")
        >>> [check() for check in services.get(ADMISSION)]
        [None, 'full']
        >>> services.get("failure_history")
        Traceback (most recent call last):
        ...
        TypeError: services are asked for by ServiceKey (otel_gpu.component), not by 'failure_history'
    """

    def __init__(self, initial: dict[ServiceKey[Any], Any] | None = None):
        self._by_key: dict[ServiceKey[Any], Any] = {}
        for key, value in (initial or {}).items():
            if key.many:
                for one in value:
                    self.publish(key, one)
            else:
                self.publish(key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if not isinstance(key, ServiceKey):
            raise TypeError(f"services are asked for by ServiceKey (otel_gpu.component), not by {key!r}")

    def publish(self, key: ServiceKey[T], service: T) -> None:
        """Offers ``service`` under ``key``; for a single-valued key a second publisher replaces the first (logged)."""
        self._check(key)
        if key.many:
            self._by_key.setdefault(key, []).append(service)
            return
        if key in self._by_key and self._by_key[key] is not service:
            _logger.warning("service %s published twice: the later one wins", key.name)
        self._by_key[key] = service

    def get(self, key: ServiceKey[T]) -> T | None:
        """The service published under ``key``, or None (a ``many`` key: a tuple of every one, maybe empty)."""
        self._check(key)
        if key.many:
            return tuple(self._by_key.get(key, ()))  # type: ignore[return-value]
        return self._by_key.get(key)

    def __getitem__(self, key: ServiceKey[T]) -> T:
        found = self.get(key)
        if found is None:
            raise KeyError(f"no component published {key.name}")
        return found

    def __contains__(self, key: object) -> bool:
        return key in self._by_key


class ComponentHost:
    """What the runtime gives a component: its id, its downstream consumers per signal, self-telemetry, and the
    shared services (e.g. the Prometheus registry) other components published."""

    def __init__(self, component_id: str, telemetry: SelfTelemetry, consumers: dict[Signal, Consumer] | None = None,
                 services: Services | dict[ServiceKey[Any], Any] | None = None):
        self.component_id = component_id
        self.telemetry = telemetry
        self._consumers: dict[Signal, Consumer] = consumers if consumers is not None else {}
        self.services: Services = services if isinstance(services, Services) else Services(services)
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
    ``host.services.get(READY)()`` tells whether the collector's pipelines are running."""


@dataclass(frozen=True)
class ComponentFactory:
    """How the runtime builds a component: its type name, kind, config class and constructor.

    ``config_class`` is a dataclass with a default for every field and a ``validate()`` that raises ``ValueError``
    naming the bad key (relative to the component, e.g. ``"interval_s must be > 0 (got -1)"``).
    """

    type: str
    kind: str  # "receiver" | "processor" | "exporter"
    config_class: builtins.type
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
