"""Times outside a window around receipt never stretch a job's wall time (issue 21: one step span with a 1970 start
set its job's ETTR to 0% for good, wall time 499,003 h)."""
from __future__ import annotations

import http.client
import json
import time
from contextlib import closing

import grpc
import pytest
from collector_proc import free_port, start_collector
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.config import ConfigError, build
from otel_gpu.exporters.store import db
from otel_gpu.otlp_build import SpansBuilder
from otel_gpu.pdata import Batch, Signal
from otel_gpu.processors.goodput import GoodputConfig, GoodputProcessor
from otel_gpu.schema import collector as names
from otel_gpu.schema import identity as I
from otel_gpu.schema import training as T

pytestmark = pytest.mark.timeout(120)


def steps(job: str, t0: float, n: int, rank: int = 0, extra: list[tuple[int, float, float]] = ()):
    """``n`` one-second step spans from ``t0`` (steps 1..n), plus ``extra`` (step, start, end) spans."""
    spans = SpansBuilder({str(I.JOB_ID): job, str(I.RANK): rank, str(I.SERVICE_NAME): "train"})
    for step in range(1, n + 1):
        start = t0 + step - 1
        spans.span(T.STEP_SPAN.name, int(start * 1e9), int((start + 1.0) * 1e9), {str(T.STEP): step})
    for step, start, end in extra:
        spans.span(T.STEP_SPAN.name, int(start * 1e9), int(end * 1e9), {str(T.STEP): step})
    return spans.build()


def processor(**settings) -> tuple[GoodputProcessor, PrometheusSelfTelemetry]:
    telemetry = PrometheusSelfTelemetry()
    proc = GoodputProcessor(build(GoodputConfig, settings, "processors.goodput"),
                            ComponentHost("goodput", telemetry, {}))
    return proc, telemetry


def test_a_1970_step_span_neither_stretches_the_wall_time_nor_sinks_the_ettr():
    proc, telemetry = processor()
    t0 = time.time() - 10.0
    proc.process(Batch.from_message(Signal.TRACES, steps("job-1970", t0, 10, extra=[(11, 1.0, 2.0)])))
    (summary,) = proc.summaries(now=t0 + 10.0)
    assert summary["wall_time_s"] == pytest.approx(10.0, abs=0.01), summary
    assert summary["ettr"] == pytest.approx(1.0, abs=0.01), summary
    assert proc.out_of_window == 1
    assert telemetry.value(names.OUT_OF_WINDOW.name, "goodput") == 1


def test_a_span_from_the_future_is_refused_and_one_inside_the_window_still_counts():
    proc, telemetry = processor(time_window_future="10m", time_window_past="1h")
    now = time.time()
    proc.process(Batch.from_message(Signal.TRACES, steps("job-f", now - 10.0, 10, extra=[
        (11, now + 3600.0, now + 3601.0),  # an hour ahead: refused
        (12, now - 1800.0, now - 1799.0),  # half an hour ago, inside the 1 h window: it counts (wall from there)
    ])))
    (summary,) = proc.summaries(now=now)
    assert summary["wall_time_s"] == pytest.approx(1800.0, abs=1.0), summary
    assert proc.out_of_window == 1 and telemetry.value(names.OUT_OF_WINDOW.name, "goodput") == 1


def test_failure_times_outside_the_window_are_replaced_by_the_receipt_time():
    proc, _ = processor()
    t0 = time.time() - 10.0
    proc.process(Batch.from_message(Signal.TRACES, steps("job-x", t0, 10)))
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.add(key=str(I.JOB_ID), value=AnyValue(string_value="job-x"))
    rl.scope_logs.add().log_records.add(
        event_name="otel_gpu.failure", time_unix_nano=1,  # a 1970 record time, onset and detection
        body=AnyValue(string_value=json.dumps({"kind": "crash", "job_id": "job-x", "onset_time": 1.0,
                                               "detected_time": 5.0, "failure_id": "f-1"})))
    proc.process(Batch.from_message(Signal.LOGS, req))
    (summary,) = proc.summaries()
    assert summary["first_seen"] == pytest.approx(t0, abs=0.01)  # the wall time still starts with the job
    assert summary["failures"] == 1
    assert proc.out_of_window == 3  # record time, onset, detection


def test_the_window_settings_are_checked():
    with pytest.raises(ConfigError, match="processors.goodput.time_window_past must be > 0"):
        build(GoodputConfig, {"time_window_past": 0}, "processors.goodput")


def test_through_a_collector_a_1970_span_leaves_the_stored_ettr_of_its_job_sane(tmp_path):
    """OTLP/gRPC in, goodput, store: the job's stored summary keeps its real wall time and the refusal is counted."""
    grpc_port, prom_port = free_port(), free_port()
    store = tmp_path / "store"
    text = f"""
receivers:
  otlp: {{grpc: {{endpoint: 127.0.0.1:{grpc_port}}}, http: null}}
processors:
  goodput: {{report_interval: 200ms}}
exporters:
  store: {{path: "{store}"}}
  prometheus: {{endpoint: 127.0.0.1:{prom_port}}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [goodput], exporters: [store]}}
    metrics: {{receivers: [otlp], processors: [goodput], exporters: [prometheus]}}
    logs: {{receivers: [otlp], processors: [goodput], exporters: [store]}}
"""
    with start_collector(text, tmp_path / "c") as proc:
        t0 = time.time() - 20.0
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            stub.Export(steps("job-live", t0, 20), timeout=10)
            stub.Export(steps("job-live", t0, 0, rank=1, extra=[(21, 1.0, 2.0)]), timeout=10)  # the 1970 span
        deadline = time.monotonic() + 15
        summary = None
        while time.monotonic() < deadline:
            try:
                with closing(db.open_reader(store)) as conn:
                    summary = db.goodput(conn, "job-live")
            except db.StoreMissing:
                summary = None
            if summary is not None:
                break
            time.sleep(0.2)
        assert summary is not None, proc.stderr_text()
        assert summary["wall_time_s"] < 3600.0, summary  # not 499,003 h
        assert summary["ettr"] is not None and summary["ettr"] > 0.5, summary
        conn = http.client.HTTPConnection("127.0.0.1", prom_port, timeout=5)
        conn.request("GET", "/metrics")
        page = conn.getresponse().read().decode()
        conn.close()
        assert 'otel_gpu_collector_out_of_window_total{otel_gpu_component="goodput"} 1.0' in page, page[-2000:]
        assert "outside the accepted window" in proc.stderr_text()
        assert proc.stop() == 0
