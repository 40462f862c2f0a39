"""Goodput across restarts (processors/goodput ledger): per incarnation, the restart gap before it and the progress
lost since the last checkpoint, whatever order the ranks' spans arrive in."""
from __future__ import annotations

from otel_gpu.processors.goodput._ledger import JobLedger


def test_per_incarnation_gap_and_wasted_progress_with_spans_out_of_order():
    ledger = JobLedger("job", 100.0, 100.0, 0)
    ledger.checkpoint("save", 109.9, 110.0, inside_step=False)  # rank 0's checkpoint arrives before the steps
    for step in range(15):  # steps 0..14, 1 s each, from 100 s
        ledger.touch(101.0 + step, 0)
        ledger.step(step, 100.0 + step, 101.0 + step, 0.0, 0.0, ratio=1.5)
    ledger.failure("crash", 115.2, 116.0)  # steps 10..14 ended after the checkpoint: 5 s lost
    ledger.touch(130.0, 1)  # the next incarnation's first record: 14 s after the failure was detected
    for step in range(10, 20):
        ledger.step(step, 130.0 + step - 10, 131.0 + step - 10, 0.0, 0.0, ratio=1.5)
        ledger.touch(131.0 + step - 10, 1)
    summary = ledger.summary()
    first, second = summary["incarnations"]
    assert (first["restart_count"], first["productive_s"], first["wasted_s"]) == (0, 10.0, 5.0)
    assert (second["restart_count"], second["restart_gap_s"], second["productive_s"]) == (1, 14.0, 10.0)
    assert summary["badput_s"]["wasted_progress"] == 5.0 and summary["badput_s"]["restart_gap"] == 14.0
    assert summary["productive_time_s"] == 20.0
