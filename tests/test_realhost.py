"""The user's first try, on the real machine the tests run on: ``otel-gpu collector`` with its *default* config (real
``/sys``, ``/proc``, no fakes; only the listening ports moved to free ones) and a plain DDP script under
``otel-gpu run -- torchrun --standalone --nproc-per-node 4``, where one rank raises, is SIGKILLed, or sleeps before a
collective. The verdict read back through ``otel-gpu report`` must name that cause and that rank (0 included), and
never blame the machine: CI machines have down, never-used interfaces (ifb0/ifb1, docker0, ...) that are not the
job's, so ``nic_link_down`` / ``exclude_node_and_restart`` would be a false accusation.

These never skip (not under CI either): they need only torch and the machine itself.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch  # noqa: F401 - the job needs it; a missing torch must fail here, not skip

from collector_proc import free_port, start_collector
from otel_gpu.collector.config import DEFAULT_CONFIG_TEXT
from otel_gpu.commands.report import build_report

HERE = Path(__file__).parent
SCRIPT = HERE / "dist_jobs" / "plain_ddp.py"
WORLD = 4
_SEED = int(os.environ.get("OTEL_GPU_TEST_SEED") or random.randrange(1 << 30))

# fault -> (kind, root_cause) the default pipeline must give
EXPECTED = {
    "exception": ("crash", "python_exception"),
    "sigkill": ("crash", "rank_process_died"),
    "sleep": ("hang", "rank_not_in_collective"),
}


def default_config(grpc: int, http: int, prometheus: int) -> str:
    """The built-in default config, byte for byte, except the three loopback ports (parallel runs must not collide)."""
    text = DEFAULT_CONFIG_TEXT
    for old, new in (("127.0.0.1:4317", grpc), ("127.0.0.1:4318", http), ("127.0.0.1:9464", prometheus)):
        assert old in text, f"the default config no longer listens on {old}; update this test"
        text = text.replace(old, f"127.0.0.1:{new}")
    return text


def torchrun() -> list[str]:
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def down_interfaces() -> list[str]:
    out = []
    for iface in sorted(Path("/sys/class/net").glob("*")):
        try:
            if (iface / "operstate").read_text().strip() == "down":
                out.append(iface.name)
        except OSError:
            pass
    return out


def live_failures(store: Path) -> list[dict]:
    try:
        failures = build_report(str(store), limit=None)["failures"]
    except Exception:  # noqa: BLE001 - the store appears a moment after the collector starts
        return []
    return [f for f in failures if f.get("status") != "withdrawn"]


def run_case(tmp_path: Path, fault: str, culprit: int) -> tuple[list[dict], str, str]:
    """Runs one job under the default collector; returns (failures, report text, job output)."""
    grpc, http, prom = free_port(), free_port(), free_port()
    collector = start_collector(default_config(grpc, http, prom), tmp_path / "collector", timeout_s=60)
    store = tmp_path / "collector" / "otel-gpu-data"
    log_path = tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "otel_gpu", "run", "--endpoint", f"http://127.0.0.1:{grpc}", "--", *torchrun(),
           "--standalone", f"--nproc-per-node={WORLD}", str(SCRIPT), "--fault", fault, "--rank", str(culprit)]
    with open(log_path, "wb") as log:
        job = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        exited_at = None
        while time.monotonic() < deadline:
            if live_failures(store):
                time.sleep(2.5)  # a second (wrong) record has a moment to show
                break
            if exited_at is None and job.poll() is not None:
                exited_at = time.monotonic()
            if exited_at is not None and time.monotonic() - exited_at > 10:
                break
            time.sleep(0.25)
        failures = live_failures(store)  # before the test's own stop of the job, which is no fault
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait(5)
        report = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(store)],
                                capture_output=True, text=True, timeout=60)
        collector.stop()
    return failures, report.stdout + report.stderr, log_path.read_text(errors="replace")[-4000:]


@pytest.mark.parametrize("fault", list(EXPECTED))
def test_default_config_on_this_machine_names_the_rank_not_the_node(fault, tmp_path):
    culprit = random.Random(f"{_SEED}-{fault}").randrange(WORLD)  # rank 0 included
    failures, report, job_output = run_case(tmp_path, fault, culprit)
    context = (f"seed={_SEED} fault={fault} culprit={culprit} down interfaces here: {down_interfaces()}\n"
               f"--- otel-gpu report ---\n{report}\n--- job output ---\n{job_output}")
    assert failures, f"no failure recorded\n{context}"
    for f in failures:  # never the machine: no healthy node may be drained for a software fault
        assert f["root_cause"] not in ("nic_link_down", "nic_errors"), context
        assert f["action"] != "exclude_node_and_restart", context
        assert not any(str(e).startswith(("nic.", "hw.network")) for e in f.get("evidence") or ()), context
    assert len(failures) == 1, f"one fault, {len(failures)} verdicts: " \
                               f"{[(f['kind'], f['root_cause'], f['culprit']) for f in failures]}\n{context}"
    (found,) = failures
    assert (found["kind"], found["root_cause"]) == EXPECTED[fault], context
    assert found["culprit"]["rank"] == culprit, context
    assert json.dumps(found)  # the record is the JSON contract
