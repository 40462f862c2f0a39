"""Per-job time accounting: where the wall time of a job went (DESIGN section 4)."""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from otel_gpu.schema.failure import BadputBucket as B

__all__ = ["JobLedger"]


@dataclass
class JobLedger:
    job_id: str
    first_seen: float
    last_seen: float
    restart_count: int = 0
    first_step_start: float | None = None
    steps: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)  # step -> start, end, data, ckpt
    counted_steps: set = field(default_factory=set)
    baseline: deque = field(default_factory=lambda: deque(maxlen=50))
    productive_s: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: {b.value: 0.0 for b in B})
    last_checkpoint_end: float | None = None
    incarnation_end: float | None = None
    failures: int = 0
    productive_since_checkpoint: float = 0.0
    hang_since: float | None = None
    last_step_end: float = 0.0
    #: Per incarnation (restart count): start, last activity, productive and wasted seconds, the gap before it.
    incarnations: list = field(default_factory=list)
    #: (end, productive seconds) of this incarnation's steps: progress lost in a failure is what ended after the last
    #: checkpoint, whatever order the ranks' spans arrive in.
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=100_000))

    def _incarnation(self) -> dict:
        if not self.incarnations:
            self.incarnations.append({"restart_count": self.restart_count, "start": self.first_seen,
                                      "end": self.last_seen, "productive_s": 0.0, "wasted_s": 0.0,
                                      "restart_gap_s": 0.0})
        return self.incarnations[-1]

    def touch(self, t: float, restart_count: int) -> None:
        if restart_count > self.restart_count:
            # A new incarnation: the gap since the last one's activity is restart badput.
            gap_from = self.incarnation_end or self.last_seen
            gap = max(0.0, t - gap_from)
            self.badput[B.RESTART_GAP.value] += gap
            self._incarnation()
            self.restart_count = restart_count
            self.incarnation_end = None
            self.incarnations.append({"restart_count": restart_count, "start": t, "end": t, "productive_s": 0.0,
                                      "wasted_s": 0.0, "restart_gap_s": gap})
            del self.incarnations[:-50]
        current = self._incarnation()
        if restart_count == current["restart_count"]:
            current["end"] = max(current["end"], t)
        self.first_seen = min(self.first_seen, t)
        self.last_seen = max(self.last_seen, t)

    def step(self, step: int, start: float, end: float, data_s: float, ckpt_s: float, ratio: float) -> None:
        key = (self.restart_count, step)
        if key in self.counted_steps:
            return  # one rank's span counts for the job (the ranks of a synchronous job share their step time)
        self.counted_steps.add(key)
        if len(self.counted_steps) > 100_000:
            self.counted_steps = set(sorted(self.counted_steps)[-50_000:])
        if self.first_step_start is None:
            self.first_step_start = start
            self.badput[B.STARTUP.value] += max(0.0, start - self.first_seen)
        if self.hang_since is not None and start > self.hang_since:
            self.badput[B.HANG.value] += start - self.hang_since  # the job moved again (restarted or unstuck)
            self.hang_since = None
        duration = max(0.0, end - start)
        self.last_step_end = max(self.last_step_end, end)
        self.badput[B.DATA_LOADING.value] += data_s
        self.badput[B.CHECKPOINT_SAVE.value] += ckpt_s
        work = max(0.0, duration - data_s - ckpt_s)
        base = statistics.median(self.baseline) if len(self.baseline) >= 5 else None
        excess = 0.0
        if base is not None and work > ratio * base:
            excess = work - base
        else:
            self.baseline.append(work)
        self.badput[B.SLOWDOWN.value] += excess
        self.productive_s += work - excess
        self.productive_since_checkpoint += work - excess
        self.recent_steps.append((end, work - excess))
        self._incarnation()["productive_s"] += work - excess

    def checkpoint(self, kind: str, start: float, end: float, inside_step: bool) -> None:
        duration = max(0.0, end - start)
        if kind == "save":
            if not inside_step:
                self.badput[B.CHECKPOINT_SAVE.value] += duration
            self.last_checkpoint_end = max(self.last_checkpoint_end or end, end)  # spans may arrive out of order
            self.productive_since_checkpoint = 0.0
        else:
            self.badput[B.CHECKPOINT_RESTORE.value] += duration

    def failure(self, kind: str, onset: float, detected: float) -> None:
        self.failures += 1
        # Progress since the last checkpoint is lost: it moves from productive to wasted.
        since = self.last_checkpoint_end
        wasted = sum(w for end, w in self.recent_steps if since is None or end > since)
        wasted = min(wasted, self.productive_s)
        self.recent_steps.clear()
        self.productive_s -= wasted
        self.badput[B.WASTED_PROGRESS.value] += wasted
        current = self._incarnation()
        current["productive_s"] -= wasted
        current["wasted_s"] += wasted
        self.productive_since_checkpoint = 0.0
        if kind == "hang" and self.hang_since is None:
            self.hang_since = max(onset, self.last_step_end)  # time already counted in a step is not hang time
        self.incarnation_end = detected

    def summary(self, now: float | None = None) -> dict:
        end = self.last_seen if now is None else max(self.last_seen, min(now, self.last_seen + 5.0))
        wall = max(0.0, end - self.first_seen)
        known = self.productive_s + sum(v for k, v in self.badput.items() if k != B.OTHER.value)
        badput = dict(self.badput)
        if self.hang_since is not None:
            badput[B.HANG.value] += max(0.0, end - self.hang_since)
            known += max(0.0, end - self.hang_since)
        badput[B.OTHER.value] = max(0.0, wall - known)
        return {"job_id": self.job_id, "ettr": round(self.productive_s / wall, 4) if wall > 0 else None,
                "wall_time_s": round(wall, 3), "productive_time_s": round(self.productive_s, 3),
                "badput_s": {k: round(v, 3) for k, v in badput.items()}, "failures": self.failures,
                "restarts": self.restart_count, "first_seen": round(self.first_seen, 3),
                "incarnations": [{k: round(v, 3) if isinstance(v, float) else v for k, v in inc.items()}
                                 for inc in self.incarnations],
                "last_seen": round(self.last_seen, 3)}
