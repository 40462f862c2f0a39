"""otel_gpu.pdata against opentelemetry-proto's own messages, the OpenTelemetry SDK's encoder and protobuf's JSON
mapping: Python -> AnyValue -> wire bytes -> AnyValue -> Python is the identity, AnyValue -> Python -> AnyValue and
message -> OTLP/JSON -> message give the same message back, and OTLP/JSON differs from ``json_format`` only where the
OTLP specification says (ids in hex, enums as integers)."""
from __future__ import annotations

import base64
import json

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common._internal import _encode_value
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

from otel_gpu import otlp_build
from otel_gpu.pdata import (Batch, MalformedBatch, Signal, any_value, attribute, attributes, attributes_dict,
                            body_object, data_points, event_name, from_json, log_records, metrics, number_points,
                            point_value, spans, to_json, to_python)

_SCALARS = (st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text()
            | st.binary())
VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@settings(max_examples=100, deadline=None)
@given(VALUES)
def test_python_to_wire_and_back_is_the_identity(value):
    wire = any_value(value).SerializeToString()
    assert to_python(AnyValue.FromString(wire)) == value


@settings(max_examples=100, deadline=None)
@given(VALUES)
def test_encoding_matches_the_opentelemetry_sdk(value):
    assert any_value(value) == _encode_value(value)


def _messages():
    scalars = st.one_of(
        st.booleans().map(lambda v: AnyValue(bool_value=v)), st.integers(-(2**63), 2**63 - 1).map(
            lambda v: AnyValue(int_value=v)), st.floats(allow_nan=False).map(lambda v: AnyValue(double_value=v)),
        st.text().map(lambda v: AnyValue(string_value=v)), st.binary().map(lambda v: AnyValue(bytes_value=v)))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4).map(
        lambda vs: AnyValue(array_value=ArrayValue(values=vs))) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4).map(lambda d: AnyValue(kvlist_value=KeyValueList(
            values=[KeyValue(key=k, value=v) for k, v in d.items()]))), max_leaves=12)


@settings(max_examples=100, deadline=None)
@given(_messages())
def test_proto_to_python_and_back_is_the_same_message(message):
    assert any_value(to_python(message)) == message


def test_empty_containers_and_none_keep_their_kind():
    assert any_value({}).WhichOneof("value") == "kvlist_value" and to_python(any_value({})) == {}
    assert any_value([]).WhichOneof("value") == "array_value" and to_python(any_value([])) == []
    assert any_value(None).WhichOneof("value") is None and to_python(AnyValue()) is None
    assert attributes_dict(attributes({"a": 1, "b": [1.5, "x"]})) == {"a": 1, "b": [1.5, "x"]}


def test_otlp_build_reexports_the_one_conversion():
    assert otlp_build.any_value is any_value and otlp_build.to_python is to_python
    assert otlp_build.attributes is attributes


# -- OTLP/JSON ---------------------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(_messages())
def test_any_value_to_otlp_json_and_back_is_the_same_message(message):
    data = to_json(message)
    assert data == json_format.MessageToDict(message, use_integers_for_enums=True)  # no ids: protobuf's mapping
    assert from_json(json.dumps(data), AnyValue) == message


def test_otlp_json_writes_int64_as_strings_and_bytes_values_in_base64():
    assert to_json(any_value(2**62)) == {"intValue": str(2**62)}
    assert to_json(any_value(b"\x01\x02")) == {"bytesValue": "AQI="}
    assert from_json('{"intValue": 7}', AnyValue) == any_value(7)  # a number is read as well


_ID16, _ID8 = st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8)
_ATTRS = st.dictionaries(st.text(max_size=6), VALUES, max_size=3)


@st.composite
def _traces(draw):
    req = trace_service_pb2.ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(attributes(draw(_ATTRS)))
        ss = rs.scope_spans.add()
        for _ in range(draw(st.integers(0, 3))):
            span = ss.spans.add(trace_id=draw(_ID16), span_id=draw(_ID8), parent_span_id=draw(_ID8 | st.just(b"")),
                                name=draw(st.text(max_size=8)), kind=draw(st.integers(0, 5)),
                                start_time_unix_nano=draw(st.integers(0, 2**64 - 1)))
            span.attributes.extend(attributes(draw(_ATTRS)))
            span.status.code = draw(st.integers(0, 2))
            for _ in range(draw(st.integers(0, 2))):
                span.links.add(trace_id=draw(_ID16), span_id=draw(_ID8))
    return req


def _ids_in_hex(node, path=""):
    """Every id in an OTLP/JSON object, with where it is."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("traceId", "spanId", "parentSpanId"):
                yield f"{path}.{key}", value
            else:
                yield from _ids_in_hex(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _ids_in_hex(value, f"{path}[{i}]")


@settings(max_examples=50, deadline=None)
@given(_traces())
def test_traces_to_otlp_json_and_back_is_the_same_request(req):
    data = to_json(req)
    reference = json_format.MessageToDict(req, use_integers_for_enums=True)
    ids = dict(_ids_in_hex(data))
    assert ids.keys() == dict(_ids_in_hex(reference)).keys()
    for where, value in _ids_in_hex(reference):  # the only difference from protobuf's mapping: ids in hex
        assert ids[where] == base64.b64decode(value).hex()
    assert from_json(json.dumps(data).encode(), Signal.TRACES) == req
    assert Batch.from_json(Signal.TRACES, json.dumps(data)).message == req


def test_logs_and_exemplars_ids_are_hex_both_ways():
    logs = logs_service_pb2.ExportLogsServiceRequest()
    logs.resource_logs.add().scope_logs.add().log_records.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8,
                                                                  severity_number=17, body=any_value(b"\x03"))
    data = to_json(logs)
    record = data["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
    assert record == {"traceId": "01" * 16, "spanId": "02" * 8, "severityNumber": 17, "body": {"bytesValue": "Aw=="}}
    assert from_json(json.dumps(data), Signal.LOGS) == logs
    m = metrics_service_pb2.ExportMetricsServiceRequest()
    metric = m.resource_metrics.add().scope_metrics.add().metrics.add(name="x")
    metric.histogram.data_points.add(count=1).exemplars.add(trace_id=b"\x0a" * 16, span_id=b"\x0b" * 8, as_int=3)
    exemplar = to_json(m)["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["histogram"]["dataPoints"][0][
        "exemplars"][0]
    assert exemplar["traceId"] == "0a" * 16 and exemplar["spanId"] == "0b" * 8
    assert from_json(json.dumps(to_json(m)), Signal.METRICS) == m


def test_from_json_takes_proto_names_and_enum_names_and_refuses_bad_ids():
    body = {"resource_spans": [{"scope_spans": [{"spans": [{"trace_id": "0f" * 16, "kind": "SPAN_KIND_SERVER",
                                                             "unknownField": {"traceId": "not hex"}}]}]}]}
    span = from_json(json.dumps(body), Signal.TRACES).resource_spans[0].scope_spans[0].spans[0]
    assert span.trace_id == b"\x0f" * 16 and span.kind == span.SPAN_KIND_SERVER
    for bad in ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "zz"}]}]}]}', "[]", "{", b"\xff"):
        with pytest.raises(MalformedBatch):
            from_json(bad, Signal.TRACES)


# -- records -----------------------------------------------------------------------------------------------------
def test_record_helpers():
    kvs = attributes({"a": 1, "b": b"\x00", "c": {"d": [b"\x01"]}})
    assert attribute(kvs, "a") == 1 and attribute(kvs, "z", "none") == "none"
    assert attributes_dict(kvs, json_safe=True) == {"a": 1, "b": "AA==", "c": {"d": ["AQ=="]}}
    gauge, hist, empty = Metric(), Metric(), Metric()
    gauge.gauge.data_points.add(as_int=3)
    gauge.gauge.data_points.add(as_double=0.5)
    hist.histogram.data_points.add(count=2)
    assert [point_value(p) for p in number_points(gauge)] == [3.0, 0.5]
    assert len(data_points(hist)) == 1 and number_points(hist) == () and data_points(empty) == ()
    old = LogRecord(attributes=attributes({"event.name": "otel_gpu.failure"}), body=any_value({"k": b"\x00"}))
    assert event_name(old) == "otel_gpu.failure" and body_object(old) == {"k": "AA=="}
    assert event_name(LogRecord(attributes=attributes({"event.name": 3}))) == ""
    assert body_object(LogRecord(body=any_value(3))) is None and body_object(LogRecord()) is None


def test_walkers_yield_every_item_with_its_resource_and_scope():
    req = trace_service_pb2.ExportTraceServiceRequest()
    for r in range(2):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(attributes({"r": r}))
        for s in range(2):
            ss = rs.scope_spans.add()
            ss.scope.name = f"s{s}"
            ss.spans.add(name=f"{r}{s}")
    seen = [(attribute(rs.resource.attributes, "r"), ss.scope.name, span.name) for rs, ss, span in spans(req)]
    assert seen == [(0, "s0", "00"), (0, "s1", "01"), (1, "s0", "10"), (1, "s1", "11")]
    assert list(log_records(logs_service_pb2.ExportLogsServiceRequest())) == []
    assert list(metrics(metrics_service_pb2.ExportMetricsServiceRequest())) == []
    assert [Signal(s).fields[2] for s in ("traces", "metrics", "logs")] == ["spans", "metrics", "log_records"]


def _loads_or_error(fn, text):
    try:
        return "ok", repr(fn(text))
    except (ValueError, RecursionError) as exc:
        return "error", type(exc).__name__


_JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                            lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES, st.integers(0, 40), st.sampled_from(["", " ", ",", "]", "}", "NaN", "\\ud800", "\x01", "1e999",
                                                          "\ufeff", "0"]))
def test_json_loads_gives_what_json_loads_gives_for_every_text(value, cut, dirt):
    """The fast decoder (msgspec) and its fallback together: the same value as ``json.loads``, or an error where it
    errs, for valid JSON (NaN, Infinity, huge integers, lone surrogates included) and for JSON cut and dirtied."""
    from otel_gpu.pdata import json_loads

    text = json.dumps(value)
    for t in (text, text[:cut] + dirt + text[cut:], text[:cut], dirt + text):
        assert _loads_or_error(json_loads, t) == _loads_or_error(json.loads, t), t
    assert _loads_or_error(json_loads, text.encode()) == _loads_or_error(json.loads, text.encode())


def test_json_loads_takes_the_edge_cases_json_loads_takes():
    from otel_gpu.pdata import json_loads

    for text in ('{"x": NaN, "y": -Infinity}', "[1e400]", '"\\ud800"', "123456789012345678901234567890",
                 '{"a": 1, "a": 2}', "[" * 5000 + "]" * 5000, '{"a": 1}x', "\ufeff{}", ""):
        assert _loads_or_error(json_loads, text) == _loads_or_error(json.loads, text), text
