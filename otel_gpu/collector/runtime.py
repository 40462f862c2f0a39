"""Builds pipelines from a validated config and runs their components' lifecycle.

Start order is exporters, processors, receivers (so nothing is received before it can go somewhere); shutdown is the
reverse, and each processor and exporter is flushed, so that SIGTERM loses nothing already accepted.

Processors are one instance per component id, shared by every pipeline that lists them (unlike the OpenTelemetry
Collector, which makes one per pipeline): the attribution processor must see traces, metrics and logs together.

Example:
    >>> from otel_gpu.collector.config import load_default
    >>> collector = Collector(load_default())   # doctest: +SKIP
    >>> collector.start(); collector.shutdown()  # doctest: +SKIP
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

from otel_gpu.collector.httpserver import HttpEndpoint
from otel_gpu.collector.security import BearerChecker, server_ssl_context
from otel_gpu.collector.config import CollectorConfig, ComponentSpec
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import (ACTING_EVENTS, READY, SELF_TELEMETRY_REGISTRY, Component, ComponentHost, Consumer,
                                Exporter, ExportResult, LogOnce, Processor, ServiceKey, Services, drop_acting_records)
from otel_gpu.pdata import Batch, Signal

__all__ = ["Collector", "StartError", "tune_gc_for_service", "GC_YOUNG_THRESHOLD"]

_logger = logging.getLogger(__name__)


class StartError(RuntimeError):
    """A component could not start (e.g. its port is taken); the message names the component."""


class _Fanout:
    __slots__ = ("targets",)

    def __init__(self, targets: list[Consumer]):
        self.targets = targets

    def consume(self, batch: Batch) -> None:
        for target in self.targets:
            target.consume(batch)


class _ExporterStage:
    """Calls one exporter, guarded: an exporter's bug drops (and counts) the batch, never the pipeline."""

    __slots__ = ("exporter", "cid", "telemetry", "log_once")

    def __init__(self, exporter: Exporter, cid: str, telemetry: PrometheusSelfTelemetry, log_once: LogOnce):
        self.exporter, self.cid, self.telemetry, self.log_once = exporter, cid, telemetry, log_once

    def consume(self, batch: Batch) -> None:
        try:
            result = self.exporter.export(batch)
        except Exception:  # noqa: BLE001 - an exporter must not take the pipeline down
            self.log_once(("export", self.cid), logging.ERROR, "exporter %s failed; batches are dropped and counted "
                          "(this is logged once)", self.cid, exc_info=True)
            result = ExportResult.FAILURE
        if result is ExportResult.SUCCESS:
            self.telemetry.exported(self.cid, batch.signal, batch.item_count())
        elif result is ExportResult.FAILURE:
            self.telemetry.dropped(self.cid, batch.signal, batch.item_count())


class _ProcessorStage:
    __slots__ = ("processor", "cid", "next", "telemetry", "log_once")

    def __init__(self, processor: Processor, cid: str, next_: Consumer, telemetry: PrometheusSelfTelemetry,
                 log_once: LogOnce):
        self.processor, self.cid, self.next, self.telemetry, self.log_once = processor, cid, next_, telemetry, log_once

    def consume(self, batch: Batch) -> None:
        try:
            out = self.processor.process(batch)
        except Exception:  # noqa: BLE001 - pass the batch on unprocessed rather than lose it
            self.log_once(("process", self.cid), logging.ERROR, "processor %s failed; batches pass through it "
                          "unprocessed (this is logged once)", self.cid, exc_info=True)
            out = batch
        if out is not None:
            self.next.consume(out)


class _ReceiverOutput:
    """A receiver's consumer for one signal: the trust boundary, then counts what it accepted and fans out.

    ``consume`` is what any sender sent: records that act (:data:`otel_gpu.component.ACTING_EVENTS`) are dropped
    here, before the first processor, counted in ``otel_gpu.collector.untrusted`` and logged once per receiver.
    ``consume_trusted`` is for what a receiver authenticated as a trusted forwarder (an aggregator's sidecars).
    """

    __slots__ = ("cid", "signal", "next", "telemetry", "log_once")

    def __init__(self, cid: str, signal: Signal, next_: Consumer, telemetry: PrometheusSelfTelemetry,
                 log_once: LogOnce):
        self.cid, self.signal, self.next, self.telemetry, self.log_once = cid, signal, next_, telemetry, log_once

    def consume(self, batch: Batch) -> None:
        out, dropped = drop_acting_records(batch)
        if dropped:
            self.telemetry.untrusted(self.cid, batch.signal, dropped)
            self.log_once(("untrusted", self.cid), logging.WARNING,
                          "receivers.%s: dropped %d %s record(s) from a sender that did not authenticate as a trusted "
                          "forwarder (only this collector's processors and trusted_forwarders may send them; "
                          "counted in otel_gpu.collector.untrusted; logged once)", self.cid, dropped,
                          "/".join(sorted(ACTING_EVENTS)))
        if out is not None:
            self.consume_trusted(out)

    def consume_trusted(self, batch: Batch) -> None:
        self.telemetry.received(self.cid, batch.signal, batch.item_count())
        self.next.consume(batch)


#: Allocations between two young-generation collections in a collector process (Python's default: 700).
GC_YOUNG_THRESHOLD = 10_000


def tune_gc_for_service() -> None:
    """Garbage collection for a collector process (``otel-gpu collector`` calls it once its pipelines started).

    A collector's heap is large and mostly acyclic: per-rank and per-device state that lives as long as its job,
    and per-request objects that die young (decoded JSON, protobuf wrappers). With Python's default thresholds a
    young collection ran every few hundred allocations and the older generations were scanned again and again: at
    2,048 nodes of digests that was about 20% of the aggregator's CPU, inside whatever was allocating (JSON decoding
    seemed to cost 67 us a digest instead of 17; benchmarks/aggregator_scale.py). What exists at start-up (modules,
    protobuf descriptors, configuration) is frozen out of every later collection, and young collections run every
    GC_YOUNG_THRESHOLD allocations. Reference cycles are still collected, a little later."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), middle, old)


class Collector:
    """A running set of pipelines. Thread-safe ``start`` / ``shutdown``; ``wait`` blocks until shut down."""

    def __init__(self, config: CollectorConfig, *, telemetry: PrometheusSelfTelemetry | None = None,
                 services: dict[ServiceKey[Any], Any] | None = None):
        self.config = config
        self.telemetry = telemetry or PrometheusSelfTelemetry()
        self._ready = threading.Event()
        self.services = Services({SELF_TELEMETRY_REGISTRY: self.telemetry.registry, READY: self._ready.is_set,
                                  **(services or {})})
        self._telemetry_endpoints: list[HttpEndpoint] = []
        self._components: dict[str, Component] = {}  # "<kind>:<id>" -> instance
        self._hosts: dict[str, ComponentHost] = {}
        self._started: list[str] = []
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._log_once = LogOnce(_logger)
        self._build()

    # -- wiring --------------------------------------------------------------------------------------------------
    def _instance(self, spec: ComponentSpec) -> Component:
        key = f"{spec.kind}:{spec.id}"
        if key not in self._components:
            host = ComponentHost(spec.id, self.telemetry, {}, self.services)
            self._hosts[key] = host
            self._components[key] = spec.factory.create(spec.config, host)
        return self._components[key]

    def _build(self) -> None:
        cfg = self.config
        exporter_stages: dict[str, _ExporterStage] = {}
        processor_next: dict[str, dict[Signal, list[Consumer]]] = {}
        receiver_next: dict[str, dict[Signal, list[Consumer]]] = {}
        for pipe in cfg.pipelines:
            targets: list[Consumer] = []
            for cid in pipe.exporters:
                spec = cfg.component("exporter", cid)
                if cid not in exporter_stages:
                    exporter_stages[cid] = _ExporterStage(self._instance(spec), cid, self.telemetry,
                                                          LogOnce(_logger))
                targets.append(exporter_stages[cid])
            head: Consumer = targets[0] if len(targets) == 1 else _Fanout(targets)
            for cid in reversed(pipe.processors):
                spec = cfg.component("processor", cid)
                proc = self._instance(spec)
                assert isinstance(proc, Processor)
                processor_next.setdefault(cid, {}).setdefault(pipe.signal, []).append(head)
                head = _ProcessorStage(proc, cid, head, self.telemetry, LogOnce(_logger))
            for cid in pipe.receivers:
                self._instance(cfg.component("receiver", cid))
                receiver_next.setdefault(cid, {}).setdefault(pipe.signal, []).append(head)
        for cid in cfg.extensions:
            self._instance(cfg.component("extension", cid))
        # A processor's host.emit() goes to what follows it, in every pipeline of the batch's signal.
        for cid, by_signal in processor_next.items():
            host = self._hosts[f"processor:{cid}"]
            for signal, nexts in by_signal.items():
                host._consumers[signal] = nexts[0] if len(nexts) == 1 else _Fanout(nexts)
        for cid, by_signal in receiver_next.items():
            host = self._hosts[f"receiver:{cid}"]
            for signal, nexts in by_signal.items():
                fan = nexts[0] if len(nexts) == 1 else _Fanout(nexts)
                host._consumers[signal] = _ReceiverOutput(cid, signal, fan, self.telemetry, LogOnce(_logger))

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def _ordered(self) -> list[str]:
        order = {"extension": -1, "exporter": 0, "processor": 1, "receiver": 2}
        extensions = self.config.extensions
        return sorted(self._components, key=lambda k: (order[k.partition(":")[0]], extensions.index(
            k.partition(":")[2]) if k.startswith("extension:") else 0))

    @property
    def telemetry_ports(self) -> list[int]:
        """Ports serving ``service.telemetry.metrics`` (useful with port 0)."""
        return [e.port for e in self._telemetry_endpoints]

    def _serve_self_metrics(self, method: str, path: str):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if path != "/metrics":
            return 404, "text/plain; charset=utf-8", b"not found: the collector's own metrics are at /metrics\n"
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.telemetry.registry)

    def _start_telemetry(self) -> None:
        cfg = self.config.telemetry.metrics
        addresses = cfg.addresses()
        if not addresses:
            return
        try:
            authorize = BearerChecker(cfg.auth, "service.telemetry.metrics.auth.bearer_token").check \
                if cfg.auth is not None else None
            ssl_context = server_ssl_context(cfg.tls, "service.telemetry.metrics.tls") if cfg.tls is not None else None
        except ValueError as exc:
            raise StartError(str(exc)) from None
        for host, port in addresses:
            try:
                endpoint = HttpEndpoint(host, port, self._serve_self_metrics, "otel-gpu-self-metrics",
                                        ssl_context=ssl_context, authorize=authorize,
                                        max_connections=cfg.max_connections)
            except OSError as exc:
                raise StartError(f"service.telemetry.metrics: cannot listen on {host}:{port}: "
                                 f"{exc.strerror or exc}; set another address or level: none") from None
            endpoint.start()
            self._telemetry_endpoints.append(endpoint)
            _logger.info("collector's own metrics on %s://%s:%d/metrics%s", "https" if ssl_context else "http", host,
                         endpoint.port, " (bearer-token auth)" if authorize else "")

    def start(self) -> None:
        """Starts every component; on failure stops what started and raises :class:`StartError`."""
        with self._lock:
            try:
                self._start_telemetry()
            except StartError:
                self._shutdown_locked(timeout_s=5.0)
                raise
            for key in self._ordered():
                kind, _, cid = key.partition(":")
                try:
                    self._components[key].start()
                except Exception as exc:
                    self._shutdown_locked(timeout_s=5.0)
                    raise StartError(f"{kind}s.{cid}: could not start: {exc}") from exc
                self._started.append(key)
            self._ready.set()
            _logger.info("otel-gpu collector started: %s", ", ".join(
                f"{p.name} [{', '.join(p.receivers)} -> {', '.join(p.processors) or '-'} -> {', '.join(p.exporters)}]"
                for p in self.config.pipelines))

    def _shutdown_locked(self, timeout_s: float) -> None:
        self._ready.clear()
        deadline = time.monotonic() + timeout_s
        for key in reversed(self._started):
            component = self._components[key]
            remaining = max(0.5, deadline - time.monotonic())
            try:
                if isinstance(component, Exporter):
                    component.force_flush(remaining)
                component.shutdown(remaining)
            except Exception:
                _logger.exception("%s: error during shutdown", key.replace(":", "s.", 1))
        self._started.clear()
        for endpoint in self._telemetry_endpoints:
            endpoint.stop(1.0)
        self._telemetry_endpoints.clear()
        self._stopped.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops receivers first, then flushes and stops processors and exporters."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._shutdown_locked(timeout_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stopped.wait(timeout_s)

    def component(self, kind: str, cid: str) -> Component:
        return self._components[f"{kind}:{cid}"]
