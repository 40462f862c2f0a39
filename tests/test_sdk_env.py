"""The OpenTelemetry SDK's environment variables on otel-gpu's fast export path: each row of the table in
otel_gpu/instrumentation/README.md, against real servers (gRPC sink, an HTTP server) and a real instrumented process."""
from __future__ import annotations

import gzip
import http.server
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otel_gpu.instrumentation import _export
from otel_gpu.instrumentation.config import InstrumentationConfig, signal_routes, unsupported_settings
from otel_gpu.testing.otlp_sink import OtlpSink

_PARSE = {"/v1/traces": trace_service_pb2.ExportTraceServiceRequest,
          "/v1/logs": logs_service_pb2.ExportLogsServiceRequest,
          "/v1/metrics": metrics_service_pb2.ExportMetricsServiceRequest}


class HttpSink:
    """An OTLP/HTTP stand-in: keeps (path, headers, decoded body) of every POST."""

    def __init__(self):
        got = self.got = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                got.append((self.path, self.headers, body))  # (case-insensitive lookups)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def http_sink():
    sink = HttpSink()
    yield sink
    sink.close()


def _client(env: dict, **options) -> _export.OtlpClient:
    cfg = InstrumentationConfig.from_env(env, **options)
    return _export.OtlpClient(cfg.endpoint, cfg.protocol, cfg.headers, cfg.export_timeout_s, buffer_mib=0,
                              routes=signal_routes(cfg, env))


def _send_all(client: _export.OtlpClient) -> None:
    res = _export.make_resource({"service.name": "t"})
    req, ss = _export.trace_request(res)
    _export.add_span(ss, "otel_gpu.step", b"\x01" * 16, b"\x02" * 8, None, 1, 2, {"training.step": 1})
    assert client.send_traces(req)
    assert client.send_metrics(metrics_service_pb2.ExportMetricsServiceRequest())
    assert client.send_logs(_export.logs_request(res, [("otel_gpu.progress", 1, {}, {"step": 1}, _export.INFO)]))
    client.close()


# -- endpoints ------------------------------------------------------------------------------------------------------
def test_generic_http_endpoint_gets_v1_signal_appended_to_its_path(http_sink):
    _send_all(_client({"OTEL_EXPORTER_OTLP_ENDPOINT": http_sink.url + "/base/", "OTEL_EXPORTER_OTLP_PROTOCOL":
                       "http/protobuf"}))
    assert [p for p, _, _ in http_sink.got] == ["/base/v1/traces", "/base/v1/metrics", "/base/v1/logs"]


def test_per_signal_http_endpoints_are_used_as_they_are(http_sink):
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": http_sink.url,
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": http_sink.url + "/custom/spans",
           "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": http_sink.url + "/ingest"}
    _send_all(_client(env))
    assert [p for p, _, _ in http_sink.got] == ["/custom/spans", "/v1/metrics", "/ingest"]
    assert trace_service_pb2.ExportTraceServiceRequest.FromString(http_sink.got[0][2]).resource_spans


def test_per_signal_grpc_endpoint_and_protocol(http_sink):
    with OtlpSink() as sink:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{sink.endpoint}",
               "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": http_sink.url + "/v1/metrics"}
        _send_all(_client(env))
        assert len(sink.traces) == 1 and len(sink.logs) == 1 and sink.metrics == []
    assert [p for p, _, _ in http_sink.got] == ["/v1/metrics"]


def test_explicit_argument_wins_over_every_variable(http_sink):
    with OtlpSink() as sink:
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": http_sink.url + "/x", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL":
               "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": http_sink.url}
        _send_all(_client(env, endpoint=f"http://{sink.endpoint}", protocol="grpc"))
        assert len(sink.traces) == len(sink.metrics) == len(sink.logs) == 1
    assert http_sink.got == []


def test_http_protocol_without_an_endpoint_goes_to_the_local_4318():
    routes = signal_routes(InstrumentationConfig.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}),
                           {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert routes["traces"].url == "http://127.0.0.1:4318/v1/traces"
    assert signal_routes(InstrumentationConfig.from_env({}), {})["traces"].url == "http://127.0.0.1:4317"


# -- headers, timeout, compression, TLS ------------------------------------------------------------------------------
def test_headers_per_signal_replace_the_generic_ones_on_grpc_and_http(http_sink):
    with OtlpSink() as sink:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{sink.endpoint}", "OTEL_EXPORTER_OTLP_HEADERS":
               "x-tenant=a%20b,x-all=1", "OTEL_EXPORTER_OTLP_LOGS_HEADERS": "x-tenant=logs",
               "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": http_sink.url + "/v1/metrics",
               "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-tenant=m"}
        _send_all(_client(env))
        traces_md, logs_md = sink.metadata
    assert traces_md["x-tenant"] == "a b" and traces_md["x-all"] == "1"
    assert logs_md["x-tenant"] == "logs" and "x-all" not in logs_md
    assert http_sink.got[0][1]["x-tenant"] == "m"


def test_timeout_in_milliseconds_per_signal_then_generic_and_ours_wins():
    env = {"OTEL_EXPORTER_OTLP_TIMEOUT": "1500", "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT": "250"}
    routes = signal_routes(InstrumentationConfig.from_env(env), env)
    assert (routes["traces"].timeout_s, routes["logs"].timeout_s) == (1.5, 0.25)
    env["OTEL_GPU_EXPORT_TIMEOUT_S"] = "4"
    assert {r.timeout_s for r in signal_routes(InstrumentationConfig.from_env(env), env).values()} == {4.0}


def test_gzip_compression_on_http_and_grpc(http_sink):
    with OtlpSink() as sink:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{sink.endpoint}", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
               "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": http_sink.url + "/v1/logs"}
        _send_all(_client(env))
        assert len(sink.traces) == 1 and len(sink.metrics) == 1  # gRPC with gzip message compression
    ((path, headers, body),) = http_sink.got
    assert headers["Content-Encoding"] == "gzip"
    assert logs_service_pb2.ExportLogsServiceRequest.FromString(body).resource_logs


def test_insecure_and_certificates_per_signal():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317", "OTEL_EXPORTER_OTLP_INSECURE": "false",
           "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/ca.pem",
           "OTEL_EXPORTER_OTLP_LOGS_CERTIFICATE": "/logs-ca.pem", "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/k.pem",
           "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE": "/m.pem"}
    routes = signal_routes(InstrumentationConfig.from_env(env), env)
    assert (routes["traces"].secure, routes["metrics"].secure, routes["logs"].secure) == (False, True, True)
    assert routes["logs"].tls_files == ("/logs-ca.pem", "", "/k.pem")
    assert routes["metrics"].tls_files == ("/ca.pem", "/m.pem", "/k.pem")
    assert signal_routes(InstrumentationConfig.from_env({}), {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317"})


# -- exporters selection ---------------------------------------------------------------------------------------------
def test_exporter_none_and_console(capsys):
    with OtlpSink() as sink:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{sink.endpoint}", "OTEL_TRACES_EXPORTER": "none",
               "OTEL_METRICS_EXPORTER": "console", "OTEL_LOGS_EXPORTER": "otlp,console"}
        _send_all(_client(env))
        assert sink.traces == [] and sink.metrics == [] and len(sink.logs) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [sorted(d) for d in lines] == [[], ["resourceLogs"]]  # the (empty) metrics request, then the logs one


def test_unknown_exporter_values_warn_and_fall_back_to_otlp(caplog):
    with caplog.at_level(logging.WARNING):
        routes = signal_routes(InstrumentationConfig.from_env({}), {"OTEL_TRACES_EXPORTER": "zipkin",
                                                                    "OTEL_METRICS_EXPORTER": "prometheus,console"})
    assert routes["traces"].otlp and not routes["traces"].console
    assert not routes["metrics"].otlp and routes["metrics"].console
    assert "OTEL_TRACES_EXPORTER='zipkin'" in caplog.text and "OTEL_METRICS_EXPORTER" in caplog.text


@pytest.mark.parametrize("var, value, falls_back", [
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "brotli", ("compression", "none")),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "-3", ("timeout_s", 2.0)),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", ("protocol", "grpc")),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift", ("protocol", "grpc")),
])
def test_bad_values_warn_naming_the_variable_and_fall_back(caplog, var, value, falls_back):
    env = {var: value}
    with caplog.at_level(logging.WARNING):
        routes = signal_routes(InstrumentationConfig.from_env(env), env)
    assert getattr(routes["traces"], falls_back[0]) == falls_back[1]
    assert var in caplog.text


def test_unsupported_settings_are_listed_and_matching_values_are_not():
    found = unsupported_settings({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1",
                                  "OTEL_SPAN_EVENT_COUNT_LIMIT": "5", "OTEL_PROPAGATORS": "b3"})
    assert [v for v, _, _ in found] == ["OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SPAN_EVENT_COUNT_LIMIT",
                                        "OTEL_PROPAGATORS"]
    assert unsupported_settings({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}) == []


def test_bsp_schedule_delay_is_the_export_interval_unless_ours_is_set():
    assert InstrumentationConfig.from_env({"OTEL_BSP_SCHEDULE_DELAY": "500"}).export_interval_s == 0.5
    assert InstrumentationConfig.from_env({"OTEL_BSP_SCHEDULE_DELAY": "500",
                                           "OTEL_GPU_EXPORT_INTERVAL_S": "3"}).export_interval_s == 3.0


# -- a real instrumented process -------------------------------------------------------------------------------------
_JOB = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import otel_gpu
    otel_gpu.instrument(heartbeat_s=0.2, export_interval_s=0.1, crash_hooks=False)
    for n in range(3):
        with otel_gpu.step(n):
            pass
    import time; time.sleep(0.6)
    otel_gpu.uninstrument()
""")


def _run(env: dict) -> subprocess.CompletedProcess:
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **env}
    return subprocess.run([sys.executable, "-c", _JOB], env=full, capture_output=True, text=True, timeout=120)


def test_a_real_process_honours_sdk_disabled_exporters_resource_and_service_name():
    with OtlpSink() as sink:
        base = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{sink.endpoint}", "OTEL_GPU_JOB_ID": "env-test"}
        off = _run({**base, "OTEL_SDK_DISABLED": "true"})
        assert off.returncode == 0, off.stderr
        assert "OTEL_SDK_DISABLED=true: instrumentation is off" in off.stderr
        assert sink.calls == 0
        on = _run({**base, "OTEL_TRACES_EXPORTER": "none", "OTEL_SERVICE_NAME": "trainer-x",
                   "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=lab,team=ml%20infra",
                   "OTEL_TRACES_SAMPLER": "traceidratio"})
        assert on.returncode == 0, on.stderr
        assert sink.wait_for(lambda s: s.logs, timeout_s=10)
        assert sink.traces == []  # OTEL_TRACES_EXPORTER=none
        assert "OTEL_TRACES_SAMPLER=traceidratio has no effect" in on.stderr
        attrs = {kv.key: kv.value.string_value for kv in sink.logs[0].resource_logs[0].resource.attributes}
        assert attrs["service.name"] == "trainer-x"
        assert attrs["deployment.environment"] == "lab" and attrs["team"] == "ml infra"


def test_attribute_limits_cut_values_and_drop_attributes_past_the_count(monkeypatch):
    from otel_gpu.instrumentation import _pbenc
    from otel_gpu.instrumentation.config import attribute_limits

    env = {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "4", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "2",
           "OTEL_LOGRECORD_ATTRIBUTE_VALUE_LENGTH_LIMIT": "2"}
    limits = attribute_limits(env)
    assert limits == {"spans": (2, 4), "logs": (None, 2)}
    assert attribute_limits({}) == {"spans": None, "logs": None}
    monkeypatch.setattr(_pbenc, "LIMITS", limits["spans"])
    monkeypatch.setattr(_export, "LOG_LIMITS", limits["logs"])
    res = _export.make_resource({"service.name": "a-long-service-name"})
    span = trace_service_pb2.ExportTraceServiceRequest.FromString(_pbenc.trace_request(
        res.SerializeToString(), _export.SCOPE.SerializeToString(),
        [_pbenc.span("s", b"\x01" * 16, b"\x02" * 8, None, 1, 2, {"a": "abcdefgh", "b": ["xyzzy", 3], "c": 1})]))
    attrs = span.resource_spans[0].scope_spans[0].spans[0].attributes
    assert [(kv.key, kv.value.string_value) for kv in attrs][:1] == [("a", "abcd")]
    assert [kv.key for kv in attrs] == ["a", "b"] and attrs[1].value.array_value.values[0].string_value == "xyzz"
    assert span.resource_spans[0].resource.attributes[0].value.string_value == "a-long-service-name"  # exempt
    logs = _export.logs_request(res, [("e", 1, {"k": "value"}, {}, _export.INFO)])
    assert logs.resource_logs[0].scope_logs[0].log_records[0].attributes[0].value.string_value == "va"
