"""What the adversarial suite found, pinned as deterministic engine cases (synthetic observations, no processes), so
that a fix is proven in seconds and never regresses. Each case names the suite run that found it.
"""
from __future__ import annotations

from otel_gpu.processors.attribution._engine import Engine, EngineSettings
from otel_gpu.processors.attribution._observations import (ExitSeen, Heartbeat, Identity, NicSample, StepSeen)

T0 = 1_800_000_000.0
WORLD = 4


def who(rank: int) -> Identity:
    return Identity("job-1", rank, host="node-a", pid=2000 + rank, local_rank=rank, world_size=WORLD)


def trickle(engine: Engine, start: float, end: float, every_s: float = 3.0, base: int = 1843) -> None:
    """A node's background: one symbol error every few seconds on a port that is up (a healthy-enough link), seen
    from the collector's first sample, as after a fresh start or a node-agent restart (no long history yet)."""
    t, n = start, 0
    while t <= end:
        engine.observe_nic(NicSample("node-a", "mlx5_0/1", t, True, {"symbol_error": base + n, "port_rcv_errors": 27}))
        t += 1.0
        if (t - start) % every_s < 1.0:
            n += 1


def steps(engine: Engine, start: float, end: float, dt: float = 0.1) -> None:
    s, t = 1, start
    while t < end:
        for r in range(WORLD):
            engine.observe_step(StepSeen(who(r), s, t, t + dt, 0.02, 0.001, 0.0), t + dt)
        s += 1
        t += dt


def test_background_symbol_errors_do_not_turn_a_sigkill_into_a_nic_fault():
    """Found by `benchmarks/attribution_suite.py --seed 20261203` run 3 (sigkill on rank 3, dirty hardware with
    background counts): crash/nic_errors instead of crash/rank_process_died. A SIGKILL is no network symptom, and a
    trickle steady since the first sample is background, whatever the length of the history."""
    engine = Engine(EngineSettings(crash_settle_s=0.5))
    trickle(engine, T0, T0 + 20)
    steps(engine, T0 + 2, T0 + 15)
    for r in range(WORLD):
        engine.observe_heartbeat(Heartbeat(who(r), T0 + 15, 140, "step", None), T0 + 15)
    engine.observe_exit(ExitSeen(who(3), T0 + 15.2, -9, "SIGKILL"), T0 + 15.3)
    found = []
    t = T0 + 15.3
    while t < T0 + 20:
        found += engine.tick(t)
        t += 0.25
    assert [(r.kind.value, r.root_cause.value, r.culprit.rank) for r in found if not r.withdrawn] == \
        [("crash", "rank_process_died", 3)], [(r.root_cause.value, r.evidence) for r in found]
