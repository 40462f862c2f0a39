"""What real OTLP clients and restarts found (issue 13, item 8): a scraped collector restarts at once, invalid ids are
refused, errors answer in the request's encoding, refused bodies are counted, unknown JSON fields are ignored whatever
they hold, and the debug exporter writes ids in hex."""
from __future__ import annotations

import gzip
import http.client
import json
import logging
import socket

import grpc
import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otel_gpu.collector import registry
from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.pdata import Signal

TRACE_ID, SPAN_ID = bytes(range(1, 17)), bytes(range(101, 109))


def _spans(trace_id: bytes = TRACE_ID, span_id: bytes = SPAN_ID, parent: bytes = b"") -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add(name="step", trace_id=trace_id, span_id=span_id,
                                                                parent_span_id=parent)
    span.start_time_unix_nano, span.end_time_unix_nano = 1, 2
    return req.SerializeToString()


def _logs(trace_id: bytes = b"", span_id: bytes = b"") -> bytes:
    req = logs_service_pb2.ExportLogsServiceRequest()
    req.resource_logs.add().scope_logs.add().log_records.add(trace_id=trace_id, span_id=span_id).body.string_value = "x"
    return req.SerializeToString()


@pytest.fixture
def collector():
    registry.BUILTIN["exporter"].setdefault("capture", "otel_gpu.testing.capture")
    c = Collector(load_text("receivers: {otlp: {grpc: {endpoint: 127.0.0.1:0}, http: {endpoint: 127.0.0.1:0}}}\n"
                            "exporters: {capture: {}}\nservice: {pipelines: {traces: {receivers: [otlp], exporters: "
                            "[capture]}, logs: {receivers: [otlp], exporters: [capture]}}}"))
    c.start()
    yield c
    c.shutdown()


def _post(port: int, path: str, body: bytes, ctype: str | None = "application/x-protobuf", method: str = "POST",
          headers: dict | None = None) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        hdrs = dict(headers or {})
        if ctype:
            hdrs["Content-Type"] = ctype
        conn.request(method, path, body=body if method != "GET" else None, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def _refused(c: Collector, signal: Signal) -> float:
    return c.telemetry.value("otel_gpu.collector.refused", "otlp", signal)


# -- a restarted node agent comes back at once --------------------------------------------------------------------
def test_a_collector_restarted_right_after_being_scraped_binds_its_ports_again():
    """Every scrape leaves the collector's side of the connection in TIME_WAIT (the server closes first); without
    SO_REUSEADDR a restart within about a minute failed with "Address already in use"."""
    ports = []
    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    prom, http_port, health, self_metrics = ports
    text = (f"extensions: {{health_check: {{endpoint: 127.0.0.1:{health}}}}}\n"
            f"receivers: {{otlp: {{grpc: {{endpoint: 127.0.0.1:0}}, http: {{endpoint: 127.0.0.1:{http_port}}}}}}}\n"
            f"exporters: {{prometheus: {{endpoint: 127.0.0.1:{prom}}}}}\n"
            f"service: {{extensions: [health_check], telemetry: {{metrics: {{address: 127.0.0.1:{self_metrics}}}}}, "
            f"pipelines: {{metrics: {{receivers: [otlp], exporters: [prometheus]}}}}}}")
    for attempt in range(2):
        c = Collector(load_text(text))
        c.start()  # the second start is the restart: it must not fail
        try:
            for port, path in ((prom, "/metrics"), (health, "/"), (self_metrics, "/metrics"), (http_port, "/")):
                status, _, _ = _post(port, path, b"", ctype=None, method="GET", headers={"Connection": "close"})
                assert status in (200, 404), (attempt, port, status)
        finally:
            c.shutdown()


# -- ids ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, what", [
    (_spans(trace_id=TRACE_ID[:15]), "trace_id of 15 bytes"),
    (_spans(trace_id=TRACE_ID + b"\x01"), "trace_id of 17 bytes"),
    (_spans(trace_id=b""), "trace_id of 0 bytes"),
    (_spans(trace_id=bytes(16)), "trace_id of 16 bytes (all zero)"),
    (_spans(span_id=SPAN_ID[:2]), "span_id of 2 bytes"),
    (_spans(span_id=b""), "span_id of 0 bytes"),
    (_spans(parent=SPAN_ID[:7]), "parent_span_id of 7 bytes"),
])
def test_spans_with_invalid_ids_are_refused_on_http_and_grpc_and_counted(collector, body, what):
    receiver = collector.component("receiver", "otlp")
    before = _refused(collector, Signal.TRACES)
    status, ctype, answer = _post(receiver.http_port, "/v1/traces", body)
    assert (status, ctype) == (400, "application/x-protobuf")
    assert what in status_pb2.Status.FromString(answer).message
    with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
        call = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        with pytest.raises(grpc.RpcError) as info:
            call(body, timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and what in info.value.details()
    assert _refused(collector, Signal.TRACES) == before + 2
    assert collector.component("exporter", "capture").of(Signal.TRACES) == []


def test_valid_ids_pass_and_log_records_may_have_none(collector):
    receiver = collector.component("receiver", "otlp")
    assert _post(receiver.http_port, "/v1/traces", _spans(parent=SPAN_ID))[0] == 200
    assert _post(receiver.http_port, "/v1/logs", _logs())[0] == 200
    assert _post(receiver.http_port, "/v1/logs", _logs(TRACE_ID, SPAN_ID))[0] == 200
    status, _, answer = _post(receiver.http_port, "/v1/logs", _logs(TRACE_ID[:15], SPAN_ID))
    assert status == 400 and "trace_id of 15" in status_pb2.Status.FromString(answer).message
    capture = collector.component("exporter", "capture")
    assert len(capture.of(Signal.TRACES)) == 1 and len(capture.of(Signal.LOGS)) == 2


def test_json_ids_of_the_wrong_length_are_refused_and_unknown_fields_are_ignored_whatever_they_hold(collector):
    receiver = collector.component("receiver", "otlp")

    def doc(trace_id: str, extra: dict | None = None) -> bytes:
        span = {"traceId": trace_id, "spanId": SPAN_ID.hex(), "name": "step", **(extra or {})}
        return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}],
                           "vendorExtension": {"traceId": "not-hex!", "nested": [{"spanId": "zz"}]}}).encode()

    assert _post(receiver.http_port, "/v1/traces", doc(TRACE_ID.hex()), "application/json")[0] == 200
    # an unknown field inside a span holding id-like keys is ignored too
    assert _post(receiver.http_port, "/v1/traces", doc(TRACE_ID.hex(), {"x-debug": {"traceId": "??"}}),
                 "application/json")[0] == 200
    status, ctype, body = _post(receiver.http_port, "/v1/traces", doc(TRACE_ID.hex()[:30]), "application/json")
    assert (status, ctype) == (400, "application/json") and "trace_id of 15 bytes" in json.loads(body)["message"]
    status, _, body = _post(receiver.http_port, "/v1/traces", doc("xyz" * 10 + "ab"), "application/json")
    assert status == 400 and "traceId: not a hex id" in json.loads(body)["message"]
    spans = collector.component("exporter", "capture").of(Signal.TRACES)
    assert [s.message.resource_spans[0].scope_spans[0].spans[0].trace_id for s in spans] == [TRACE_ID, TRACE_ID]


# -- errors in the request's encoding, and counted -----------------------------------------------------------------
@pytest.mark.parametrize("ctype, expect", [("application/x-protobuf", "application/x-protobuf"),
                                           ("application/json", "application/json"),
                                           (None, "application/json")])
def test_404_and_405_answer_in_the_request_encoding(collector, ctype, expect):
    port = collector.component("receiver", "otlp").http_port
    for method, path, code in (("POST", "/v1/trace", 404), ("PUT", "/v1/traces", 405), ("GET", "/v1/traces", 405)):
        status, got, body = _post(port, path, b"x", ctype, method=method)
        assert (status, got) == (code, expect), (method, path)
        message = (status_pb2.Status.FromString(body).message if expect == "application/x-protobuf"
                   else json.loads(body)["message"])
        assert ("no OTLP service" if code == 404 else "OTLP/HTTP takes POST") in message


def test_requests_refused_for_their_body_are_counted(collector):
    port = collector.component("receiver", "otlp").http_port
    cases = [
        (_post(port, "/v1/traces", b"not gzip", headers={"Content-Encoding": "gzip"}), 400),
        (_post(port, "/v1/traces", _spans(), headers={"Content-Encoding": "br"}), 415),
        (_post(port, "/v1/traces", _spans(), ctype="text/plain"), 415),
        (_post(port, "/v1/traces", gzip.compress(b"\0" * (17 << 20)), headers={"Content-Encoding": "gzip"}), 413),
    ]
    assert [c[0][0] for c in cases] == [c[1] for c in cases]
    assert _refused(collector, Signal.TRACES) == len(cases)
    assert collector.component("exporter", "capture").of(Signal.TRACES) == []


# -- debug exporter -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verbosity", ["normal", "detailed"])
def test_debug_exporter_writes_ids_in_hex(caplog, verbosity):
    from otel_gpu.exporters.debug import FACTORY
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.component import ComponentHost
    from otel_gpu.config import build
    from otel_gpu.pdata import Batch

    exporter = FACTORY.create(build(FACTORY.config_class, {"verbosity": verbosity}, "exporters.debug"),
                              ComponentHost("debug", PrometheusSelfTelemetry()))
    with caplog.at_level(logging.INFO, logger="otel_gpu.exporters.debug"):
        exporter.export(Batch.from_bytes(Signal.TRACES, _spans(parent=bytes(range(8)))))
    text = caplog.text
    assert TRACE_ID.hex() in text and SPAN_ID.hex() in text and bytes(range(8)).hex() in text
    assert "\\x" not in text and "\\001" not in text
