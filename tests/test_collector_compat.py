"""Collector configs written for the OpenTelemetry Collector: Go durations, extensions (health_check), the batch
processor and service.telemetry, and configs from the Collector's documentation loaded unchanged."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from otel_gpu.collector import registry
from otel_gpu.collector.config import load_file, load_text
from otel_gpu.collector.runtime import Collector, StartError
from otel_gpu.component import READY, ComponentHost
from otel_gpu.config import ConfigError, build, format_duration, parse_duration
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.pdata import Batch, Signal, count_items

DATA = Path(__file__).parent / "testdata" / "otelcol"


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


# -- durations ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [
    ("5s", 5.0), ("250ms", 0.25), ("1m", 60.0), ("1m30s", 90.0), ("1.5h", 5400.0), ("2h45m", 9900.0), ("300us", 3e-4),
    ("300µs", 3e-4), ("10ns", 1e-8), ("0", 0.0), ("-1s", -1.0), ("+2s", 2.0), (".5s", 0.5),
])
def test_go_duration_syntax(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5", "5 s", "s", "", "1d", "5sec", "1.2.3s", "--1s", "0x10s"])
def test_not_a_duration(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("seconds, text", [(5, "5s"), (0.25, "250ms"), (300, "5m"), (90, "1m30s"), (7200, "2h"),
                                           (0, "0s"), (1.5, "1.5s"), (2e-5, "20us")])
def test_format_duration_round_trips(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def test_old_unit_keys_are_refused_with_the_new_key_and_value():
    with pytest.raises(ConfigError) as info:
        load_text("receivers: {otlp: {}}\nexporters: {otlp: {endpoint: 'b:4317', timeout_s: 5, retry_on_failure: "
                  "{initial_interval_s: 0.5}}}\nservice: {pipelines: {traces: {receivers: [otlp], exporters: [otlp]}}}")
    problems = "\n".join(info.value.problems)
    assert "exporters.otlp.timeout_s was renamed: write timeout: 5s" in problems
    assert "exporters.otlp.retry_on_failure.initial_interval_s was renamed: write initial_interval: 500ms" in problems


def test_durations_reach_the_component_in_its_unit_and_validation_names_the_yaml_key():
    cfg = load_text("receivers: {otlp: {http: {read_timeout: 1m}}}\nprocessors: {memory_limiter: {check_interval: "
                    "250ms, limit_mib: 100}}\nexporters: {debug: {}}\nservice: {pipelines: {traces: {receivers: [otlp],"
                    " processors: [memory_limiter], exporters: [debug]}}}")
    assert cfg.component("receiver", "otlp").config.http.read_timeout_s == 60.0
    assert cfg.component("processor", "memory_limiter").config.check_interval_s == 0.25
    with pytest.raises(ConfigError) as info:
        load_text("receivers: {nvml: {interval: 0s}}\nexporters: {debug: {}}\n"
                  "service: {pipelines: {metrics: {receivers: [nvml], exporters: [debug]}}}")
    assert "receivers.nvml.interval must be > 0" in str(info.value)
    with pytest.raises(ConfigError, match=r"receivers.nvml.interval: expected a duration such as 5s.*got int 5"):
        load_text("receivers: {nvml: {interval: 5}}\nexporters: {debug: {}}\n"
                  "service: {pipelines: {metrics: {receivers: [nvml], exporters: [debug]}}}")


# -- the Collector's documented configs ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(DATA.glob("*.yaml")), ids=lambda p: p.name)
def test_configs_written_for_the_opentelemetry_collector_load_unchanged(path):
    cfg = load_file(path)
    assert cfg.pipelines
    text = path.read_text()
    if "health_check" in text:
        assert cfg.extensions == ["health_check"]


def _on_free_ports(text: str) -> str:
    """The same config with every listener on 127.0.0.1 and a free port (port 0), so that tests run side by side."""
    text = re.sub(r"(endpoint|address): (localhost|0\.0\.0\.0):\d+", r"\1: 127.0.0.1:0", text)
    return text.replace("host: '0.0.0.0'", "host: '127.0.0.1'").replace("port: 8888", "port: 0")


def test_documented_config_runs_health_check_and_self_metrics_where_it_says():
    collector = Collector(load_text(_on_free_ports((DATA / "internal_telemetry_prometheus.yaml").read_text())))
    collector.start()
    try:
        health = collector.component("extension", "health_check")
        status, ctype, body = _get(f"http://127.0.0.1:{health.port}/health")
        assert (status, ctype) == (200, "application/json")
        doc = json.loads(body)
        assert doc["status"] == "Server available" and doc["upSince"].endswith("Z") and parse_duration(doc["uptime"]) >= 0
        assert _get(f"http://127.0.0.1:{health.port}/")[0] == 404  # path: /health
        (port,) = collector.telemetry_ports
        status, _, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and b"otel_gpu_collector_received" in body
        # the Prometheus exporter's /health is kept
        prom = collector.component("exporter", "prometheus")
        assert _get(f"{prom.url}/health")[0] == 200
    finally:
        collector.shutdown()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{health.port}/health", timeout=2)


def test_health_check_says_503_while_the_pipelines_do_not_run():
    from otel_gpu.extensions.health_check import FACTORY

    ready = [False]
    host = ComponentHost("health_check", PrometheusSelfTelemetry(), services={READY: lambda: ready[0]})
    ext = FACTORY.create(build(FACTORY.config_class, {"endpoint": "127.0.0.1:0"}, "extensions.health_check"), host)
    ext.start()
    try:
        status, _, body = _get(f"http://127.0.0.1:{ext.port}/")
        assert status == 503 and json.loads(body)["status"] == "Server not available"
        ready[0] = True
        assert _get(f"http://127.0.0.1:{ext.port}/")[0] == 200
    finally:
        ext.shutdown()


def test_telemetry_address_that_cannot_be_bound_fails_start_naming_the_key():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_text(f"receivers: {{otlp: {{grpc: {{endpoint: 127.0.0.1:0}}, http: null}}}}\nexporters: {{debug: {{}}}}"
                        f"\nservice: {{telemetry: {{metrics: {{address: 127.0.0.1:{port}}}}}, pipelines: {{traces: "
                        f"{{receivers: [otlp], exporters: [debug]}}}}}}")
        with pytest.raises(StartError, match=f"service.telemetry.metrics: cannot listen on 127.0.0.1:{port}"):
            Collector(cfg).start()


@pytest.mark.parametrize("telemetry, message", [
    ("{metrics: {readers: [{periodic: {exporter: {otlp: {endpoint: x}}}}]}}", "only a pull reader with a prometheus"),
    ("{metrics: {address: nope}}", "service.telemetry.metrics.address must be HOST:PORT"),
    ("{metrics: {level: loud}}", "service.telemetry.metrics.level must be none, basic, normal or detailed"),
    ("{logs: {level: chatty}}", "service.telemetry.logs.level must be debug, info, warn or error"),
    ("{logs: {output_paths: [/var/log/x]}}", "only stderr and stdout"),
    ("{tracez: {}}", "service.telemetry.tracez: unknown setting"),
])
def test_bad_service_telemetry_names_the_key(telemetry, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_text(f"receivers: {{otlp: {{}}}}\nexporters: {{debug: {{}}}}\nservice: {{telemetry: {telemetry}, "
                  f"pipelines: {{traces: {{receivers: [otlp], exporters: [debug]}}}}}}")


def test_service_extensions_must_be_defined():
    with pytest.raises(ConfigError, match=r"service.extensions: 'health_chek' is not defined under extensions: "
                                          r"\(did you mean 'health_check'\?"):
        load_text("extensions: {health_check: {}}\nreceivers: {otlp: {}}\nexporters: {debug: {}}\nservice: "
                  "{extensions: [health_chek], pipelines: {traces: {receivers: [otlp], exporters: [debug]}}}")
    with pytest.raises(ConfigError, match="extensions.zpages: unknown extension type 'zpages'"):
        load_text("extensions: {zpages: {}}\nreceivers: {otlp: {}}\nexporters: {debug: {}}\n"
                  "service: {pipelines: {traces: {receivers: [otlp], exporters: [debug]}}}")


# -- batch processor ---------------------------------------------------------------------------------------------
def _spans(n: int, service: str = "svc") -> Batch:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    ss = rs.scope_spans.add()
    for i in range(n):
        ss.spans.add(name=f"s{i}", trace_id=b"\x01" * 16, span_id=(i + 1).to_bytes(8, "big"))
    return Batch.from_message(Signal.TRACES, req)


def _batch_collector(settings: str):
    registry.BUILTIN["exporter"].setdefault("capture", "otel_gpu.testing.capture")
    collector = Collector(load_text(f"receivers: {{otlp: {{grpc: {{endpoint: 127.0.0.1:0}}, http: null}}}}\n"
                                    f"processors: {{batch: {settings}}}\nexporters: {{capture: {{}}}}\nservice: "
                                    f"{{pipelines: {{traces: {{receivers: [otlp], processors: [batch], "
                                    f"exporters: [capture]}}}}}}"))
    collector.start()
    return collector, collector.component("receiver", "otlp"), collector.component("exporter", "capture")


def test_batch_sends_on_size_splits_at_max_size_and_flushes_on_timeout():
    collector, receiver, capture = _batch_collector("{send_batch_size: 10, send_batch_max_size: 12, timeout: 300ms}")
    try:
        for n in (4, 4):
            receiver.accept_batch(_spans(n))
        assert capture.batches == []  # 8 < send_batch_size: waits
        receiver.accept_batch(_spans(9, "other"))  # 17 >= 10: sent, cut at 12
        sizes = [b.item_count() for b in capture.batches]
        assert sizes == [12, 5], sizes
        services = {kv.value.string_value for b in capture.batches for rs in b.message.resource_spans
                    for kv in rs.resource.attributes}
        assert services == {"svc", "other"}  # each item keeps its resource
        receiver.accept_batch(_spans(3))
        assert capture.wait_for(lambda e: sum(b.item_count() for b in e.batches) == 20, timeout_s=5)
        assert [b.item_count() for b in capture.batches] == [12, 5, 3]  # the timeout sent the 3
    finally:
        collector.shutdown()


def test_batch_passes_what_waits_on_shutdown_and_timeout_zero_only_splits():
    collector, receiver, capture = _batch_collector("{send_batch_size: 1000, timeout: 1h}")
    receiver.accept_batch(_spans(7))
    assert capture.batches == []
    collector.shutdown()
    assert [b.item_count() for b in capture.batches] == [7]
    collector, receiver, capture = _batch_collector("{timeout: 0s, send_batch_size: 0, send_batch_max_size: 3}")
    try:
        receiver.accept_batch(_spans(7))
        assert [b.item_count() for b in capture.batches] == [3, 3, 1]
        assert sum(count_items(Signal.TRACES, b.message) for b in capture.batches) == 7
    finally:
        collector.shutdown()


@pytest.mark.parametrize("settings, message", [
    ({"send_batch_size": 10, "send_batch_max_size": 5}, "send_batch_max_size must be 0 or >= send_batch_size"),
    ({"timeout": "-1s"}, "processors.batch.timeout must be >= 0"),
    ({"metadata_keys": ["tenant"]}, "metadata_keys: batching by client metadata is not supported"),
])
def test_batch_config_errors(settings, message):
    from otel_gpu.processors.batch import BatchConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        build(BatchConfig, settings, "processors.batch")
