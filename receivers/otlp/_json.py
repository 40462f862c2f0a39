"""OTLP/JSON to protobuf: json_format with the OTLP twist that trace and span ids are hex strings, not base64."""
from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf import json_format

from otel_gpu.pdata import Batch, MalformedBatch, Signal

__all__ = ["batch_from_json"]

# Where the OTLP data model has ids (its only bytes fields): OTLP/JSON writes them as hex (trace 32, span 16 digits).
# Only these places are converted: an unknown field is ignored whatever it holds, as the OTLP specification asks.
# Each level accepts the lowerCamelCase name of OTLP/JSON and the proto field name (json_format reads both).
_ID_KEYS = ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id")
_POINT_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "exponential_histogram", "summary")


def _items(node: Any, *keys: str) -> list:
    """The list under the first of ``keys`` that ``node`` (a dict) holds; [] for anything else."""
    if isinstance(node, dict):
        for key in keys:
            value = node.get(key)
            if isinstance(value, list):
                return value
    return []


def _convert_ids(item: Any) -> None:
    if not isinstance(item, dict):
        return
    for key in _ID_KEYS:
        value = item.get(key)
        if isinstance(value, str) and value:
            try:
                raw = bytes.fromhex(value)
            except ValueError:
                raise MalformedBatch(f"{key}: not a hex id ({value[:40]!r})") from None
            item[key] = base64.b64encode(raw).decode("ascii")


def _hex_ids_to_base64(data: dict, signal: Signal) -> None:
    if signal is Signal.TRACES:
        for rs in _items(data, "resourceSpans", "resource_spans"):
            for ss in _items(rs, "scopeSpans", "scope_spans"):
                for span in _items(ss, "spans"):
                    _convert_ids(span)
                    for link in _items(span, "links"):
                        _convert_ids(link)
    elif signal is Signal.LOGS:
        for rl in _items(data, "resourceLogs", "resource_logs"):
            for sl in _items(rl, "scopeLogs", "scope_logs"):
                for record in _items(sl, "logRecords", "log_records"):
                    _convert_ids(record)
    else:
        for rm in _items(data, "resourceMetrics", "resource_metrics"):
            for sm in _items(rm, "scopeMetrics", "scope_metrics"):
                for metric in _items(sm, "metrics"):
                    for kind in _POINT_KINDS:
                        for point in _items(metric.get(kind) if isinstance(metric, dict) else None,
                                            "dataPoints", "data_points"):
                            for exemplar in _items(point, "exemplars"):
                                _convert_ids(exemplar)


def batch_from_json(signal: Signal, body: bytes) -> Batch:
    """Parses an OTLP/JSON export request (unknown fields ignored, as the OTLP spec asks of receivers).

    Raises:
        MalformedBatch: not JSON, not an export request of ``signal``, or an id that is not hex.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise MalformedBatch(f"malformed OTLP/JSON {signal.value} request: {exc}") from None
    if not isinstance(data, dict):
        raise MalformedBatch(f"malformed OTLP/JSON {signal.value} request: the top level must be an object")
    _hex_ids_to_base64(data, signal)
    message = signal.request_type()()
    try:
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    # SystemError: upb's field lookup fails that way on a key holding a lone surrogate ({"\ud800": 1}).
    except (json_format.ParseError, ValueError, TypeError, RecursionError, SystemError) as exc:
        raise MalformedBatch(f"malformed OTLP/JSON {signal.value} request: {exc}") from None
    return Batch.from_message(signal, message)
