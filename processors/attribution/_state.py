"""Per-job and per-rank state the detectors read; bounded (deques with maxlen, a few fields per rank)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.processors.attribution._observations import (ExceptionSeen, ExitSeen, Heartbeat, Identity, Stacks,
                                                           StateSeen, StepSeen)
from otel_gpu.failure import FailureRecord
from otel_gpu.processors.attribution._types import Finding
from otel_gpu.schema.failure import RootCause

__all__ = ["RankState", "JobState", "OpenVerdict", "merge_identity"]


_NONE: tuple = ()  # a rank's history before its first entry: one shared empty tuple, not four deques per rank


@dataclass(slots=True)
class RankState:
    """What the detectors know of one rank. Slots and histories made on first use: a job of 131,072 ranks holds one
    of these per rank (benchmarks/aggregator_scale.py), and with node digests most ranks never fill a history."""

    who: Identity
    last_heartbeat: Heartbeat | None = None
    last_seen: float = 0.0  # collector clock of the newest report from this rank
    stacks: Stacks | None = None
    exception: ExceptionSeen | None = None  # raised in the main thread (or a thread whose rank then stopped)
    background_exception: ExceptionSeen | None = None  # raised in another thread: a crash only if the rank stops
    exit: ExitSeen | None = None
    frozen: StateSeen | None = None  # its process exists but does not run (state T or D), as its launcher saw
    # StepSeen. Only the newest is read (close_steps); a short history keeps per-rank memory small at aggregator
    # scale (64 per rank held ~100 MB for a 4k-rank job; benchmarks/aggregator_scale.py).
    steps: deque | tuple = _NONE
    compute_baseline: deque | tuple = _NONE  # healthy compute seconds (32)
    data_baseline: deque | tuple = _NONE
    checkpoints: deque | tuple = _NONE  # durations (16)
    rank: int = field(init=False)  # who.rank, read often enough to be a plain attribute

    def __post_init__(self) -> None:
        self.rank = self.who.rank

    def note_step(self, step: StepSeen) -> None:
        if not self.steps:
            self.steps = deque(maxlen=2)
        self.steps.append(step)  # type: ignore[union-attr]

    def learn(self, compute: float | None, data: float | None) -> None:
        """A healthy step's compute and data seconds (the rank's baselines)."""
        if compute is not None:
            if not self.compute_baseline:
                self.compute_baseline = deque(maxlen=32)
            self.compute_baseline.append(compute)  # type: ignore[union-attr]
        if data is not None:
            if not self.data_baseline:
                self.data_baseline = deque(maxlen=32)
            self.data_baseline.append(data)  # type: ignore[union-attr]

    def note_checkpoint(self, duration: float) -> None:
        if not self.checkpoints:
            self.checkpoints = deque(maxlen=16)
        self.checkpoints.append(duration)  # type: ignore[union-attr]

    def failed(self) -> bool:
        """Raised in its main thread, or ended with a non-zero code, a signal, or vanished (no status at all)."""
        return self.exception is not None or (self.exit is not None and (
            self.exit.code not in (0, None) or self.exit.signal is not None or self.exit.vanished))

    def exited_clean(self) -> bool:
        return self.exit is not None and self.exit.code in (0, None) and self.exit.signal is None \
            and self.exception is None and not self.exit.vanished


@dataclass
class OpenVerdict:
    """A record that late evidence may still revise, or progress may withdraw."""

    record: FailureRecord
    finding: Finding
    revise_until: float  # collector clock: after this, hardware evidence no longer revises it
    devices_version: int = 0  # DeviceEvidence.version last looked at (nothing new: nothing to revise)
    crash_reports: int = 0  # JobState.crash_reports when last decided (a later report may change a crash verdict)
    progress: dict[int, tuple] = field(default_factory=dict)  # rank -> progress marker when it was decided
    last_seen: dict[int, float] = field(default_factory=dict)  # rank -> last report when it was decided


@dataclass
class JobState:
    job_id: str
    world_size: int | None = None
    restart_count: int = 0
    start_time: float = 0.0  # when this incarnation was first seen (collector clock)
    ranks: dict[int, RankState] = field(default_factory=dict)
    last_activity: float = 0.0
    net_ifaces: frozenset[str] | None = None  # union of what the ranks say they communicate over
    #: the crash or hang that stands for this incarnation: later crash/hang signals are its consequences, until it
    #: is withdrawn (the ranks progressed again) or the job restarts
    terminal: FailureRecord | None = None
    finished: bool = False  # every rank exited 0
    incident_open: float | None = None  # first crash signal time (collector clock)
    incident_deadline: float | None = None
    incident_extended: bool = False
    failures: int = 0  # failure ids handed out in this job (all incarnations)
    crash_reports: int = 0  # exceptions and failed exits seen in this incarnation (a crash verdict may be revised)
    open: list[OpenVerdict] = field(default_factory=list)
    step_times: dict[int, dict[int, StepSeen]] = field(default_factory=dict)  # step -> rank -> StepSeen
    step_done: deque = field(default_factory=lambda: deque(maxlen=256))  # (step, job step seconds), in order
    baseline: deque = field(default_factory=lambda: deque(maxlen=30))
    slow_flags: deque = field(default_factory=lambda: deque(maxlen=8))
    slow_steps: list = field(default_factory=list)  # steps of the current slowdown episode
    slowdown_active: RootCause | None = None
    last_step_closed: int = -1
    #: node digests of this job (``_digest.DigestJob``), when its sidecars send them; None: per-rank records only
    digest: Any = None

    def new_incarnation(self, restart_count: int, now: float) -> None:
        """A restart: re-arm crash/hang detection, keep the slowdown baseline and the failure numbering."""
        self.restart_count = restart_count
        self.terminal = None
        self.finished = False
        self.incident_open = self.incident_deadline = None
        self.incident_extended = False
        self.ranks.clear()
        self.start_time = now
        self.open = [o for o in self.open if o.record.kind.value == "slowdown"]


def merge_identity(known: Identity, new: Identity) -> Identity:
    """Fills what ``known`` lacks from ``new``; never overwrites (a launcher's report about a rank carries the
    launcher's own pid and no local rank)."""
    fields = {f: getattr(known, f) if getattr(known, f) is not None else getattr(new, f)
              for f in ("host", "pid", "local_rank", "world_size", "gpu", "gpu_uuid", "net_ifaces", "started")}
    return Identity(known.job_id, known.rank, restart_count=max(known.restart_count, new.restart_count), **fields)
