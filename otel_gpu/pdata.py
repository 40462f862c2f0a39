"""The batches that flow through a collector pipeline: one OTLP export request each, parsed only when needed.

A receiver that got bytes off the wire wraps them as they are (:meth:`Batch.from_bytes`); a pass-through pipeline
hands the same bytes to the OTLP exporter without ever building Python objects per span. A processor that reads the
batch uses :attr:`Batch.message` (parsed once, C-speed with the upb protobuf backend); one that changes it calls
:meth:`Batch.mutable`, which drops the cached bytes so that the exporter re-serializes.

Values: :func:`any_value` / :func:`set_any` turn a Python value into an OTLP ``AnyValue`` (as the OpenTelemetry SDK's
encoder does), :func:`to_python` turns one back, :func:`attributes` pre-builds ``KeyValue`` messages and
:func:`attributes_dict` reads them; :func:`iter_points` walks the data points of a metrics request. This is the one
place that converts; ``otel_gpu.otlp_build`` re-exports these names next to its request builders.

Example:
    >>> from otel_gpu.pdata import Batch, Signal
    >>> b = Batch.from_message(Signal.LOGS, Signal.LOGS.request_type()())
    >>> b.item_count()
    0
    >>> to_python(any_value({"rank": 3, "ops": ["all_reduce", b"\\x00"], "ok": True, "empty": {}}))
    {'rank': 3, 'ops': ['all_reduce', b'\\x00'], 'ok': True, 'empty': {}}
    >>> attributes_dict(attributes({"gpu.index": 2, "hw.type": "gpu"}))
    {'gpu.index': 2, 'hw.type': 'gpu'}
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

__all__ = ["Batch", "Signal", "MalformedBatch", "any_value", "attributes", "attributes_dict", "count_items",
           "iter_points", "set_any", "to_python"]


class Signal(str, enum.Enum):
    TRACES = "traces"
    METRICS = "metrics"
    LOGS = "logs"

    def request_type(self):
        return _REQUEST_TYPES[self]

    def response_type(self):
        return _RESPONSE_TYPES[self]


_REQUEST_TYPES = {
    Signal.TRACES: trace_service_pb2.ExportTraceServiceRequest,
    Signal.METRICS: metrics_service_pb2.ExportMetricsServiceRequest,
    Signal.LOGS: logs_service_pb2.ExportLogsServiceRequest,
}
_RESPONSE_TYPES = {
    Signal.TRACES: trace_service_pb2.ExportTraceServiceResponse,
    Signal.METRICS: metrics_service_pb2.ExportMetricsServiceResponse,
    Signal.LOGS: logs_service_pb2.ExportLogsServiceResponse,
}


class MalformedBatch(ValueError):
    """The bytes are not a valid OTLP export request of the signal."""


def count_items(signal: Signal, message: Any) -> int:
    """Spans, metric data points or log records in an export request (loops over resources and scopes only)."""
    if signal is Signal.TRACES:
        return sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans)
    if signal is Signal.LOGS:
        return sum(len(sl.log_records) for rl in message.resource_logs for sl in rl.scope_logs)
    total = 0
    for rm in message.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind is not None:
                    total += len(getattr(m, kind).data_points)
    return total


class Batch:
    """One OTLP export request of one signal, with its wire bytes cached while it is unchanged."""

    __slots__ = ("signal", "_raw", "_message", "_items")

    def __init__(self, signal: Signal, raw: bytes | None, message: Any | None):
        self.signal = signal
        self._raw = raw
        self._message = message
        self._items: int | None = None

    @classmethod
    def from_bytes(cls, signal: Signal, raw: bytes) -> Batch:
        """Parses (to validate and count) but keeps the bytes for a pass-through export.

        Raises:
            MalformedBatch: when ``raw`` is not an export request of ``signal``.
        """
        message = signal.request_type()()
        try:
            message.ParseFromString(raw)
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise MalformedBatch(f"malformed OTLP {signal.value} request: {exc}") from None
        return cls(signal, bytes(raw), message)

    @classmethod
    def from_message(cls, signal: Signal, message: Any) -> Batch:
        return cls(signal, None, message)

    @property
    def message(self) -> Any:
        """The parsed request, for reading. Call :meth:`mutable` before changing it."""
        if self._message is None:
            message = self.signal.request_type()()
            message.ParseFromString(self._raw)
            self._message = message
        return self._message

    def mutable(self) -> Any:
        """The parsed request, for changing: the cached wire bytes are dropped."""
        message = self.message
        self._raw = None
        self._items = None
        return message

    def to_bytes(self) -> bytes:
        if self._raw is None:
            self._raw = self._message.SerializeToString()
        return self._raw

    def item_count(self) -> int:
        if self._items is None:
            self._items = count_items(self.signal, self.message)
        return self._items

    def __repr__(self) -> str:
        return f"Batch({self.signal.value}, items={self.item_count()})"


# -- values ------------------------------------------------------------------------------------------------------
def any_value(value: Any) -> AnyValue:
    """A Python value as an OTLP ``AnyValue`` (bool, int, float, str, bytes, lists and mappings of these; None is the
    empty value; anything else becomes its ``str``)."""
    out = AnyValue()
    set_any(out, value)
    return out


def set_any(out: AnyValue, value: Any) -> None:
    """Fills ``out`` (e.g. ``kv.value`` or ``record.body`` of a message being built) with ``value``."""
    if isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, (bytes, bytearray)):
        out.bytes_value = bytes(value)
    elif isinstance(value, Mapping):
        kvlist = out.kvlist_value
        kvlist.SetInParent()  # an empty mapping stays a (empty) kvlist, as the SDK encodes it
        for k, v in value.items():
            set_any(kvlist.values.add(key=str(k)).value, v)
    elif isinstance(value, (list, tuple)):
        arr = out.array_value
        arr.SetInParent()
        for v in value:
            set_any(arr.values.add(), v)
    elif value is None:
        pass  # an empty AnyValue
    else:
        out.string_value = str(value)


def to_python(value: AnyValue) -> Any:
    """An ``AnyValue`` as a Python value (kvlist: dict, array: list, empty: None)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [to_python(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: to_python(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def attributes(attrs: Mapping[str, Any] | None) -> list[KeyValue]:
    """Pre-builds ``KeyValue`` messages, to reuse on every data point (keys may be schema ``Attr`` objects)."""
    out: list[KeyValue] = []
    for key, value in (attrs or {}).items():
        kv = KeyValue(key=str(key))
        set_any(kv.value, value)
        out.append(kv)
    return out


def attributes_dict(key_values: Iterable[KeyValue]) -> dict[str, Any]:
    """Repeated ``KeyValue`` (attributes of a resource, span, point or record) as a dict."""
    return {kv.key: to_python(kv.value) for kv in key_values}


def iter_points(request: Any) -> Iterable[tuple[Any, Any, dict[str, Any]]]:
    """Yields ``(metric, data_point, attributes as a dict)`` over a metrics export request."""
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind is None:
                    continue
                for dp in getattr(m, kind).data_points:
                    yield m, dp, attributes_dict(dp.attributes)
