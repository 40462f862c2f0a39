"""Security: loopback by default; bearer-token auth and TLS / mutual TLS on the OTLP receivers and exporters; TLS and
basic auth on the Prometheus endpoint; secrets never in logs or config errors.

Everything runs over real gRPC / HTTP(S) on loopback, with certificates made at test time (``cryptography``).
"""
from __future__ import annotations

import base64
import dataclasses
import datetime
import http.client
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from collector_proc import free_port, start_collector
from otel_gpu.collector.config import load_default, load_text
from otel_gpu.collector.registry import BUILTIN, load_factory
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import SELF_TELEMETRY_REGISTRY, ComponentHost
from otel_gpu.config import ConfigError, build
from otel_gpu.pdata import Batch, Signal

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


# -- certificates --------------------------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    # The extensions a real CA (cert-manager, openssl) puts in, which strict verifiers (urllib3 2.x) require.
    builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                                    critical=False)
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(
            [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert=None, key=None) -> str:
    data = b""
    if cert is not None:
        data += cert.public_bytes(serialization.Encoding.PEM)
    if key is not None:
        data += key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    path.write_bytes(data)
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    files = {}
    for prefix in ("", "rogue_"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert(f"{prefix}test-ca", ca_key, _name(f"{prefix}test-ca"), ca_key, ca=True)
        files[f"{prefix}ca"] = _write(d / f"{prefix}ca.pem", ca)
        client_key = ec.generate_private_key(ec.SECP256R1())
        files[f"{prefix}client_cert"] = _write(d / f"{prefix}client.pem",
                                               _cert(f"{prefix}client", client_key, ca.subject, ca_key))
        files[f"{prefix}client_key"] = _write(d / f"{prefix}client.key", key=client_key)
        if not prefix:
            server_key = ec.generate_private_key(ec.SECP256R1())
            files["server_cert"] = _write(d / "server.pem", _cert("localhost", server_key, ca.subject, ca_key,
                                                                  server=True))
            files["server_key"] = _write(d / "server.key", key=server_key)
    return files


# -- helpers -------------------------------------------------------------------------------------------------------
def trace_body(name: str = "s") -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.append(trace_pb2.Span(
        trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name=name, start_time_unix_nano=1, end_time_unix_nano=2))
    return req.SerializeToString()


class Keep:
    def __init__(self):
        self.batches: list[Batch] = []

    def consume(self, batch: Batch) -> None:
        self.batches.append(batch)


def start_receiver(settings: dict):
    factory = load_factory("receiver", "otlp")
    cfg = build(factory.config_class, settings, "receivers.otlp")
    keep = Keep()
    host = ComponentHost("otlp", PrometheusSelfTelemetry(), {s: keep for s in Signal})
    receiver = factory.create(cfg, host)
    receiver.start()
    return receiver, keep


def grpc_export(channel, metadata=None, timeout=5):
    call = channel.unary_unary(TRACE_METHOD, request_serializer=None, response_deserializer=None)
    return call(trace_body(), timeout=timeout, metadata=metadata)


def grpc_code(channel, metadata=None) -> grpc.StatusCode:
    try:
        grpc_export(channel, metadata)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def https_post(port: int, ctx: ssl.SSLContext | None, headers: dict | None = None):
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=ctx) if ctx is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=5))
    try:
        conn.request("POST", "/v1/traces", body=trace_body(),
                     headers={"Content-Type": "application/x-protobuf", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def client_ctx(pki, cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki["ca"])
    if cert is not None:
        ctx.load_cert_chain(pki[f"{cert}client_cert"], pki[f"{cert}client_key"])
    return ctx


# -- loopback by default -------------------------------------------------------------------------------------------
def _endpoints(obj, path: str):
    """Every endpoint-like string setting in a (nested) config dataclass."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, None)
        key = f"{path}.{f.name}"
        if isinstance(value, str) and value and (f.name.endswith("endpoint") or f.name.endswith("address")):
            yield key, value
        elif dataclasses.is_dataclass(value):
            yield from _endpoints(value, key)


def _host(endpoint: str) -> str:
    target = endpoint.split("://", 1)[-1].split("/", 1)[0]
    return target.rpartition(":")[0].strip("[]")


def test_every_listener_binds_loopback_by_default():
    """Every built-in component's defaults, and the built-in default config, listen on loopback only."""
    checked = []
    for kind, table in BUILTIN.items():
        for type_name in table:
            factory = load_factory(kind, type_name)
            if kind == "exporter":
                continue  # an exporter's endpoint is where it sends, not where it listens (prometheus: below)
            for key, endpoint in _endpoints(factory.config_class(), f"{kind}s.{type_name}"):
                checked.append(key)
                assert _host(endpoint) in LOOPBACK, f"{key} defaults to {endpoint}"
    prom = load_factory("exporter", "prometheus").config_class()
    assert _host(prom.endpoint) in LOOPBACK
    checked.append("exporters.prometheus.endpoint")
    default = load_default()
    for spec in default.components.values():
        if spec.kind == "exporter" and spec.type != "prometheus":
            continue
        for key, endpoint in _endpoints(spec.config, f"{spec.kind}s.{spec.id}"):
            checked.append(key)
            assert _host(endpoint) in LOOPBACK, f"default config: {key} = {endpoint}"
    assert default.telemetry.metrics.addresses() == []
    assert {"receivers.otlp.grpc.endpoint", "receivers.otlp.http.endpoint",
            "exporters.prometheus.endpoint"} <= set(checked), checked


def test_default_listeners_really_bind_loopback():
    """The default config's listeners, started (on free ports), accept only on 127.0.0.1: a connection to this
    machine's other addresses is refused."""
    from otel_gpu.collector.runtime import Collector

    config = load_default()
    for spec in config.components.values():
        for _key, endpoint in _endpoints(spec.config, spec.id):
            host = _host(endpoint)
            obj = spec.config
            for part in _key.split(".")[1:-1]:
                obj = getattr(obj, part)
            setattr(obj, _key.split(".")[-1], f"{host}:0")
    store = config.components["exporter:store"].config
    store.path = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"otel-gpu-sec-{os.getpid()}")
    collector = Collector(config)
    collector.start()
    try:
        receiver = collector.component("receiver", "otlp")
        prom = collector.component("exporter", "prometheus")
        ports = [receiver.grpc_port, receiver.http_port, prom.port]
        assert all(ports)
        other = _non_loopback_address()
        for port in ports:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
            if other is not None:
                with pytest.raises(OSError):
                    socket.create_connection((other, port), timeout=2).close()
    finally:
        collector.shutdown()


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outward interface's address
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


# -- receiver: bearer auth -----------------------------------------------------------------------------------------
def test_receiver_bearer_auth_grpc_and_http(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("tok-EXAMPLE-1\n")
    auth = {"bearer_token_file": str(token_file)}
    receiver, keep = start_receiver({"grpc": {"endpoint": "127.0.0.1:0", "auth": auth},
                                     "http": {"endpoint": "127.0.0.1:0", "auth": auth}})
    try:
        with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as ch:
            assert grpc_code(ch) is grpc.StatusCode.UNAUTHENTICATED
            assert grpc_code(ch, (("authorization", "Bearer wrong"),)) is grpc.StatusCode.UNAUTHENTICATED
            assert grpc_code(ch, (("authorization", "Basic dG9rLUVYQU1QTEUtMQ=="),)) is grpc.StatusCode.UNAUTHENTICATED
            assert grpc_code(ch, (("authorization", "Bearer tok-EXAMPLE-1"),)) is grpc.StatusCode.OK
        assert len(keep.batches) == 1
        status, headers, _ = https_post(receiver.http_port, None)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert https_post(receiver.http_port, None, {"Authorization": "Bearer nope"})[0] == 401
        assert https_post(receiver.http_port, None, {"Authorization": "Bearer tok-EXAMPLE-1"})[0] == 200
        assert len(keep.batches) == 2
        # Rotation: a new token in the file is picked up without a restart; the old one stops working.
        time.sleep(0.05)
        token_file.write_text("tok-EXAMPLE-2-rotated\n")
        time.sleep(1.2)
        assert https_post(receiver.http_port, None, {"Authorization": "Bearer tok-EXAMPLE-1"})[0] == 401
        assert https_post(receiver.http_port, None, {"Authorization": "Bearer tok-EXAMPLE-2-rotated"})[0] == 200
    finally:
        receiver.shutdown()


def test_receiver_token_from_env_and_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_GPU_TEST_TOKEN", "env-tok-EXAMPLE")
    port = free_port()
    cfg = load_text(f"""
receivers: {{otlp: {{grpc: {{endpoint: "127.0.0.1:{port}", auth: {{bearer_token: "${{env:OTEL_GPU_TEST_TOKEN}}"}}}},
                     http: null}}}}
exporters: {{debug: {{}}}}
service: {{pipelines: {{traces: {{receivers: [otlp], exporters: [debug]}}}}}}
""")
    assert "env-tok-EXAMPLE" not in repr(cfg.components["receiver:otlp"].config)
    from otel_gpu.collector.runtime import Collector, StartError

    collector = Collector(cfg)
    collector.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert grpc_code(ch, (("authorization", "Bearer env-tok-EXAMPLE"),)) is grpc.StatusCode.OK
            assert grpc_code(ch, (("authorization", "Bearer env-tok"),)) is grpc.StatusCode.UNAUTHENTICATED
    finally:
        collector.shutdown()
    bad = load_text(f"""
receivers: {{otlp: {{grpc: {{endpoint: "127.0.0.1:0", auth: {{bearer_token_file: {tmp_path}/missing}}}}, http: null}}}}
exporters: {{debug: {{}}}}
service: {{pipelines: {{traces: {{receivers: [otlp], exporters: [debug]}}}}}}
""")
    with pytest.raises(StartError, match=r"receivers.otlp: could not start: grpc.auth.bearer_token_file: cannot read"):
        Collector(bad).start()


# -- receiver: TLS and mutual TLS ----------------------------------------------------------------------------------
def test_receiver_tls_grpc_and_http(pki):
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"]}
    receiver, keep = start_receiver({"grpc": {"endpoint": "127.0.0.1:0", "tls": tls},
                                     "http": {"endpoint": "127.0.0.1:0", "tls": tls}})
    try:
        roots = Path(pki["ca"]).read_bytes()
        with grpc.secure_channel(f"127.0.0.1:{receiver.grpc_port}", grpc.ssl_channel_credentials(roots)) as ch:
            assert grpc_code(ch) is grpc.StatusCode.OK
        with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as ch:  # plaintext to a TLS port
            assert grpc_code(ch) is grpc.StatusCode.UNAVAILABLE
        rogue = Path(pki["rogue_ca"]).read_bytes()  # a client that does not trust our server's CA
        with grpc.secure_channel(f"127.0.0.1:{receiver.grpc_port}", grpc.ssl_channel_credentials(rogue)) as ch:
            assert grpc_code(ch) is grpc.StatusCode.UNAVAILABLE
        assert https_post(receiver.http_port, client_ctx(pki))[0] == 200
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            https_post(receiver.http_port, None)  # plaintext to a TLS port
        assert len(keep.batches) == 2
    finally:
        receiver.shutdown()


def test_receiver_mutual_tls_grpc_and_http(pki):
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"], "client_ca_file": pki["ca"]}
    receiver, keep = start_receiver({"grpc": {"endpoint": "127.0.0.1:0", "tls": tls},
                                     "http": {"endpoint": "127.0.0.1:0", "tls": tls}})
    try:
        roots = Path(pki["ca"]).read_bytes()

        def creds(prefix: str | None):
            if prefix is None:
                return grpc.ssl_channel_credentials(roots)
            return grpc.ssl_channel_credentials(roots, Path(pki[f"{prefix}client_key"]).read_bytes(),
                                                Path(pki[f"{prefix}client_cert"]).read_bytes())

        target = f"127.0.0.1:{receiver.grpc_port}"
        with grpc.secure_channel(target, creds("")) as ch:
            assert grpc_code(ch) is grpc.StatusCode.OK
        for bad in (None, "rogue_"):  # no client certificate; one signed by another CA
            with grpc.secure_channel(target, creds(bad)) as ch:
                assert grpc_code(ch) is grpc.StatusCode.UNAVAILABLE, bad
        assert https_post(receiver.http_port, client_ctx(pki, ""))[0] == 200
        for bad in (None, "rogue_"):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
                https_post(receiver.http_port, client_ctx(pki, bad))
        # A failed handshake does not stop the server from serving the next client.
        assert https_post(receiver.http_port, client_ctx(pki, ""))[0] == 200
        assert len(keep.batches) == 3
    finally:
        receiver.shutdown()


def test_tls_config_errors_name_the_key(pki, tmp_path):
    factory = load_factory("receiver", "otlp")
    with pytest.raises(ConfigError, match=r"receivers.otlp.grpc.tls.cert_file: TLS needs both cert_file and key_file"):
        build(factory.config_class, {"grpc": {"tls": {"cert_file": pki["server_cert"]}}}, "receivers.otlp")
    # Files are read at start (a config can be validated away from its secrets, e.g. a rendered Helm chart).
    from otel_gpu.collector.runtime import Collector, StartError

    cfg = load_text(f"""
receivers: {{otlp: {{grpc: null, http: {{endpoint: "127.0.0.1:0", tls: {{cert_file: {pki['server_cert']},
                     key_file: {pki['server_key']}, client_ca_file: {tmp_path}/nope.pem}}}}}}}}
exporters: {{debug: {{}}}}
service: {{pipelines: {{traces: {{receivers: [otlp], exporters: [debug]}}}}}}
""")
    with pytest.raises(StartError, match=r"receivers.otlp: could not start: http.tls.client_ca_file: cannot read"):
        Collector(cfg).start()
    (tmp_path / "garbage.pem").write_text("not a certificate")
    cfg.components["receiver:otlp"].config.http.tls.client_ca_file = ""
    cfg.components["receiver:otlp"].config.http.tls.cert_file = str(tmp_path / "garbage.pem")
    with pytest.raises(StartError, match=r"http.tls.cert_file / key_file: not a matching PEM"):
        Collector(cfg).start()


# -- exporters: TLS (mutual) + bearer token, to our own receiver ------------------------------------------------------
@pytest.mark.parametrize("kind", ["otlp", "otlphttp"])
def test_exporter_tls_client_cert_and_token_reach_a_locked_receiver(pki, tmp_path, kind):
    token_file = tmp_path / "token"
    token_file.write_text("exp-tok-EXAMPLE")
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"], "client_ca_file": pki["ca"]}
    auth = {"bearer_token_file": str(token_file)}
    receiver, keep = start_receiver({"grpc": {"endpoint": "127.0.0.1:0", "tls": tls, "auth": auth},
                                     "http": {"endpoint": "127.0.0.1:0", "tls": tls, "auth": auth}})
    factory = load_factory("exporter", kind)
    client_tls = {"ca_file": pki["ca"], "cert_file": pki["client_cert"], "key_file": pki["client_key"]}
    endpoint = (f"https://localhost:{receiver.grpc_port}" if kind == "otlp"
                else f"https://localhost:{receiver.http_port}")
    results = {}
    try:
        for label, token in (("right", "exp-tok-EXAMPLE"), ("wrong", "not-the-token")):
            telemetry = PrometheusSelfTelemetry()
            cfg = build(factory.config_class, {
                "endpoint": endpoint, "tls": client_tls, "auth": {"bearer_token": token},
                "retry_on_failure": {"initial_interval": "100ms", "max_interval": "200ms", "max_elapsed_time": "1s"},
                "sending_queue": {"num_consumers": 1}}, f"exporters.{kind}")
            exporter = factory.create(cfg, ComponentHost(kind, telemetry))
            exporter.start()
            before = len(keep.batches)
            exporter.export(Batch.from_bytes(Signal.TRACES, trace_body(label)))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not (
                    telemetry.value("otel_gpu.collector.exported", kind, Signal.TRACES)
                    or telemetry.value("otel_gpu.collector.dropped", kind, Signal.TRACES)):
                time.sleep(0.05)
            exporter.shutdown(2)
            results[label] = (len(keep.batches) - before,
                              telemetry.value("otel_gpu.collector.exported", kind, Signal.TRACES),
                              telemetry.value("otel_gpu.collector.dropped", kind, Signal.TRACES))
    finally:
        receiver.shutdown()
    assert results["right"] == (1, 1.0, 0.0), results
    assert results["wrong"] == (0, 0.0, 1.0), results  # UNAUTHENTICATED / 401: permanent, dropped and counted
    assert keep.batches[0].message.resource_spans[0].scope_spans[0].spans[0].name == "right"


# -- prometheus: TLS + basic auth ----------------------------------------------------------------------------------
def test_prometheus_tls_and_basic_auth(pki, tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("pw-EXAMPLE-secret\n")
    factory = load_factory("exporter", "prometheus")
    cfg = build(factory.config_class, {"endpoint": "127.0.0.1:0",
                                       "tls": {"cert_file": pki["server_cert"], "key_file": pki["server_key"]},
                                       "basic_auth": {"username": "scraper", "password_file": str(pw)}},
                "exporters.prometheus")
    telemetry = PrometheusSelfTelemetry()
    telemetry.received("otlp", Signal.METRICS, 3)
    exporter = factory.create(cfg, ComponentHost("prometheus", telemetry,
                                                 services={SELF_TELEMETRY_REGISTRY: telemetry.registry}))
    exporter.start()
    assert exporter.url.startswith("https://127.0.0.1:")

    def get(path: str, user: str | None = None, password: str | None = None, ctx=None):
        conn = http.client.HTTPSConnection("127.0.0.1", exporter.port, timeout=5, context=ctx or client_ctx(pki))
        headers = {}
        if user is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    try:
        status, headers, _ = get("/metrics")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
        assert get("/metrics", "scraper", "wrong")[0] == 401
        assert get("/metrics", "other", "pw-EXAMPLE-secret")[0] == 401
        status, _, body = get("/metrics", "scraper", "pw-EXAMPLE-secret")
        assert status == 200 and b"otel_gpu_collector_received" in body, (status, body[:200])
        assert get("/health")[0] == 200  # probes need no credentials
        conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=5)  # plaintext to the TLS port
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            conn.request("GET", "/health")
            conn.getresponse()
        conn.close()
    finally:
        exporter.shutdown()


# -- secrets never logged ------------------------------------------------------------------------------------------
SECRETS = ("tok-RECEIVER-9f3a", "tok-CLIENT-WRONG-77c1", "tok-EXPORTER-5d2e", "pw-PROM-0b8d")


@pytest.mark.timeout(60)
def test_secrets_never_appear_in_collector_logs(tmp_path, pki):
    token_file = tmp_path / "receiver.token"
    token_file.write_text(SECRETS[0])
    grpc_port, http_port, prom_port, dead_port = free_port(), free_port(), free_port(), free_port()
    text = f"""
receivers:
  otlp:
    grpc: {{endpoint: 127.0.0.1:{grpc_port}, auth: {{bearer_token_file: {token_file}}}}}
    http: {{endpoint: 127.0.0.1:{http_port}, auth: {{bearer_token_file: {token_file}}}}}
exporters:
  otlp: {{endpoint: 127.0.0.1:{dead_port}, auth: {{bearer_token: "${{env:EXPORT_TOKEN}}"}},
          retry_on_failure: {{initial_interval: 100ms, max_interval: 200ms, max_elapsed_time: 1s}}}}
  prometheus:
    endpoint: 127.0.0.1:{prom_port}
    basic_auth: {{username: scraper, password: "${{env:PROM_PASSWORD}}"}}
service:
  telemetry: {{logs: {{level: debug}}}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [otlp]}}
    metrics: {{receivers: [otlp], exporters: [prometheus]}}
"""
    env = {"EXPORT_TOKEN": SECRETS[2], "PROM_PASSWORD": SECRETS[3]}
    with start_collector(text, tmp_path, env=env) as proc:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            for token in (SECRETS[0], SECRETS[1]):
                grpc_code(ch, (("authorization", f"Bearer {token}"),))
        for token in (SECRETS[0], SECRETS[1]):
            https_post(http_port, None, {"Authorization": f"Bearer {token}"})
        for password in (SECRETS[3], SECRETS[1]):
            conn = http.client.HTTPConnection("127.0.0.1", prom_port, timeout=5)
            auth = base64.b64encode(f"scraper:{password}".encode()).decode()
            conn.request("GET", "/metrics", headers={"Authorization": f"Basic {auth}"})
            conn.getresponse().read()
            conn.close()
        time.sleep(1.5)  # the exporter tries the dead backend and gives up (logged)
        assert proc.stop() == 0
        log = proc.stderr_text()
    assert "otel-gpu collector ready" in log and "bearer-token auth" in log
    assert "dropping traces batch" in log or "drop" in log.lower()
    for secret in SECRETS:
        assert secret not in log, f"{secret} leaked into the collector's log"
        assert base64.b64encode(secret.encode()).decode() not in log


@pytest.mark.parametrize("value", ["tok-ERR-41aa", "[tok-ERR-41aa, x]", "{tok-ERR-41aa: 1}", "12345678901234"])
def test_secrets_never_appear_in_config_errors(value, monkeypatch, tmp_path):
    monkeypatch.setenv("SECRET_VALUE", value)
    needle = "tok-ERR-41aa" if "tok" in value else value
    configs = [
        # both the inline token and a file
        'receivers: {otlp: {grpc: {auth: {bearer_token: "${env:SECRET_VALUE}", bearer_token_file: /x}}}}',
        # a sibling setting wrong, and an unknown key beside the token
        'receivers: {otlp: {grpc: {max_workers: many, auth: {bearer_token: "${env:SECRET_VALUE}", '
        'bearer_tokn: 1}}}}',
        # exporter token and prometheus password, with errors around them
        'exporters: {otlp: {endpoint: "nope", auth: {bearer_token: "${env:SECRET_VALUE}"}}, '
        'prometheus: {basic_auth: {username: "a:b", password: "${env:SECRET_VALUE}"}}}',
    ]
    tail = "\nservice: {pipelines: {traces: {receivers: [otlp], exporters: [debug]}}}\n"
    for text in configs:
        with pytest.raises(ConfigError) as info:
            load_text(text + tail)
        assert needle not in str(info.value), str(info.value)
    # The same through the CLI: its error output does not show the secret either.
    (tmp_path / "bad.yaml").write_text(configs[0] + tail)
    out = subprocess.run([sys.executable, "-m", "otel_gpu", "collector", "--config", str(tmp_path / "bad.yaml")],
                         capture_output=True, text=True, timeout=30, env={**os.environ, "SECRET_VALUE": value})
    assert out.returncode != 0 and "bearer_token" in out.stderr, out.stderr
    assert needle not in out.stderr + out.stdout


# -- Helm chart: least privilege everywhere, memory limit, a protected aggregator link ---------------------------------
def test_helm_chart_security_settings(monkeypatch):
    pytest.importorskip("helm_python")
    monkeypatch.setenv("NODE_NAME", "n1")
    import kubernetes_validate
    import yaml
    from test_helm import NAMESPACE, RELEASE, one, render

    values = {"aggregator": {"enabled": True, "security": {"tlsSecret": "agg-tls", "mutualTls": True,
                                                           "tokenSecret": "agg-token"}}}
    manifests, _ = render(values)
    for m in manifests:
        doc = {k: v for k, v in m.items() if k != "__template__"}
        kubernetes_validate.validate(doc, "1.30", strict=True)
    agg_name, agent_name = f"{RELEASE}-otel-gpu-aggregator", f"{RELEASE}-otel-gpu-agent"
    agg_cfg = yaml.safe_load(one(manifests, "ConfigMap", agg_name)["data"]["config.yaml"])
    agent_cfg = yaml.safe_load(one(manifests, "ConfigMap", agent_name)["data"]["config.yaml"])
    for proto in ("grpc", "http"):
        server = agg_cfg["receivers"]["otlp"][proto]
        assert server["tls"] == {"cert_file": "/var/run/secrets/otel-gpu/tls/tls.crt",
                                 "key_file": "/var/run/secrets/otel-gpu/tls/tls.key",
                                 "client_ca_file": "/var/run/secrets/otel-gpu/tls/ca.crt"}
        assert server["auth"] == {"bearer_token_file": "/var/run/secrets/otel-gpu/token/token"}
    link = agent_cfg["exporters"]["otlp/aggregator"]
    assert link["endpoint"] == f"https://{agg_name}.{NAMESPACE}.svc:4317"
    assert link["tls"]["ca_file"].endswith("ca.crt") and link["tls"]["cert_file"].endswith("tls.crt")
    assert link["auth"] == {"bearer_token_file": "/var/run/secrets/otel-gpu/token/token"}
    for cfg in (agg_cfg, agent_cfg):
        assert cfg["processors"]["memory_limiter"]["limit_percentage"] == 80
        # the memory limiter comes first in every pipeline (the aggregator's add attribution and goodput after it)
        assert all(p["processors"][0] == "memory_limiter" for p in cfg["service"]["pipelines"].values())
        load_text(yaml.safe_dump(cfg))  # our validator takes it (secret files are read at start, not here)
    for kind, name in (("Deployment", agg_name), ("DaemonSet", agent_name)):
        pod = one(manifests, kind, name)["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        container = pod["containers"][0]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["aggregator-tls"]["readOnly"] and mounts["aggregator-token"]["readOnly"]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["aggregator-tls"]["secret"]["secretName"] == "agg-tls"
        assert vols["aggregator-token"]["secret"]["secretName"] == "agg-token"
    # Off when the operator opts out of a token (the chart refuses otherwise: tests/test_helm.py): no secret volumes,
    # plaintext in-cluster link, memory limiter still on.
    manifests, _ = render({"aggregator": {"enabled": True, "security": {"allowUnauthenticated": True}}})
    pod = one(manifests, "Deployment", agg_name)["spec"]["template"]["spec"]
    assert not {"aggregator-tls", "aggregator-token"} & {v["name"] for v in pod["volumes"]}
    agg_cfg = yaml.safe_load(one(manifests, "ConfigMap", agg_name)["data"]["config.yaml"])
    assert "tls" not in agg_cfg["receivers"]["otlp"]["grpc"] and "memory_limiter" in agg_cfg["processors"]
    manifests, _ = render({"memoryLimiter": {"enabled": False}})
    agent_cfg = yaml.safe_load(one(manifests, "ConfigMap", agent_name)["data"]["config.yaml"])
    assert "memory_limiter" not in agent_cfg.get("processors", {})  # attribution and goodput stay


def test_opentelemetry_sdk_exporters_with_tls_and_token(pki, tmp_path, monkeypatch):
    """Interop: the OpenTelemetry SDK's gRPC and HTTP span exporters reach a receiver that requires TLS and a token
    when given the CA and `authorization: Bearer ...` (OTEL_EXPORTER_OTLP_CERTIFICATE / _HEADERS in env form), and
    are refused without the token."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override a session's own CA file (session.verify); this
    # machine sets both, so the SDK's certificate_file would be ignored.
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("t").start_as_current_span("sdk-span"):
        pass
    spans = memory.get_finished_spans()
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"]}
    auth = {"bearer_token": "sdk-tok-EXAMPLE"}
    receiver, keep = start_receiver({"grpc": {"endpoint": "127.0.0.1:0", "tls": tls, "auth": auth},
                                     "http": {"endpoint": "127.0.0.1:0", "tls": tls, "auth": auth}})
    creds = grpc.ssl_channel_credentials(Path(pki["ca"]).read_bytes())
    results = {}
    try:
        for label, headers in (("token", {"authorization": "Bearer sdk-tok-EXAMPLE"}), ("none", {})):
            g = GrpcSpanExporter(endpoint=f"localhost:{receiver.grpc_port}", credentials=creds, headers=headers,
                                 timeout=3)
            h = HttpSpanExporter(endpoint=f"https://localhost:{receiver.http_port}/v1/traces",
                                 certificate_file=pki["ca"], headers=headers, timeout=3)
            results[label] = (g.export(spans), h.export(spans))
            g.shutdown()
            h.shutdown()
    finally:
        receiver.shutdown()
    assert results["token"] == (SpanExportResult.SUCCESS, SpanExportResult.SUCCESS), results
    assert results["none"] == (SpanExportResult.FAILURE, SpanExportResult.FAILURE), results
    assert len(keep.batches) == 2


@pytest.mark.timeout(60)
def test_helm_secured_aggregator_link_works_end_to_end(tmp_path, monkeypatch):
    """The rendered aggregator's otlp receiver settings and the rendered agents' otlp/aggregator exporter settings,
    with the Secret mount paths pointed at real files (one kubernetes.io/tls-shaped Secret: tls.crt with server and
    client usages, tls.key, ca.crt; a token Secret), talk to each other over mutual TLS with the token."""
    pytest.importorskip("helm_python")
    import yaml
    from test_helm import NAMESPACE, RELEASE, one, render

    from otel_gpu.collector.runtime import Collector

    monkeypatch.setenv("NODE_NAME", "n1")
    manifests, _ = render({"aggregator": {"enabled": True, "security": {"tlsSecret": "t", "mutualTls": True,
                                                                        "tokenSecret": "k"}}})
    agg_cfg = yaml.safe_load(one(manifests, "ConfigMap", f"{RELEASE}-otel-gpu-aggregator")["data"]["config.yaml"])
    agent_cfg = yaml.safe_load(one(manifests, "ConfigMap", f"{RELEASE}-otel-gpu-agent")["data"]["config.yaml"])
    svc = f"{RELEASE}-otel-gpu-aggregator.{NAMESPACE}.svc"
    # The Secrets, as Kubernetes would mount them.
    secrets = tmp_path / "secrets"
    (secrets / "tls").mkdir(parents=True)
    (secrets / "token").mkdir()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("link-ca", ca_key, _name("link-ca"), ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    leaf = (x509.CertificateBuilder().subject_name(_name(svc)).issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(svc)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(secrets / "tls" / "ca.crt", ca)
    _write(secrets / "tls" / "tls.crt", leaf)
    _write(secrets / "tls" / "tls.key", key=key)
    (secrets / "token" / "token").write_text("link-tok-EXAMPLE\n")

    def remap(node):
        if isinstance(node, str):
            return node.replace("/var/run/secrets/otel-gpu", str(secrets))
        if isinstance(node, dict):
            return {k: remap(v) for k, v in node.items()}
        return node

    port = free_port()
    receiver_settings = remap(agg_cfg["receivers"]["otlp"])
    receiver_settings["grpc"]["endpoint"] = f"127.0.0.1:{port}"
    receiver_settings["http"] = None
    aggregator = Collector(load_text(yaml.safe_dump({
        "receivers": {"otlp": receiver_settings}, "exporters": {"debug": {}},
        "service": {"pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["debug"]}}}})))
    link = remap(agent_cfg["exporters"]["otlp/aggregator"])
    assert link["endpoint"] == f"https://{svc}:4317"
    link["endpoint"] = f"https://127.0.0.1:{port}"
    link["tls"]["server_name_override"] = svc  # the Service name, as DNS would resolve it in the cluster
    link["retry_on_failure"] = {"initial_interval": "200ms", "max_interval": "500ms", "max_elapsed_time": "5s"}
    sender_cfg = load_text(yaml.safe_dump({
        "receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": None}},
        "exporters": {"otlp/aggregator": link},
        "service": {"pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["otlp/aggregator"]}}}}))
    agent = Collector(sender_cfg)
    aggregator.start()
    agent.start()
    try:
        exporter = agent.component("exporter", "otlp/aggregator")
        exporter.export(Batch.from_bytes(Signal.TRACES, trace_body("over-the-link")))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not aggregator.telemetry.value(
                "otel_gpu.collector.received", "otlp", Signal.TRACES):
            time.sleep(0.05)
        assert aggregator.telemetry.value("otel_gpu.collector.received", "otlp", Signal.TRACES) == 1
        assert agent.telemetry.value("otel_gpu.collector.exported", "otlp/aggregator", Signal.TRACES) == 1
    finally:
        agent.shutdown()
        aggregator.shutdown()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_training_processes_reach_a_mutual_tls_receiver_through_the_standard_env_variables(pki, monkeypatch,
                                                                                          protocol):
    """OTEL_EXPORTER_OTLP_CERTIFICATE / _CLIENT_CERTIFICATE / _CLIENT_KEY, as the OTel SDK's exporters read them."""
    from otel_gpu.instrumentation._export import OtlpClient

    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"], "client_ca_file": pki["ca"]}
    receiver, keep = start_receiver({"grpc": {"endpoint": "127.0.0.1:0", "tls": tls},
                                     "http": {"endpoint": "127.0.0.1:0", "tls": tls}})
    port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
    try:
        untrusting = OtlpClient(f"https://127.0.0.1:{port}", protocol=protocol, timeout_s=3, buffer_mib=0)
        untrusting.send_traces(trace_body("refused"))
        assert untrusting.sent == 0 and untrusting.failed >= 1  # no CA given: our private CA is not trusted
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", pki["ca"])
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", pki["client_cert"])
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", pki["client_key"])
        client = OtlpClient(f"https://127.0.0.1:{port}", protocol=protocol, timeout_s=3, buffer_mib=0)
        assert client.send_traces(trace_body("delivered"))
        assert client.sent == 1
        names = [s.name for b in keep.batches for rs in b.message.resource_spans for ss in rs.scope_spans
                 for s in ss.spans]
        assert names == ["delivered"]
    finally:
        receiver.shutdown()
