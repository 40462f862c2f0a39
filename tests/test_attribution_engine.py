"""The attribution engine's decisions on synthetic observation streams (deterministic, no processes).

The real multi-process proof is tests/test_attribution_scenarios.py; these pin the rules: first cause wins,
consequences are not culprits, hardware outranks its software symptom, no false alarms on noise.
"""
from __future__ import annotations

import random

from otel_gpu.processors.attribution._engine import Engine
from otel_gpu.processors.attribution.config import AttributionConfig
from otel_gpu.processors.attribution._observations import (ExceptionSeen, ExitSeen, GpuSample, Heartbeat, Identity,
                                                           Inflight, NicSample, Stacks, StepSeen, XidSeen)

T0 = 1_700_000_000.0
WORLD = 4


def who(rank: int, job: str = "job-1") -> Identity:
    return Identity(job, rank, host=f"node{rank // 2}", pid=1000 + rank, local_rank=rank % 2, world_size=WORLD)


def heartbeats(engine, t, stuck_ranks, seq, *, culprit=None, culprit_started=None, op="all_reduce", nbytes=1024,
               ops=None):
    for r in range(WORLD):
        if r in stuck_ranks:
            inflight = Inflight("collective", (ops or {}).get(r, op), "0", seq, T0 + 10, (ops or {}).get(f"b{r}", nbytes))
            hb = Heartbeat(who(r), t, 7, "collective", inflight, {"0": seq - 1}, {"0": seq})
        else:
            started = culprit_started if culprit_started is not None else seq - 1
            hb = Heartbeat(who(r), t, 7, "step", None, {"0": started}, {"0": started})
        engine.observe_heartbeat(hb, t)


def run_until(engine, start, end, feed=None, dt=0.5):
    t, out = start, []
    while t <= end:
        if feed:
            feed(t)
        out += [(t, r) for r in engine.tick(t)]
        t += dt
    return out


def test_hang_names_the_rank_that_never_reached_the_collective_with_its_stack():
    engine = Engine(AttributionConfig(hang_timeout_s=10))
    engine.observe_stacks(Stacks(who(2), T0 + 12, "train.py:40 main", [
        {"file": "/work/train.py", "line": 40, "function": "main"},
        {"file": "/usr/lib/python3.11/time.py", "line": 1, "function": "sleep"}]), T0 + 12)
    found = run_until(engine, T0 + 10, T0 + 30, lambda t: heartbeats(engine, t, {0, 1, 3}, 41))
    assert len(found) == 1
    t, rec = found[0]
    assert rec.kind.value == "hang" and rec.root_cause.value == "rank_not_in_collective"
    assert rec.culprit.rank == 2 and rec.culprit.host == "node1"
    assert rec.category.value == "user" and rec.action.value == "user_fix"
    assert T0 + 20 <= t <= T0 + 25, "attributed within timeout + 5 s of onset"
    assert "all_reduce seq 41" in rec.summary and "train.py:40" in rec.summary


def test_a_rank_that_reached_the_stuck_collective_later_waits_too():
    """Ranks 1 and 3 enter all_reduce seq 41 at T0+10, rank 2 four seconds later (a slower step), rank 0 never:
    when the hang is named (rank 0's stack in), all three wait for rank 0, not only the two stuck the longest."""
    engine = Engine(AttributionConfig(hang_timeout_s=10))
    engine.observe_stacks(Stacks(who(0), T0 + 15, "train.py:40 main", [
        {"file": "/work/train.py", "line": 40, "function": "main"}]), T0 + 15)

    def feed(t):
        for r in range(WORLD):
            entered = {1: T0 + 10, 3: T0 + 10, 2: T0 + 14}.get(r)
            if entered is not None and t >= entered:
                hb = Heartbeat(who(r), t, 7, "collective", Inflight("collective", "all_reduce", "0", 41, entered, 1024),
                               {"0": 40}, {"0": 41})
            else:
                hb = Heartbeat(who(r), t, 7, "step", None, {"0": 40}, {"0": 40})
            engine.observe_heartbeat(hb, t)

    found = run_until(engine, T0 + 10, T0 + 30, feed)
    assert len(found) == 1
    t, rec = found[0]
    assert t < T0 + 24, "named before rank 2 itself had waited the hang timeout"
    assert rec.culprit.rank == 0 and rec.root_cause.value == "rank_not_in_collective"
    assert "3 rank(s) wait for it" in rec.summary, rec.summary
    assert "stuck_ranks=1,2,3" in rec.evidence
    assert [w["rank"] for w in rec.details["waiting"]] == [1, 2, 3]

def test_crash_first_cause_wins_and_peer_failures_are_consequences():
    engine = Engine(AttributionConfig(crash_settle_s=1.0))
    for r in range(WORLD):
        engine.observe_heartbeat(Heartbeat(who(r), T0, 3, "step", None), T0)
    # Ranks 0, 1, 3 fail in the next collective *before* the launcher reports rank 3's SIGKILL... no: rank 1 dies.
    for r in (0, 2, 3):
        engine.observe_exception(ExceptionSeen(who(r), T0 + 0.2, "RuntimeError", "Connection closed by peer",
                                               "peer_failure"), T0 + 0.2)
    engine.observe_exit(ExitSeen(who(1), T0 + 0.1, -9, "SIGKILL"), T0 + 0.6)
    found = run_until(engine, T0 + 0.2, T0 + 4)
    assert len(found) == 1
    t, rec = found[0]
    assert rec.root_cause.value == "rank_process_died" and rec.culprit.rank == 1
    assert rec.category.value == "infrastructure" and rec.action.value == "auto_restart"
    assert t - (T0 + 0.2) <= 3.0
    assert any("consequence_ranks=0,2,3" in e for e in rec.evidence)


def test_cuda_oom_exception_is_a_user_error():
    engine = Engine()
    engine.observe_exception(ExceptionSeen(who(3), T0, "torch.OutOfMemoryError", "CUDA out of memory. Tried to "
                                           "allocate 2.00 GiB", "cuda_oom"), T0)
    (_, rec), = run_until(engine, T0, T0 + 3)
    assert (rec.root_cause.value, rec.category.value, rec.culprit.rank) == ("cuda_oom", "user", 3)


def test_xid_79_on_the_failed_ranks_gpu_outranks_the_exception():
    engine = Engine()
    engine.observe_gpu(GpuSample("node1", "1", T0 - 5, uuid="GPU-abc"))
    engine.observe_xid(XidSeen("node1", "1", 79, T0 - 0.5))
    engine.observe_exception(ExceptionSeen(who(3), T0, "RuntimeError", "CUDA error: unspecified launch failure",
                                           "cuda_error"), T0)
    (_, rec), = run_until(engine, T0, T0 + 3)
    assert rec.root_cause.value == "gpu_fell_off_bus" and rec.category.value == "hardware"
    assert rec.culprit.rank == 3 and rec.culprit.gpu == "GPU-abc"
    assert rec.action.value == "exclude_node_and_restart" and rec.details["xid"] == 79


def test_collective_mismatch_when_every_rank_waits_at_the_same_seq_with_different_ops():
    engine = Engine(AttributionConfig(hang_timeout_s=5))
    ops = {0: "all_reduce", 1: "all_reduce", 2: "broadcast", 3: "all_reduce"}
    found = run_until(engine, T0 + 10, T0 + 20, lambda t: heartbeats(engine, t, {0, 1, 2, 3}, 9, ops=ops))
    (_, rec), = found
    assert rec.root_cause.value == "collective_mismatch" and rec.culprit.rank == 2 and rec.category.value == "user"


def test_nic_link_down_on_the_culprits_node_explains_the_hang():
    engine = Engine(AttributionConfig(hang_timeout_s=5))
    engine.observe_nic(NicSample("node1", "mlx5_0/1", T0, up=True))
    engine.observe_nic(NicSample("node1", "mlx5_0/1", T0 + 9, up=False))
    found = run_until(engine, T0 + 10, T0 + 20, lambda t: heartbeats(engine, t, {0, 1, 3}, 5))
    (_, rec), = found
    assert rec.root_cause.value == "nic_link_down" and rec.culprit.host == "node1"
    assert rec.category.value == "infrastructure"


def _steps(engine, step, base_t, durations, coll=None, data=None):
    for r, d in durations.items():
        engine.observe_step(StepSeen(who(r), step, base_t, base_t + d,
                                     None if coll is None else coll[r], None if data is None else data[r]), base_t + d)


def test_no_false_alarm_on_a_noisy_healthy_run():
    engine = Engine()
    rng = random.Random(7)
    t = T0
    records = []
    for step in range(300):
        base = 0.1 * (1 + rng.uniform(-0.3, 0.3)) + (0.08 if rng.random() < 0.05 else 0.0)
        _steps(engine, step, t, {r: base for r in range(WORLD)},
               coll={r: base * rng.uniform(0.2, 0.6) for r in range(WORLD)})
        t += base
        records += engine.tick(t)
    assert records == []


def test_compute_straggler_is_named_within_ten_steps_and_thermal_throttle_explains_it():
    for throttled in (False, True):
        engine = Engine()
        engine.observe_gpu(GpuSample("node1", "0", T0, clock_events=frozenset()))
        t, found, onset_step = T0, [], 20
        for step in range(60):
            slow = step >= onset_step
            if slow and throttled:
                engine.observe_gpu(GpuSample("node1", "0", t, clock_events=frozenset({"hw_thermal_slowdown"})))
            d = 0.3 if slow else 0.1
            coll = {r: (0.22 if slow else 0.03) for r in range(WORLD)}
            coll[2] = 0.02  # rank 2 (node1, GPU 0) computes; the others wait for it
            _steps(engine, step, t, {r: d for r in range(WORLD)}, coll=coll)
            t += d
            found += [(step, r) for r in engine.tick(t)]
        assert len(found) == 1, found
        step, rec = found[0]
        assert step - onset_step < 10
        assert rec.kind.value == "slowdown" and rec.culprit.rank == 2
        assert rec.root_cause.value == ("gpu_thermal_throttle" if throttled else "straggler_compute")


def test_launcher_stopping_the_survivors_does_not_make_them_culprits():
    engine = Engine(AttributionConfig(crash_settle_s=1.0))
    # torchrun notices rank 2's death and SIGTERMs the others; their reports can arrive before rank 2's.
    for r in (0, 1, 3):
        engine.observe_exit(ExitSeen(who(r), T0 + 0.3, -15, "SIGTERM"), T0 + 0.3)
    engine.observe_exit(ExitSeen(who(2), T0 + 0.1, -9, "SIGKILL"), T0 + 0.9)
    (_, rec), = run_until(engine, T0 + 0.3, T0 + 4)
    assert (rec.root_cause.value, rec.culprit.rank) == ("rank_process_died", 2)


def test_clean_exits_are_not_failures():
    engine = Engine()
    for r in range(WORLD):
        engine.observe_heartbeat(Heartbeat(who(r), T0, 60, "step", None), T0)
        engine.observe_exit(ExitSeen(who(r), T0 + 1, 0 if r else None, None), T0 + 1)
    assert run_until(engine, T0 + 1, T0 + 30) == []


def test_a_ranks_identity_keeps_its_process_creation_time_when_later_reports_fill_it_in():
    """Every report about a rank merges into what is known of it; the creation time (which tells an earlier
    program's XID from the rank's own) was dropped by the merge, and the 60-run suite named an os._exit gpu_xid
    from an XID 13 seen before the job started."""
    from otel_gpu.processors.attribution._state import merge_identity

    own = Identity("j", 0, host="n0", pid=1000, started=1_000.0)
    from_launcher = Identity("j", 0, host="n0", pid=77, local_rank=0, started=900.0)
    merged = merge_identity(own, from_launcher)
    assert (merged.pid, merged.local_rank, merged.started) == (1000, 0, 1_000.0)
    assert merge_identity(Identity("j", 0, host="n0"), own).started == 1_000.0


def test_a_link_that_was_back_up_before_the_job_started_does_not_explain_its_crash():
    """An earlier fault cut node0's link and restored it right before this job started (within the 30 s window of
    the crash that follows): the SIGKILL is the cause. The same drop while the job runs still explains it."""
    for down_at, up_at, expect in ((T0 - 25, T0 - 12, "rank_process_died"), (T0 - 3, None, "nic_link_down")):
        engine = Engine(AttributionConfig(crash_settle_s=1.0))
        engine.observe_nic(NicSample("node0", "data0", T0 - 40, up=True))
        engine.observe_nic(NicSample("node0", "data0", down_at, up=False))
        if up_at is not None:
            engine.observe_nic(NicSample("node0", "data0", up_at, up=True))
        for r in range(WORLD):
            engine.observe_heartbeat(Heartbeat(who(r), T0 - 5, 1, "step", None), T0 - 5)
            engine.observe_heartbeat(Heartbeat(who(r), T0, 3, "step", None), T0)
        for r in (0, 2, 3):
            engine.observe_exception(ExceptionSeen(who(r), T0 + 0.2, "RuntimeError", "Connection closed by peer",
                                                   "peer_failure"), T0 + 0.2)
        engine.observe_exit(ExitSeen(who(1), T0 + 0.1, -9, "SIGKILL"), T0 + 0.6)
        (_, rec), = run_until(engine, T0 + 0.2, T0 + 4)
        assert rec.root_cause.value == expect and rec.culprit.host == "node0", (down_at, rec)
