"""The crash detector on synthetic observations: first cause wins over consequences, user exceptions are never
blamed on unrelated hardware, a CUDA error is linked to the XID on its GPU (before, with or after the exception, up
to several seconds late, revising the first verdict), XID classes, background-thread exceptions, uneven inputs;
culprits drawn from every rank (0 included), hardware baselines dirty."""
from __future__ import annotations

import random

import pytest

from attribution_synth import T0, Cluster, latest
from otel_gpu.processors.attribution._observations import ExceptionSeen, ExitSeen

SEEDS = range(6)


def _dirty(c: Cluster) -> None:
    c.history(T0 - 600, T0)


def _steady(c: Cluster, upto: float):
    def feed(t):
        c.devices(t)
        for r in range(c.world):
            rank = c.engine.jobs.get(c.job) and c.engine.jobs[c.job].ranks.get(r)
            if rank is not None and (rank.exit is not None or rank.exception is not None):
                continue
            if t <= upto:
                c.heartbeat(r, t, step=int(t - T0), started={"0": int(t - T0) * 3}, stalled=0.1)
    return feed


@pytest.mark.parametrize("seed", SEEDS)
def test_a_user_exception_is_not_blamed_on_unrelated_hardware(seed):
    rng = random.Random(seed)
    c = Cluster(world=rng.choice([4, 8]))
    culprit = rng.randrange(c.world)
    other = rng.choice([r for r in range(c.world) if r != culprit])
    _dirty(c)
    c.run(T0, T0 + 10, _steady(c, T0 + 10))
    c.xid(other, 79, T0 + 10.2)  # another rank's GPU falls off the bus at the same moment
    exc_type = rng.choice(["KeyError", "ValueError", "ZeroDivisionError"])
    c.engine.observe_exception(ExceptionSeen(c.who(culprit), T0 + 10.3, exc_type, "'label'", "user_code",
                                             thread="MainThread"), T0 + 10.3)
    for r in range(c.world):
        if r != culprit:
            c.engine.observe_exception(ExceptionSeen(c.who(r), T0 + 10.6, "RuntimeError", "Connection closed by peer",
                                                     "peer_failure"), T0 + 10.6)
    found = c.run(T0 + 10.5, T0 + 30, _steady(c, T0 + 10))
    final = list(latest([r for _, r in found]).values())
    assert len(final) == 1, [(r.root_cause.value, r.culprit.rank) for r in final]
    rec = final[0]
    assert (rec.root_cause.value, rec.culprit.rank, rec.action.value) == ("python_exception", culprit, "user_fix")
    assert rec.version == 1


@pytest.mark.parametrize("delay_s", [-2.0, 0.0, 1.0, 3.0, 6.0])
def test_a_cuda_error_is_linked_to_the_xid_on_its_gpu_even_when_the_xid_arrives_late(delay_s):
    rng = random.Random(int(delay_s * 10))
    c = Cluster(world=4)
    culprit = rng.randrange(4)
    _dirty(c)
    c.run(T0, T0 + 10, _steady(c, T0 + 10))
    symptom = T0 + 10.0
    c.engine.observe_exception(ExceptionSeen(c.who(culprit), symptom, "torch.AcceleratorError",
                                             "CUDA error: unspecified launch failure", "cuda_error"), symptom)
    for r in range(4):
        if r != culprit:
            c.engine.observe_exception(ExceptionSeen(c.who(r), symptom + 0.3, "RuntimeError",
                                                     "Connection closed by peer", "peer_failure"), symptom + 0.3)

    def feed(t):
        c.devices(t)
        if abs(t - max(symptom + delay_s, symptom + 0.5)) < 0.25:  # it reaches the collector at most this late
            c.xid(culprit, 79, symptom + delay_s, pid=c.who(culprit).pid)
    if delay_s <= 0:
        c.xid(culprit, 79, symptom + delay_s, pid=c.who(culprit).pid)
    found = c.run(symptom, symptom + 25, feed)
    final = list(latest([r for _, r in found]).values())
    assert len(final) == 1, [(r.root_cause.value, r.version) for _, r in found]
    rec = final[0]
    assert (rec.root_cause.value, rec.culprit.rank, rec.culprit.gpu) == ("gpu_fell_off_bus", culprit,
                                                                         c.uuid(culprit))
    assert rec.action.value == "exclude_node_and_restart" and rec.category.value == "hardware"
    assert "gpu.xid=79" in " ".join(rec.evidence) and "XID 79" in rec.summary
    if rec.version > 1:
        assert rec.previous_root_cause == "python_exception"
        assert found[0][1].failure_id == rec.failure_id and found[0][1].version == 1


def test_an_application_xid_is_software_and_the_node_stays():
    c = Cluster(world=4)
    _dirty(c)
    c.xid(2, 13, T0 + 9.9, pid=c.who(2).pid)
    c.xid(2, 45, T0 + 9.95, pid=c.who(2).pid)
    c.engine.observe_exception(ExceptionSeen(c.who(2), T0 + 10, "torch.AcceleratorError",
                                             "CUDA error: an illegal memory access was encountered", "cuda_error"),
                               T0 + 10)
    (_, rec), = c.run(T0 + 10, T0 + 25, lambda t: c.devices(t))
    assert (rec.root_cause.value, rec.culprit.rank, rec.details["xid"]) == ("gpu_xid", 2, 13)
    assert rec.category.value == "software" and rec.action.value != "exclude_node_and_restart"


def test_another_processes_application_xid_on_a_shared_gpu_is_not_this_ranks():
    c = Cluster(world=4)
    _dirty(c)
    c.xid(1, 13, T0 + 9.9, pid=777)  # someone else's kernel fault on rank 1's GPU
    c.engine.observe_exit(ExitSeen(c.who(1), T0 + 10, -9, "SIGKILL"), T0 + 10)
    (_, rec), = c.run(T0 + 10, T0 + 25, lambda t: c.devices(t))
    assert (rec.root_cause.value, rec.culprit.rank, rec.action.value) == ("rank_process_died", 1, "auto_restart")


@pytest.mark.parametrize("seed", SEEDS)
def test_a_killed_rank_on_dirty_hardware_is_named_and_old_faults_are_baseline(seed):
    rng = random.Random(seed)
    c = Cluster(world=rng.choice([4, 8]))
    culprit = rng.randrange(c.world)
    _dirty(c)  # includes an XID 79 on GPU 0 of every host ten minutes ago, ifb0 down since boot, power cap on
    c.run(T0, T0 + 10, _steady(c, T0 + 10))
    for r in range(c.world):
        if r != culprit:  # the survivors' reports can arrive first
            c.engine.observe_exit(ExitSeen(c.who(r), T0 + 10.3, -15, "SIGTERM"), T0 + 10.3)
    c.engine.observe_exit(ExitSeen(c.who(culprit), T0 + 10.1, -9, "SIGKILL"), T0 + 10.6)
    found = c.run(T0 + 10.5, T0 + 30, _steady(c, T0 + 10))
    (_, rec), = found
    assert (rec.root_cause.value, rec.culprit.rank, rec.action.value) == ("rank_process_died", culprit,
                                                                          "auto_restart")
    assert not any("ifb0" in e or "xid" in e or "power" in e for e in rec.evidence), rec.evidence


def test_a_background_thread_exception_is_a_crash_only_if_the_rank_stops():
    c = Cluster(world=4)
    c.engine.observe_exception(ExceptionSeen(c.who(1), T0 + 5, "ValueError", "bad metric", "user_code",
                                             thread="metrics-uploader"), T0 + 5)
    assert c.run(T0, T0 + 30, _steady(c, T0 + 30)) == []  # training went on
    c.engine.observe_exception(ExceptionSeen(c.who(3), T0 + 31, "OSError", "disk full", "user_code",
                                             thread="prefetch"), T0 + 31)
    c.engine.observe_exit(ExitSeen(c.who(3), T0 + 32, 1, None), T0 + 32)
    (_, rec), = c.run(T0 + 32, T0 + 40, _steady(c, T0 + 31))
    assert (rec.root_cause.value, rec.culprit.rank) == ("python_exception", 3) and "prefetch" in rec.summary


def test_a_rank_that_ended_cleanly_before_its_peers_failed_is_the_culprit():
    c = Cluster(world=4)
    c.engine.observe_exit(ExitSeen(c.who(0), T0 + 10, 0, None), T0 + 10)
    for r in (1, 2, 3):
        c.engine.observe_exception(ExceptionSeen(c.who(r), T0 + 12, "RuntimeError", "Connection closed by peer",
                                                 "peer_failure"), T0 + 12)
    (_, rec), = c.run(T0 + 12, T0 + 20)
    assert (rec.kind.value, rec.root_cause.value, rec.culprit.rank) == ("crash", "rank_exited_early", 0)
    assert rec.action.value == "user_fix"


@pytest.mark.parametrize("exit_late_s", [0.2, 0.9, 3.0])
def test_a_crash_is_named_fast_and_revised_when_the_culprits_own_report_comes_late(exit_late_s):
    """The survivors' errors arrive first; the killed rank's exit report may come seconds later. The first verdict
    goes out within a second of the first report, and a late first cause revises it (same failure id)."""
    c = Cluster(world=4)
    culprit = random.Random(int(exit_late_s * 10)).randrange(4)
    first = T0 + 10.0
    for r in range(4):
        if r != culprit:
            c.engine.observe_exception(ExceptionSeen(c.who(r), first + 0.05, "RuntimeError",
                                                     "Connection closed by peer", "gloo_error"), first + 0.05)

    def feed(t):
        if abs(t - (first + exit_late_s)) < 0.05:
            c.engine.observe_exit(ExitSeen(c.who(culprit), first, -9, "SIGKILL"), t)
    found = c.run(first + 0.05, first + 8, feed, dt=0.1)
    assert found and found[0][0] - first <= 1.1, "a first verdict within about a second"
    final = list(latest([r for _, r in found]).values())
    assert len(final) == 1
    rec = final[0]
    assert (rec.root_cause.value, rec.culprit.rank) == ("rank_process_died", culprit), [
        (r.root_cause.value, r.culprit.rank, r.version) for _, r in found]


def test_a_job_stopped_on_purpose_is_no_crash_even_when_the_stop_signals_arrive_spread_out():
    c = Cluster(world=4)
    order = random.Random(5).sample(range(4), 4)
    c.engine.observe_exit(ExitSeen(c.who(order[0]), T0 + 10, -15, "SIGTERM"), T0 + 10)

    def feed(t):
        for i, r in enumerate(order[1:]):
            if abs(t - (T0 + 10.6 + 0.3 * i)) < 0.05:
                c.engine.observe_exit(ExitSeen(c.who(r), T0 + 10.1, -15, "SIGTERM"), t)
    assert c.run(T0 + 10, T0 + 20, feed, dt=0.1) == []
