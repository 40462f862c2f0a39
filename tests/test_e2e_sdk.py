"""End to end: the official OpenTelemetry SDK (OTLP gRPC, then OTLP HTTP) -> `otel-gpu collector` subprocess ->
OTLP -> a sink. Resource, attributes, timestamps and ids must arrive unchanged; bad input must not hurt the
collector; SIGTERM must flush what it queued."""
from __future__ import annotations

import http.client
import socket
import time

import grpc
import pytest
from opentelemetry._logs import SeverityNumber
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context

from otel_gpu.testing.otlp_sink import OtlpSink

from collector_proc import free_port, start_collector

TRACES_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def collector_config(sink_endpoint: str, grpc_port: int, http_port: int, extra_exporter: str = "") -> str:
    return f"""
receivers:
  otlp:
    grpc: {{endpoint: "127.0.0.1:{grpc_port}", max_recv_msg_size_mib: 1}}
    http: {{endpoint: "127.0.0.1:{http_port}", max_request_body_size_mib: 1}}
exporters:
  otlp:
    endpoint: "{sink_endpoint}"
    retry_on_failure: {{initial_interval: 200ms, max_interval: 500ms}}
{extra_exporter}
service:
  pipelines:
    traces: {{receivers: [otlp], exporters: [otlp]}}
    metrics: {{receivers: [otlp], exporters: [otlp]}}
    logs: {{receivers: [otlp], exporters: [otlp]}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(sink, collector, grpc_port, http_port), shared by the tests that leave the collector running."""
    with OtlpSink() as sink:
        grpc_port, http_port = free_port(), free_port()
        collector = start_collector(collector_config(sink.endpoint, grpc_port, http_port),
                                    tmp_path_factory.mktemp("collector"))
        try:
            yield sink, collector, grpc_port, http_port
        finally:
            assert collector.stop() == 0, collector.stderr_text()[-3000:]


def value_of(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(value_of(v) for v in any_value.array_value.values)
    return getattr(any_value, kind)


def attrs(key_values) -> dict:
    return {kv.key: value_of(kv.value) for kv in key_values}


def sdk_exporters(protocol: str, grpc_port: int, http_port: int):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = f"127.0.0.1:{grpc_port}"
        return (OTLPSpanExporter(endpoint=endpoint, insecure=True), OTLPMetricExporter(endpoint=endpoint, insecure=True),
                OTLPLogExporter(endpoint=endpoint, insecure=True))
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    base = f"http://127.0.0.1:{http_port}"
    return (OTLPSpanExporter(endpoint=f"{base}/v1/traces"), OTLPMetricExporter(endpoint=f"{base}/v1/metrics"),
            OTLPLogExporter(endpoint=f"{base}/v1/logs"))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_signals_arrive_unchanged(stack, protocol):
    sink, collector, grpc_port, http_port = stack
    service = f"trainer-{protocol}"
    resource = Resource.create({"service.name": service, "host.name": "node-7", "otel_gpu.job.id": "job-42"})
    span_exporter, metric_exporter, log_exporter = sdk_exporters(protocol, grpc_port, http_port)

    # -- traces
    memory = InMemorySpanExporter()
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    tracer = tracer_provider.get_tracer("e2e", "1.0")
    with tracer.start_as_current_span("train.step", kind=SpanKind.INTERNAL, start_time=1_750_000_000_123_456_789,
                                      attributes={"step": 12, "loss": 0.25, "ok": True, "ranks": [0, 1, 2],
                                                  "tag": "warmup"}) as parent:
        parent.add_event("checkpoint", {"bytes": 1024}, timestamp=1_750_000_000_200_000_000)
        for rank in range(3):
            child = tracer.start_span("collective.all_reduce", context=set_span_in_context(parent),
                                      attributes={"rank": rank, "bytes": 262144})
            child.end(end_time=1_750_000_000_300_000_000 + rank)
    # -- logs, correlated with the parent span
    memory_logs = InMemoryLogRecordExporter()
    logger_provider = LoggerProvider(resource=resource)
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(memory_logs))
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(log_exporter))
    logger_provider.get_logger("e2e").emit(timestamp=1_750_000_000_400_000_000, body="NVRM: Xid 79",
                                           severity_number=SeverityNumber.ERROR, attributes={"gpu": 3},
                                           context=set_span_in_context(parent))
    # -- metrics
    before_ns = time.time_ns()
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=3_600_000)
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    meter = meter_provider.get_meter("e2e")
    meter.create_counter("e2e.steps").add(5, {"rank": 1})
    meter.create_histogram("e2e.step_time", unit="s").record(0.5, {"rank": 1})

    tracer_provider.shutdown()
    logger_provider.shutdown()
    meter_provider.shutdown()
    after_ns = time.time_ns()

    def mine(resource_items):
        return [r for r in resource_items if attrs(r.resource.attributes).get("service.name") == service]

    assert sink.wait_for(lambda s: sum(len(ss.spans) for r in s.traces for rs in mine(r.resource_spans)
                                       for ss in rs.scope_spans) >= 4
                         and any(mine(r.resource_logs) for r in s.logs)
                         and any(mine(r.resource_metrics) for r in s.metrics), timeout_s=15), \
        collector.stderr_text()[-3000:]

    sent = {s.context.span_id.to_bytes(8, "big"): s for s in memory.get_finished_spans()}
    got = {}
    for request in sink.traces:
        for rs in mine(request.resource_spans):
            assert attrs(rs.resource.attributes) == dict(resource.attributes)
            for ss in rs.scope_spans:
                assert (ss.scope.name, ss.scope.version) == ("e2e", "1.0")
                got.update({span.span_id: span for span in ss.spans})
    assert set(got) == set(sent)
    for span_id, want in sent.items():
        span = got[span_id]
        assert span.trace_id == want.context.trace_id.to_bytes(16, "big")
        assert span.parent_span_id == (want.parent.span_id.to_bytes(8, "big") if want.parent else b"")
        assert span.name == want.name
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (want.start_time, want.end_time)
        assert attrs(span.attributes) == {k: tuple(v) if isinstance(v, tuple | list) else v
                                          for k, v in want.attributes.items()}
        assert [(e.name, e.time_unix_nano, attrs(e.attributes)) for e in span.events] == \
            [(e.name, e.timestamp, dict(e.attributes)) for e in want.events]
    assert got[next(i for i, s in sent.items() if s.name == "train.step")].start_time_unix_nano == \
        1_750_000_000_123_456_789

    (want_log,) = memory_logs.get_finished_logs()
    records = [lr for r in sink.logs for rl in mine(r.resource_logs) for sl in rl.scope_logs for lr in sl.log_records]
    (record,) = records
    assert record.body.string_value == "NVRM: Xid 79" and record.time_unix_nano == 1_750_000_000_400_000_000
    assert record.severity_number == SeverityNumber.ERROR.value and attrs(record.attributes) == {"gpu": 3}
    assert record.trace_id == parent.get_span_context().trace_id.to_bytes(16, "big")
    assert record.span_id == parent.get_span_context().span_id.to_bytes(8, "big")
    assert record.observed_time_unix_nano == want_log.log_record.observed_timestamp

    metrics = {m.name: m for r in sink.metrics for rm in mine(r.resource_metrics) for sm in rm.scope_metrics
               for m in sm.metrics}
    (point,) = metrics["e2e.steps"].sum.data_points
    assert point.as_int == 5 and attrs(point.attributes) == {"rank": 1}
    assert before_ns <= point.time_unix_nano <= after_ns
    (hist,) = metrics["e2e.step_time"].histogram.data_points
    assert hist.count == 1 and hist.sum == 0.5 and metrics["e2e.step_time"].unit == "s"
    assert collector.alive


def test_collector_survives_bad_input_and_loses_nothing(stack):
    sink, collector, grpc_port, http_port = stack

    def request(tag: str, n: int = 2) -> bytes:
        req = trace_service_pb2.ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = "service.name", tag
        for i in range(n):
            span = rs.scope_spans.add().spans.add() if i == 0 else rs.scope_spans[0].spans.add()
            span.name, span.trace_id, span.span_id = "x" * 40, b"\7" * 16, (i + 1).to_bytes(8, "big")
        return req.SerializeToString()

    def post(body: bytes, ctype: str = "application/x-protobuf") -> int:
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
        try:
            conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": ctype})
            return conn.getresponse().status
        finally:
            conn.close()

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        export = channel.unary_unary(TRACES_EXPORT)
        export(request("before-grpc"), timeout=10)
        assert post(request("before-http")) == 200
        with pytest.raises(grpc.RpcError) as err:
            export(b"\x0a\x05\x0a\x03\xff", timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            export(request("huge", 20_000), timeout=10)  # > max_recv_msg_size_mib: 1
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert post(b"\x0a\x05\x0a\x03\xff") == 400
        assert post(request("json?"), "text/plain") == 415
        assert post(request("huge", 20_000)) == 413
        with socket.create_connection(("127.0.0.1", http_port), timeout=10) as s:  # truncated, then hang up
            body = request("truncated")
            s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                      b"Content-Length: %d\r\n\r\n" % (len(body) * 2) + body)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(100).startswith(b"HTTP/1.1 400")
        export(request("after-grpc"), timeout=10)
        assert post(request("after-http")) == 200

    def services(s):
        return {attrs(rs.resource.attributes)["service.name"] for r in s.traces for rs in r.resource_spans}

    wanted = {"before-grpc", "before-http", "after-grpc", "after-http"}
    assert sink.wait_for(lambda s: wanted <= services(s), timeout_s=10)
    assert not services(sink) & {"huge", "truncated", "json?"}
    assert collector.alive


def test_sigterm_flushes_what_the_collector_queued(tmp_path):
    with OtlpSink() as sink:
        grpc_port, http_port = free_port(), free_port()
        collector = start_collector(collector_config(sink.endpoint, grpc_port, http_port), tmp_path)
        sink.fail_next(4, grpc.StatusCode.UNAVAILABLE)  # the backend is down for a moment: batches sit in retry
        req = trace_service_pb2.ExportTraceServiceRequest()
        spans = req.resource_spans.add().scope_spans.add()
        for i in range(100):
            span = spans.spans.add()
            span.name, span.trace_id, span.span_id = f"s{i}", b"\3" * 16, (i + 1).to_bytes(8, "big")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            export = channel.unary_unary(TRACES_EXPORT)
            for _ in range(5):
                export(req.SerializeToString(), timeout=10)
        assert sink.span_count() < 500  # not all delivered yet: the failures forced retries
        assert collector.stop(timeout_s=20) == 0
        assert sink.span_count() == 500, collector.stderr_text()[-3000:]
        assert "received SIGTERM" in collector.stderr_text()
