"""The otlp receiver over real sockets: gRPC and HTTP (protobuf, JSON), every error status, and that it stays up."""
from __future__ import annotations

import base64
import gzip
import http.client
import json
import socket
import zlib

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otel_gpu.collector.config import load_text
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.config import ConfigError, build
from otel_gpu.pdata import Signal
from otel_gpu.receivers.otlp import OtlpReceiver, OtlpReceiverConfig

TRACE_ID = bytes(range(16))
SPAN_ID = bytes(range(100, 108))
METHODS = {
    Signal.TRACES: "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    Signal.METRICS: "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
    Signal.LOGS: "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
}


def trace_request(n_spans: int = 3, name: str = "step") -> trace_service_pb2.ExportTraceServiceRequest:
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    attr = rs.resource.attributes.add()
    attr.key, attr.value.string_value = "service.name", "trainer"
    ss = rs.scope_spans.add()
    for i in range(n_spans):
        span = ss.spans.add()
        span.trace_id, span.span_id, span.parent_span_id = TRACE_ID, SPAN_ID[:6] + i.to_bytes(2, "big"), SPAN_ID
        span.name, span.start_time_unix_nano, span.end_time_unix_nano = f"{name}{i}", 1_700_000_000_000_000_000 + i, \
            1_700_000_000_500_000_000 + i
        a = span.attributes.add()
        a.key, a.value.int_value = "rank", i
    return req


def metrics_request() -> metrics_service_pb2.ExportMetricsServiceRequest:
    req = metrics_service_pb2.ExportMetricsServiceRequest()
    m = req.resource_metrics.add().scope_metrics.add().metrics.add()
    m.name = "hw.gpu.utilization"
    dp = m.gauge.data_points.add()
    dp.as_double, dp.time_unix_nano = 0.5, 1_700_000_000_000_000_000
    ex = dp.exemplars.add()
    ex.trace_id, ex.span_id, ex.as_double = TRACE_ID, SPAN_ID, 0.5
    return req


def logs_request() -> logs_service_pb2.ExportLogsServiceRequest:
    req = logs_service_pb2.ExportLogsServiceRequest()
    lr = req.resource_logs.add().scope_logs.add().log_records.add()
    lr.body.string_value, lr.trace_id, lr.span_id = "NVRM: Xid 79", TRACE_ID, SPAN_ID
    return req


REQUESTS = {Signal.TRACES: trace_request, Signal.METRICS: metrics_request, Signal.LOGS: logs_request}


class Recorder:
    def __init__(self):
        self.batches = []
        self.fail = False

    def consume(self, batch):
        if self.fail:
            raise RuntimeError("pipeline broken on purpose")
        self.batches.append(batch)


@pytest.fixture
def rx():
    """A started receiver on free ports; yields (receiver, recorder, telemetry)."""
    telemetry = PrometheusSelfTelemetry()
    recorder = Recorder()
    host = ComponentHost("otlp", telemetry, {s: recorder for s in Signal})
    cfg = build(OtlpReceiverConfig, {"grpc": {"endpoint": "127.0.0.1:0", "max_recv_msg_size_mib": 0.05},
                                     "http": {"endpoint": "127.0.0.1:0", "max_request_body_size_mib": 0.05,
                                              "read_timeout": "2s"}}, "receivers.otlp")
    receiver = OtlpReceiver(cfg, host)
    receiver.start()
    yield receiver, recorder, telemetry
    receiver.shutdown(2)


def grpc_call(receiver, signal: Signal, body: bytes) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
        return channel.unary_unary(METHODS[signal])(body, timeout=5)


def post(receiver, path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST"):
    conn = http.client.HTTPConnection("127.0.0.1", receiver.http_port, timeout=5)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/x-protobuf", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def assert_still_up(receiver, recorder, before: int) -> None:
    """A valid request goes through on both protocols and nothing accepted before is lost."""
    body = trace_request(1, "after").SerializeToString()
    assert grpc_call(receiver, Signal.TRACES, body) == b""
    assert post(receiver, "/v1/traces", body)[0] == 200
    assert len(recorder.batches) == before + 2
    assert recorder.batches[-1].to_bytes() == body


# -- gRPC ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("signal", list(Signal))
def test_grpc_passes_request_bytes_through_unchanged(rx, signal):
    receiver, recorder, telemetry = rx
    body = REQUESTS[signal]().SerializeToString()
    assert grpc_call(receiver, signal, body) == b""
    (batch,) = recorder.batches
    assert batch.signal is signal and batch.to_bytes() == body
    assert batch.message == REQUESTS[signal]()


def test_grpc_malformed_is_invalid_argument_and_counted(rx):
    receiver, recorder, telemetry = rx
    grpc_call(receiver, Signal.TRACES, trace_request().SerializeToString())
    with pytest.raises(grpc.RpcError) as err:
        grpc_call(receiver, Signal.TRACES, b"\x0a\xff\xff\xff\xff\x0f garbage")
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed OTLP traces request" in err.value.details()
    assert telemetry.value("otel_gpu.collector.refused", "otlp", Signal.TRACES) == 1
    assert_still_up(receiver, recorder, before=1)


def test_grpc_oversized_is_resource_exhausted(rx):
    receiver, recorder, _ = rx
    big = trace_request(2000).SerializeToString()
    assert len(big) > 0.05 * 1024 * 1024
    with pytest.raises(grpc.RpcError) as err:
        grpc_call(receiver, Signal.TRACES, big)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_still_up(receiver, recorder, before=0)


def test_pipeline_failure_tells_client_to_retry(rx):
    receiver, recorder, telemetry = rx
    recorder.fail = True
    with pytest.raises(grpc.RpcError) as err:
        grpc_call(receiver, Signal.TRACES, trace_request(3).SerializeToString())
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    status, headers, _ = post(receiver, "/v1/traces", trace_request(3).SerializeToString())
    assert status == 503 and headers["Retry-After"] == "1"
    assert telemetry.value("otel_gpu.collector.refused", "otlp", Signal.TRACES) == 6
    recorder.fail = False
    assert_still_up(receiver, recorder, before=0)


def test_only_signals_with_a_pipeline_are_served():
    recorder = Recorder()
    host = ComponentHost("otlp", PrometheusSelfTelemetry(), {Signal.LOGS: recorder})
    receiver = OtlpReceiver(build(OtlpReceiverConfig, {"grpc": {"endpoint": "127.0.0.1:0"},
                                                       "http": {"endpoint": "127.0.0.1:0"}}, "r"), host)
    receiver.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            grpc_call(receiver, Signal.TRACES, trace_request().SerializeToString())
        assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert post(receiver, "/v1/traces", b"")[0] == 404
        assert grpc_call(receiver, Signal.LOGS, logs_request().SerializeToString()) == b""
        assert post(receiver, "/v1/logs", logs_request().SerializeToString())[0] == 200
        assert len(recorder.batches) == 2
    finally:
        receiver.shutdown(2)


# -- HTTP ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("signal", list(Signal))
def test_http_protobuf(rx, signal):
    receiver, recorder, _ = rx
    body = REQUESTS[signal]().SerializeToString()
    status, headers, payload = post(receiver, f"/v1/{signal.value}", body)
    assert status == 200 and headers["Content-Type"] == "application/x-protobuf"
    signal.response_type().FromString(payload)
    assert recorder.batches[0].to_bytes() == body


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_http_compressed(rx, encoding, compress):
    receiver, recorder, _ = rx
    body = trace_request(50).SerializeToString()
    assert post(receiver, "/v1/traces", compress(body), {"Content-Encoding": encoding})[0] == 200
    assert recorder.batches[0].to_bytes() == body


def test_http_chunked_body(rx):
    receiver, recorder, _ = rx
    body = trace_request(20).SerializeToString()
    conn = http.client.HTTPConnection("127.0.0.1", receiver.http_port, timeout=5)
    conn.request("POST", "/v1/traces", body=iter([body[:100], body[100:]]),
                 headers={"Content-Type": "application/x-protobuf"}, encode_chunked=True)
    assert conn.getresponse().status == 200
    conn.close()
    assert recorder.batches[0].to_bytes() == body


@pytest.mark.parametrize("signal", list(Signal))
def test_http_json_with_hex_ids(rx, signal):
    receiver, recorder, _ = rx
    expected = REQUESTS[signal]()
    doc = json_format.MessageToDict(expected)

    def to_hex(node):  # what an OTLP/JSON client sends: ids as hex, not protobuf-JSON base64
        if isinstance(node, dict):
            return {k: (base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId") else to_hex(v))
                    for k, v in node.items()}
        return [to_hex(v) for v in node] if isinstance(node, list) else node

    doc = to_hex(doc)
    assert TRACE_ID.hex() in json.dumps(doc)
    doc["someFutureField"] = 1  # receivers must ignore unknown fields
    status, headers, payload = post(receiver, f"/v1/{signal.value}", json.dumps(doc).encode(),
                                    {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200 and headers["Content-Type"] == "application/json" and json.loads(payload) == {}
    assert recorder.batches[0].message == expected


def test_http_json_errors(rx):
    receiver, recorder, telemetry = rx
    bad_hex = {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "name": "x"}]}]}]}
    for body in (b"{not json", b"[1, 2]", json.dumps(bad_hex).encode(), b'{"resourceSpans": 7}'):
        status, headers, payload = post(receiver, "/v1/traces", body, {"Content-Type": "application/json"})
        assert status == 400, body
        assert json.loads(payload)["code"] == 3
    assert telemetry.value("otel_gpu.collector.refused", "otlp", Signal.TRACES) == 4
    assert_still_up(receiver, recorder, before=0)


def test_http_malformed_protobuf_is_400_with_status(rx):
    receiver, recorder, _ = rx
    post(receiver, "/v1/traces", trace_request().SerializeToString())
    status, headers, payload = post(receiver, "/v1/traces", b"\x0a\xff\xff\xff\xff\x0f garbage")
    assert status == 400 and headers["Content-Type"] == "application/x-protobuf"
    assert "malformed" in status_pb2.Status.FromString(payload).message
    cut = trace_request(5).SerializeToString()[:-7]  # a protobuf cut in the middle of a field
    assert post(receiver, "/v1/traces", cut)[0] == 400
    assert_still_up(receiver, recorder, before=1)


def test_http_truncated_body_then_client_gone(rx):
    receiver, recorder, _ = rx
    body = trace_request(5).SerializeToString()
    with socket.create_connection(("127.0.0.1", receiver.http_port), timeout=5) as s:
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                  b"Content-Length: %d\r\n\r\n" % (len(body) + 100) + body)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(4096):  # the server closes after an error reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply
    assert b"truncated request body" in reply
    assert_still_up(receiver, recorder, before=0)


def test_http_status_codes(rx):
    receiver, recorder, _ = rx
    body = trace_request().SerializeToString()
    assert post(receiver, "/v1/traces", body, {"Content-Type": "text/plain"})[0] == 415
    assert post(receiver, "/v1/traces", body, {"Content-Encoding": "br"})[0] == 415
    assert post(receiver, "/v1/spans", body)[0] == 404
    status, headers, _ = post(receiver, "/v1/traces", b"", method="GET")
    assert status == 405 and headers["Allow"] == "POST"
    assert post(receiver, "/v1/traces", b"", method="PUT")[0] == 405
    big = trace_request(2000).SerializeToString()
    assert post(receiver, "/v1/traces", big)[0] == 413
    bomb = gzip.compress(b"\0" * (10 * 1024 * 1024))  # 10 KB that inflates to 10 MiB, over the 0.05 MiB limit
    assert post(receiver, "/v1/traces", bomb, {"Content-Encoding": "gzip"})[0] == 413
    assert post(receiver, "/v1/traces", gzip.compress(body)[:-5], {"Content-Encoding": "gzip"})[0] == 400
    with socket.create_connection(("127.0.0.1", receiver.http_port), timeout=5) as s:  # no Content-Length
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 411")
    assert recorder.batches == []
    assert_still_up(receiver, recorder, before=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=300), json_body=st.booleans())
def test_http_and_grpc_survive_arbitrary_bodies(rx, body, json_body):
    receiver, recorder, _ = rx
    ctype = "application/json" if json_body else "application/x-protobuf"
    status = post(receiver, "/v1/logs", body, {"Content-Type": ctype})[0]
    assert status in (200, 400)
    try:
        grpc_call(receiver, Signal.LOGS, body)
    except grpc.RpcError as err:
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_call(receiver, Signal.TRACES, trace_request(1).SerializeToString()) == b""


# -- start-up and config -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_port_taken_raises_a_clear_error(rx, proto):
    receiver, _, _ = rx
    port = receiver.grpc_port if proto == "grpc" else receiver.http_port
    other = {"grpc": None, "http": None, proto: {"endpoint": f"127.0.0.1:{port}"}}
    second = OtlpReceiver(build(OtlpReceiverConfig, other, "r"),
                          ComponentHost("otlp/2", PrometheusSelfTelemetry(), {Signal.TRACES: Recorder()}))
    name = {"grpc": "gRPC", "http": "HTTP"}[proto]
    with pytest.raises(OSError, match=rf"cannot listen for OTLP/{name} on 127.0.0.1:{port}.*free port"):
        second.start()


def test_config_shapes():
    text = """
receivers:
  otlp: {grpc: {endpoint: "127.0.0.1:0"}, http: null}
  otlp/compat: {protocols: {http: }}
exporters: {debug: {}}
service: {pipelines: {traces: {receivers: [otlp, otlp/compat], exporters: [debug]}}}
"""
    cfg = load_text(text)
    plain = cfg.component("receiver", "otlp").config
    assert plain.grpc.endpoint == "127.0.0.1:0" and plain.grpc.max_recv_msg_size_mib == 16 and plain.http is None
    compat = cfg.component("receiver", "otlp/compat").config
    assert compat.grpc is None and compat.http.endpoint == "127.0.0.1:4318"
    with pytest.raises(ConfigError, match=r"receivers\.otlp\.grpc\.endpoint must be HOST:PORT"):
        load_text(text.replace('"127.0.0.1:0"', "nowhere"))
    with pytest.raises(ConfigError, match=r"receivers\.otlp\.grpc\.max_recv_msg_size_mib: expected a number"):
        load_text(text.replace('endpoint: "127.0.0.1:0"', "max_recv_msg_size_mib: lots"))
    with pytest.raises(ConfigError, match="enable at least one protocol"):
        load_text(text.replace('{grpc: {endpoint: "127.0.0.1:0"}, http: null}', "{grpc: null, http: null}"))


def test_http_connections_beyond_max_connections_get_503_and_the_server_recovers():
    """Idle or hostile connections cannot grow the collector by a thread each without bound."""
    import time
    import urllib.error
    import urllib.request

    from otel_gpu.collector.registry import load_factory
    from otel_gpu.pdata import Signal as _Signal

    class _Keep:
        def __init__(self):
            self.batches = []

        def consume(self, batch):
            self.batches.append(batch)

    factory = load_factory("receiver", "otlp")
    cfg = build(factory.config_class, {"grpc": None, "http": {"endpoint": "127.0.0.1:0", "max_connections": 2,
                                                             "read_timeout": "5s"}}, "receivers.otlp")
    keep = _Keep()
    receiver = factory.create(cfg, ComponentHost("otlp", PrometheusSelfTelemetry(), {s: keep for s in _Signal}))
    receiver.start()
    idle = []
    try:
        for _ in range(2):  # two clients that connect and send nothing: both serving threads are taken
            idle.append(socket.create_connection(("127.0.0.1", receiver.http_port), timeout=5))
        time.sleep(0.3)
        third = socket.create_connection(("127.0.0.1", receiver.http_port), timeout=5)
        answer = third.recv(200)
        third.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer
        for s in idle:
            s.close()
        deadline = time.monotonic() + 5
        while True:  # the idle connections' threads end; a real request is served again
            body = trace_service_pb2.ExportTraceServiceRequest().SerializeToString()
            req = urllib.request.Request(f"http://127.0.0.1:{receiver.http_port}/v1/traces", data=body,
                                         headers={"Content-Type": "application/x-protobuf"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    assert resp.status == 200
                break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline
                time.sleep(0.1)
        assert len(keep.batches) == 1
    finally:
        for s in idle:
            s.close()
        receiver.shutdown(2.0)
