"""Issue 15 item 3, the verdict channel of ``otel-gpu run --restart``: a real collector process (fake NVML) drains a
GPU whose row remap failed; its verdict exporter serves the device states (``GET /api/v1/devices``, bearer token),
and the supervisor's drained-device decision (policy ``devices.exclude_drained``) excludes it before a restart."""
from __future__ import annotations

import contextlib
import json
import random
import time
import urllib.error
import urllib.request

import pytest
from collector_proc import free_port, start_collector

from otel_gpu.collector.config import load_default
from otel_gpu.pdata import Signal
from otel_gpu.failure import from_json
from otel_gpu.supervisor import Supervisor, load_policy_text
from otel_gpu.supervisor.supervisor import Decision

HOST = "rack1-node7"


def _get(url, token):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=5) as resp:  # loopback
        return json.loads(resp.read())


def _wait(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s")


def test_a_drained_gpu_is_served_and_excluded_at_the_next_restart_when_the_policy_says_so(tmp_path, monkeypatch):
    rng = random.Random()
    bad = rng.randrange(4)  # GPU 0 can be the bad one
    scenario = tmp_path / "nvml.yaml"
    # Start dirty: every GPU has some corrected remaps; only the bad one's remap fails.
    scenario.write_text("gpu_count: 4\n"
                        + "gpus: {" + ", ".join(f"{i}: {{remapped_rows_correctable: {rng.randrange(1, 4)}}}"
                                                for i in range(4)) + "}\n"
                        + f"timeline:\n  - {{at_s: {rng.uniform(0.5, 1.5):.2f}, gpu: {bad}, set: {{remap_failure: 1}}}}\n")
    token = "s3cret-" + str(rng.randrange(10**6))
    (tmp_path / "token").write_text(token)
    port = free_port()
    text = f"""
receivers:
  nvml: {{backend: fake, scenario: "{scenario}", interval: 200ms, host_name: {HOST}}}
processors:
  health: {{sample_interval: 200ms, evaluate_interval: 200ms}}
exporters:
  prometheus: {{endpoint: "127.0.0.1:{free_port()}"}}
  verdict: {{endpoint: "127.0.0.1:{port}", auth: {{bearer_token_file: "{tmp_path / 'token'}"}}}}
service:
  pipelines:
    metrics: {{receivers: [nvml], processors: [health], exporters: [prometheus]}}
    logs: {{receivers: [nvml], processors: [health], exporters: [verdict]}}
"""
    url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        collector = stack.enter_context(start_collector(text, tmp_path / "collector", timeout_s=60))
        gpus = _wait(lambda: [d for d in _get(f"{url}/api/v1/devices?state=drain", token)["devices"]
                              if d["kind"] == "gpu"], 60)
        assert len(gpus) == 1 and gpus[0]["gpu_index"] == bad and gpus[0]["host"] == HOST, gpus
        gpu = gpus[0]
        assert gpu["device_id"] == f"gpu:{gpu['uuid']}" and gpu["evidence"] and gpu["since"] > 0
        # same auth as /api/v1/failures; a bad state names the values
        with pytest.raises(urllib.error.HTTPError) as unauthorized:
            _get(f"{url}/api/v1/devices?state=drain", None)
        assert unauthorized.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as bad_state:
            _get(f"{url}/api/v1/devices?state=drained", token)
        assert bad_state.value.code == 400 and b"healthy, watch, drain" in bad_state.value.read()
        # the healthy GPUs are not listed; another host's filter finds nothing
        healthy = _get(f"{url}/api/v1/devices?state=healthy", token)["devices"]
        assert {d["gpu_index"] for d in healthy if d["kind"] == "gpu"} == set(range(4)) - {bad}
        assert _get(f"{url}/api/v1/devices?state=drain&host=other-node", token)["devices"] == []

        out = tmp_path / "hook.txt"
        # No shell: a script that wants to redirect is given the fields as its arguments.
        hook = (f"sh -c 'printf \\\"%s|%s|%s|%s\\\\n\\\" \\\"$@\\\" >> {out}' hook {{host}} {{gpu_uuid}} {{gpu_index}} "
                "{root_cause}")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")

        log = stack.enter_context(open(tmp_path / "run.log", "a", encoding="utf-8"))

        def supervisor(policy_text):
            return Supervisor(["true"], "auto", load_policy_text(policy_text), None, "job-d", url, out=log,
                              verdict_token=token, local_host=HOST)

        # Default policy: drained devices are ignored (no hook, same devices).
        off = supervisor(f"hooks: {{exclude: \"{hook}\", exclude_gpu: true}}\n")
        assert not off.policy.devices.exclude_drained
        assert off.exclude_drained() == [] and off._cuda_env() == {} and not out.exists()
        on = supervisor(f"hooks: {{exclude: \"{hook}\", exclude_gpu: true}}\ndevices: {{exclude_drained: true}}\n")
        excluded = on.exclude_drained()
        node = f"node:{HOST}"
        assert {e["device_id"] for e in excluded} >= {gpu["device_id"]}
        assert set(out.read_text().splitlines()) >= {f"{HOST}|{gpu['uuid']}|{bad}|device_drain"}
        assert on._cuda_env() == {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(4) if i != bad)}
        # acted on once: the next restart does not run the hook again for the same drain
        lines = out.read_text()
        assert on.exclude_drained() == [] and out.read_text() == lines
        # the restart decision carries it (printed and recorded like the others)
        decision = on._decide(_Launch(), 0, 0, time.time() - 1,
                              {"rc": 1, "record": from_json({"failure_id": "f1", "kind": "crash",
                                                             "root_cause": "rank_process_died", "job_id": "job-d",
                                                             "onset_time": 1.0, "detected_time": 2.0,
                                                             "confidence": 0.9, "action": "auto_restart"}),
                               "trigger": "exit", "printed": True, "ended": time.time()})
        assert decision.decision == "restart" and decision.drained is None  # nothing new drained since
        fresh = supervisor("devices: {exclude_drained: true}\nhooks: {exclude_gpu: true}\n")
        decision = fresh._decide(_Launch(), 0, 0, time.time() - 1,
                                 {"rc": 1, "record": from_json({"failure_id": "f2", "kind": "crash",
                                                                "root_cause": "rank_process_died", "job_id": "job-d",
                                                                "onset_time": 1.0, "detected_time": 2.0,
                                                                "confidence": 0.9, "action": "auto_restart"}),
                                  "trigger": "exit", "printed": True, "ended": time.time()})
        assert decision.decision == "exclude_and_restart", decision
        assert [d["device_id"] for d in decision.drained] == [gpu["device_id"]]  # the node has no hook to go by
        assert f"without drained {gpu['device_id']}" in decision.reason
        log.flush()
        assert f"without drained {gpu['device_id']}" in (tmp_path / "run.log").read_text()
        assert node in {d["device_id"] for d in _get(f"{url}/api/v1/devices?state=drain", token)["devices"]}
        assert collector.stop() == 0


class _Launch:
    status = 1
    client = None

    @staticmethod
    def torchelastic_restarts():
        return 0


def test_default_config_routes_device_events_to_the_verdict_exporter_and_policy_errors_name_the_key():
    config = load_default()
    logs = [p for p in config.pipelines if p.signal is Signal.LOGS and "verdict" in p.exporters]
    assert logs and any("health" in p.processors for p in logs)
    assert load_policy_text("").devices.exclude_drained is False
    with pytest.raises(Exception, match="devices.exclude_draind: unknown setting.*exclude_drained"):
        load_policy_text("devices: {exclude_draind: true}")
    with pytest.raises(Exception, match="devices.at_start: needs exclude_drained"):
        load_policy_text("devices: {at_start: true}")
    assert isinstance(Decision("j", 0, 0, 0.0, "start", None, "exclude", "r", drained=[]), Decision)
