"""The attribution rules of issue 22 on synthetic observations: a rank that vanished (no status anyone could read) is a
death that outranks its peers' communication errors, whenever its record arrives; the first rank to die is the
culprit, not the first to report; a frozen rank (its launcher saw it in state T or D) is a hang named by its state and
wait channel: stopped is nobody's hardware, uninterruptible sleep inside the NVIDIA driver is the GPU's, and an XID on
its GPU names the XID. Culprits drawn from every rank (0 included), hardware baselines dirty."""
from __future__ import annotations

import random

import pytest

from attribution_synth import T0, Cluster, latest
from otel_gpu.processors.attribution._observations import ExceptionSeen, ExitSeen, StateSeen

SEEDS = range(5)


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


def _final(c: Cluster, found) -> list:
    return [r for r in latest([r for _, r in found]).values() if not r.withdrawn]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_vanished_rank_is_a_death_that_outranks_its_peers_communication_errors_even_reported_last(seed):
    rng = random.Random(seed)
    c = Cluster(world=4)
    culprit = rng.randrange(4)
    c.history(T0 - 600, T0)
    c.run(T0, T0 + 10, _steady(c, T0 + 10))
    died = T0 + 10.1
    for r in range(4):  # the peers fail in their next collective and report at once
        if r != culprit:
            c.engine.observe_exception(ExceptionSeen(c.who(r), died + 0.05, "RuntimeError",
                                                     "[gloo] Connection closed by peer", "gloo_error"), died + 0.05)
    found = c.run(T0 + 10.2, T0 + 11.5, _steady(c, T0 + 10))
    # the launcher's record of the dead rank comes late: stamped with when it ended, with no code and no signal
    c.engine.observe_exit(ExitSeen(c.who(culprit), died, None, None, "vanished"), T0 + 11.6)
    found += c.run(T0 + 11.6, T0 + 20, _steady(c, T0 + 10))
    final = _final(c, found)
    assert [(r.kind.value, r.root_cause.value, r.culprit.rank) for r in final] == [
        ("crash", "rank_process_died", culprit)]
    assert "process.exit.how=vanished" in final[0].evidence[0] and final[0].action.value == "auto_restart"


def test_a_vanished_rank_is_never_a_clean_exit():
    c = Cluster(world=4)
    c.run(T0, T0 + 10, _steady(c, T0 + 10))
    c.engine.observe_exit(ExitSeen(c.who(2), T0 + 10.1, None, None, "vanished"), T0 + 10.1)
    rank = c.engine.jobs[c.job].ranks[2]
    assert rank.failed() and not rank.exited_clean()
    (_, rec), = c.run(T0 + 10.2, T0 + 14, _steady(c, T0 + 10))
    assert (rec.root_cause.value, rec.culprit.rank) == ("rank_process_died", 2)
    assert "rank_exited_early" not in rec.root_cause.value


@pytest.mark.parametrize("seed", SEEDS)
def test_the_first_rank_to_die_is_the_culprit_not_the_first_to_report(seed):
    """Lightning: rank k is SIGKILLed; 5 s later rank 0's observer SIGKILLs rank 0 itself. Rank 0's record (the
    launched command's own status) reaches the collector first, rank k's later, stamped with when it died."""
    rng = random.Random(seed)
    c = Cluster(world=4)
    k = rng.randrange(1, 4)
    c.run(T0, T0 + 10, _steady(c, T0 + 10))
    c.engine.observe_exit(ExitSeen(c.who(0), T0 + 15.0, -9, "SIGKILL", "killed"), T0 + 15.0)
    found = c.run(T0 + 15.0, T0 + 15.6, _steady(c, T0 + 10))
    c.engine.observe_exit(ExitSeen(c.who(k), T0 + 10.1, -9, "SIGKILL", "killed"), T0 + 15.7)
    found += c.run(T0 + 15.7, T0 + 20, _steady(c, T0 + 10))
    final = _final(c, found)
    assert [(r.root_cause.value, r.culprit.rank) for r in final] == [("rank_process_died", k)]


def _frozen_job(c: Cluster, culprit: int, state: StateSeen | None, *, heartbeats_go_on: bool):
    """Every rank steps until T0+10; then ``culprit`` freezes: the others wait for it in all_reduce seq 31. With
    ``heartbeats_go_on`` the culprit's watchdog still reports (only its main thread is stuck, as in the GPU driver)."""
    def feed(t):
        c.devices(t)
        if state is not None and t >= state.time + 2.0 and c.engine.jobs[c.job].ranks[culprit].frozen is None:
            c.engine.observe_state(state, t)
        for r in range(c.world):
            if t <= T0 + 10:
                c.heartbeat(r, t, step=int(t - T0), started={"0": int(t - T0) * 3}, stalled=0.1)
            elif r == culprit:
                if heartbeats_go_on:
                    c.heartbeat(r, t, step=10, started={"0": 30}, stalled=t - (T0 + 10))
            else:
                c.heartbeat(r, t, step=10, started={"0": 31}, inflight=("collective", "0", 31, "all_reduce",
                                                                      T0 + 10.1))
    return feed


@pytest.mark.parametrize("seed", SEEDS)
def test_a_stopped_rank_is_a_hang_named_stopped_and_not_blamed_on_hardware(seed):
    rng = random.Random(seed)
    c = Cluster(world=4)
    k = rng.randrange(4)
    c.history(T0 - 600, T0)
    c.xid(k, 79, T0 + 10.5)  # even with a hardware fault on its GPU: a SIGSTOP is not the GPU's doing
    st = StateSeen(c.who(k), T0 + 10.2, "T", "stopped", "do_signal_stop")
    found = c.run(T0 + 1, T0 + 30, _frozen_job(c, k, st, heartbeats_go_on=False))
    final = _final(c, found)
    assert [(r.kind.value, r.root_cause.value, r.culprit.rank) for r in final] == [("hang", "rank_frozen", k)]
    rec = final[0]
    assert (rec.category.value, rec.action.value) == ("infrastructure", "investigate")
    assert "stopped" in rec.summary and "do_signal_stop" in rec.summary
    assert rec.evidence[0].startswith("process.state=T") and "process.wchan=do_signal_stop" in rec.evidence


def test_a_silent_rank_with_no_frozen_report_is_still_a_dead_process():
    c = Cluster(world=4)
    found = c.run(T0 + 1, T0 + 30, _frozen_job(c, 2, None, heartbeats_go_on=False))
    (rec,) = _final(c, found)
    assert (rec.kind.value, rec.root_cause.value, rec.culprit.rank) == ("crash", "rank_process_died", 2)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reports", [True, False])
def test_a_rank_in_uninterruptible_sleep_inside_the_gpu_driver_points_at_the_hardware(seed, reports):
    """Only the main thread is stuck in the driver: the watchdog may still report (``reports``) or not."""
    rng = random.Random(seed)
    c = Cluster(world=4)
    k = rng.randrange(4)
    c.history(T0 - 600, T0)
    st = StateSeen(c.who(k), T0 + 10.3, "D", "gpu_driver", "os_wait_uninterruptible",
                   "os_wait_uninterruptible+0x3c/0x60 [nvidia]\n_nv012345rm+0x1a/0x90 [nvidia]")
    found = c.run(T0 + 1, T0 + 30, _frozen_job(c, k, st, heartbeats_go_on=reports))
    final = _final(c, found)
    assert [(r.kind.value, r.root_cause.value, r.culprit.rank) for r in final] == [("hang", "rank_frozen", k)]
    rec = final[0]
    assert (rec.category.value, rec.action.value) == ("hardware", "exclude_node_and_restart")
    assert rec.auto_remediable is True
    assert any(e.startswith("process.kernel_stack=os_wait_uninterruptible") for e in rec.evidence)


def test_a_rank_in_uninterruptible_sleep_with_an_xid_on_its_gpu_names_the_xid():
    c = Cluster(world=4)
    k = 1
    c.history(T0 - 600, T0)
    c.xid(k, 79, T0 + 10.0)
    st = StateSeen(c.who(k), T0 + 10.3, "D", "uninterruptible", "schedule_timeout")
    found = c.run(T0 + 1, T0 + 30, _frozen_job(c, k, st, heartbeats_go_on=True))
    (rec,) = _final(c, found)
    assert (rec.kind.value, rec.root_cause.value, rec.culprit.rank) == ("hang", "gpu_fell_off_bus", k)
    assert rec.action.value == "exclude_node_and_restart"


def test_a_rank_in_uninterruptible_sleep_elsewhere_is_investigated_not_drained():
    c = Cluster(world=4)
    c.history(T0 - 600, T0)
    st = StateSeen(c.who(3), T0 + 10.3, "D", "uninterruptible", "nfs_wait_bit_killable")
    found = c.run(T0 + 1, T0 + 30, _frozen_job(c, 3, st, heartbeats_go_on=True))
    (rec,) = _final(c, found)
    assert (rec.root_cause.value, rec.culprit.rank, rec.action.value) == ("rank_frozen", 3, "investigate")
    assert "nfs_wait_bit_killable" in rec.summary


def test_every_rank_in_one_collective_and_one_frozen_in_the_driver_names_that_rank():
    c = Cluster(world=4)
    c.history(T0 - 600, T0)
    k = 2
    st = StateSeen(c.who(k), T0 + 10.3, "D", "gpu_driver", "_nv000713rm")

    def feed(t):
        c.devices(t)
        if t >= T0 + 12.5:
            c.engine.observe_state(st, t)
        for r in range(4):
            c.heartbeat(r, t, step=10, started={"0": 31}, inflight=("collective", "0", 31, "all_reduce", T0 + 10.1))
    found = c.run(T0 + 10.5, T0 + 30, feed)
    (rec,) = _final(c, found)
    assert (rec.kind.value, rec.root_cause.value, rec.culprit.rank, rec.category.value) == (
        "hang", "rank_frozen", k, "hardware")


def test_a_stopped_rank_that_is_continued_withdraws_its_hang():
    c = Cluster(world=4)
    k = 0
    st = StateSeen(c.who(k), T0 + 10.2, "T", "stopped", "do_signal_stop")
    (_, first), = c.run(T0 + 1, T0 + 25, _frozen_job(c, k, st, heartbeats_go_on=False))
    assert first.root_cause.value == "rank_frozen"
    c.engine.observe_state(StateSeen(c.who(k), T0 + 25.2, "S", None, "hrtimer_nanosleep"), T0 + 25.2)

    def back(t):
        for r in range(4):
            c.heartbeat(r, t, step=11 + int(t - T0 - 25), started={"0": 32 + int(t - T0 - 25)}, stalled=0.1)
    revised = c.run(T0 + 25.5, T0 + 30, back)
    (_, second), = revised
    assert (second.failure_id, second.version, second.withdrawn) == (first.failure_id, 2, True)
    assert c.engine.jobs[c.job].ranks[k].frozen is None
