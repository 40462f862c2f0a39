"""What the adversarial suite found, pinned as deterministic engine cases (synthetic observations, no processes), so
that a fix is proven in seconds and never regresses. Each case names the suite run that found it. Both were fixed in
attr-engine's ce43b88 (no background known: only a burst counts; strength before onset).
"""
from __future__ import annotations

from otel_gpu.processors.attribution._engine import Engine
from otel_gpu.processors.attribution.config import AttributionConfig
from otel_gpu.processors.attribution._evidence import DeviceEvidence, strongest
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
    """Found by `benchmarks/attribution_suite.py --seed 20261203` (sigkill on rank 3, dirty hardware with background
    counts): crash/nic_errors instead of crash/rank_process_died. The NIC_ERRORS window looks 60 s back and a
    background rate needs 30 s of history before the window, so for a job younger than ~90 s of collector history
    (a fresh node, a node-agent restart, a slow start) no background is known and any 3 trickle errors blame the node.
    A trickle steady since the first sample is background; and a SIGKILL is no network symptom."""
    engine = Engine(AttributionConfig(crash_settle_s=0.5))
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


def test_a_link_that_went_down_beats_a_background_trickle_that_began_earlier():
    """Found by `benchmarks/attribution_suite.py --seed 20261203` run 3 (nic_down, mlx5_0/1 drops 0.5 s after the
    hang begins, eth0 with background rx_errors): hang/nic_errors (eth0) instead of hang/nic_link_down (mlx5_0/1).
    `strongest()` orders hardware faults by earliest onset, and a trickle's "onset" is its first increment in the
    window, so background noise that started earlier outranks the real link drop."""
    ev = DeviceEvidence()
    for i in range(40):
        t = T0 + i
        ev.observe_nic(NicSample("node-a", "eth0", t, True, {"rx_errors": 12 + i // 4}))
        ev.observe_nic(NicSample("node-a", "mlx5_0/1", t, i < 35, {"link_downed": 2 + (i >= 35)}))
    symptom = T0 + 34.5
    best = strongest(ev.nic_faults("node-a", symptom, job_start=T0 + 5))
    assert best is not None and best.cause.value == "nic_link_down" and best.port == "mlx5_0/1", best


def test_an_old_application_xid_does_not_make_a_double_bit_ecc_error_mere_cleanup():
    """Found by `benchmarks/attribution_suite.py --runs 6 --only xid79 ecc_dbe nic_down straggler two_failures
    os_exit --seed 20261203` run 6 (ecc_dbe on rank 2, an old XID 13 from no rank of the job 23 s before, XID 48 and
    the DBE counter 0.5 s after the CUDA error): crash/gpu_xid (xid 13, "gpu.xid.later=48") instead of
    crash/gpu_ecc_uncorrectable. The earliest XID of a burst is the cause only within a burst; an application XID
    that matches no rank's pid and came long before is no part of it."""
    from otel_gpu.processors.attribution._observations import GpuSample, XidSeen

    ev = DeviceEvidence()
    rank2 = Identity("job-1", 2, host="node-a", pid=2002, local_rank=2, world_size=WORLD, gpu="2")
    for i in range(30):
        ev.observe_gpu(GpuSample("node-a", "2", T0 + i, counters={"ecc_uncorrected": 0 if i < 24 else 1}))
    ev.observe_xid(XidSeen("node-a", "2", 13, T0 + 0.5))  # an earlier job's graphics exception, no pid
    ev.observe_xid(XidSeen("node-a", "2", 48, T0 + 23.9))
    best = strongest(ev.gpu_faults(rank2, T0 + 23.4))
    assert best is not None and best.cause.value == "gpu_ecc_uncorrectable", best
