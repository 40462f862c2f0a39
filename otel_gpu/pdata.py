"""The batches that flow through a collector pipeline: one OTLP export request each, parsed only when needed.

A receiver that got bytes off the wire wraps them as they are (:meth:`Batch.from_bytes`); a pass-through pipeline
hands the same bytes to the OTLP exporter without ever building Python objects per span. A processor that reads the
batch uses :attr:`Batch.message` (parsed once, C-speed with the upb protobuf backend); one that changes it calls
:meth:`Batch.mutable`, which drops the cached bytes so that the exporter re-serializes.

Example:
    >>> from otel_gpu.pdata import Batch, Signal
    >>> b = Batch.from_message(Signal.LOGS, Signal.LOGS.request_type()())
    >>> b.item_count()
    0
"""
from __future__ import annotations

import enum
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

__all__ = ["Batch", "Signal", "MalformedBatch", "count_items"]


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
