"""Goodput accounting: where a job's wall time went."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from otel_gpu.processors.goodput._ledger import JobLedger

T0 = 1_700_000_000.0
# Shrinking a failing timeline can take minutes; the failing example is printed either way.
_NO_LONG_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


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


def test_one_checkpoint_saved_by_eight_ranks_counts_once_inside_a_step_or_between_steps():
    for inside in (True, False):
        job = JobLedger("j", T0, T0)
        t = T0
        for step in range(4):
            ckpt = 5.0 if (inside and step == 2) else 0.0
            for rank in range(8):  # every rank reports the same step; the job counts it once
                job.touch(t + 1.0 + ckpt, 0)
                job.step(step, t, t + 1.0 + ckpt, 0.0, ckpt, 1.2)
            if ckpt:
                for rank in range(8):  # and every rank's checkpoint span, inside that step
                    job.checkpoint("save", t + 1.0, t + 6.0)
            t += 1.0 + ckpt
            if step == 1 and not inside:
                for rank in range(8):
                    job.checkpoint("save", t, t + 5.0)
                t += 5.0
                job.touch(t, 0)
        s = job.summary()
        assert s["badput_s"]["checkpoint_save"] == 5.0, (inside, s)
        assert abs(s["productive_time_s"] - 4.0) < 1e-6
        assert abs(s["productive_time_s"] + sum(s["badput_s"].values()) - s["wall_time_s"]) < 1e-6


@st.composite
def _timelines(draw):
    """A job: incarnations of steps (some with data and checkpoint time), checkpoint spans from every rank (inside a
    step or between steps), restores at start-up, failures (revised, withdrawn), restarts; events in time order,
    ranks in any order."""
    ranks = draw(st.integers(1, 8))
    events, t = [], T0
    for inc in range(draw(st.integers(1, 3))):
        t += draw(st.floats(0.0, 20.0))
        events.append(("touch", t, inc))
        if draw(st.booleans()):
            d = draw(st.floats(0.1, 5.0))
            for _ in range(ranks):
                events.append(("ckpt", "load", t, t + d, inc))
            t += d
        t += draw(st.floats(0.0, 10.0))
        fid = 0
        for step in range(draw(st.integers(0, 25))):
            d = draw(st.floats(0.05, 3.0))
            data = draw(st.floats(0.0, 1.0)) * d * 0.5
            ckpt = draw(st.sampled_from([0.0, 0.0, 0.0, 0.3])) * d
            jitter = [draw(st.floats(0.0, 0.02)) for _ in range(ranks)]
            for r in draw(st.permutations(range(ranks))):
                events.append(("step", step, t + jitter[r], t + d + jitter[r], data, ckpt, inc))
            if ckpt:
                for r in range(ranks):
                    events.append(("ckpt", "save", t + d - ckpt, t + d, inc))
            t += d + max(jitter)
            if draw(st.integers(0, 9)) == 0:  # a save between steps
                c = draw(st.floats(0.1, 4.0))
                for r in range(ranks):
                    events.append(("ckpt", "save", t, t + c, inc))
                t += c
            t += draw(st.floats(0.0, 0.5))
            if draw(st.integers(0, 14)) == 0:
                fid += 1
                kind = draw(st.sampled_from(["hang", "crash", "slowdown"]))
                name = f"{inc}-{fid}"
                events.append(("failure", kind, t - 0.5, t + 2.0, name, False))
                if draw(st.booleans()):
                    events.append(("failure", kind, t - 0.5, t + 3.0, name, False))  # a revision
                if kind == "hang" and draw(st.booleans()):
                    events.append(("failure", kind, t - 0.5, t + 4.0, name, True))  # withdrawn
        t += draw(st.floats(0.0, 10.0))
        events.append(("touch", t, inc))
    return events


def replay(events) -> JobLedger:
    """A ledger fed one of :func:`_timelines`, as the processor feeds it."""
    job = JobLedger("j", events[0][1], events[0][1])
    for e in events:
        if e[0] == "touch":
            job.touch(e[1], e[2])
        elif e[0] == "step":
            _, step, start, end, data, ckpt, inc = e
            job.touch(start, inc)
            job.touch(end, inc)
            job.step(step, start, end, data, ckpt, 1.2, restart_count=inc)
        elif e[0] == "ckpt":
            _, kind, start, end, inc = e
            job.touch(start, inc)
            job.touch(end, inc)
            job.checkpoint(kind, start, end, restart_count=inc)
        else:
            _, kind, onset, detected, fid, withdrawn = e
            job.failure(kind, onset, detected, failure_id=fid, withdrawn=withdrawn)
    return job


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], phases=_NO_LONG_SHRINK)
@given(_timelines())
def test_buckets_and_productive_time_add_up_to_wall_time_per_job_and_per_incarnation(events):
    s = replay(events).summary()
    assert all(v >= -1e-6 for v in s["badput_s"].values()), s
    assert s["productive_time_s"] >= -1e-6
    assert abs(s["productive_time_s"] + sum(s["badput_s"].values()) - s["wall_time_s"]) < 0.02, s
    assert abs(sum(i["wall_time_s"] for i in s["incarnations"]) - s["wall_time_s"]) < 0.02, s
    for inc in s["incarnations"]:
        assert all(v >= -1e-6 for v in inc["badput_s"].values()), inc
        assert abs(inc["productive_time_s"] + sum(inc["badput_s"].values()) - inc["wall_time_s"]) < 0.02, inc
    assert s["ettr"] is None or 0.0 <= s["ettr"] <= 1.0
    assert _overfull_s(s) < 0.02, s  # each second counted once, where it happened (the picture draws these bins)


def test_wasted_progress_is_what_came_after_the_last_save_in_time_whatever_the_order_spans_arrive_in():
    """Spans come in batches per rank: a save at step 20 may be seen before steps 11-20 are. Only steps that ended
    after the save (21-25) are lost when the job fails at step 25 (the demo once showed ETTR 0%)."""
    for save_first in (True, False):
        job = JobLedger("j", T0, T0)
        steps = [(s, T0 + s, T0 + s + 1.0) for s in range(25)]  # step s runs [s, s+1)
        save = (T0 + 20.0, T0 + 20.0)  # saved between step 19 and step 20
        if save_first:
            for s, a, b in steps[:10]:
                job.step(s, a, b, 0.0, 0.0, 10.0)
            job.checkpoint("save", save[0], save[1] + 0.001)
            for s, a, b in steps[10:]:
                job.step(s, a, b, 0.0, 0.0, 10.0)
        else:
            for s, a, b in steps:
                job.step(s, a, b, 0.0, 0.0, 10.0)
            job.checkpoint("save", save[0], save[1] + 0.001)
        job.failure("crash", onset=T0 + 25.0, detected=T0 + 25.5)
        summary = job.summary(T0 + 26.0)
        assert summary["badput_s"]["wasted_progress"] == pytest.approx(5.0, abs=0.01), save_first
        assert summary["productive_time_s"] == pytest.approx(20.0, abs=0.01), save_first


def test_the_processor_keeps_a_long_first_step_that_is_not_first_in_its_batch_inside_the_wall_time():
    """A rank's first step span starts when the instrumentation does (start-up included) and a batch is in no
    particular order: the job's wall time must still begin there (a real 4-rank torchrun job reported ETTR 141%)."""
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.component import ComponentHost
    from otel_gpu.config import build
    from otel_gpu.otlp_build import SpansBuilder
    from otel_gpu.pdata import Batch, Signal
    from otel_gpu.processors.goodput import GoodputConfig, GoodputProcessor
    from otel_gpu.schema import identity as I
    from otel_gpu.schema import training as T

    proc = GoodputProcessor(build(GoodputConfig, {}, "processors.goodput"),
                            ComponentHost("goodput", PrometheusSelfTelemetry(), {}))
    t0 = time.time() - 60.0  # live spans: inside the window around receipt (time_window_past / _future)
    for rank in range(4):
        spans = SpansBuilder({str(I.JOB_ID): "job-early", str(I.RANK): rank})
        for step in range(1, 20):  # steps 1-19 of 0.25 s, then the 3 s first step, last in the batch
            start = t0 + step * 0.25
            spans.span(T.STEP_SPAN.name, int(start * 1e9), int((start + 0.25) * 1e9), {str(T.STEP): step})
        spans.span(T.STEP_SPAN.name, int((t0 - 2.75) * 1e9), int((t0 + 0.25) * 1e9), {str(T.STEP): 0})
        proc.process(Batch.from_message(Signal.TRACES, spans.build()))
    (summary,) = proc.summaries()
    assert summary["wall_time_s"] == pytest.approx(7.75) and summary["ettr"] <= 1.0, summary
    assert abs(summary["productive_time_s"] + sum(summary["badput_s"].values()) - summary["wall_time_s"]) < 1e-3


def _overfull_s(summary) -> float:
    """Seconds the timeline's bins hold beyond their width (time counted twice), over all incarnations."""
    tl, excess = summary["timeline"], 0.0
    for inc in tl["incarnations"]:
        bins: dict[int, float] = {}
        for first, values in inc["seconds"].values():
            for j, v in enumerate(values):
                bins[first + j] = bins.get(first + j, 0.0) + v
        excess += sum(max(0.0, v - tl["bin_s"]) for v in bins.values())
    return excess


def test_a_restarted_jobs_gap_ends_at_its_earliest_span_whatever_span_arrives_first():
    """The restarted ranks' first batch need not start with their first span: the gap ends at the earliest activity
    of the new incarnation, and no second is counted twice (a real restart demo counted 1.3 s of its first steps
    in the restart gap too)."""
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.component import ComponentHost
    from otel_gpu.config import build
    from otel_gpu.otlp_build import SpansBuilder
    from otel_gpu.pdata import Batch, Signal
    from otel_gpu.processors.goodput import GoodputConfig, GoodputProcessor
    from otel_gpu.schema import identity as I
    from otel_gpu.schema import training as T

    proc = GoodputProcessor(build(GoodputConfig, {}, "processors.goodput"),
                            ComponentHost("goodput", PrometheusSelfTelemetry(), {}))
    t0 = time.time() - 60.0  # live spans: inside the window around receipt (time_window_past / _future)

    def batch(restart: int, steps: list[tuple[int, float, float]]) -> None:
        spans = SpansBuilder({str(I.JOB_ID): "job-r", str(I.RANK): 0, str(I.RESTART_COUNT): restart})
        for step, a, b in steps:
            spans.span(T.STEP_SPAN.name, int(a * 1e9), int(b * 1e9), {str(T.STEP): step})
        proc.process(Batch.from_message(Signal.TRACES, spans.build()))

    batch(0, [(s, t0 + s, t0 + s + 1) for s in range(10)])  # 10 s of steps, then the job dies
    later = [(s, t0 + 20 + s, t0 + 21 + s) for s in range(10)]  # restarted 10 s later, at t0 + 20
    batch(1, later[5:] + later[:5])  # steps 5-9 first in the batch, then 0-4
    (summary,) = proc.summaries()
    inc0, inc1 = summary["incarnations"]
    assert inc1["badput_s"]["restart_gap"] == pytest.approx(10.0, abs=0.01), inc1
    assert summary["productive_time_s"] == pytest.approx(20.0, abs=0.01)
    assert summary["badput_s"]["other"] == pytest.approx(0.0, abs=0.01)
    assert _overfull_s(summary) < 1e-3


def test_node_signals_stamped_with_the_job_after_it_ended_do_not_lengthen_its_wall_time(monkeypatch):
    """A node sidecar stamps its GPU and NIC metrics and XID events with the job for ``job_idle_s`` (120 s) after
    the job's last record, and with the configured job id for as long as it runs: they say which job the node
    serves, not that the job still runs. A 10 s job that crashed read ETTR 0.9% on a real host (wall time up to the
    sidecar's horizon). A rank's own metrics, heartbeats and its launcher's exit event do keep the job alive."""
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.component import ComponentHost
    from otel_gpu.config import build
    from otel_gpu.otlp_build import LogsBuilder, MetricsBuilder, SpansBuilder
    from otel_gpu.pdata import Batch, Signal
    from otel_gpu.processors.goodput import GoodputConfig, GoodputProcessor
    from otel_gpu.processors.goodput import processor as goodput_module
    from otel_gpu.schema import gpu as G
    from otel_gpu.schema import identity as I
    from otel_gpu.schema import training as T

    clock = [time.time() - 300.0]
    monkeypatch.setattr(goodput_module, "time", type("Clock", (), {"time": staticmethod(lambda: clock[0])}))
    proc = GoodputProcessor(build(GoodputConfig, {}, "processors.goodput"),
                            ComponentHost("goodput", PrometheusSelfTelemetry(), {}))
    t0 = clock[0]
    node = {str(I.JOB_ID): "job-done", str(I.HOST_NAME): "node-7"}
    for rank in range(2):
        spans = SpansBuilder({**node, str(I.RANK): rank})
        for step in range(40):  # 10 s of 0.25 s steps
            start = t0 + step * 0.25
            spans.span(T.STEP_SPAN.name, int(start * 1e9), int((start + 0.25) * 1e9), {str(T.STEP): step})
        clock[0] = t0 + 10.0
        proc.process(Batch.from_message(Signal.TRACES, spans.build()))
    # The launcher says rank 1 ended at 10.5 s (its resource names the job, not a rank).
    clock[0] = t0 + 10.5
    exits = LogsBuilder({**node, str(I.RANK): 1})
    exits.event(T.EXIT_EVENT, {"exit_code": 1}, time_ns=int(clock[0] * 1e9))
    proc.process(Batch.from_message(Signal.LOGS, exits.build()))
    # Then two minutes of the node's GPU metrics and an XID on one of its GPUs, stamped with the job.
    for second in range(11, 131):
        clock[0] = t0 + second
        metrics = MetricsBuilder(node, time_ns=int(clock[0] * 1e9))
        metrics.gauge("hw.gpu.utilization", 0.0, {str(I.GPU_INDEX): 0})
        proc.process(Batch.from_message(Signal.METRICS, metrics.build()))
        if second == 60:
            xid = LogsBuilder(node)
            xid.event(G.XID_EVENT, {"xid": 13}, time_ns=int(clock[0] * 1e9))
            proc.process(Batch.from_message(Signal.LOGS, xid.build()))
    (summary,) = proc.summaries()
    assert summary["wall_time_s"] == pytest.approx(10.5), summary
    assert summary["ettr"] == pytest.approx(10.0 / 10.5, abs=1e-3), summary
    # A rank's own metrics are the job's activity: they do count.
    rank_metrics = MetricsBuilder({**node, str(I.RANK): 0}, time_ns=int(clock[0] * 1e9))
    rank_metrics.gauge("otel_gpu.training.step.duration", 0.25)
    proc.process(Batch.from_message(Signal.METRICS, rank_metrics.build()))
    (summary,) = proc.summaries()
    assert summary["wall_time_s"] == pytest.approx(130.0), summary
