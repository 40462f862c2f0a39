"""Synthetic observation streams for the attribution detectors' unit tests: ranks on hosts, heartbeats, and dirty
hardware baselines (a port down since boot and an unused one never up, the power cap on before the job, NIC errors and
PCIe replays at a background rate, an old XID), as an ordinary machine has them."""
from __future__ import annotations

from dataclasses import dataclass, field

from otel_gpu.processors.attribution._engine import Engine
from otel_gpu.processors.attribution.config import AttributionConfig
from otel_gpu.processors.attribution._observations import (GpuSample, Heartbeat, Identity, Inflight, NicSample,
                                                           Stacks, XidSeen)

T0 = 1_700_000_000.0
USER_FRAMES = [{"file": "/home/me/train.py", "line": 88, "function": "main"},
               {"file": "/usr/lib/python3.11/time.py", "line": 1, "function": "sleep"}]


def latest(records: list) -> dict[str, object]:
    """failure_id -> its latest revision."""
    out: dict[str, object] = {}
    for r in records:
        out[r.failure_id] = r
    return out


@dataclass
class Cluster:
    world: int = 4
    per_host: int = 2
    job: str = "job-1"
    restart: int = 0
    settings: AttributionConfig = field(default_factory=lambda: AttributionConfig(hang_timeout_s=5.0, stack_grace_s=2.0))
    engine: Engine = None
    records: list = field(default_factory=list)  # (t, record)
    t: float = T0

    def __post_init__(self) -> None:
        self.engine = Engine(self.settings)

    def host(self, rank: int) -> str:
        return f"node{rank // self.per_host}"

    def hosts(self) -> list[str]:
        return sorted({self.host(r) for r in range(self.world)})

    def who(self, rank: int) -> Identity:
        return Identity(self.job, rank, host=self.host(rank), pid=1000 + rank, local_rank=rank % self.per_host,
                        world_size=self.world, restart_count=self.restart,
                        gpu_uuid=f"GPU-{self.host(rank)}-{rank % self.per_host}")

    def uuid(self, rank: int) -> str:
        return f"GPU-{self.host(rank)}-{rank % self.per_host}"

    # -- training side ---------------------------------------------------------------------------------------------
    def heartbeat(self, rank: int, t: float, *, step: int = 7, started: dict[str, int] | None = None,
                  inflight: tuple | None = None, stalled: float | None = None, state: str | None = None) -> None:
        """``inflight``: (kind, pg, seq, op, since) or None."""
        infl = None
        if inflight is not None:
            kind, pg, seq, op, since = inflight
            infl = Inflight(kind, op, pg, seq, since)
        started = dict(started or {})
        if infl is not None and infl.kind == "collective":
            started[pg] = max(started.get(pg, 0), seq)
        hb = Heartbeat(self.who(rank), t, step, state or (infl.kind if infl else "step"), infl,
                       {k: v - (1 if infl and k == infl.pg else 0) for k, v in started.items()}, started,
                       stalled_s=stalled)
        self.engine.observe_heartbeat(hb, t)

    def stacks(self, rank: int, t: float, frames=None) -> None:
        frames = USER_FRAMES if frames is None else frames
        self.engine.observe_stacks(Stacks(self.who(rank), t, None, frames), t)

    # -- hardware side ---------------------------------------------------------------------------------------------
    def devices(self, t: float, *, clock: dict[str, frozenset] | None = None, counters: dict | None = None,
                ports: dict | None = None) -> None:
        """One poll of every host's GPUs and ports at ``t``; dirty by default: power cap on everywhere, ifb0 down
        since boot, eth1 down (unused), ib port mlx5_0/1 and eth0 up, rx_errors and pcie_replay at a background
        rate (one every 40 s / 60 s)."""
        for host in self.hosts():
            for i in range(self.per_host):
                rank = self.hosts().index(host) * self.per_host + i
                uuid = f"GPU-{host}-{i}"
                reasons = (clock or {}).get(uuid, frozenset({"sw_power_cap"}))
                c = {"pcie_replay": float(int((t - T0 + 10_000) // 60)), "ecc_uncorrected": 2.0,
                     "nvlink_errors": 0.0}
                c.update((counters or {}).get(uuid, {}))
                self.engine.observe_gpu(GpuSample(host, str(i), t, uuid=uuid, clock_events=reasons, counters=c,
                                                  pids=(1000 + rank,)))
            state = {"ifb0": False, "eth1": False, "mlx5_0/1": True, "eth0": True}
            state.update((ports or {}).get(host, {}))
            for port, up in state.items():
                cnt = {"rx_errors": float(int((t - T0 + 10_000) // 40)), "symbol_error": 17.0, "link_downed": 3.0}
                cnt.update((counters or {}).get(f"{host}:{port}", {}))
                self.engine.observe_nic(NicSample(host, port, t, up=up, counters=cnt))

    def history(self, start: float, end: float, dt: float = 5.0, clock: dict | None = None) -> None:
        """Dirty device history before the job, and an old XID 79 on every host's GPU 0 ten minutes ago."""
        for host in self.hosts():
            self.engine.observe_xid(XidSeen(host, "0", 79, start + 1.0, pid=4242))
        t = start
        while t < end:
            self.devices(t, clock=clock)
            t += dt

    def xid(self, rank: int, code: int, t: float, *, pid: int | None = None) -> None:
        self.engine.observe_xid(XidSeen(self.host(rank), str(rank % self.per_host), code, t, pid=pid))

    # -- driving ---------------------------------------------------------------------------------------------------
    def run(self, start: float, end: float, feed=None, dt: float = 0.5) -> list:
        t, out = start, []
        while t <= end:
            self.t = t
            if feed:
                feed(t)
            found = self.engine.tick(t)
            out += [(t, r) for r in found]
            t += dt
        self.records += out
        return out
