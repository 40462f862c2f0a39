"""Goodput accounting: where a job's wall time went."""
from __future__ import annotations

from otel_gpu.processors.goodput._ledger import JobLedger

T0 = 1_700_000_000.0


def test_startup_steps_checkpoint_slowdown_and_hang_add_up_to_wall_time():
    job = JobLedger("j", T0, T0)
    t = T0 + 10.0  # 10 s of start-up before the first step
    for step in range(20):
        duration = 1.0 if step < 15 else 3.0  # the last 5 steps are 2 s too slow
        job.step(step, t, t + duration, data_s=0.1, ckpt_s=0.0, ratio=1.2)
        t += duration
        job.touch(t, 0)
        if step == 9:
            job.checkpoint("save", t, t + 2.0, inside_step=False)
            t += 2.0
    job.failure("hang", onset=t, detected=t + 15.0)
    job.touch(t + 20.0, 0)
    s = job.summary()
    b = s["badput_s"]
    assert b["startup"] == 10.0
    assert b["checkpoint_save"] == 2.0
    assert abs(b["data_loading"] - 2.0) < 1e-6
    assert abs(b["slowdown"] - 5 * 2.0) < 1e-6
    assert abs(b["hang"] - 20.0) < 1e-6
    # 10 steps after the checkpoint (0.9 s productive each, minus nothing) are wasted by the hang.
    assert abs(b["wasted_progress"] - (5 * 0.9 + 5 * 0.9)) < 1e-6
    assert abs(s["productive_time_s"] - 10 * 0.9) < 1e-6
    total = s["productive_time_s"] + sum(b.values())
    assert abs(total - s["wall_time_s"]) < 1e-3
    assert abs(s["ettr"] - s["productive_time_s"] / s["wall_time_s"]) < 1e-3


def test_restart_gap_is_counted_once_per_new_incarnation():
    job = JobLedger("j", T0, T0)
    job.step(0, T0, T0 + 1, 0.0, 0.0, 1.2)
    job.touch(T0 + 1, 0)
    job.failure("crash", T0 + 1, T0 + 1.5)
    job.touch(T0 + 31.5, 1)  # the restarted ranks report 30 s later
    assert abs(job.summary()["badput_s"]["restart_gap"] - 30.0) < 1e-6
    assert job.summary()["restarts"] == 1
