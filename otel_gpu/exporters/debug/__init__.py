"""``debug`` exporter: logs what passes, for trying a configuration (the OpenTelemetry Collector's ``debug``).

``verbosity: basic`` logs one summary line per batch, ``normal`` one line per span / log record / metric, ``detailed``
the whole request as OTLP/JSON. Trace and span ids are written as hex, as OTLP/JSON and every tracing UI write them.

Example config::

    exporters:
      debug: {verbosity: detailed}
"""
from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from otel_gpu.component import ComponentFactory, Exporter, ExportResult
from otel_gpu.pdata import Batch, Signal

__all__ = ["DebugExporter", "DebugExporterConfig", "FACTORY", "to_otlp_json"]

_logger = logging.getLogger(__name__)
_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})


@dataclass
class DebugExporterConfig:
    verbosity: str = "basic"  # basic | normal | detailed
    sampling_initial: int = 2  # accepted for compatibility with the Collector's keys; every batch is logged
    sampling_thereafter: int = 1
    use_internal_logger: bool = True

    def validate(self) -> None:
        if self.verbosity not in ("basic", "normal", "detailed"):
            raise ValueError(f"verbosity must be basic, normal or detailed (got {self.verbosity!r})")


def _hex_ids(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in _ID_KEYS and isinstance(v, str) else _hex_ids(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids(v) for v in node]
    return node


def to_otlp_json(message: Any) -> dict:
    """An OTLP request as OTLP/JSON: lowerCamelCase keys, ids in hex (json_format alone writes them in base64).

    >>> from opentelemetry.proto.trace.v1.trace_pb2 import Span
    >>> to_otlp_json(Span(trace_id=bytes(range(16)), span_id=b"\\x00" * 7 + b"\\x2a", name="step"))
    {'traceId': '000102030405060708090a0b0c0d0e0f', 'spanId': '000000000000002a', 'name': 'step'}
    """
    return _hex_ids(json_format.MessageToDict(message))


def _lines(batch: Batch) -> list[str]:
    msg = batch.message
    out = []
    if batch.signal is Signal.TRACES:
        for rs in msg.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    out.append(f"span {sp.name!r} trace_id={sp.trace_id.hex()} span_id={sp.span_id.hex()}"
                               + (f" parent_span_id={sp.parent_span_id.hex()}" if sp.parent_span_id else ""))
    elif batch.signal is Signal.LOGS:
        for rl in msg.resource_logs:
            for sl in rl.scope_logs:
                for rec in sl.log_records:
                    ids = f" trace_id={rec.trace_id.hex()} span_id={rec.span_id.hex()}" if rec.trace_id else ""
                    out.append(f"log {rec.event_name or '-'} {rec.severity_text or rec.severity_number}{ids} "
                               f"{rec.body.string_value[:200]!r}")
    else:
        for rm in msg.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    n = len(getattr(m, kind).data_points) if kind else 0
                    out.append(f"metric {m.name} {kind} points={n}")
    return out


class DebugExporter(Exporter):
    def export(self, batch: Batch) -> ExportResult:
        verbosity = self.config.verbosity
        if verbosity == "detailed":
            _logger.info("%s: %s\n%s", self.host.component_id, batch,
                         json.dumps(to_otlp_json(batch.message), indent=1))
        elif verbosity == "normal":
            _logger.info("%s: %s\n%s", self.host.component_id, batch, "\n".join(_lines(batch)))
        else:
            _logger.info("%s: %s", self.host.component_id, batch)
        return ExportResult.SUCCESS


FACTORY = ComponentFactory("debug", "exporter", DebugExporterConfig, DebugExporter,
                           description="Logs batches; for trying a configuration.")
