"""The ``batch`` processor: merges requests per signal, passes them on by size or age, splits oversized ones.

One instance serves every pipeline that lists it (the runtime shares processors); what it holds is passed on with
``host.emit`` (by the timer) or returned from ``process`` (when the size is reached). Shutdown passes on what waits.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from otel_gpu.component import Processor
from otel_gpu.pdata import Batch, Signal, count_items, data_points
from otel_gpu.processors.batch.config import BatchConfig

__all__ = ["BatchProcessor", "split"]


def _weight(signal: Signal, item: Any) -> int:
    return len(data_points(item)) if signal is Signal.METRICS else 1


def split(signal: Signal, message: Any, max_items: int) -> list[Any]:
    """``message`` cut into requests of at most ``max_items`` items (spans, log records, metric data points), each
    item under a copy of its resource and scope. A metric's points stay together, so a metric with more points than
    ``max_items`` goes alone in its request.

    >>> from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    >>> req = ExportTraceServiceRequest()
    >>> ss = req.resource_spans.add().scope_spans.add()
    >>> for i in range(5): _ = ss.spans.add(name=f"s{i}")
    >>> [count_items(Signal.TRACES, r) for r in split(Signal.TRACES, req, 2)]
    [2, 2, 1]
    """
    if max_items <= 0 or count_items(signal, message) <= max_items:
        return [message]
    res_key, scope_key, item_key = signal.fields
    out: list[Any] = []
    current, room = None, 0
    for res in getattr(message, res_key):
        for scope in getattr(res, scope_key):
            target_scope = None
            for item in getattr(scope, item_key):
                weight = _weight(signal, item)
                if current is None or (weight > room and room < max_items):
                    current, room, target_scope = signal.request_type()(), max_items, None
                    out.append(current)
                if target_scope is None:
                    target_res = getattr(current, res_key).add()
                    target_res.resource.CopyFrom(res.resource)
                    target_res.schema_url = res.schema_url
                    target_scope = getattr(target_res, scope_key).add()
                    target_scope.scope.CopyFrom(scope.scope)
                    target_scope.schema_url = scope.schema_url
                getattr(target_scope, item_key).add().CopyFrom(item)
                room -= weight
            # the next scope starts a new scope (and resource) entry in the current request
    return out or [message]


class BatchProcessor(Processor):
    config: BatchConfig

    def __init__(self, config: BatchConfig, host):
        super().__init__(config, host)
        self._lock = threading.Lock()
        self._pending: dict[Signal, tuple[Any, int, float]] = {}  # signal -> (merged request, items, first arrival)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.config.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name=f"otel-gpu-{self.host.component_id}",
                                            daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._flush(lambda _age: True)

    def _run(self) -> None:
        period = min(self.config.timeout_s, 1.0) / 2
        while not self._stop.wait(period):
            now = time.monotonic()
            self._flush(lambda since: now - since >= self.config.timeout_s)

    def _flush(self, due) -> None:
        with self._lock:
            ready = [(signal, merged) for signal, (merged, _n, since) in self._pending.items() if due(since)]
            for signal, _ in ready:
                del self._pending[signal]
        for signal, merged in ready:
            for part in split(signal, merged, self.config.send_batch_max_size):
                self.host.emit(Batch.from_message(signal, part))

    def process(self, batch: Batch) -> Batch | None:
        cfg = self.config
        items = batch.item_count()
        if cfg.timeout_s == 0:
            parts = split(batch.signal, batch.message, cfg.send_batch_max_size)
            if len(parts) == 1:
                return batch
            for part in parts[:-1]:
                self.host.emit(Batch.from_message(batch.signal, part))
            return Batch.from_message(batch.signal, parts[-1])
        with self._lock:
            merged, count, since = self._pending.get(batch.signal, (None, 0, time.monotonic()))
            if merged is None:
                merged = batch.signal.request_type()()
            merged.MergeFrom(batch.message)  # repeated resources are appended
            count += items
            if count < cfg.send_batch_size:
                self._pending[batch.signal] = (merged, count, since)
                return None
            self._pending.pop(batch.signal, None)
        parts = split(batch.signal, merged, cfg.send_batch_max_size)
        for part in parts[:-1]:
            self.host.emit(Batch.from_message(batch.signal, part))
        return Batch.from_message(batch.signal, parts[-1])
