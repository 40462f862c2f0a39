"""Exit truth whoever the parent is, and frozen ranks, with real processes under the real ``otel-gpu run``: a parent
that reaps late (Lightning polls every 5 s) still yields the exact signal, stamped with when the rank died; an
orphan whose parent exited first is reaped by ``otel-gpu run`` (its subreaper) with its exact code; a rank gone with
no status anyone could read is "vanished", never clean; a SIGSTOPped rank is reported frozen with its state and wait
channel, and running again after SIGCONT."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from otel_gpu.instrumentation import _procstate, _registry
from otel_gpu.instrumentation.launcher import ExitWatcher
from otel_gpu.testing.otlp_sink import OtlpSink

PY = sys.executable


def _attrs(record) -> dict:
    out = {}
    for kv in record.attributes:
        v = kv.value
        out[kv.key] = v.string_value if v.HasField("string_value") else v.int_value if v.HasField("int_value") \
            else None
    return out


def _exits(sink: OtlpSink) -> dict[int, tuple[dict, float]]:
    """rank -> (attributes, record time in unix seconds) of the launcher's exit records."""
    out = {}
    for lr in sink.log_records():
        if lr.event_name == "otel_gpu.process.exit":
            a = _attrs(lr)
            if a.get("training.rank") is not None:
                out[a["training.rank"]] = (a, lr.time_unix_nano / 1e9)
    return out


def _otel_gpu_run(sink: OtlpSink, script: str, tmp_path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ, OTEL_GPU_JOB_ID="exit-truth", PYTHONUNBUFFERED="1")
    return subprocess.run([PY, "-m", "otel_gpu", "run", "--endpoint", f"http://{sink.endpoint}", "--", PY, str(path),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=timeout_s)


def test_a_rank_killed_under_a_parent_that_reaps_late_gets_its_signal_and_its_time_of_death(tmp_path):
    """A Lightning-shaped parent (not a rank itself here): it Popens rank 1, which SIGKILLs itself; the parent
    reaps it 4 s later."""
    script = """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import os, signal, sys, time; time.sleep(0.5); open(sys.argv[1] + '/died', 'w').write(repr(time.time()));"
            "os.kill(os.getpid(), signal.SIGKILL)", sys.argv[1]], env=dict(os.environ, RANK="1"))
        time.sleep(4.0)
        child.wait()
        open(sys.argv[1] + "/reaped", "w").write(repr(time.time()))
    """
    with OtlpSink() as sink:
        done = _otel_gpu_run(sink, script, tmp_path)
        assert done.returncode == 0, done.stderr
        assert sink.wait_for(lambda s: 1 in _exits(s), timeout_s=10), done.stderr
        attrs, t = _exits(sink)[1]
    assert (attrs["process.exit.signal"], attrs["process.exit.code"], attrs["process.exit.how"]) == (
        "SIGKILL", -9, "killed")
    died = float((tmp_path / "died").read_text())
    reaped = float((tmp_path / "reaped").read_text())
    assert died <= t < died + 1.0 < reaped  # when it died, not when its parent got round to reaping it


def test_an_orphan_is_reaped_by_otel_gpu_run_with_its_exact_exit_code(tmp_path):
    """The rank's parent exits first (as Lightning's rank 0 when it is killed): the rank ends later with os._exit(3),
    which leaves no record of its own; only its reaper can know the code."""
    script = """
        import os, subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(1.5); os._exit(3)"],
                         env=dict(os.environ, RANK="2"))
        os._exit(0)  # the parent goes first, without waiting
    """
    with OtlpSink() as sink:
        done = _otel_gpu_run(sink, script, tmp_path)
        assert done.returncode == 0, done.stderr
        assert sink.wait_for(lambda s: 2 in _exits(s), timeout_s=10), done.stderr
        attrs, _ = _exits(sink)[2]
    assert (attrs["process.exit.code"], attrs["process.exit.how"]) == (3, "exited")
    assert "vanished" not in done.stderr


def test_a_rank_gone_with_no_status_anyone_could_read_is_vanished_never_clean(tmp_path):
    """The watcher sees the rank only after its uninstrumented parent reaped it: nothing is left to read."""
    folder = str(tmp_path)
    child = subprocess.Popen([PY, "-c", "import os; os._exit(0)"])
    child.wait()  # reaped here, by a parent that writes no record
    _registry.write_proc(folder, {"pid": child.pid, "ppid": os.getpid(), "role": "rank", "rank": 1})
    (rep,) = ExitWatcher(folder, grace_s=0).scan()
    assert (rep["how"], rep["code"], rep["signal"], rep["source"]) == ("vanished", None, None, "vanished")


def test_the_watcher_reads_a_zombies_exact_status_before_its_parent_reaps_it(tmp_path):
    folder = str(tmp_path)
    child = subprocess.Popen([PY, "-c", "import os; os._exit(7)"])
    deadline = time.monotonic() + 10
    while _procstate.read_stat(child.pid).state != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    _registry.write_proc(folder, {"pid": child.pid, "ppid": os.getpid(), "role": "rank", "rank": 0})
    (rep,) = ExitWatcher(folder, grace_s=5.0).scan()  # no waiting for a record: the kernel said it
    child.wait()
    assert (rep["code"], rep["source"], rep["how"], rep.get("no_atexit")) == (7, "kernel", "exited", True)


def test_a_stopped_rank_is_reported_frozen_with_its_wait_channel_and_running_again_after_sigcont():
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        watch = _procstate.FrozenRanks(frozen_after_s=0.3, interval_s=0.0)
        procs = {proc.pid: {"rank": 3}}
        time.sleep(0.3)
        assert watch.check(procs, time.time()) == []  # sleeping (S) is not frozen
        os.kill(proc.pid, signal.SIGSTOP)
        reports, deadline = [], time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.1)
            reports = watch.check(procs, time.time())
        (rep,) = reports
        assert (rep["rank"], rep["state"], rep["how"], rep["wchan"], rep["resumed"]) == (
            3, "T", "stopped", "do_signal_stop", False)
        assert watch.check(procs, time.time() + 5) == []  # once per transition
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.3)
        (back,) = watch.check(procs, time.time())
        assert back["resumed"] is True and back["state"] in ("S", "R") and back["how"] is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("state, wchan, stack, expected", [
    ("T", "do_signal_stop", "", "stopped"),
    ("t", "ptrace_stop", "", "stopped"),
    ("D", "os_wait_uninterruptible", "", "gpu_driver"),
    ("D", "_nv012345rm", "", "gpu_driver"),
    ("D", "uvm_spin_loop", "", "gpu_driver"),
    ("D", "", "os_acquire_spinlock+0x12/0x30 [nvidia]\nioctl+0x1/0x2", "gpu_driver"),
    ("D", "nvme_poll", "", "uninterruptible"),  # nvme is a disk, not the GPU
    ("D", "nfs_wait_bit_killable", "", "uninterruptible"),
    ("S", "hrtimer_nanosleep", "", None),
    ("R", "", "", None),
])
def test_a_frozen_state_is_told_apart_by_state_wait_channel_and_kernel_stack(state, wchan, stack, expected):
    assert _procstate.frozen_how(state, wchan, stack) == expected
