"""What the attribution engine observes, decoded from OTLP by the processor; plain data, no OTLP types."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Identity", "Heartbeat", "Stacks", "ExceptionSeen", "ExitSeen", "StateSeen", "StepSeen", "SpanSeen",
           "GpuSample", "XidSeen", "NicSample", "NodeStep"]


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a training record came from (resource attributes)."""

    job_id: str
    rank: int
    host: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    gpu: str | None = None  # CUDA device index (as text) when known
    restart_count: int = 0
    gpu_uuid: str | None = None  # the CUDA device's UUID ("GPU-..."), the surest join to NVML
    net_ifaces: frozenset[str] | None = None  # network interfaces / HCAs the rank communicates over, when known
    started: float | None = None  # when the rank's process was created (process.creation.time), when known


@dataclass
class Inflight:
    kind: str  # "collective" | "data" | "checkpoint" | other
    op: str | None
    pg: str | None
    seq: int | None
    since: float
    bytes: int | None = None
    p2p: bool = False  # a send/recv: its peer is not known from the group, so it adds no wait-for edge


@dataclass
class Heartbeat:
    who: Identity
    time: float
    step: int | None
    state: str | None
    inflight: Inflight | None
    last_seq: dict[str, int] = field(default_factory=dict)
    last_started_seq: dict[str, int] = field(default_factory=dict)
    stack_top: str | None = None  # innermost frame of the main thread, when the heartbeat carries it
    stalled_s: float | None = None  # seconds without progress, as the rank's watchdog counts them
    steps_done: int | None = None  # optimizer steps the rank completed (its own counter), when it says


@dataclass
class Stacks:
    who: Identity
    time: float
    top: str | None
    frames: list[dict[str, Any]] = field(default_factory=list)  # main thread, outermost first


@dataclass
class ExceptionSeen:
    who: Identity
    time: float
    type: str
    message: str
    hint: str | None
    stack: str = ""
    thread: str | None = None  # the thread it was raised in; None or "MainThread" for the main thread


@dataclass
class ExitSeen:
    who: Identity
    time: float  # when the process ended (the launcher stamps the record so), not when its status was read
    code: int | None
    signal: str | None
    how: str | None = None  # exited | exception | killed | vanished (gone with no status: a death, never clean)

    @property
    def vanished(self) -> bool:
        return self.how == "vanished" and self.signal is None and self.code in (None, 0)


@dataclass
class StateSeen:
    """``otel-gpu run`` saw a live rank frozen (its main thread in state T or D), or running again (``frozen``
    None)."""

    who: Identity
    time: float  # since when it is frozen (or when it ran again)
    state: str  # R S D T t
    frozen: str | None  # stopped | gpu_driver | uninterruptible | None (runs again)
    wchan: str = ""
    stack: str = ""  # kernel stack, innermost first (only when the launcher runs as root)


@dataclass
class StepSeen:
    who: Identity
    step: int
    start: float
    end: float
    collective_s: float | None = None
    data_s: float | None = None
    checkpoint_s: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


def _most_first(t: tuple[float, int, float, float]) -> tuple[float, int]:
    return -t[0], t[1]


@dataclass(slots=True)
class NodeStep:
    """One step of a job as its node digests sum it up (their step rows, ``processors/compact/_digest.py``), merged
    over the nodes: what the slowdown detector reads instead of every rank's StepSeen."""

    start: float  # the earliest start a row gave
    duration: float = 0.0  # the slowest rank's
    nodes: int = 0  # rows merged
    data_min: float | None = float("inf")  # the least growth of a rank's data time over its baseline
    floor: float | None = float("inf")  # the least (collective s + compute and data baselines) of a rank; None: unknown
    #: (growth, rank, compute growth, data growth), most first: the ranks whose own time grew most (KEEP at most)
    top: list[tuple[float, int, float, float]] = field(default_factory=list)

    KEEP = 4

    def add(self, row: list) -> None:
        """Merges one node's row ``[step, ranks, start, end, duration, data_s, checkpoint_s, data_growth_min,
        collective_floor_min, [[rank, compute_growth, data_growth], ...]]``."""
        self.nodes += 1
        self.start = min(self.start, float(row[2]))
        self.duration = max(self.duration, float(row[4]))
        if self.data_min is not None:
            self.data_min = None if row[7] is None else min(self.data_min, float(row[7]))
        if self.floor is not None:
            self.floor = None if row[8] is None else min(self.floor, float(row[8]))
        top = self.top  # kept most first
        for n, dc, dd in row[9] or ():
            dc, dd = float(dc), float(dd)
            grew = max(dc, dd)
            if len(top) >= self.KEEP and grew <= top[-1][0]:
                continue  # the usual row: nobody grew more than those kept
            top.append((grew, int(n), dc, dd))
            top.sort(key=_most_first)
            del top[self.KEEP:]

    @property
    def bound(self) -> float:
        """What a rank not among ``top`` grew at most (the least kept; 0.0 with none kept)."""
        return min((t[0] for t in self.top), default=0.0)

    def growth_of(self, rank: int) -> tuple[float, float]:
        """(compute growth, data growth) of ``rank`` in this step; its bound when it is not among the kept."""
        for _, n, dc, dd in self.top:
            if n == rank:
                return dc, dd
        return self.bound, self.bound


@dataclass
class SpanSeen:
    """A data-wait or checkpoint span (kind "data" | "checkpoint_save" | "checkpoint_load" | "collective")."""

    who: Identity
    kind: str
    start: float
    end: float
    step: int | None = None


@dataclass
class GpuSample:
    host: str
    gpu: str  # NVML index as text
    time: float
    uuid: str | None = None
    clock_events: frozenset[str] | None = None  # active clock-event reasons, e.g. {"hw_thermal_slowdown"}
    counters: dict[str, float] = field(default_factory=dict)  # cumulative: ecc_uncorrected, xid, nvlink_errors, ...
    pids: tuple[int, ...] = ()


@dataclass
class XidSeen:
    host: str
    gpu: str | None
    code: int
    time: float
    pci_bus_id: str | None = None
    message: str = ""
    pid: int | None = None  # the process the XID hit, when the driver names it


@dataclass
class NicSample:
    host: str
    port: str  # "mlx5_0/1" or "eth0"
    time: float
    up: bool | None = None
    counters: dict[str, float] = field(default_factory=dict)  # cumulative error counters by name
