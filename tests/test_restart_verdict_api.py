"""The collector's verdict API (``verdict`` exporter): the latest version of each failure per job over HTTP, bearer
token like the other listeners, on in the default config; and the restart policy's validation."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from otel_gpu.collector.config import load_default
from otel_gpu.component import ComponentHost
from otel_gpu.config import ConfigError, build
from otel_gpu.exporters.verdict import FACTORY, VerdictExporterConfig
from otel_gpu.instrumentation import _export
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import failure as F
from otel_gpu.supervisor import load_policy_text
from otel_gpu.supervisor._verdict import VerdictClient, VerdictUnavailable, default_url


class _Telemetry:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _exporter(settings):
    cfg = build(VerdictExporterConfig, settings, "exporters.verdict")
    exporter = FACTORY.create(cfg, ComponentHost("verdict", _Telemetry()))
    exporter.start()
    return exporter


def _failure_batch(*records):
    req = _export.logs_request(_export.make_resource({"service.name": "otel-gpu"}),
                               [(F.FAILURE_EVENT.name, 1, {}, r, _export.ERROR) for r in records])
    return Batch.from_message(Signal.LOGS, req)


def _get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.status, json.loads(resp.read())


def _record(fid, version, job="job-a", t=100.0, **extra):
    return {"failure_id": fid, "version": version, "job_id": job, "kind": "crash", "root_cause": "rank_process_died",
            "action": "auto_restart", "detected_time": t, "onset_time": t - 1, "confidence": 0.9, **extra}


def test_latest_version_per_failure_id_withdrawn_left_out_per_job():
    exporter = _exporter({"endpoint": "127.0.0.1:0"})
    try:
        exporter.export(_failure_batch(_record("f1", 2, summary="second"), _record("f2", 1, t=90.0),
                                       _record("f3", 1, job="job-b")))
        exporter.export(_failure_batch(_record("f1", 1, summary="first, late"),  # an older version arriving late
                                       _record("f2", 2, t=90.0, withdrawn=True)))
        status, body = _get(f"{exporter.url}/api/v1/failures?job_id=job-a")
        assert status == 200
        assert [(r["failure_id"], r["version"], r.get("summary")) for r in body["failures"]] == [("f1", 2, "second")]
        _, body = _get(f"{exporter.url}/api/v1/failures?job_id=job-a&include_withdrawn=1")
        assert [r["failure_id"] for r in body["failures"]] == ["f1", "f2"]  # newest detection first
        _, body = _get(f"{exporter.url}/api/v1/failures?job_id=job-a&since=101")
        assert body["failures"] == []
        _, body = _get(f"{exporter.url}/api/v1/failures?job_id=nobody")
        assert body["failures"] == []
        client = VerdictClient(exporter.url)
        assert client.healthy() and [r.failure_id for r in client.failures("job-b")] == ["f3"]
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(f"{exporter.url}/api/v1/failures?job_id=job-b&since=yesterday")
        assert err.value.code == 400
    finally:
        exporter.shutdown()


def test_bearer_token_like_the_other_listeners(tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-verdict-1\n")
    exporter = _exporter({"endpoint": "127.0.0.1:0", "auth": {"bearer_token_file": str(token)}})
    try:
        exporter.export(_failure_batch(_record("f1", 1)))
        for bad in (None, "wrong"):
            with pytest.raises(urllib.error.HTTPError) as err:
                _get(f"{exporter.url}/api/v1/failures?job_id=job-a", bad)
            assert err.value.code == 401
        assert _get(f"{exporter.url}/health")[0] == 200  # probes need no token
        assert len(_get(f"{exporter.url}/api/v1/failures?job_id=job-a", "tok-verdict-1")[1]["failures"]) == 1
        with pytest.raises(VerdictUnavailable, match="check the bearer token"):
            VerdictClient(exporter.url, "wrong").failures("job-a")
        assert VerdictClient(exporter.url, "tok-verdict-1").failures("job-a")[0].failure_id == "f1"
    finally:
        exporter.shutdown()


def test_on_in_the_default_config_on_loopback_next_to_otlp():
    config = load_default()
    spec = config.components["exporter:verdict"]
    assert spec.config.endpoint == "127.0.0.1:4319"
    assert any("verdict" in p.exporters for p in config.pipelines if p.signal is Signal.LOGS)
    assert default_url("http://127.0.0.1:4317") == "http://127.0.0.1:4319"


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"exporters.verdict.endpoint must be HOST:PORT"):
        build(VerdictExporterConfig, {"endpoint": "4319"}, "exporters.verdict")
    with pytest.raises(ConfigError, match=r"exporters.verdict.max_jobs must be >= 1"):
        build(VerdictExporterConfig, {"max_jobs": 0}, "exporters.verdict")


def test_policy_overrides_defaults_and_errors():
    policy = load_policy_text("actions: {hardware: investigate, gpu_xid: exclude_node_and_restart}\n"
                              "budget: {max_restarts: 5, window: 2h, backoff_initial: 500ms}\n")
    assert policy.action_for({"root_cause": "gpu_xid", "category": "hardware"}) == "exclude_node_and_restart"
    assert policy.action_for({"root_cause": "nvlink_error", "category": "hardware",
                              "action": "exclude_node_and_restart"}) == "investigate"
    assert policy.action_for({"root_cause": "python_exception", "action": "user_fix"}) == "user_fix"
    assert (policy.budget.max_restarts, policy.budget.window_s, policy.budget.backoff_initial_s) == (5, 7200.0, 0.5)
    defaults = load_policy_text("")
    assert (defaults.budget.max_restarts, defaults.budget.window_s, defaults.hang.decision,
            defaults.verdict.wait_s, defaults.stop_grace_s, defaults.backend_timeout_s) == (3, 3600.0, "by_action",
                                                                                          15.0, 10.0, 1800.0)
    with pytest.raises(ConfigError) as err:
        load_policy_text("budget: {window: soon}\nverdict: {url: '127.0.0.1:4319'}\nbackend_timeout: -5\nfoo: 1\n")
    text = str(err.value)
    for needle in ("budget.window must be a duration like 30s", "verdict.url must start with http://",
                   "backend_timeout must be", "foo: unknown setting"):
        assert needle in text, text
    with pytest.raises(ConfigError, match="not valid YAML at line 1"):
        load_policy_text("budget: {max_restarts: [")


def test_exclude_hook_gets_each_culprit_field_as_one_argument_and_gpu_is_left_out(tmp_path, monkeypatch):
    from otel_gpu.failure import from_json
    from otel_gpu.supervisor import Supervisor
    from otel_gpu.supervisor.supervisor import Decision

    out = tmp_path / "hook.txt"
    policy = load_policy_text(f"hooks:\n  exclude: printf '%s|' {{host}} reason=\"x {{root_cause}}\" -- {out}\n")
    assert policy.hooks.exclude_argv == ["printf", "%s|", "{host}", "reason=x {root_cause}", "--", str(out)]
    # A script gets the fields as its arguments ("$@") or environment, never inside its text.
    policy = load_policy_text(f"hooks:\n  exclude: sh -c 'printf \"%s|\" \"$@\" \"$OTEL_GPU_CULPRIT_HOST\" > {out}' hook "
                              "{host} {gpu_uuid} {gpu_index} {rank} {root_cause}\n  exclude_gpu: true\n")
    sup = Supervisor(["true"], "auto", policy, None, "job-x", "http://127.0.0.1:9")
    record = from_json(_record("f9", 1, job="job-x", root_cause="gpu_fell_off_bus",
                               culprit={"rank": 0, "host": "node-7", "gpu": "2"}))
    decision = Decision("job-x", 0, 0, 0.0, "exit", 1, "restart", "")
    sup._exclude(record, decision)
    assert out.read_text() == "node-7||2|0|gpu_fell_off_bus|node-7|"
    assert decision.hook["exit_code"] == 0 and decision.excluded == "host node-7, GPU 2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert sup._cuda_env() == {"CUDA_VISIBLE_DEVICES": "0,1,3"}


def test_tls_on_the_shared_server_and_device_states(tmp_path):
    """The verdict API on otel_gpu.collector.httpserver with TLS: the supervisor's client (CA file) reads failures and the
    latest drained devices; a plaintext client gets nothing; a later state of a device supersedes."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from otel_gpu.collector import httpserver
    from otel_gpu.schema import health as H

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False).sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    exporter = _exporter({"endpoint": "127.0.0.1:0", "max_devices": 2,
                          "tls": {"cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem")}})
    try:
        assert isinstance(exporter._server, httpserver.ThreadedHttpServer) and exporter.url.startswith("https://")
        exporter.export(_failure_batch(_record("f1", 1)))
        states = [{"device_id": "gpu:GPU-a", "kind": "gpu", "host": "h1", "uuid": "GPU-a", "gpu_index": 0,
                   "state": "drain", "since": 10.0, "time": 10.0, "evidence": ["remap failed"]},
                  {"device_id": "gpu:GPU-a", "kind": "gpu", "host": "h1", "uuid": "GPU-a", "gpu_index": 0,
                   "state": "watch", "since": 5.0, "time": 5.0, "evidence": []},  # older: ignored
                  {"device_id": "node:h2", "kind": "node", "host": "h2", "state": "drain", "since": 11.0,
                   "time": 11.0}, {"device_id": ["bad"], "state": "drain"}, {"device_id": "x", "state": "broken"}]
        req = _export.logs_request(_export.make_resource({"service.name": "otel-gpu"}),
                                   [(H.STATE_CHANGE_EVENT.name, 1, {}, s, _export.WARN) for s in states])
        exporter.export(Batch.from_message(Signal.LOGS, req))
        client = VerdictClient(exporter.url, ca_file=str(tmp_path / "cert.pem"))
        assert [f.failure_id for f in client.failures("job-a")] == ["f1"]
        assert [d["device_id"] for d in client.devices("drain")] == ["node:h2", "gpu:GPU-a"]
        assert [d["device_id"] for d in client.devices("drain", ("h1",))] == ["gpu:GPU-a"]
        assert client.devices("watch") == []
        with pytest.raises(VerdictUnavailable):
            VerdictClient(exporter.url.replace("https", "http")).devices()
        exporter.export(Batch.from_message(Signal.LOGS, _export.logs_request(
            _export.make_resource({}), [(H.STATE_CHANGE_EVENT.name, 1, {}, {"device_id": f"gpu:GPU-{i}", "kind": "gpu",
                                         "state": "watch", "time": 20.0 + i}, _export.WARN) for i in range(3)])))
        assert len(exporter.devices(("healthy", "watch", "drain"))) == 2  # max_devices: the oldest changes go
    finally:
        exporter.shutdown()
