"""OTLP/JSON to protobuf: json_format with the OTLP twist that trace and span ids are hex strings, not base64."""
from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf import json_format

from otel_gpu.pdata import Batch, MalformedBatch, Signal

__all__ = ["batch_from_json"]

# Every bytes field of the OTLP data model is an id; OTLP/JSON writes them as hex (trace 32, span 16 digits).
_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})


def _hex_ids_to_base64(node: Any) -> None:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if isinstance(value, (dict, list)):
                    stack.append(value)
                elif key in _ID_KEYS and isinstance(value, str) and value:
                    try:
                        raw = bytes.fromhex(value)
                    except ValueError:
                        raise MalformedBatch(f"{key}: not a hex id ({value[:40]!r})") from None
                    item[key] = base64.b64encode(raw).decode("ascii")
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))


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
    _hex_ids_to_base64(data)
    message = signal.request_type()()
    try:
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    # SystemError: upb's field lookup fails that way on a key holding a lone surrogate ({"\ud800": 1}).
    except (json_format.ParseError, ValueError, TypeError, RecursionError, SystemError) as exc:
        raise MalformedBatch(f"malformed OTLP/JSON {signal.value} request: {exc}") from None
    return Batch.from_message(signal, message)
