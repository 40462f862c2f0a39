"""A ``capture`` exporter that keeps every batch it gets, for tests that run a real Collector.

It is not in the built-in table; a test adds it for its own run::

    monkeypatch.setitem(registry.BUILTIN["exporter"], "capture", "otel_gpu.testing.capture")
    collector = Collector(load_text(yaml_with_a_capture_exporter))
    exporter = collector.component("exporter", "capture")
    exporter.wait_for(lambda e: e.log_records(), timeout_s=5)

Example:
    >>> from otel_gpu.testing.capture import FACTORY
    >>> FACTORY.type
    'capture'
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_gpu.component import ComponentFactory, Exporter, ExportResult
from otel_gpu.otlp_build import iter_points, to_python
from otel_gpu.pdata import Batch, Signal

__all__ = ["CaptureExporter", "CaptureExporterConfig", "FACTORY"]


@dataclass
class CaptureExporterConfig:
    def validate(self) -> None:
        return None


class CaptureExporter(Exporter):
    def __init__(self, config: CaptureExporterConfig, host: Any):
        super().__init__(config, host)
        self.batches: list[Batch] = []
        self._cond = threading.Condition()

    def export(self, batch: Batch) -> ExportResult:
        with self._cond:
            self.batches.append(batch)
            self._cond.notify_all()
        return ExportResult.SUCCESS

    def of(self, signal: Signal) -> list[Batch]:
        with self._cond:
            return [b for b in self.batches if b.signal is signal]

    def points(self, name: str | None = None) -> list[tuple[Any, Any, dict[str, Any], dict[str, Any]]]:
        """``(metric, point, attributes, resource attributes)`` of every metric point (of ``name``), oldest first."""
        out = []
        for batch in self.of(Signal.METRICS):
            for rm in batch.message.resource_metrics:
                resource = {kv.key: to_python(kv.value) for kv in rm.resource.attributes}
                single = type(batch.message)()
                single.resource_metrics.add().CopyFrom(rm)
                for m, dp, attrs in iter_points(single):
                    if name is None or m.name == name:
                        out.append((m, dp, attrs, resource))
        return out

    def log_records(self, event_name: str | None = None) -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
        """``(record, attributes, resource attributes)`` of every log record (named ``event_name``)."""
        out = []
        for batch in self.of(Signal.LOGS):
            for rl in batch.message.resource_logs:
                resource = {kv.key: to_python(kv.value) for kv in rl.resource.attributes}
                for sl in rl.scope_logs:
                    for r in sl.log_records:
                        if event_name is None or r.event_name == event_name:
                            out.append((r, {kv.key: to_python(kv.value) for kv in r.attributes}, resource))
        return out

    def wait_for(self, predicate: Callable[[CaptureExporter], Any], timeout_s: float = 5.0) -> Any:
        """Waits until ``predicate(self)`` is truthy and returns its value; raises TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate(self)
            if value:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout_s} s ({len(self.batches)} batches captured)")
            with self._cond:
                self._cond.wait(min(remaining, 0.05))


FACTORY = ComponentFactory("capture", "exporter", CaptureExporterConfig, CaptureExporter,
                           description="Keeps every batch (tests only).")
