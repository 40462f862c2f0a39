"""``otel-gpu run --restart auto`` on real 2-rank gloo jobs under torchrun, against a real collector (attribution,
goodput, store, verdict API): a transient kill is restarted once and the job resumes from its checkpoint; a user error
is never restarted and its diagnosis comes within 5 s; a transient hang is stopped and restarted; the budget ends a
restart loop; with no collector the job runs once, plain.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from contextlib import closing

import pytest

from otel_gpu.exporters.store import db
from otel_gpu.commands.report import build_report, format_text
from otel_gpu.testing.restart_rig import RestartRig, free_port

HANG_TIMEOUT_S = 8.0
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """The collector's default hang timeout (15 s): a start-up slowed by a loaded machine is not taken for a hang."""
    with RestartRig(tmp_path_factory.mktemp("restart"), hang_timeout_s=15.0) as r:
        yield r


@pytest.fixture
def hang_rig(tmp_path):
    with RestartRig(tmp_path / "rig", hang_timeout_s=HANG_TIMEOUT_S) as r:
        yield r


class Run:
    """``otel-gpu run`` as a subprocess; every stderr line with the time it arrived."""

    def __init__(self, argv, env, timeout_s=480.0):  # generous: a loaded 2-core machine starts torch slowly
        self.lines: list[tuple[float, str]] = []
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, errors="replace")
        reader = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        reader.start()
        try:
            self.rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(5)
            raise AssertionError("otel-gpu run did not end:\n" + self.text[-6000:]) from None
        reader.join(10)

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.time(), line.rstrip("\n")))

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)

    def count(self, needle: str) -> int:
        return sum(needle in line for _, line in self.lines)


def _decisions(rig, job_id, timeout_s=10.0):
    deadline = time.time() + timeout_s
    while True:
        with closing(db.open_reader(rig.store)) as conn:
            found = db.restarts(conn, job_id)
        if (found and found[-1]["decision"] != "restart") or time.time() > deadline:
            return found
        time.sleep(0.3)


def _job() -> str:
    return f"restart-test-{uuid.uuid4().hex[:8]}"


def test_rank_killed_once_is_restarted_once_and_resumes_from_its_checkpoint(rig, tmp_path):
    job = _job()
    run = Run(rig.run_argv(["--restart", "auto", "--policy", str(_policy(tmp_path, ""))]),
              rig.job_env(fault="sigkill", rank=0, job_id=job, job_dir=tmp_path))
    assert run.rc == 0, run.text[-6000:]
    progress = rig.progress(tmp_path)
    starts = [p for p in progress if p["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [0, 10], progress  # checkpoint at step 9; fault at step 15
    assert [s["restart_count"] for s in starts] == ["0", "1"]
    assert progress[-1]["event"] == "done"
    assert run.count("-> RESTART") == 1 and run.count("-> DONE") == 1, run.text[-4000:]
    decisions = _decisions(rig, job)
    assert [d["decision"] for d in decisions] == ["restart", "done"], decisions
    assert decisions[0]["root_cause"] == "rank_process_died" and decisions[0]["action"] == "auto_restart"
    assert decisions[0]["culprit"]["rank"] == 0
    text = format_text(build_report(rig.store, job))
    assert "incarnations (job" in text and "rank_process_died -> auto_restart -> restart" in text, text


def test_value_error_is_never_restarted_and_the_diagnosis_comes_within_5_s(rig, tmp_path):
    job = _job()
    run = Run(rig.run_argv(["--restart", "auto"]),
              rig.job_env(fault="exception", once=False, job_id=job, job_dir=tmp_path))
    assert run.rc != 0
    progress = rig.progress(tmp_path)
    assert [p["event"] for p in progress if p["event"] != "first_step"] == ["launch", "start", "fault"], \
        progress  # one start: zero restarts
    crash = progress[-1]["t"]
    shown = run.first(f"CRASH in job {job}: rank 1 raised ValueError")
    assert shown is not None, run.text[-6000:]
    assert shown - crash <= 5.0, f"diagnosis {shown - crash:.1f} s after the crash"
    assert run.count("culprit: rank 1") >= 1 and run.count("-> STOP") == 1 and run.count("RESTART") == 0
    assert [d["decision"] for d in _decisions(rig, job)] == ["stop"]


def test_transient_hang_is_stopped_and_restarted_within_the_hang_timeout_plus_10_s(hang_rig, tmp_path):
    rig = hang_rig
    job = _job()
    policy = _policy(tmp_path, "hang: {decision: restart}\nbudget: {backoff_initial: 0.5s}\nstop_grace: 3s\n")
    run = Run(rig.run_argv(["--restart", "auto", "--policy", str(policy)]),
              rig.job_env(fault="hang", rank=1, job_id=job, job_dir=tmp_path))
    assert run.rc == 0, run.text[-6000:]
    progress = rig.progress(tmp_path)
    onset = next(p["t"] for p in progress if p["event"] == "fault")
    assert [p["resumed_from"] for p in progress if p["event"] == "start"] == [0, 10]
    assert progress[-1]["event"] == "done"
    decisions = _decisions(rig, job)
    assert [d["decision"] for d in decisions] == ["restart", "done"], decisions
    first = decisions[0]
    assert first["kind"] == "hang" and first["trigger"] == "hang" and first["culprit"]["rank"] == 1
    restarted_at = first["time"] + first["backoff_s"]
    assert restarted_at - onset <= HANG_TIMEOUT_S + 10.0, f"restarted {restarted_at - onset:.1f} s after onset"
    assert first["time_saved_s"] > 1700  # gloo's 30 min watchdog would have fired instead


def test_restart_loop_stops_at_the_budget(rig, tmp_path):
    job = _job()
    run = Run(rig.run_argv(["--restart", "auto", "--max-restarts", "1", "--policy",
                            str(_policy(tmp_path, "budget: {backoff_initial: 0.2s}\n"))]),
              rig.job_env(fault="sigkill", once=False, job_id=job, job_dir=tmp_path))
    assert run.rc != 0
    launches = [p for p in rig.progress(tmp_path) if p["event"] == "launch"]
    assert len(launches) == 2  # the first start and one restart
    assert [d["decision"] for d in _decisions(rig, job)] == ["restart", "give_up"]
    assert run.count("restart budget spent (1 per 60 min)") == 1, run.text[-4000:]


def test_policy_with_errors_exits_2_before_anything_starts(tmp_path):
    policy = _policy(tmp_path, "budget: {max_restarts: -2}\nhang: {decison: restart}\n"
                               "hooks: {exclude: 'scontrol drain {hots}'}\nactions: {gpu_xid: reboot}\n")
    marker = tmp_path / "started"
    done = subprocess.run([sys.executable, "-m", "otel_gpu", "run", "--restart", "auto", "--policy", str(policy),
                           "--", "touch", str(marker)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    for key in ("budget.max_restarts", "hang.decison", "did you mean 'decision'", "hooks.exclude", "{hots}",
                "actions.gpu_xid", "'reboot'"):
        assert key in done.stderr, done.stderr
    assert not marker.exists()


def test_unreachable_collector_runs_the_job_plain_and_never_restarts(tmp_path):
    rig = RestartRig(tmp_path / "rig", start_collector=False)  # its ports: free, nobody listens
    run = Run(rig.run_argv(["--restart", "auto"]), rig.job_env(fault="sigkill", job_dir=tmp_path / "job"))
    assert run.rc != 0
    assert [p["event"] for p in rig.progress(tmp_path / "job") if p["event"] != "first_step"] == \
        ["launch", "start", "fault"]
    assert run.count("WARNING: no verdict from the collector") == 1, run.text[-4000:]
    assert run.count("never restarting on a guess") == 1 and run.count("RESTART") == 0


def _policy(tmp_path, text: str):
    path = tmp_path / f"policy-{free_port()}.yaml"
    path.write_text(text)
    return path
