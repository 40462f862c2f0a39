"""Fuzzing the OTLP gRPC and HTTP receivers of a running in-process Collector (otlp -> attribution, goodput ->
store, capture) over real loopback sockets.

Hostile input: mutated valid protobuf (bit flips, truncation, insertions, length-field corruption), random bytes,
invalid UTF-8 in string fields, AnyValue nested thousands deep, thousands of attributes, huge strings, OTLP/JSON with
wrong types, negative or overflowing integers, wrong content types and encodings. The collector must answer with a
client error (INVALID_ARGUMENT / RESOURCE_EXHAUSTED over gRPC; 400 / 413 / 415 over HTTP) or accept the request,
never INTERNAL / UNKNOWN / 500 or a dropped connection, log no error, and serve a valid request after every example.

Bounded for CI (derandomized); ``OTEL_GPU_FUZZ_SCALE`` / ``OTEL_GPU_FUZZ_RANDOM`` run a longer campaign
(benchmarks/fuzz/README.md).
"""
from __future__ import annotations

import http.client
import json
import logging
import os

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.pdata import Signal

METHODS = {
    Signal.TRACES: "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    Signal.METRICS: "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
    Signal.LOGS: "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
}
LIMIT_MIB = 1  # small limits so that "too big" is cheap to reach
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
HTTP_OK = {200, 400, 413, 415}


def fuzz(examples: int):
    """Hypothesis settings: ``examples`` scaled by OTEL_GPU_FUZZ_SCALE; derandomized unless OTEL_GPU_FUZZ_RANDOM=1."""
    scale = float(os.environ.get("OTEL_GPU_FUZZ_SCALE", "1") or 1)
    return settings(max_examples=max(1, int(examples * scale)), deadline=None, database=None,
                    derandomize=os.environ.get("OTEL_GPU_FUZZ_RANDOM") != "1",
                    suppress_health_check=list(HealthCheck), print_blob=True)


class _Errors(logging.Handler):
    """Every ERROR the collector logs, and every request the HTTP server failed to answer (logged at DEBUG)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or "error serving" in record.getMessage():
            trace = logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
            self.records.append(f"{record.name}: {record.getMessage()}\n{trace}")


class Running:
    def __init__(self, collector: Collector, errors: _Errors):
        self.collector, self.errors = collector, errors
        receiver = collector.component("receiver", "otlp")
        self.grpc_port, self.http_port = receiver.grpc_port, receiver.http_port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.calls = {s: self.channel.unary_unary(m, request_serializer=None, response_deserializer=None)
                      for s, m in METHODS.items()}
        self.capture = collector.component("exporter", "capture")

    def grpc(self, signal: Signal, body: bytes) -> grpc.StatusCode:
        try:
            self.calls[signal](body, timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    def http(self, signal: Signal, body: bytes, ctype: str = "application/x-protobuf",
             headers: dict[str, str] | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
        try:
            conn.request("POST", f"/v1/{signal.value}", body=body, headers={"Content-Type": ctype, **(headers or {})})
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()

    def http_raw(self, signal: Signal, body: bytes) -> int:
        """POSTs over a plain socket: a server that answers 413 before reading a huge body is still heard."""
        import socket

        with socket.create_connection(("127.0.0.1", self.http_port), timeout=10) as sock:
            sock.sendall(f"POST /v1/{signal.value} HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode())
            try:
                sock.sendall(body)
            except OSError:  # the server answered and closed while we were still sending
                pass
            reply = b""
            while b"\r\n" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        return int(reply.split(b" ", 2)[1])

    def check_serving(self) -> None:
        """A valid request still goes through both protocols, end to end to the exporter; nothing was logged."""
        assert not self.errors.records, "\n".join(self.errors.records[:3])
        before = len(self.capture.batches)
        assert self.grpc(Signal.LOGS, _valid_logs().SerializeToString()) is grpc.StatusCode.OK
        assert self.http(Signal.TRACES, _valid_traces().SerializeToString()) == 200
        assert self.http(Signal.METRICS, b'{"resourceMetrics": []}', "application/json") == 200
        assert len(self.capture.batches) >= before + 3


@pytest.fixture(scope="module")
def running(tmp_path_factory, capture_exporter_module):
    pipe = {"receivers": ["otlp"], "processors": ["attribution", "goodput"], "exporters": ["capture", "store"]}
    config = {"receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0", "max_recv_msg_size_mib": LIMIT_MIB},
                                     "http": {"endpoint": "127.0.0.1:0", "max_request_body_size_mib": LIMIT_MIB}}},
              "processors": {"attribution": {"tick_interval": "200ms"}, "goodput": {"report_interval": "200ms"}},
              "exporters": {"capture": {}, "store": {"path": str(tmp_path_factory.mktemp("store"))}},
              "service": {"pipelines": {"traces": pipe, "metrics": pipe, "logs": pipe}}}
    errors = _Errors()
    root = logging.getLogger("otel_gpu")
    http_logger = logging.getLogger("otel_gpu.receivers.otlp._http")
    old_level = http_logger.level
    http_logger.setLevel(logging.DEBUG)
    root.addHandler(errors)
    collector = Collector(load_text(yaml.safe_dump(config)))
    collector.start()
    try:
        r = Running(collector, errors)
        r.check_serving()
        yield r
        r.check_serving()
        r.channel.close()
    finally:
        collector.shutdown()
        root.removeHandler(errors)
        http_logger.setLevel(old_level)
    assert not errors.records, "\n".join(errors.records[:3])


# -- valid requests to mutate ------------------------------------------------------------------------------------------

def _valid_logs(body: str = "hello", n_attrs: int = 2) -> logs_service_pb2.ExportLogsServiceRequest:
    req = logs_service_pb2.ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    for key, value in (("training.job.id", "job-fuzz"), ("service.name", "trainer")):
        rl.resource.attributes.add(key=key).value.string_value = value
    rl.resource.attributes.add(key="training.rank").value.int_value = 0
    lr = rl.scope_logs.add().log_records.add(time_unix_nano=1_700_000_000_000_000_000, severity_number=9,
                                             event_name="otel_gpu.training.progress")
    lr.body.string_value = body
    for i in range(n_attrs):
        kv = lr.attributes.add(key=f"a{i}")
        kv.value.kvlist_value.values.add(key="inner").value.array_value.values.add(int_value=i)
    return req


def _valid_traces(name: str = "otel_gpu.step") -> trace_service_pb2.ExportTraceServiceRequest:
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="training.job.id").value.string_value = "job-fuzz"
    rs.resource.attributes.add(key="training.rank").value.int_value = 1
    span = rs.scope_spans.add().spans.add(trace_id=bytes(range(16)), span_id=bytes(range(8)), name=name,
                                          start_time_unix_nano=1_700_000_000_000_000_000,
                                          end_time_unix_nano=1_700_000_000_500_000_000)
    span.attributes.add(key="training.step").value.int_value = 3
    span.events.add(name="e", time_unix_nano=1).attributes.add(key="x").value.double_value = 1.5
    return req


def _valid_metrics() -> metrics_service_pb2.ExportMetricsServiceRequest:
    req = metrics_service_pb2.ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.add(key="host.name").value.string_value = "node-a"
    sm = rm.scope_metrics.add()
    m = sm.metrics.add(name="gpu.xid.errors")
    p = m.sum.data_points.add(as_int=3, time_unix_nano=1)
    p.attributes.add(key="gpu.index").value.int_value = 0
    h = sm.metrics.add(name="h").histogram.data_points.add(count=2, sum=1.0, bucket_counts=[1, 1],
                                                           explicit_bounds=[0.5])
    h.attributes.add(key="k").value.bytes_value = b"\x00\xff"
    return req


VALID = {Signal.LOGS: _valid_logs().SerializeToString(), Signal.TRACES: _valid_traces().SerializeToString(),
         Signal.METRICS: _valid_metrics().SerializeToString()}


@st.composite
def mutated(draw) -> tuple[Signal, bytes]:
    signal = draw(st.sampled_from(list(Signal)))
    data = bytearray(VALID[signal])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "length", "delete", "splice"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "length":  # a length or varint byte turned huge, zero or unterminated
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 8))]
        else:
            other = VALID[draw(st.sampled_from(list(Signal)))]
            data[i:i] = other[:draw(st.integers(0, len(other)))]
    return signal, bytes(data)


# -- protobuf over both protocols ---------------------------------------------------------------------------------------

def _check_grpc(running: Running, signal: Signal, body: bytes) -> None:
    code = running.grpc(signal, body)
    assert code in GRPC_OK, (code, body[:80])


def _check_http(running: Running, signal: Signal, body: bytes, ctype: str = "application/x-protobuf",
                headers: dict[str, str] | None = None) -> int:
    status = running.http(signal, body, ctype, headers)
    assert status in HTTP_OK, (status, body[:80])
    return status


@fuzz(150)
@given(case=st.one_of(mutated(), st.tuples(st.sampled_from(list(Signal)), st.binary(max_size=512))))
def test_mutated_or_random_protobuf_gets_a_client_error_or_is_accepted(running, case):
    signal, body = case
    _check_grpc(running, signal, body)
    _check_http(running, signal, body)
    running.check_serving()


def _placeholder_to_invalid_utf8(req, placeholder: str, bad: bytes) -> bytes:
    raw = req.SerializeToString()
    assert placeholder.encode() in raw
    return raw.replace(placeholder.encode(), bad.ljust(len(placeholder), b"\xff")[:len(placeholder)])


@fuzz(40)
@given(bad=st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80abc", b"ok\xfe"]),
       where=st.sampled_from(["body", "key", "event"]))
def test_invalid_utf8_in_string_fields_is_invalid_argument(running, bad, where):
    placeholder = "P" * 12
    if where == "body":
        req = _valid_logs(body=placeholder)
    elif where == "key":
        req = _valid_logs()
        req.resource_logs[0].resource.attributes.add(key=placeholder).value.int_value = 1
    else:
        req = _valid_logs()
        req.resource_logs[0].scope_logs[0].log_records[0].event_name = placeholder
    body = _placeholder_to_invalid_utf8(req, placeholder, bad)
    assert running.grpc(Signal.LOGS, body) is grpc.StatusCode.INVALID_ARGUMENT
    assert running.http(Signal.LOGS, body) == 400
    running.check_serving()


# A hand-written protobuf encoder, so that nesting can go deeper than the Python protobuf library would build.
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _deep_any_value(depth: int, kind: str) -> bytes:
    value = _field(1, b"leaf")  # AnyValue.string_value
    for _ in range(depth):
        if kind == "kvlist":  # AnyValue.kvlist_value(6) -> KeyValueList.values(1) -> KeyValue{key(1), value(2)}
            value = _field(6, _field(1, _field(1, b"k") + _field(2, value)))
        else:  # AnyValue.array_value(5) -> ArrayValue.values(1)
            value = _field(5, _field(1, value))
    return value


def _logs_with_resource_attr(any_value: bytes) -> bytes:
    kv = _field(1, b"deep") + _field(2, any_value)
    return _field(1, _field(1, _field(1, kv)))  # ExportLogsServiceRequest.resource_logs.resource.attributes


@pytest.mark.parametrize("depth", [50, 101, 1000, 5000])
@pytest.mark.parametrize("kind", ["kvlist", "array"])
def test_deeply_nested_any_value_protobuf(running, depth, kind):
    body = _logs_with_resource_attr(_deep_any_value(depth, kind))
    code = running.grpc(Signal.LOGS, body)
    status = running.http(Signal.LOGS, body)
    assert code in GRPC_OK and status in HTTP_OK, (code, status)
    if depth >= 1000:  # past the protobuf recursion limit
        assert code is grpc.StatusCode.INVALID_ARGUMENT and status == 400
    running.check_serving()


def _deep_json(depth: int, kind: str) -> bytes:
    inner = '{"stringValue": "leaf"}'
    for _ in range(depth):
        inner = ('{"kvlistValue": {"values": [{"key": "k", "value": %s}]}}' if kind == "kvlist"
                 else '{"arrayValue": {"values": [%s]}}') % inner
    return ('{"resourceLogs": [{"resource": {"attributes": [{"key": "deep", "value": %s}]}}]}' % inner).encode()


@pytest.mark.parametrize("depth", [50, 101, 1000, 5000])
@pytest.mark.parametrize("kind", ["kvlist", "array"])
def test_deeply_nested_any_value_json(running, depth, kind):
    status = running.http(Signal.LOGS, _deep_json(depth, kind), "application/json")
    assert status in HTTP_OK, status
    if depth >= 1000:
        assert status == 400
    running.check_serving()


@pytest.mark.parametrize("n", [5000, 40000])
def test_thousands_of_attributes_and_huge_strings(running, n):
    req = _valid_logs(n_attrs=0)
    lr = req.resource_logs[0].scope_logs[0].log_records[0]
    for i in range(n):
        lr.attributes.add(key=f"k{i}").value.string_value = "v" * 8
    body = req.SerializeToString()
    expect_grpc = grpc.StatusCode.OK if len(body) <= LIMIT_MIB << 20 else grpc.StatusCode.RESOURCE_EXHAUSTED
    assert running.grpc(Signal.LOGS, body) is expect_grpc
    assert running.http(Signal.LOGS, body) == (200 if len(body) <= LIMIT_MIB << 20 else 413)
    huge = _valid_logs(body="x" * (3 << 20)).SerializeToString()
    assert running.grpc(Signal.LOGS, huge) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert running.http_raw(Signal.LOGS, huge) == 413
    big_ok = _valid_logs(body="y" * (LIMIT_MIB << 19)).SerializeToString()  # half the limit: accepted
    assert running.grpc(Signal.LOGS, big_ok) is grpc.StatusCode.OK
    assert running.http(Signal.LOGS, big_ok) == 200
    running.check_serving()


# -- OTLP/JSON -------------------------------------------------------------------------------------------------------

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                          st.floats(allow_nan=False), st.text(max_size=20),
                          st.sampled_from(["", "abc", "-1", "18446744073709551616", "-9223372036854775809", "1e400",
                                           "NaN", "Infinity", "0x10", "zz" * 8, "00" * 16, "\ud800"]))
_json_values = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(st.sampled_from(["stringValue", "intValue", "doubleValue", "boolValue",
                                                               "kvlistValue", "arrayValue", "bytesValue", "values",
                                                               "key", "value", "x"]), inner, max_size=3),
                            max_leaves=12)
_OTLP_KEYS = ["resourceLogs", "resourceSpans", "resourceMetrics", "resource", "attributes", "scopeLogs",
              "scopeSpans", "scopeMetrics", "logRecords", "spans", "metrics", "body", "traceId", "spanId",
              "parentSpanId", "timeUnixNano", "startTimeUnixNano", "endTimeUnixNano", "severityNumber", "name",
              "gauge", "sum", "dataPoints", "asInt", "asDouble", "eventName", "key", "value", "intValue",
              "droppedAttributesCount", "kind", "status", "code", "flags"]


@st.composite
def otlp_json(draw) -> tuple[Signal, bytes]:
    """An OTLP/JSON-shaped document with wrong types, bad ids and out-of-range numbers sprinkled in."""
    signal = draw(st.sampled_from(list(Signal)))
    shape = st.recursive(_json_values, lambda inner: st.dictionaries(st.sampled_from(_OTLP_KEYS), inner, max_size=4)
                         | st.lists(inner, max_size=3), max_leaves=20)
    doc = draw(shape)
    if draw(st.booleans()):
        top = {Signal.LOGS: "resourceLogs", Signal.TRACES: "resourceSpans", Signal.METRICS: "resourceMetrics"}[signal]
        doc = {top: doc if isinstance(doc, list) else [doc]}
    text = json.dumps(doc)  # Infinity and NaN tokens included: Python reads them, OTLP does not
    return signal, text.encode("utf-8", errors="surrogatepass")


@fuzz(200)
@given(case=otlp_json())
def test_json_with_wrong_types_gets_400_or_is_accepted(running, case):
    signal, body = case
    _check_http(running, signal, body, "application/json")
    running.check_serving()


@fuzz(60)
@given(signal=st.sampled_from(list(Signal)), body=st.binary(max_size=256),
       ctype=st.sampled_from(["application/json", "application/x-protobuf", "text/plain", "", "application/json; x",
                              "APPLICATION/JSON", "multipart/form-data; boundary=x", "application/protobuf"]),
       encoding=st.sampled_from([None, "gzip", "deflate", "br", "identity", "gzip, gzip", "x-gzip", "zstd"]))
def test_wrong_content_types_and_encodings(running, signal, body, ctype, encoding):
    headers = {"Content-Encoding": encoding} if encoding else {}
    _check_http(running, signal, body, ctype, headers)
    running.check_serving()


# -- malformed HTTP framing --------------------------------------------------------------------------------------------

_HTTP_ANSWERS = HTTP_OK | {404, 405, 408, 411, 414, 431, 501, 505}  # 501/505: unknown method / HTTP version (stdlib)


@st.composite
def raw_http_requests(draw) -> bytes:
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "FOO", "post", ""]))
    path = draw(st.sampled_from(["/v1/traces", "/v1/logs", "/v1/metrics", "/v1/metrics?x=1", "/", "//v1/logs",
                                 "/v1/logs/../traces", "*", "/" + "a" * 70000]))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/x", ""]))
    body = draw(st.sampled_from([b"", VALID[Signal.LOGS], b'{"resourceLogs": []}', b"garbage"]))
    headers = [("Content-Type", draw(st.sampled_from(["application/x-protobuf", "application/json", "text/x"])))]
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "both", "bad-length", "short", "long",
                                    "bad-chunk", "neg-length", "huge-length", "two-lengths"]))
    if framing == "length":
        headers.append(("Content-Length", str(len(body))))
        payload = body
    elif framing == "chunked" or framing == "both":
        headers.append(("Transfer-Encoding", "chunked"))
        if framing == "both":
            headers.append(("Content-Length", "3"))
        payload = (f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n") if body else b"0\r\n\r\n"
    elif framing == "bad-chunk":
        headers.append(("Transfer-Encoding", "chunked"))
        payload = draw(st.sampled_from([b"zz\r\nab\r\n0\r\n\r\n", b"ffffffffffffffff\r\n", b"5\r\nab", b"5;x\r\n"]))
    elif framing == "none":
        payload = body
    elif framing == "bad-length":
        headers.append(("Content-Length", draw(st.sampled_from(["abc", "1.5", "", " 1", "0x10", "1e3"]))))
        payload = body
    elif framing == "neg-length":
        headers.append(("Content-Length", "-5"))
        payload = body
    elif framing == "huge-length":
        headers.append(("Content-Length", str(draw(st.sampled_from([2**31, 2**63, 10**30])))))
        payload = body
    elif framing == "two-lengths":
        headers += [("Content-Length", str(len(body))), ("Content-Length", "1")]
        payload = body
    elif framing == "short":  # fewer bytes than announced; the sender then closes its side
        headers.append(("Content-Length", str(len(body) + 10)))
        payload = body
    else:  # more bytes than announced: the rest is read as the next request
        headers.append(("Content-Length", str(max(0, len(body) - 3))))
        payload = body
    if draw(st.booleans()):
        headers.append(("Content-Encoding", draw(st.sampled_from(["gzip", "deflate", "bogus", ""]))))
    if draw(st.booleans()):
        headers.append((draw(st.sampled_from(["X-\x01", "Bad Header", "A" * 70000, ""])), "v"))
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1", errors="replace") + payload


@fuzz(150)
@given(request=raw_http_requests())
def test_malformed_http_framing_gets_a_client_error(running, request):
    import socket

    with socket.create_connection(("127.0.0.1", running.http_port), timeout=10) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)  # EOF: a server waiting for announced bytes sees the request end
        except OSError:
            pass
        reply = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        except OSError:
            pass
    statuses = [int(m.group(1)) for m in __import__("re").finditer(rb"HTTP/1\.[01] (\d{3}) ", reply)]
    assert all(s in _HTTP_ANSWERS for s in statuses), (statuses, request[:200])
    running.check_serving()
