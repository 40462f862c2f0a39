"""otel_gpu.pdata's value conversion against opentelemetry-proto's own messages and the OpenTelemetry SDK's encoder:
Python -> AnyValue -> wire bytes -> AnyValue -> Python is the identity, and AnyValue -> Python -> AnyValue gives the
same message back."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common._internal import _encode_value
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList

from otel_gpu import otlp_build
from otel_gpu.pdata import any_value, attributes, attributes_dict, to_python

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
