"""Trace and span ids as the OTLP specification defines them: a trace id is 16 bytes, a span id 8, neither all zero.

A span without a valid trace id and span id (wrong length, empty, zero) or with a parent span id that is neither empty
nor 8 bytes, and a log record whose (optional) ids are neither empty nor the right length make the whole request
invalid: it is refused with HTTP 400 / gRPC INVALID_ARGUMENT, as the OpenTelemetry Collector refuses a request whose
ids fail to decode. Span links and metric exemplars are not checked: reading them costs as much again per span, and
otel-gpu reads neither. The check is one inline loop (about a fifth of the protobuf parse on this machine); the
message naming the item is built only once something is wrong.
"""
from __future__ import annotations

from typing import Any

from otel_gpu.pdata import MalformedBatch, Signal

__all__ = ["check_ids"]

_ZERO16, _ZERO8 = bytes(16), bytes(8)


def _bad_span(span) -> str | None:
    tid, sid, parent = span.trace_id, span.span_id, span.parent_span_id
    if len(tid) != 16 or tid == _ZERO16:
        return f"trace_id of {len(tid)} bytes{' (all zero)' if tid and not any(tid) else ''}; a trace id is 16 " \
               f"bytes, not all zero"
    if len(sid) != 8 or sid == _ZERO8:
        return f"span_id of {len(sid)} bytes{' (all zero)' if sid and not any(sid) else ''}; a span id is 8 bytes, " \
               f"not all zero"
    if parent and len(parent) != 8:
        return f"parent_span_id of {len(parent)} bytes; a span id is 8 bytes (or empty for a root span)"
    return None


def _raise_first_bad(message: Any) -> None:
    for r, rs in enumerate(message.resource_spans):
        for s, ss in enumerate(rs.scope_spans):
            for i, span in enumerate(ss.spans):
                problem = _bad_span(span)
                if problem is not None:
                    raise MalformedBatch(f"resource_spans[{r}].scope_spans[{s}].spans[{i}]: {problem}")


def check_ids(signal: Signal, message: Any) -> None:
    """Raises MalformedBatch naming the first item with an invalid id."""
    if signal is Signal.TRACES:
        zero16, zero8 = _ZERO16, _ZERO8
        for rs in message.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    tid, sid = span.trace_id, span.span_id
                    if len(tid) != 16 or len(sid) != 8 or tid == zero16 or sid == zero8:
                        _raise_first_bad(message)
                    parent = span.parent_span_id
                    if parent and len(parent) != 8:
                        _raise_first_bad(message)
    elif signal is Signal.LOGS:
        for r, rl in enumerate(message.resource_logs):
            for s, sl in enumerate(rl.scope_logs):
                for i, rec in enumerate(sl.log_records):
                    tl, sl_ = len(rec.trace_id), len(rec.span_id)
                    if tl not in (0, 16) or sl_ not in (0, 8):
                        raise MalformedBatch(f"resource_logs[{r}].scope_logs[{s}].log_records[{i}]: trace_id of {tl} "
                                             f"and span_id of {sl_} bytes; they are 16 and 8 bytes, or empty")
