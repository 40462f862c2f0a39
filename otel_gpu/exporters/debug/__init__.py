"""``debug`` exporter: logs what passes, for trying a configuration (the OpenTelemetry Collector's ``debug``).

``verbosity: basic`` logs one summary line per batch, ``normal`` one line per span / log record / metric, ``detailed``
the whole request as OTLP/JSON (:func:`otel_gpu.pdata.to_json`: trace and span ids in hex, as every tracing UI
writes them, enums as integers).

Example config::

    exporters:
      debug: {verbosity: detailed}
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from otel_gpu.component import ComponentFactory, Exporter, ExportResult
from otel_gpu.pdata import Batch, Signal, data_points, log_records, metrics, spans, to_json, to_python

__all__ = ["DebugExporter", "DebugExporterConfig", "FACTORY"]

_logger = logging.getLogger(__name__)


@dataclass
class DebugExporterConfig:
    verbosity: str = "basic"  # basic | normal | detailed
    sampling_initial: int = 2  # accepted for compatibility with the Collector's keys; every batch is logged
    sampling_thereafter: int = 1
    use_internal_logger: bool = True

    def validate(self) -> None:
        if self.verbosity not in ("basic", "normal", "detailed"):
            raise ValueError(f"verbosity must be basic, normal or detailed (got {self.verbosity!r})")


def _text(body) -> str:
    value = to_python(body, json_safe=True)
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)


def _lines(batch: Batch) -> list[str]:
    msg = batch.message
    if batch.signal is Signal.TRACES:
        return [f"span {sp.name!r} trace_id={sp.trace_id.hex()} span_id={sp.span_id.hex()}"
                + (f" parent_span_id={sp.parent_span_id.hex()}" if sp.parent_span_id else "")
                for _, _, sp in spans(msg)]
    if batch.signal is Signal.LOGS:
        return [f"log {rec.event_name or '-'} {rec.severity_text or rec.severity_number}"
                + (f" trace_id={rec.trace_id.hex()} span_id={rec.span_id.hex()}" if rec.trace_id else "")
                + f" {_text(rec.body)[:200]!r}" for _, _, rec in log_records(msg)]
    return [f"metric {m.name} {m.WhichOneof('data')} points={len(data_points(m))}" for _, _, m in metrics(msg)]


class DebugExporter(Exporter):
    def export(self, batch: Batch) -> ExportResult:
        verbosity = self.config.verbosity
        if verbosity == "detailed":
            _logger.info("%s: %s\n%s", self.host.component_id, batch,
                         json.dumps(to_json(batch.message), indent=1))
        elif verbosity == "normal":
            _logger.info("%s: %s\n%s", self.host.component_id, batch, "\n".join(_lines(batch)))
        else:
            _logger.info("%s: %s", self.host.component_id, batch)
        return ExportResult.SUCCESS


FACTORY = ComponentFactory("debug", "exporter", DebugExporterConfig, DebugExporter,
                           description="Logs batches; for trying a configuration.")
