"""OTLP data in the collector: the batches that flow through a pipeline, and the one place that converts OTLP values.

Like the OpenTelemetry Collector's ``pdata``, every component reads and writes OTLP through this module instead of
walking ``AnyValue`` oneofs by hand.

Batches: one OTLP export request each, parsed only when needed. A receiver that got bytes off the wire wraps them as
they are (:meth:`Batch.from_bytes`); a pass-through pipeline hands the same bytes to the OTLP exporter without ever
building Python objects per span. A processor that reads the batch uses :attr:`Batch.message` (parsed once, C-speed
with the upb protobuf backend); one that changes it calls :meth:`Batch.mutable`, which drops the cached bytes so that
the exporter re-serializes.

Values: :func:`any_value` / :func:`set_any` turn a Python value into an OTLP ``AnyValue`` (as the OpenTelemetry SDK's
encoder does), :func:`to_python` turns one back; :func:`attributes` pre-builds ``KeyValue`` messages,
:func:`attributes_dict` and :func:`attribute` read them. Records: :func:`point_value`, :func:`data_points`,
:func:`event_name`, :func:`body_object`; :func:`spans`, :func:`log_records`, :func:`metrics` and :func:`iter_points`
walk a request. OTLP/JSON: :func:`to_json` and :func:`from_json` (hex trace and span ids, int64 as strings, enums as
integers). ``otel_gpu.otlp_build`` holds the request builders and re-exports the value functions.

Example:
    >>> from otel_gpu.pdata import Batch, Signal
    >>> b = Batch.from_message(Signal.LOGS, Signal.LOGS.request_type()())
    >>> b.item_count()
    0
    >>> to_python(any_value({"rank": 3, "ops": ["all_reduce", b"\\x00"], "ok": True, "empty": {}}))
    {'rank': 3, 'ops': ['all_reduce', b'\\x00'], 'ok': True, 'empty': {}}
    >>> kvs = attributes({"gpu.index": 2, "hw.type": "gpu", "hw.id": b"\\x01"})
    >>> attributes_dict(kvs), attribute(kvs, "hw.type"), attribute(kvs, "host.name", "?")
    ({'gpu.index': 2, 'hw.type': 'gpu', 'hw.id': b'\\x01'}, 'gpu', '?')
    >>> attributes_dict(kvs, json_safe=True)["hw.id"]  # bytes as OTLP/JSON writes them: base64
    'AQ=='
    >>> from opentelemetry.proto.trace.v1.trace_pb2 import Span
    >>> to_json(Span(trace_id=bytes(range(16)), span_id=b"\\x00" * 7 + b"\\x2a", name="step", kind=1))
    {'traceId': '000102030405060708090a0b0c0d0e0f', 'spanId': '000000000000002a', 'name': 'step', 'kind': 1}
    >>> from_json(b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "000000000000002a"}]}]}]}',
    ...           Signal.TRACES).resource_spans[0].scope_spans[0].spans[0].span_id
    b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00*'
"""
from __future__ import annotations

import base64
import enum
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

try:  # a declared dependency; without it (a platform with no wheel) json alone decodes, slower
    from msgspec import DecodeError as _FastDecodeError
    from msgspec.json import Decoder as _FastDecoder

    _fast_loads: Any = _FastDecoder().decode
except ImportError:  # pragma: no cover - msgspec is installed with otel-gpu
    _fast_loads = None

__all__ = ["Batch", "Signal", "MalformedBatch", "any_value", "attribute", "attributes", "attributes_dict",
           "body_object", "count_items", "data_points", "event_name", "from_json", "iter_points", "log_records",
           "metrics", "number_points", "point_value", "set_any", "spans", "to_json", "to_python"]


class Signal(str, enum.Enum):
    TRACES = "traces"
    METRICS = "metrics"
    LOGS = "logs"

    def request_type(self):
        return _REQUEST_TYPES[self]

    def response_type(self):
        return _RESPONSE_TYPES[self]

    @property
    def fields(self) -> tuple[str, str, str]:
        """The request's field names: resource list, scope list, item list (``"resource_spans"``, ...)."""
        return _FIELDS[self]


_REQUEST_TYPES: dict[Signal, Any] = {
    Signal.TRACES: trace_service_pb2.ExportTraceServiceRequest,
    Signal.METRICS: metrics_service_pb2.ExportMetricsServiceRequest,
    Signal.LOGS: logs_service_pb2.ExportLogsServiceRequest,
}
_RESPONSE_TYPES = {
    Signal.TRACES: trace_service_pb2.ExportTraceServiceResponse,
    Signal.METRICS: metrics_service_pb2.ExportMetricsServiceResponse,
    Signal.LOGS: logs_service_pb2.ExportLogsServiceResponse,
}
_FIELDS = {
    Signal.TRACES: ("resource_spans", "scope_spans", "spans"),
    Signal.METRICS: ("resource_metrics", "scope_metrics", "metrics"),
    Signal.LOGS: ("resource_logs", "scope_logs", "log_records"),
}


class MalformedBatch(ValueError):
    """The bytes are not a valid OTLP export request of the signal."""


def count_items(signal: Signal, message: Any) -> int:
    """Spans, metric data points or log records in an export request (loops over resources and scopes only)."""
    if signal is Signal.TRACES:
        return sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans)
    if signal is Signal.LOGS:
        return sum(len(sl.log_records) for rl in message.resource_logs for sl in rl.scope_logs)
    return sum(len(data_points(m)) for rm in message.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)


class Batch:
    """One OTLP export request of one signal, with its wire bytes cached while it is unchanged."""

    __slots__ = ("signal", "_raw", "_message", "_items", "_bodies")

    def __init__(self, signal: Signal, raw: bytes | None, message: Any | None):
        self.signal = signal
        self._raw = raw
        self._message = message
        self._items: int | None = None
        self._bodies: dict[tuple[int, int, int], dict[str, Any] | None] | None = None

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
    def from_json(cls, signal: Signal, body: bytes | str) -> Batch:
        """Parses an OTLP/JSON export request (see :func:`from_json`).

        Raises:
            MalformedBatch: not JSON, not an export request of ``signal``, or an id that is not hex.
        """
        return cls(signal, None, from_json(body, signal))

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
        self._bodies = None
        return message

    def body(self, position: tuple[int, int, int], record: Any) -> dict[str, Any] | None:
        """:func:`body_object` of the log record at ``position`` (resource, scope and record index), decoded once
        for every processor of the pipeline that reads it (a node digest: attribution, then goodput). The dict is
        shared: read only.

        >>> from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
        >>> b, r = Batch.from_message(Signal.LOGS, None), LogRecord(body=any_value('{"step": 7}'))
        >>> b.body((0, 0, 0), r) is b.body((0, 0, 0), r), b.body((0, 0, 0), r)
        (True, {'step': 7})
        """
        bodies = self._bodies
        if bodies is None:
            bodies = self._bodies = {}
        try:
            return bodies[position]
        except KeyError:
            out = bodies[position] = body_object(record)
            return out

    def wire(self) -> bytes | None:
        """The bytes it arrived as, while it is unchanged; None for a batch built or changed here."""
        return self._raw

    def to_bytes(self) -> bytes:
        if self._raw is None:
            self._raw = self.message.SerializeToString()
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


_SCALARS = frozenset(("string_value", "int_value", "double_value", "bool_value"))


def to_python(value: AnyValue, json_safe: bool = False) -> Any:
    """An ``AnyValue`` as a Python value (kvlist: dict, array: list, empty: None).

    With ``json_safe``, bytes become base64 text, as OTLP/JSON writes them, so that the result can go to
    ``json.dumps`` (a store column, a Prometheus label).
    """
    kind = value.WhichOneof("value")
    if kind in _SCALARS:  # the usual case first: this runs for every attribute a processor reads
        return getattr(value, kind)
    if kind is None:
        return None
    if kind == "array_value":
        return [to_python(v, json_safe) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: to_python(kv.value, json_safe) for kv in value.kvlist_value.values}
    if json_safe:
        return base64.b64encode(value.bytes_value).decode("ascii")
    return value.bytes_value


def attributes(attrs: Mapping[str, Any] | None) -> list[KeyValue]:
    """Pre-builds ``KeyValue`` messages, to reuse on every data point (keys may be schema ``Attr`` objects)."""
    out: list[KeyValue] = []
    for key, value in (attrs or {}).items():
        kv = KeyValue(key=str(key))
        set_any(kv.value, value)
        out.append(kv)
    return out


def attributes_dict(key_values: Iterable[KeyValue], json_safe: bool = False) -> dict[str, Any]:
    """Repeated ``KeyValue`` (attributes of a resource, span, point or record) as a dict (a repeated key: the last)."""
    return {kv.key: to_python(kv.value, json_safe) for kv in key_values}


def attribute(key_values: Iterable[KeyValue], key: str, default: Any = None) -> Any:
    """The value of one attribute (the first ``key``), ``default`` when absent; no dict is built."""
    for kv in key_values:
        if kv.key == key:
            return to_python(kv.value)
    return default


# -- records -----------------------------------------------------------------------------------------------------
def data_points(metric: Any) -> Any:
    """The data points of a metric of any kind (gauge, sum, histogram, ...); ``()`` for a metric without data."""
    kind = metric.WhichOneof("data")
    return getattr(metric, kind).data_points if kind is not None else ()


def number_points(metric: Any) -> Any:
    """The data points of a gauge or a sum (those that :func:`point_value` reads); ``()`` for other kinds."""
    kind = metric.WhichOneof("data")
    return getattr(metric, kind).data_points if kind in ("gauge", "sum") else ()


def point_value(point: Any) -> float:
    """A gauge or sum data point's value as a float (``as_int`` or ``as_double``; 0.0 when it has neither)."""
    return point.as_double if point.WhichOneof("value") == "as_double" else float(point.as_int)


def event_name(record: Any) -> str:
    """A log record's event name: ``event_name``, else the ``event.name`` attribute older SDKs write; ``""``."""
    if record.event_name:
        return record.event_name
    name = attribute(record.attributes, "event.name")
    return name if isinstance(name, str) else ""


def json_loads(text: str | bytes) -> Any:
    """``json.loads(text)``, three to four times faster: msgspec's decoder for what it accepts (a node digest: 13.8 ->
    3.6 us), ``json.loads`` for the rest (NaN, Infinity, lone surrogates, numbers out of range, anything malformed),
    so that the result, or the error, is ``json.loads``'s for every input.

    >>> json_loads('{"a": [1, 2.5, null]}'), json_loads('{"x": NaN}')["x"] != 0, json_loads("12345678901234567890123")
    ({'a': [1, 2.5, None]}, True, 12345678901234567890123)
    """
    if _fast_loads is not None:
        try:
            return _fast_loads(text)
        except (_FastDecodeError, RecursionError):
            pass
    return json.loads(text)


def body_object(record: Any) -> dict[str, Any] | None:
    """A log record's body as a JSON object: a string body holding a JSON object, or a kvlist body (bytes in base64);
    None for any other body.

    >>> from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
    >>> body_object(LogRecord(body=any_value('{"kind": "hang"}'))), body_object(LogRecord(body=any_value({"n": 1})))
    ({'kind': 'hang'}, {'n': 1})
    >>> body_object(LogRecord(body=any_value("[1]"))), body_object(LogRecord(body=any_value("{oops")))
    (None, None)
    """
    kind = record.body.WhichOneof("value")
    if kind == "string_value":
        try:
            out = json_loads(record.body.string_value)
        except (ValueError, RecursionError):  # RecursionError: nested thousands deep
            return None
        return out if isinstance(out, dict) else None
    if kind == "kvlist_value":
        return to_python(record.body, json_safe=True)
    return None


# -- walking requests --------------------------------------------------------------------------------------------
def _walk(request: Any, resource_field: str, scope_field: str, item_field: str) -> Iterator[tuple[Any, Any, Any]]:
    for resource_items in getattr(request, resource_field):
        for scope_items in getattr(resource_items, scope_field):
            for item in getattr(scope_items, item_field):
                yield resource_items, scope_items, item


def spans(request: Any) -> Iterator[tuple[Any, Any, Any]]:
    """Yields ``(resource_spans, scope_spans, span)`` over a traces export request."""
    return _walk(request, *_FIELDS[Signal.TRACES])


def log_records(request: Any) -> Iterator[tuple[Any, Any, Any]]:
    """Yields ``(resource_logs, scope_logs, log_record)`` over a logs export request."""
    return _walk(request, *_FIELDS[Signal.LOGS])


def metrics(request: Any) -> Iterator[tuple[Any, Any, Any]]:
    """Yields ``(resource_metrics, scope_metrics, metric)`` over a metrics export request."""
    return _walk(request, *_FIELDS[Signal.METRICS])


def iter_points(request: Any) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """Yields ``(metric, data_point, attributes as a dict)`` over a metrics export request."""
    for _, _, m in metrics(request):
        for dp in data_points(m):
            yield m, dp, attributes_dict(dp.attributes)


# -- OTLP/JSON ---------------------------------------------------------------------------------------------------
# OTLP/JSON is protobuf's JSON mapping (lowerCamelCase keys, 64-bit integers as strings, bytes in base64) with two
# twists: trace and span ids are hex, not base64, and enums are integers. The ids are the only bytes fields besides
# AnyValue's bytes_value, which stays base64.
_ID_FIELDS = frozenset(("trace_id", "span_id", "parent_span_id"))
_ID_PLANS: dict[str, dict[str, Any]] = {}


def _id_plan(descriptor: Any, visiting: tuple[str, ...] = ()) -> dict[str, Any]:
    """JSON key (OTLP/JSON's lowerCamelCase and the proto name, both of which a reader accepts) -> True for an id,
    or the plan of the sub-message, for the fields of ``descriptor`` that lead to ids. AnyValue, Resource and the
    like lead to none, so that the walk never enters attributes."""
    plan = _ID_PLANS.get(descriptor.full_name)
    if plan is not None:
        return plan
    plan = {}
    for field in descriptor.fields:
        if field.type == field.TYPE_BYTES and field.name in _ID_FIELDS:
            sub: Any = True
        elif field.message_type is not None and field.message_type.full_name not in visiting:
            sub = _id_plan(field.message_type, (*visiting, descriptor.full_name))
            if not sub:
                continue
        else:
            continue
        plan[field.json_name] = plan[field.name] = sub
    _ID_PLANS[descriptor.full_name] = plan
    return plan


def _convert_ids(node: Any, plan: dict[str, Any], convert) -> None:
    if isinstance(node, list):
        for item in node:
            _convert_ids(item, plan, convert)
    elif isinstance(node, dict):
        for key, sub in plan.items():
            value = node.get(key)
            if value is None:
                continue
            if sub is True:
                if isinstance(value, str) and value:
                    node[key] = convert(key, value)
            else:
                _convert_ids(value, sub, convert)


def _base64_to_hex(key: str, value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_base64(key: str, value: str) -> str:
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise MalformedBatch(f"{key}: not a hex id ({value[:40]!r})") from None
    return base64.b64encode(raw).decode("ascii")


def to_json(message: Any) -> dict[str, Any]:
    """A message (an export request, a span, an ``AnyValue``, ...) as an OTLP/JSON object, for ``json.dumps``."""
    out = json_format.MessageToDict(message, use_integers_for_enums=True)
    _convert_ids(out, _id_plan(message.DESCRIPTOR), _base64_to_hex)
    return out


def from_json(body: bytes | str | dict, message_type: Any) -> Any:
    """Parses OTLP/JSON into a new message of ``message_type`` (a :class:`Signal` for its export request, or a
    message class). Unknown fields are ignored, as the OTLP specification asks of receivers; enums may be integers
    or names, 64-bit integers numbers or strings, and object keys lowerCamelCase or the proto field names.

    Raises:
        MalformedBatch: not JSON, not a message of the type, or an id that is not hex.
    """
    if isinstance(message_type, Signal):
        what, message = f"OTLP/JSON {message_type.value} request", message_type.request_type()()
    else:
        message = message_type()
        what = f"OTLP/JSON {message.DESCRIPTOR.name}"
    if isinstance(body, dict):
        data: Any = json.loads(json.dumps(body))  # a copy: the ids are rewritten in place
    else:
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
            raise MalformedBatch(f"malformed {what}: {exc}") from None
    if not isinstance(data, dict):
        raise MalformedBatch(f"malformed {what}: the top level must be an object")
    try:
        _convert_ids(data, _id_plan(message.DESCRIPTOR), _hex_to_base64)
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    # SystemError: upb's field lookup fails that way on a key holding a lone surrogate ({"\ud800": 1}).
    except (json_format.ParseError, ValueError, TypeError, RecursionError, SystemError) as exc:
        if isinstance(exc, MalformedBatch):
            raise
        raise MalformedBatch(f"malformed {what}: {exc}") from None
    return message
