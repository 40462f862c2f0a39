"""What the attribution engine observes, decoded from OTLP by the processor; plain data, no OTLP types."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Identity", "Heartbeat", "Stacks", "ExceptionSeen", "ExitSeen", "StateSeen", "StepSeen", "SpanSeen",
           "GpuSample", "XidSeen", "NicSample"]


@dataclass(frozen=True)
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
