"""Goodput across restarts (processors/goodput ledger): per incarnation, the restart gap that leads to it and the
progress lost since the last checkpoint."""
from __future__ import annotations

from otel_gpu.processors.goodput._ledger import JobLedger


def test_per_incarnation_restart_gap_and_progress_lost_since_the_checkpoint():
    ledger = JobLedger("job", 100.0, 100.0, 0)
    for step in range(15):  # steps 0..14, 1 s each, from 100 s; a checkpoint saved after step 9
        ledger.touch(101.0 + step, 0)
        ledger.step(step, 100.0 + step, 101.0 + step, 0.0, 0.0, ratio=1.5)
        if step == 9:
            ledger.checkpoint("save", 110.0, 110.0001)
    ledger.failure("crash", 115.2, 116.0, failure_id="f1")  # steps 10..14 are lost: 5 s
    ledger.touch(130.0, 1)  # the next incarnation (restart_count 1): 14 s after the failure was detected
    for step in range(10, 20):
        ledger.step(step, 130.0 + step - 10, 131.0 + step - 10, 0.0, 0.0, ratio=1.5)
        ledger.touch(131.0 + step - 10, 1)
    summary = ledger.summary()
    first, second = summary["incarnations"]
    assert (first["restart_count"], first["productive_time_s"], first["badput_s"]["wasted_progress"]) == (0, 10.0, 5.0)
    assert (second["restart_count"], second["badput_s"]["restart_gap"], second["productive_time_s"]) == (1, 14.0, 10.0)
    assert summary["badput_s"]["wasted_progress"] == 5.0 and summary["badput_s"]["restart_gap"] == 14.0
