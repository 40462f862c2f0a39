"""The otlp (gRPC) and otlphttp exporters against real servers: bytes unchanged, retry, queue, drain, counts."""
from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost, ExportResult
from otel_gpu.config import ConfigError, build
from otel_gpu.exporters.otlp import OtlpExporter, OtlpExporterConfig, OtlpHttpExporter, OtlpHttpExporterConfig
from otel_gpu.pdata import Batch, Signal
from otel_gpu.receivers.otlp import OtlpReceiver, OtlpReceiverConfig
from otel_gpu.testing.otlp_sink import OtlpSink

from collector_proc import free_port

FAST_RETRY = {"initial_interval": "20ms", "max_interval": "100ms", "max_elapsed_time": "10s"}
EXPORTED, DROPPED = "otel_gpu.collector.exported", "otel_gpu.collector.dropped"


def spans(n: int, tag: str = "s") -> Batch:
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    a = rs.resource.attributes.add()
    a.key, a.value.string_value = "service.name", tag
    ss = rs.scope_spans.add()
    for i in range(n):
        span = ss.spans.add()
        span.name, span.trace_id, span.span_id = f"{tag}{i}", b"\1" * 16, (i + 1).to_bytes(8, "big")
    return Batch.from_bytes(Signal.TRACES, req.SerializeToString())


def metric_batch() -> Batch:
    req = metrics_service_pb2.ExportMetricsServiceRequest()
    m = req.resource_metrics.add().scope_metrics.add().metrics.add()
    m.name = "m"
    m.sum.data_points.add().as_int = 3
    m.sum.data_points.add().as_int = 4
    return Batch.from_bytes(Signal.METRICS, req.SerializeToString())


def log_batch() -> Batch:
    req = logs_service_pb2.ExportLogsServiceRequest()
    req.resource_logs.add().scope_logs.add().log_records.add().body.string_value = "hello"
    return Batch.from_bytes(Signal.LOGS, req.SerializeToString())


def make(cls, config_cls, settings: dict, cid: str = "otlp"):
    telemetry = PrometheusSelfTelemetry()
    exporter = cls(build(config_cls, settings, f"exporters.{cid}"), ComponentHost(cid, telemetry))
    exporter.start()
    return exporter, telemetry


@pytest.fixture
def sink():
    with OtlpSink() as s:
        yield s


# -- gRPC ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_grpc_delivers_every_signal_unchanged(sink, compression):
    exporter, telemetry = make(OtlpExporter, OtlpExporterConfig, {"endpoint": sink.endpoint,
                                                                  "compression": compression})
    batches = [spans(5), metric_batch(), log_batch()]
    assert [exporter.export(b) for b in batches] == [ExportResult.QUEUED] * 3
    assert exporter.force_flush(5)
    assert sink.traces == [batches[0].message] and sink.metrics == [batches[1].message]
    assert sink.logs == [batches[2].message]
    assert telemetry.value(EXPORTED, "otlp", Signal.TRACES) == 5
    assert telemetry.value(EXPORTED, "otlp", Signal.METRICS) == 2
    assert telemetry.value(EXPORTED, "otlp", Signal.LOGS) == 1
    exporter.shutdown(2)
    assert exporter.export(spans(1)) is ExportResult.FAILURE  # after shutdown: refused, never hangs


def test_grpc_retries_unavailable(sink):
    sink.fail_next(3, grpc.StatusCode.UNAVAILABLE)
    exporter, telemetry = make(OtlpExporter, OtlpExporterConfig, {"endpoint": sink.endpoint,
                                                                  "retry_on_failure": FAST_RETRY})
    exporter.export(spans(7))
    assert exporter.force_flush(5)
    assert sink.calls == 4 and sink.span_count() == 7
    assert telemetry.value(EXPORTED, "otlp", Signal.TRACES) == 7
    assert telemetry.value(DROPPED, "otlp", Signal.TRACES) == 0
    exporter.shutdown(2)


def test_grpc_permanent_error_drops_without_retry(sink):
    sink.fail_next(1, grpc.StatusCode.INVALID_ARGUMENT)
    exporter, telemetry = make(OtlpExporter, OtlpExporterConfig, {"endpoint": sink.endpoint,
                                                                  "retry_on_failure": FAST_RETRY,
                                                                  "sending_queue": {"num_consumers": 1}})
    exporter.export(spans(4))
    exporter.export(spans(2))
    assert exporter.force_flush(5)
    assert sink.calls == 2 and sink.span_count() == 2
    assert telemetry.value(DROPPED, "otlp", Signal.TRACES) == 4
    assert telemetry.value(EXPORTED, "otlp", Signal.TRACES) == 2
    exporter.shutdown(2)


def test_grpc_gives_up_after_max_elapsed_time(sink):
    sink.fail_next(1000, grpc.StatusCode.UNAVAILABLE)
    exporter, telemetry = make(OtlpExporter, OtlpExporterConfig, {"endpoint": sink.endpoint, "retry_on_failure": {
        **FAST_RETRY, "max_elapsed_time": "300ms"}})
    started = time.monotonic()
    exporter.export(spans(3))
    assert exporter.force_flush(5)
    assert 0.1 < time.monotonic() - started < 2  # gives up once the next wait would pass 0.3 s
    assert sink.calls > 2 and telemetry.value(DROPPED, "otlp", Signal.TRACES) == 3
    exporter.shutdown(2)


def test_grpc_honours_retry_info():
    """RESOURCE_EXHAUSTED with RetryInfo(0.4 s) is retried after 0.4 s, though the backoff would wait 30 s."""
    times: list[float] = []

    def export(raw, context):
        times.append(time.monotonic())
        if len(times) == 1:
            info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=400_000_000))
            status = status_pb2.Status(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="slow down")
            status.details.add().Pack(info)
            context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down")
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        exporter, telemetry = make(OtlpExporter, OtlpExporterConfig, {"endpoint": f"127.0.0.1:{port}",
                                   "retry_on_failure": {"initial_interval": "30s", "max_interval": "30s"}})
        exporter.export(spans(2))
        assert exporter.force_flush(5)
        assert len(times) == 2 and 0.35 < times[1] - times[0] < 3
        assert telemetry.value(EXPORTED, "otlp", Signal.TRACES) == 2
        exporter.shutdown(2)
    finally:
        server.stop(0)


def test_shutdown_drains_the_queue(sink):
    exporter, telemetry = make(OtlpExporter, OtlpExporterConfig, {"endpoint": sink.endpoint,
                                                                  "sending_queue": {"num_consumers": 2}})
    for i in range(30):
        assert exporter.export(spans(10, f"b{i}")) is ExportResult.QUEUED
    exporter.shutdown(10)
    assert sink.span_count() == 300 and len(sink.traces) == 30
    assert telemetry.value(EXPORTED, "otlp", Signal.TRACES) == 300


def test_shutdown_deadline_drops_and_counts_what_is_left():
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    exporter, telemetry = make(OtlpExporter, OtlpExporterConfig, {"endpoint": dead, "retry_on_failure": FAST_RETRY,
                                                                  "sending_queue": {"num_consumers": 1}})
    for _ in range(5):
        exporter.export(spans(2))
    started = time.monotonic()
    exporter.shutdown(0.6)
    assert time.monotonic() - started < 2.5
    assert telemetry.value(DROPPED, "otlp", Signal.TRACES) == 10
    assert telemetry.value(EXPORTED, "otlp", Signal.TRACES) == 0


def test_queue_full_drops_are_counted_through_the_collector():
    """Receiver -> exporter to a dead backend, queue of 2: what does not fit is dropped and counted, never blocks."""
    dead = f"127.0.0.1:{free_port()}"
    config = load_text(f"""
receivers: {{otlp: {{grpc: {{endpoint: "127.0.0.1:0"}}, http: null}}}}
exporters:
  otlp:
    endpoint: "{dead}"
    retry_on_failure: {{initial_interval: 30s, max_interval: 30s}}
    sending_queue: {{queue_size: 2, num_consumers: 1}}
service: {{pipelines: {{traces: {{receivers: [otlp], exporters: [otlp]}}}}}}
""")
    collector = Collector(config)
    collector.start()
    try:
        port = collector.component("receiver", "otlp").grpc_port
        telemetry = collector.telemetry
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
            call(spans(3).to_bytes(), timeout=5)
            deadline = time.monotonic() + 5  # the one sender takes the first batch and sits in its 30 s backoff
            while telemetry.value("otel_gpu.collector.queue.size", "otlp") != 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            started = time.monotonic()
            for _ in range(5):
                call(spans(3).to_bytes(), timeout=5)  # accepted: the receiver is never blocked
            assert time.monotonic() - started < 2
        assert telemetry.value("otel_gpu.collector.received", "otlp", Signal.TRACES) == 18
        assert telemetry.value("otel_gpu.collector.queue.size", "otlp") == 2
        assert telemetry.value(DROPPED, "otlp", Signal.TRACES) == 9  # 3 batches of 3 did not fit
    finally:
        collector.shutdown(1.0)
    # Past the shutdown deadline the queued and in-flight batches are dropped and counted too: nothing vanishes.
    assert telemetry.value(DROPPED, "otlp", Signal.TRACES) == 18
    assert telemetry.value(EXPORTED, "otlp", Signal.TRACES) == 0


def test_queue_disabled_sends_on_the_callers_thread(sink):
    exporter, _ = make(OtlpExporter, OtlpExporterConfig, {"endpoint": sink.endpoint,
                                                          "sending_queue": {"enabled": False}})
    assert exporter.export(spans(2)) is ExportResult.SUCCESS and sink.span_count() == 2
    exporter.shutdown(1)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"exporters\.otlp\.endpoint is required"):
        build(OtlpExporterConfig, {}, "exporters.otlp")
    with pytest.raises(ConfigError, match=r"exporters\.otlp\.compression must be gzip or none"):
        build(OtlpExporterConfig, {"endpoint": "a:1", "compression": "zstd"}, "exporters.otlp")
    with pytest.raises(ConfigError, match=r"exporters\.otlp\.sending_queue\.queue_size must be >= 1"):
        build(OtlpExporterConfig, {"endpoint": "a:1", "sending_queue": {"queue_size": 0}}, "exporters.otlp")
    with pytest.raises(ConfigError, match=r"exporters\.otlphttp\.endpoint must be a URL"):
        build(OtlpHttpExporterConfig, {"endpoint": "backend:4318"}, "exporters.otlphttp")


# -- HTTP ----------------------------------------------------------------------------------------------------------
class Keep:
    def __init__(self):
        self.batches = []

    def consume(self, batch):
        self.batches.append(batch)


def test_http_delivers_every_signal_to_an_otlp_http_receiver():
    keep = Keep()
    receiver = OtlpReceiver(build(OtlpReceiverConfig, {"grpc": None, "http": {"endpoint": "127.0.0.1:0"}}, "r"),
                            ComponentHost("otlp", PrometheusSelfTelemetry(), {s: keep for s in Signal}))
    receiver.start()
    try:
        exporter, telemetry = make(OtlpHttpExporter, OtlpHttpExporterConfig,
                                   {"endpoint": f"http://127.0.0.1:{receiver.http_port}"}, "otlphttp")
        batches = [spans(5), metric_batch(), log_batch(), spans(2)]
        for b in batches:
            assert exporter.export(b) is ExportResult.QUEUED
        exporter.shutdown(5)
        assert sorted(b.to_bytes() for b in keep.batches) == sorted(b.to_bytes() for b in batches)
        assert telemetry.value(EXPORTED, "otlphttp", Signal.TRACES) == 7
        assert telemetry.value(EXPORTED, "otlphttp", Signal.LOGS) == 1
    finally:
        receiver.shutdown(2)


class _Scripted(BaseHTTPRequestHandler):
    """Answers from a script of (status, headers); records what it got."""

    protocol_version = "HTTP/1.1"
    script: list = []
    got: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append((time.monotonic(), self.path, dict(self.headers), body))
        status, headers = type(self).script.pop(0) if type(self).script else (200, {})
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    handler = type("H", (_Scripted,), {"script": [], "got": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, handler
    server.shutdown()
    server.server_close()


def test_http_retries_503_after_retry_after_and_sends_headers(scripted):
    server, handler = scripted
    handler.script = [(503, {"Retry-After": "1"}), (429, {}), (200, {})]
    exporter, telemetry = make(OtlpHttpExporter, OtlpHttpExporterConfig, {
        "endpoint": f"http://127.0.0.1:{server.server_port}/base", "headers": {"x-tenant": "team-a"},
        "retry_on_failure": FAST_RETRY}, "otlphttp")
    batch = spans(3)
    exporter.export(batch)
    assert exporter.force_flush(8)
    assert len(handler.got) == 3
    assert handler.got[1][0] - handler.got[0][0] >= 0.9  # Retry-After: 1 honoured over the 20 ms backoff
    _, path, headers, body = handler.got[-1]
    assert path == "/base/v1/traces" and headers["x-tenant"] == "team-a"
    assert headers["Content-Type"] == "application/x-protobuf" and headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body) == batch.to_bytes()
    assert telemetry.value(EXPORTED, "otlphttp", Signal.TRACES) == 3
    exporter.shutdown(2)


def test_http_permanent_error_drops(scripted):
    server, handler = scripted
    handler.script = [(400, {})]
    exporter, telemetry = make(OtlpHttpExporter, OtlpHttpExporterConfig, {
        "endpoint": f"http://127.0.0.1:{server.server_port}", "compression": "none",
        "retry_on_failure": FAST_RETRY}, "otlphttp")
    exporter.export(spans(4))
    assert exporter.force_flush(5)
    assert len(handler.got) == 1 and telemetry.value(DROPPED, "otlphttp", Signal.TRACES) == 4
    exporter.shutdown(2)


def test_http_connection_refused_is_retried_until_the_server_appears():
    port = free_port()
    exporter, telemetry = make(OtlpHttpExporter, OtlpHttpExporterConfig, {
        "endpoint": f"http://127.0.0.1:{port}", "retry_on_failure": FAST_RETRY}, "otlphttp")
    exporter.export(spans(2))
    time.sleep(0.3)
    keep = Keep()
    receiver = OtlpReceiver(build(OtlpReceiverConfig, {"grpc": None, "http": {"endpoint": f"127.0.0.1:{port}"}}, "r"),
                            ComponentHost("otlp", PrometheusSelfTelemetry(), {s: keep for s in Signal}))
    receiver.start()
    try:
        assert exporter.force_flush(5)
        assert len(keep.batches) == 1 and telemetry.value(EXPORTED, "otlphttp", Signal.TRACES) == 2
    finally:
        exporter.shutdown(2)
        receiver.shutdown(2)
