"""The hang detector on synthetic observations: the wait-for graph across process groups, uneven inputs, a culprit
without a stack, long checkpoints, telemetry gaps, a lost node, a hang that resumes; culprits drawn from every rank
(0 included), hardware baselines dirty."""
from __future__ import annotations

import random

import pytest

from attribution_synth import T0, Cluster, latest
from otel_gpu.processors.attribution._observations import ExitSeen, NicSample

SEEDS = range(6)


def _subgroup_hang(c: Cluster, culprit: int, t: float, *, with_stack: bool = True) -> None:
    """Subgroups of 2 (pg "1".. for [0,1], [2,3], ...). The culprit stops before its subgroup all_reduce k; its
    partner waits in the subgroup; every other pair finished its subgroup op and waits in the world group."""
    n_world, k = 40, 12
    partner = culprit ^ 1
    for r in range(c.world):
        sub = str(r // 2 + 1)
        if r == culprit:
            c.heartbeat(r, t, started={"0": n_world, sub: k - 1}, stalled=t - (T0 + 10))
        elif r == partner:
            c.heartbeat(r, t, started={"0": n_world, sub: k}, inflight=("collective", sub, k, "all_reduce", T0 + 10))
        else:
            c.heartbeat(r, t, started={"0": n_world + 1, sub: k},
                        inflight=("collective", "0", n_world + 1, "all_reduce", T0 + 10))
    if with_stack and t >= T0 + 12:
        c.stacks(culprit, T0 + 12)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_culprit_is_the_end_of_the_wait_for_chain_across_subgroups(seed):
    rng = random.Random(seed)
    c = Cluster(world=rng.choice([4, 8]), per_host=rng.choice([2, 4]))
    culprit = rng.randrange(c.world)
    c.history(T0 - 600, T0)
    found = c.run(T0 + 10, T0 + 25, lambda t: (c.devices(t), _subgroup_hang(c, culprit, t)))
    assert len(found) == 1, [(t, r.summary) for t, r in found]
    t, rec = found[0]
    assert (rec.kind.value, rec.root_cause.value, rec.culprit.rank) == ("hang", "rank_not_in_collective", culprit)
    assert rec.category.value == "user" and rec.action.value == "user_fix", rec.summary
    assert rec.culprit.gpu == c.uuid(culprit)
    assert t <= T0 + 10 + 5 + 2.5, "named within the timeout plus the stack grace"
    assert rec.failure_id and rec.version == 1 and not rec.withdrawn


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_a_culprit_without_a_stack_is_named_after_a_bounded_grace(seed):
    c = Cluster(world=4)
    culprit = random.Random(seed).randrange(4)
    found = c.run(T0 + 10, T0 + 25, lambda t: _subgroup_hang(c, culprit, t, with_stack=False))
    (t, rec), = found
    assert rec.culprit.rank == culprit and rec.root_cause.value == "rank_not_in_collective"
    assert rec.action.value == "investigate" and "no stack" in rec.summary
    assert T0 + 10 + 5 + 2 <= t <= T0 + 10 + 5 + 2 + 1


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_uneven_inputs_a_rank_that_exited_zero_while_its_peers_wait_is_the_culprit(seed):
    c = Cluster(world=4)
    culprit = random.Random(seed).randrange(4)
    c.history(T0 - 300, T0)
    c.heartbeat(culprit, T0 + 9, started={"0": 40})
    c.engine.observe_exit(ExitSeen(c.who(culprit), T0 + 9.5, 0, None), T0 + 9.5)

    def feed(t):
        c.devices(t)
        for r in range(4):
            if r != culprit:
                c.heartbeat(r, t, started={"0": 41}, inflight=("collective", "0", 41, "all_reduce", T0 + 10))
    (t, rec), = c.run(T0 + 10, T0 + 20, feed)
    assert (rec.kind.value, rec.root_cause.value, rec.culprit.rank) == ("hang", "rank_exited_early", culprit)
    assert (rec.category.value, rec.action.value) == ("user", "user_fix")


def test_a_long_checkpoint_on_one_rank_is_busy_and_a_later_real_hang_is_still_named():
    c = Cluster(world=4)
    saver = 0

    def checkpointing(t):  # rank 0 saves for 40 s; the others wait for it in the next all_reduce
        for r in range(4):
            if r == saver:
                c.heartbeat(r, t, started={"0": 40}, inflight=("checkpoint", None, None, None, T0 + 10))
            else:
                c.heartbeat(r, t, started={"0": 41}, inflight=("collective", "0", 41, "all_reduce", T0 + 10))
    assert c.run(T0 + 10, T0 + 50, checkpointing) == []

    def training(t):
        for r in range(4):
            c.heartbeat(r, t, step=8 + int(t - T0 - 50), started={"0": 42 + int(t - T0 - 50)}, stalled=0.1)
    assert c.run(T0 + 50.5, T0 + 60, training) == []
    # then rank 3 falls asleep before a collective: that hang is reported
    sleeper = 3

    def hang(t):
        for r in range(4):
            if r == sleeper:
                c.heartbeat(r, t, step=18, started={"0": 60}, stalled=t - (T0 + 61))
            else:
                c.heartbeat(r, t, step=18, started={"0": 61}, inflight=("collective", "0", 61, "all_reduce", T0 + 61))
        if t > T0 + 63:
            c.stacks(sleeper, T0 + 63)
    (_, rec), = c.run(T0 + 60.5, T0 + 75, hang)
    assert (rec.root_cause.value, rec.culprit.rank) == ("rank_not_in_collective", sleeper)


def test_a_checkpoint_longer_than_its_bound_is_a_checkpoint_stall():
    c = Cluster(world=4)
    c.settings.checkpoint_timeout_s = 30.0

    def feed(t):
        for r in range(4):
            if r == 2:
                c.heartbeat(r, t, started={"0": 40}, inflight=("checkpoint", None, None, None, T0 + 10))
            else:
                c.heartbeat(r, t, started={"0": 41}, inflight=("collective", "0", 41, "all_reduce", T0 + 10))
    found = c.run(T0 + 10, T0 + 45, feed)
    (t, rec), = found
    assert (rec.root_cause.value, rec.culprit.rank) == ("checkpoint_stall", 2) and t >= T0 + 40


def test_a_telemetry_gap_from_a_collector_restart_is_not_a_failure():
    c = Cluster(world=4)

    def steady(t):
        c.devices(t)
        for r in range(4):
            c.heartbeat(r, t, step=int(t - T0), started={"0": int(t - T0) * 3}, stalled=0.2,
                        inflight=("collective", "0", int(t - T0) * 3, "all_reduce", t - 0.05) if r else None)
    c.history(T0 - 100, T0)
    assert c.run(T0, T0 + 20, steady) == []
    assert c.run(T0 + 20.5, T0 + 45, None) == []  # nothing arrives for 25 s: not a crash, not a hang
    assert c.run(T0 + 45.5, T0 + 60, steady) == []


def test_a_node_agent_restart_silences_one_host_while_the_others_keep_stepping():
    c = Cluster(world=4)

    def feed(t):
        quiet = T0 + 20 <= t < T0 + 40  # node1's agent restarts: its ranks' and devices' reports stop
        for r in range(4):
            if quiet and c.host(r) == "node1":
                continue
            c.heartbeat(r, t, step=int(t - T0), started={"0": int(t - T0) * 3}, stalled=0.2,
                        inflight=("collective", "0", int(t - T0) * 3, "all_reduce", t - 0.05))
        if not quiet:
            c.devices(t)
    assert c.run(T0, T0 + 60, feed) == []


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_a_node_whose_ranks_and_device_metrics_vanish_together_is_lost(seed):
    c = Cluster(world=6, per_host=2)
    lost = random.Random(seed).choice(c.hosts())
    c.history(T0 - 100, T0 + 10)

    def feed(t):
        for r in range(6):
            if c.host(r) == lost:
                continue
            c.heartbeat(r, t, started={"0": 41}, inflight=("collective", "0", 41, "all_reduce", T0 + 10))
        for host in c.hosts():
            if host != lost:
                for port in ("mlx5_0/1", "eth0"):
                    c.engine.observe_nic(NicSample(host, port, t, up=True))
    for r in range(6):
        c.heartbeat(r, T0 + 10, started={"0": 40})
    (t, rec), = c.run(T0 + 10.5, T0 + 30, feed)
    assert (rec.kind.value, rec.root_cause.value, rec.culprit.host) == ("crash", "node_lost", lost)
    assert rec.action.value == "exclude_node_and_restart"


def test_a_hang_that_resumes_is_withdrawn_and_the_next_failure_is_reported():
    c = Cluster(world=4)
    culprit = 0

    def stuck(t):
        _subgroup_hang(c, culprit, t)
    (_, first), = c.run(T0 + 10, T0 + 20, stuck)

    def resumed(t):
        for r in range(4):
            c.heartbeat(r, t, step=9 + int(t - T0 - 20), started={"0": 50 + int(t - T0 - 20)}, stalled=0.1)
    revised = c.run(T0 + 20.5, T0 + 25, resumed)
    (_, second), = revised
    assert second.failure_id == first.failure_id and second.version == 2 and second.withdrawn
    assert second.to_dict()["withdrawn"] is True and "previous_root_cause" not in second.to_dict()
    c.engine.observe_exit(ExitSeen(c.who(2), T0 + 26, -9, "SIGKILL"), T0 + 26)
    (_, crash), = c.run(T0 + 26, T0 + 30, resumed)
    assert crash.failure_id != first.failure_id and crash.root_cause.value == "rank_process_died"
    assert crash.culprit.rank == 2


@pytest.mark.parametrize("late_s", [-3.0, 0.0, 2.0, 6.0])
def test_every_rank_in_one_collective_and_a_link_down_near_the_onset_before_or_late(late_s):
    """A link on one node goes down around the onset (up to several seconds late): the verdict names it, at once or
    as a revision of the first verdict (same failure id, version 2, previous root cause)."""
    c = Cluster(world=4)
    bad = random.Random(int(late_s)).choice(c.hosts())
    c.history(T0 - 100, T0 + 10)
    link_t = T0 + 10 + late_s

    def feed(t):
        c.devices(t, ports={bad: {"mlx5_0/1": t < link_t}})
        for r in range(4):
            c.heartbeat(r, t, started={"0": 41}, inflight=("collective", "0", 41, "all_reduce", T0 + 10))
    found = c.run(T0 + 10, T0 + 35, feed, dt=0.5)
    final = latest([r for _, r in found])
    assert len(final) == 1, [(r.root_cause.value, r.version) for _, r in found]
    rec = next(iter(final.values()))
    assert (rec.root_cause.value, rec.culprit.host) == ("nic_link_down", bad)
    assert "mlx5_0/1" in " ".join(rec.evidence) and "ifb0" not in " ".join(rec.evidence)
    if rec.version > 1:
        assert rec.previous_root_cause == "unknown"


def test_a_rank_slow_before_its_first_step_is_starting_not_hung_until_the_startup_bound():
    c = Cluster(world=4)
    c.settings.startup_timeout_s = 40.0

    def feed(t):  # DDP's initial broadcasts: rank 0 still imports while the others wait in broadcast seq 3
        for r in range(4):
            if r == 0:
                c.heartbeat(r, t, step=1, started={"0": 2}, stalled=t - (T0 + 10))
            else:
                c.heartbeat(r, t, step=1, started={"0": 3}, inflight=("collective", "0", 3, "broadcast", T0 + 10))
            c.engine.jobs[c.job].ranks[r].last_heartbeat.steps_done = 0
        c.stacks(0, t, [{"file": "/venv/lib/python3.11/site-packages/sympy/core/assumptions.py", "line": 664,
                         "function": "_prepare_class_assumptions"}])
    assert c.run(T0 + 10, T0 + 45, feed) == []
    (_, rec), = c.run(T0 + 45.5, T0 + 52, feed)
    assert (rec.root_cause.value, rec.culprit.rank) == ("rank_not_in_collective", 0)


def test_a_silent_rank_verdict_is_withdrawn_when_the_rank_reports_and_progresses_again():
    c = Cluster(world=4)
    quiet = 2

    def feed(t):
        for r in range(4):
            if r == quiet and t > T0 + 10:
                continue  # frozen (e.g. swapped out) for a while
            c.heartbeat(r, t, started={"0": 41}, inflight=("collective", "0", 41, "all_reduce", T0 + 10.2))
    (_, first), = c.run(T0 + 5, T0 + 20, feed)
    assert (first.root_cause.value, first.culprit.rank) == ("rank_process_died", quiet)

    def back(t):
        for r in range(4):
            c.heartbeat(r, t, step=8, started={"0": 42 + int(t - T0 - 20)}, stalled=0.1)
    (_, second), = c.run(T0 + 20.5, T0 + 25, back)
    assert (second.failure_id, second.version, second.withdrawn) == (first.failure_id, 2, True)


@pytest.mark.parametrize("innermost, expected", [
    ({"file": "/usr/lib/python3.11/queue.py", "function": "get"}, "user"),  # the user's code waits on a queue
    ({"file": "/usr/lib/python3.11/threading.py", "function": "wait"}, "user"),
    ({"file": "/venv/lib/python3.11/site-packages/torch/futures/__init__.py", "function": "wait"}, "software"),
    ({"file": "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py", "function": "synchronize"}, "software"),
])
def test_a_rank_blocked_in_a_librarys_wait_is_not_the_users_fault(innermost, expected):
    """Only a standard-library call blocks on the user's behalf; a library's own ``wait`` (torch futures, a work
    handle, a CUDA synchronize behind a dead link) is a rank stuck inside the library, which hardware may explain
    (the suite's link-down scenario was named the user's fault by function name alone)."""
    from otel_gpu.processors.attribution._hang import category_by_stack
    from otel_gpu.processors.attribution._observations import Identity, Stacks
    from otel_gpu.processors.attribution._state import RankState

    who = Identity("j", 1, host="n0")
    frames = [{"file": "/home/u/train.py", "function": "main"}, {"file": "/home/u/train.py", "function": "step"},
              innermost]
    category, _ = category_by_stack(RankState(who, stacks=Stacks(who, T0, None, frames)))
    assert category.value == expected
