"""The prometheus exporter: OTLP metric batches in, a real HTTP scrape out, parsed with prometheus-client's parser."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector, StartError
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import SELF_TELEMETRY_REGISTRY, ComponentHost
from otel_gpu.config import ConfigError, build
from otel_gpu.exporters.prometheus import PrometheusExporter, PrometheusExporterConfig
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import collector as names

DELTA, CUMULATIVE = 1, 2


def kv(key, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def request(metrics: list[m.Metric], resource: dict | None = None) -> Batch:
    resource = {"training.job.id": "job-1", "host.name": "node-a"} if resource is None else resource
    rm = m.ResourceMetrics()
    rm.resource.attributes.extend(kv(k, v) for k, v in resource.items())
    rm.scope_metrics.add().metrics.extend(metrics)
    return Batch.from_message(Signal.METRICS, ExportMetricsServiceRequest(resource_metrics=[rm]))


def number(value, attrs=None, t=None, **kw) -> m.NumberDataPoint:
    dp = m.NumberDataPoint(time_unix_nano=t if t is not None else time.time_ns(), **kw)
    if isinstance(value, int):
        dp.as_int = value
    else:
        dp.as_double = value
    dp.attributes.extend(kv(k, v) for k, v in (attrs or {}).items())
    return dp


def gauge(name, unit, points, description="") -> m.Metric:
    return m.Metric(name=name, unit=unit, description=description, gauge=m.Gauge(data_points=points))


def sum_(name, unit, points, monotonic=True, temporality=CUMULATIVE) -> m.Metric:
    return m.Metric(name=name, unit=unit, sum=m.Sum(data_points=points, is_monotonic=monotonic,
                                                    aggregation_temporality=temporality))


def histogram(name, unit, bounds, counts, total, attrs=None, temporality=CUMULATIVE) -> m.Metric:
    dp = m.HistogramDataPoint(time_unix_nano=time.time_ns(), explicit_bounds=bounds, bucket_counts=counts,
                              count=sum(counts), sum=total)
    dp.attributes.extend(kv(k, v) for k, v in (attrs or {}).items())
    return m.Metric(name=name, unit=unit, histogram=m.Histogram(data_points=[dp], aggregation_temporality=temporality))


def make_exporter(**settings) -> tuple[PrometheusExporter, PrometheusSelfTelemetry]:
    telemetry = PrometheusSelfTelemetry()
    config = build(PrometheusExporterConfig, {"endpoint": "127.0.0.1:0", **settings}, "exporters.prometheus")
    host = ComponentHost("prometheus", telemetry, services={SELF_TELEMETRY_REGISTRY: telemetry.registry})
    exporter = PrometheusExporter(config, host)
    exporter.start()
    return exporter, telemetry


@pytest.fixture
def exporter():
    exp, _ = make_exporter()
    yield exp
    exp.shutdown()


def get(url: str, accept: str | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()


def scrape(exp: PrometheusExporter) -> dict:
    """family name -> (type, [(sample name, labels, value)])."""
    _, _, text = get(exp.url + "/metrics")
    return {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text)}


def test_types_names_labels_and_values(exporter):
    batch = request([
        gauge("hw.gpu.utilization", "1", [number(0.75, {"hw.id": "GPU-0", "gpu.index": 0})],
              description="GPU utilization"),
        gauge("hw.power", "W", [number(312, {"hw.id": "GPU-0"})]),
        sum_("hw.energy", "J", [number(1234.5, {"hw.id": "GPU-0"})]),
        sum_("hw.gpu.memory.usage", "By", [number(2048, {"hw.id": "GPU-0"})], monotonic=False),
        histogram("training.step.duration", "s", [0.1, 0.5, 1.0], [1, 3, 2, 1], 3.2, {"training.rank": 2}),
    ])
    assert exporter.export(batch).value == "success"
    families = scrape(exporter)

    kind, samples = families["hw_gpu_utilization_ratio"]
    assert kind == "gauge"
    assert samples == [("hw_gpu_utilization_ratio",
                        {"hw_id": "GPU-0", "gpu_index": "0", "training_job_id": "job-1", "host_name": "node-a"}, 0.75)]
    assert families["hw_power_watts"][1][0][2] == 312.0
    kind, samples = families["hw_energy_joules"]  # the text parser names counter families without _total
    assert kind == "counter" and samples[0][0] == "hw_energy_joules_total" and samples[0][2] == 1234.5
    assert families["hw_gpu_memory_usage_bytes"][0] == "gauge"  # non-monotonic sum

    kind, samples = families["training_step_duration_seconds"]
    assert kind == "histogram"
    buckets = {s[1]["le"]: s[2] for s in samples if s[0].endswith("_bucket")}
    assert buckets == {"0.1": 1.0, "0.5": 4.0, "1.0": 6.0, "+Inf": 7.0}
    assert {s[0]: s[2] for s in samples if not s[0].endswith("_bucket")} == {
        "training_step_duration_seconds_count": 7.0, "training_step_duration_seconds_sum": 3.2}
    assert all(s[1]["training_rank"] == "2" for s in samples)


def test_latest_value_wins_and_late_points_do_not_overwrite(exporter):
    t0 = time.time_ns()
    exporter.export(request([gauge("hw.temperature", "Cel", [number(60.0, {"hw.id": "a"}, t=t0)])]))
    exporter.export(request([gauge("hw.temperature", "Cel", [number(71.0, {"hw.id": "a"}, t=t0 + 10)])]))
    exporter.export(request([gauge("hw.temperature", "Cel", [number(55.0, {"hw.id": "a"}, t=t0 + 5)])]))
    assert scrape(exporter)["hw_temperature_celsius"][1][0][2] == 71.0


def test_delta_sums_and_histograms_are_accumulated(exporter):
    for _ in range(3):
        exporter.export(request([sum_("otel_gpu.failures", "{failure}", [number(2, {"failure.kind": "hang"})],
                                      temporality=DELTA),
                                 histogram("lat", "ms", [1.0], [1, 2], 5.0, temporality=DELTA)]))
    families = scrape(exporter)
    assert families["otel_gpu_failures"][1] == [("otel_gpu_failures_total", {
        "failure_kind": "hang", "training_job_id": "job-1", "host_name": "node-a"}, 6.0)]
    samples = {(s[0], s[1].get("le")): s[2] for s in families["lat_milliseconds"][1]}
    assert samples[("lat_milliseconds_bucket", "1.0")] == 3.0
    assert samples[("lat_milliseconds_bucket", "+Inf")] == 9.0
    assert samples[("lat_milliseconds_sum", None)] == 15.0


def test_unsupported_types_are_skipped_and_no_recorded_value_removes(exporter, caplog):
    summary = m.Metric(name="rpc.latency", summary=m.Summary(data_points=[m.SummaryDataPoint(count=1, sum=1.0)]))
    expo = m.Metric(name="expo", exponential_histogram=m.ExponentialHistogram(
        data_points=[m.ExponentialHistogramDataPoint(count=1)]))
    with caplog.at_level("INFO"):
        for _ in range(3):
            exporter.export(request([summary, expo, gauge("", "", [number(1.0)]), gauge("g", "", [number(1.0)])]))
    families = scrape(exporter)
    assert set(families) >= {"g"} and "rpc_latency" not in families and "expo" not in families
    assert sum("rpc.latency" in r.getMessage() for r in caplog.records) == 1  # logged once
    exporter.export(request([gauge("g", "", [number(0.0, flags=1)])]))
    assert "g" not in scrape(exporter)


def test_attribute_types_sanitizing_and_precedence():
    exp, _ = make_exporter(const_labels={"cluster": "c1", "host_name": "const"}, namespace="train")
    try:
        exp.export(request([gauge("x.y", "", [number(1.0, {
            "flag": True, "ratio": 0.5, "list.attr": "s", "list_attr": "t", "9lives": "cat", "host.name": "dp"})])],
            resource={"host.name": "res", "service.name": "svc"}))
        name, labels, _ = scrape(exp)["train_x_y"][1][0]
        assert name == "train_x_y"
        assert labels == {"flag": "true", "ratio": "0.5", "list_attr": "s;t", "key_9lives": "cat",
                          "host_name": "dp", "job": "svc", "cluster": "c1"}
    finally:
        exp.shutdown()


TRAINING_RESOURCE = {"service.name": "trainer", "service.namespace": "ml", "service.instance.id": "pod-7/rank-3",
                     "training.job.id": "job-9", "host.name": "node-b", "training.rank": 3, "gpu.index": 1,
                     "process.pid": 4242, "training.world_size": 8}


def test_resources_as_in_the_collector_target_info_and_promoted_labels(exporter):
    """resource_to_telemetry_conversion is off by default, as in the OpenTelemetry Collector: series get job and
    instance (from service.*) plus the promoted set the dashboards filter on; every other resource attribute is on
    target_info, which joins on job and instance."""
    exporter.export(request([gauge("otel_gpu.step.duration", "s", [number(0.5)])], resource=TRAINING_RESOURCE))
    families = scrape(exporter)
    (_, labels, value), = families["otel_gpu_step_duration_seconds"][1]
    assert labels == {"job": "ml/trainer", "instance": "pod-7/rank-3", "training_job_id": "job-9",
                      "host_name": "node-b", "training_rank": "3", "gpu_index": "1"}
    kind, samples = families["target_info"]
    assert kind == "gauge"
    assert samples == [("target_info", {"job": "ml/trainer", "instance": "pod-7/rank-3", "training_job_id": "job-9",
                                        "host_name": "node-b", "training_rank": "3", "gpu_index": "1",
                                        "process_pid": "4242", "training_world_size": "8"}, 1.0)]


def test_target_info_only_for_resources_prometheus_would_describe(exporter):
    """Prometheus' OTLP translator: no target_info without job or instance, nor with nothing but them."""
    exporter.export(request([gauge("a", "", [number(1.0)])], resource={"host.name": "node-a"}))
    exporter.export(request([gauge("b", "", [number(1.0)])], resource={"service.name": "only"}))
    families = scrape(exporter)
    assert "target_info" not in families
    assert families["a"][1][0][1] == {"host_name": "node-a"} and families["b"][1][0][1] == {"job": "only"}


def test_resource_to_telemetry_conversion_on_copies_every_resource_attribute():
    exp, _ = make_exporter(resource_to_telemetry_conversion={"enabled": True})
    try:
        exp.export(request([gauge("g", "", [number(1.0, {"a": "b"})])], resource=TRAINING_RESOURCE))
        labels = scrape(exp)["g"][1][0][1]
        assert labels["process_pid"] == "4242" and labels["service_name"] == "trainer" and labels["a"] == "b"
        assert labels["job"] == "ml/trainer"
    finally:
        exp.shutdown()


def test_resource_to_telemetry_conversion_off_accepts_collector_form():
    exp, _ = make_exporter(resource_to_telemetry_conversion={"enabled": False}, promote_resource_attributes=[])
    try:
        exp.export(request([gauge("g", "", [number(1.0, {"a": "b"})])]))
        assert scrape(exp)["g"][1][0][1] == {"a": "b"}
    finally:
        exp.shutdown()


def test_series_expire():
    exp, _ = make_exporter(metric_expiration="1s")
    try:
        exp.export(request([gauge("old", "", [number(1.0)])]))
        time.sleep(0.6)
        exp.export(request([gauge("new", "", [number(1.0)])]))
        assert {"old", "new"} <= set(scrape(exp))
        time.sleep(0.6)
        families = scrape(exp)
        assert "old" not in families and "new" in families
        time.sleep(1.1)
        assert not {"old", "new"} & set(scrape(exp))
        assert exp.state.series_count() == 0
    finally:
        exp.shutdown()


def test_self_telemetry_openmetrics_and_health():
    config = load_text("""
receivers: {otlp: {protocols: {grpc: {endpoint: "127.0.0.1:0"}}}}
exporters: {prometheus: {endpoint: "127.0.0.1:0"}}
service: {pipelines: {metrics: {receivers: [otlp], exporters: [prometheus]}}}
""")
    collector = Collector(config)
    collector.start()
    try:
        receiver = collector.component("receiver", "otlp")
        exp = collector.component("exporter", "prometheus")
        receiver.accept_batch(request([gauge("hw.power", "W", [number(100.0)] * 1)]))
        families = scrape(exp)
        assert "hw_power_watts" in families
        received = families[names.RECEIVED.prometheus_name.removesuffix("_total")][1]
        assert (names.RECEIVED.prometheus_name,
                {"otel_gpu_component": "otlp", "otel_gpu_signal": "metrics"}, 1.0) in received
        exported = families[names.EXPORTED.prometheus_name.removesuffix("_total")][1]
        assert any(s[1]["otel_gpu_component"] == "prometheus" and s[2] == 1.0 for s in exported)

        status, ctype, text = get(exp.url + "/metrics", accept="application/openmetrics-text; version=1.0.0")
        assert status == 200 and ctype.startswith("application/openmetrics-text")
        om = {f.name: f for f in parse_openmetrics(text)}
        assert om["hw_power_watts"].type == "gauge" and text.rstrip().endswith("# EOF")

        status, ctype, body = get(exp.url + "/health")
        assert status == 200 and json.loads(body) == {"status": "ok"} and ctype == "application/json"
        with pytest.raises(urllib.error.HTTPError) as err:
            get(exp.url + "/nope")
        assert err.value.code == 404
        url = exp.url
    finally:
        collector.shutdown()
    with pytest.raises(OSError):  # not serving after shutdown
        get(url + "/health")


def test_port_in_use_is_a_clear_start_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = build(PrometheusExporterConfig, {"endpoint": f"127.0.0.1:{port}"}, "exporters.prometheus")
        exp = PrometheusExporter(config, ComponentHost("prometheus", PrometheusSelfTelemetry()))
        with pytest.raises(RuntimeError, match=f"port {port} is already in use.*exporters.prometheus.endpoint"):
            exp.start()
        collector = Collector(load_text(f"""
receivers: {{otlp: {{protocols: {{grpc: {{endpoint: "127.0.0.1:0"}}}}}}}}
exporters: {{prometheus: {{endpoint: "127.0.0.1:{port}"}}}}
service: {{pipelines: {{metrics: {{receivers: [otlp], exporters: [prometheus]}}}}}}
"""))
        with pytest.raises(StartError, match="exporters.prometheus: could not start.*already in use"):
            collector.start()


@pytest.mark.parametrize("settings, message", [
    ({"endpoint": "nope"}, "exporters.prometheus.endpoint: expected HOST:PORT"),
    ({"metric_expiration": "0s"}, "metric_expiration must be > 0"),
    ({"const_labels": {"bad-name": "x"}}, "const_labels.bad-name: not a valid Prometheus label name"),
    ({"namespace": "1x"}, "namespace must match"),
])
def test_config_errors_name_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        build(PrometheusExporterConfig, settings, "exporters.prometheus")


def test_export_is_cheap():
    """A GPU node's metrics (8 GPUs x 30 series) convert in well under a millisecond per data point."""
    exp, _ = make_exporter()
    try:
        metrics = [gauge(f"hw.metric{i}", "W", [number(float(g), {"hw.id": f"GPU-{g}", "gpu.index": g})
                                                for g in range(8)]) for i in range(30)]
        batch = request(metrics)
        exp.export(batch)
        start = time.perf_counter()
        for _ in range(50):
            exp.export(batch)
        per_point = (time.perf_counter() - start) / (50 * 240)
        assert per_point < 100e-6, per_point
        assert exp.state.series_count() == 240
    finally:
        exp.shutdown()


def test_otel_sdk_to_collector_subprocess_to_prometheus_scrape(tmp_path):
    """The real path: OTel SDK metrics -> OTLP gRPC -> `otel-gpu collector` process -> GET /metrics."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    from collector_proc import free_port, start_collector

    grpc_port, prom_port = free_port(), free_port()
    config = f"""
receivers: {{otlp: {{protocols: {{grpc: {{endpoint: "127.0.0.1:{grpc_port}"}}}}}}}}
exporters:
  prometheus: {{endpoint: "127.0.0.1:{prom_port}", const_labels: {{cluster: c1}}}}
  store: {{path: "{tmp_path / 'store'}"}}
service: {{pipelines: {{metrics: {{receivers: [otlp], exporters: [prometheus, store]}}}}}}
"""
    with start_collector(config, tmp_path) as collector:
        resource = Resource.create({"service.name": "trainer", "training.job.id": "job-9", "training.rank": 3,
                                    "host.name": "node-7"})
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True),
                                               export_interval_millis=3_600_000)
        provider = MeterProvider(resource=resource, metric_readers=[reader])
        meter = provider.get_meter("e2e")
        meter.create_counter("training.steps", unit="{step}").add(7, {"training.rank": 3})
        meter.create_up_down_counter("queue.depth").add(-2)
        meter.create_histogram("training.step.duration", unit="s").record(0.3)
        meter.create_observable_gauge("hw.gpu.utilization", [lambda _o: [Observation(0.5, {"hw.id": "GPU-0"})]],
                                      unit="1")
        assert provider.force_flush(10_000)
        provider.shutdown()

        url = f"http://127.0.0.1:{prom_port}"
        families: dict = {}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and "training_steps" not in families:
            _, _, text = get(url + "/metrics")
            families = {f.name: f for f in text_string_to_metric_families(text)}
            time.sleep(0.1)
        steps = families["training_steps"]
        assert steps.type == "counter"
        (sample,) = steps.samples
        assert sample.name == "training_steps_total" and sample.value == 7.0
        assert {"training_rank": "3", "training_job_id": "job-9", "host_name": "node-7", "job": "trainer",
                "cluster": "c1"}.items() <= sample.labels.items()
        # The SDK's resource (telemetry.sdk.*, service.name) is on target_info, joined on job/instance.
        (info,) = families["target_info"].samples
        assert info.labels["job"] == "trainer" and info.labels["telemetry_sdk_language"] == "python"
        assert families["queue_depth"].type == "gauge" and families["queue_depth"].samples[0].value == -2.0
        hist = families["training_step_duration_seconds"]
        assert hist.type == "histogram"
        assert {s.name: s.value for s in hist.samples if s.name.endswith(("_count", "_sum"))} == {
            "training_step_duration_seconds_count": 1.0, "training_step_duration_seconds_sum": 0.3}
        assert families["hw_gpu_utilization_ratio"].samples[0].value == 0.5
        assert names.RECEIVED.prometheus_name.removesuffix("_total") in families  # self-telemetry beside them
        assert get(url + "/health")[0] == 200
        assert collector.stop() == 0
