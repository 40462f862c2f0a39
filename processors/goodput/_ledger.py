"""Per-job time accounting: where the wall time of a job went (docs/design.md section 4).

Invariant (tests/test_goodput.py, a hypothesis test): productive time + every badput bucket (``other`` included) =
wall time, for the job and for each incarnation (the walls of the incarnations partition the job's wall: the restart
gap belongs to the incarnation it leads to). Each second of the timeline is counted once: the job's step time comes
from one rank per step (the ranks of a synchronous job share it), steps never overlap each other, and a checkpoint is
the union of the ranks' checkpoint spans (eight ranks saving the same five seconds count five seconds), its part
inside a step counted by that step's ``checkpoint_time``.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from otel_gpu.processors.goodput._timeline import PRODUCTIVE, Timeline
from otel_gpu.schema.failure import BadputBucket as B

__all__ = ["JobLedger"]


class _Intervals:
    """A bounded union of time intervals: how much of [a, b] is already covered, and adding to it."""

    __slots__ = ("spans",)

    def __init__(self) -> None:
        self.spans: list[list[float]] = []  # sorted, disjoint [start, end]

    def covered(self, a: float, b: float) -> float:
        total = 0.0
        for s, e in self.spans:
            if e <= a:
                continue
            if s >= b:
                break
            total += min(b, e) - max(a, s)
        return total

    def add(self, a: float, b: float) -> float:
        """Adds [a, b]; returns the length that was not covered before."""
        if b <= a:
            return 0.0
        new = (b - a) - self.covered(a, b)
        merged, placed = [], False
        for s, e in self.spans:
            if e < a or s > b:
                if s > b and not placed:
                    merged.append([a, b])
                    placed = True
                merged.append([s, e])
            else:
                a, b = min(a, s), max(b, e)
        if not placed:
            merged.append([a, b])
        merged.sort()
        self.spans = merged[-512:]  # bounded: old intervals are never revisited by an ordered stream
        return new


def _gaps(a: float, b: float, *sets: _Intervals) -> list[tuple[float, float]]:
    """The parts of [a, b] that no interval of ``sets`` covers, in time order."""
    if b <= a:
        return []
    pieces = sorted((max(a, s), min(b, e)) for iv in sets for s, e in iv.spans if e > a and s < b)
    out, at = [], a
    for s, e in pieces:
        if s > at:
            out.append((at, s))
        at = max(at, e)
    if at < b:
        out.append((at, b))
    return out


def _length(pieces: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in pieces)


def _covered(a: float, b: float, *sets: _Intervals) -> float:
    """Length of [a, b] covered by the union of ``sets``."""
    return max(0.0, b - a) - _length(_gaps(a, b, *sets))


def _split(pieces: list[tuple[float, float]], amounts: list[float]) -> list[list[tuple[float, float]]]:
    """Cuts ``pieces`` (in time order) into consecutive runs of the given lengths."""
    out: list[list[tuple[float, float]]] = []
    queue = list(pieces)
    for amount in amounts:
        run: list[tuple[float, float]] = []
        while amount > 1e-12 and queue:
            s, e = queue[0]
            if e - s <= amount + 1e-12:
                run.append((s, e))
                amount -= e - s
                queue.pop(0)
            else:
                run.append((s, s + amount))
                queue[0] = (s + amount, e)
                amount = 0.0
        out.append(run)
    return out


@dataclass
class _Incarnation:
    start: float  # where its wall time begins (the previous incarnation's end)
    first_activity: float | None = None  # its first span or event
    first_step_start: float | None = None
    startup_from: float | None = None  # where its startup was counted from (at its first step)


@dataclass
class JobLedger:
    """The accounting of one job. Every counted second goes into :attr:`timeline` with the interval it lies in; the
    buckets, productive time and ETTR of :meth:`summary` are that timeline's sums (the picture draws the same)."""

    job_id: str
    first_seen: float
    last_seen: float
    restart_count: int = 0
    first_step_start: float | None = None
    counted_steps: set = field(default_factory=set)
    baseline: deque = field(default_factory=lambda: deque(maxlen=50))
    last_checkpoint_end: float | None = None
    incarnation_end: float | None = None
    failures: int = 0
    # (step end, productive seconds, restart count, productive intervals) of counted steps that ended after the last
    # checkpoint save, in arrival order. By time, not by arrival: spans come in batches per rank, so a save can be
    # seen before the steps that preceded it; counting "since the save arrived" called a whole run's progress lost
    # (the demo showed ETTR 0%).
    since_checkpoint: deque = field(default_factory=lambda: deque(maxlen=100_000))
    hang_since: float | None = None
    last_step_end: float = 0.0
    incarnations: dict[int, _Incarnation] = field(default_factory=dict)
    steps_iv: _Intervals = field(default_factory=_Intervals)  # counted step time
    ckpt_iv: _Intervals = field(default_factory=_Intervals)  # counted checkpoint-span time outside steps
    failure_ids: dict[str, list] = field(default_factory=dict)  # failure id -> the productive time it moved
    timeline: Timeline | None = None

    def __post_init__(self) -> None:
        self.incarnations.setdefault(self.restart_count, _Incarnation(self.first_seen))
        if self.timeline is None:
            self.timeline = Timeline(self.first_seen)

    # -- bookkeeping -----------------------------------------------------------------------------------------------
    def _rc(self, restart_count: int | None) -> int:
        """The incarnation that time of ``restart_count`` is counted in (the current one for an unknown count)."""
        n = self.restart_count if restart_count is None else restart_count
        if n in self.incarnations:
            return n
        return self.restart_count if self.restart_count in self.incarnations else next(iter(self.incarnations))

    def _inc(self, restart_count: int | None) -> _Incarnation:
        return self.incarnations[self._rc(restart_count)]

    def _add(self, bucket: B | str, pieces: list[tuple[float, float]], restart_count: int | None = None,
             sign: float = 1.0) -> float:
        name = bucket if isinstance(bucket, str) else bucket.value
        return self.timeline.add(name, self._rc(restart_count), pieces, sign)

    @property
    def productive_s(self) -> float:
        return self.timeline.total(PRODUCTIVE)

    @property
    def badput(self) -> dict[str, float]:
        return {b.value: self.timeline.total(b.value) for b in B}

    def touch(self, t: float, restart_count: int) -> None:
        if restart_count > self.restart_count:
            # A new incarnation: the gap since the last one's end is restart badput, in the new incarnation.
            gap_from = min(max(self.incarnation_end or self.last_seen, self.last_seen), max(t, self.last_seen))
            if self.hang_since is not None:
                self._add(B.HANG, self._hang_between(self.hang_since, gap_from))  # it lasted until the restart
                self.hang_since = None
            self.restart_count = restart_count
            self.incarnations[restart_count] = _Incarnation(gap_from, first_activity=max(t, gap_from))
            self._add(B.RESTART_GAP, [(gap_from, t)])
            self.incarnation_end = None
            self.last_seen = max(self.last_seen, gap_from)
        elif restart_count == self.restart_count:
            self._earlier_activity(self.incarnations[self._rc(restart_count)], t)
        if t < self.first_seen:
            self.first_seen = t
            first = min(self.incarnations)
            self.incarnations[first].start = min(self.incarnations[first].start, t)
        self.last_seen = max(self.last_seen, t)

    def _earlier_activity(self, inc: _Incarnation, t: float) -> None:
        """Activity of a restarted incarnation before the first one seen (spans come in batches, in no particular
        order): its restart gap ended there. Counting the gap up to the first span that happened to arrive counted
        the restarted job's first steps twice (a real restart demo: 1.3 s of steps also in the gap)."""
        if inc.first_activity is not None and inc.start <= t < inc.first_activity:
            self._add(B.RESTART_GAP, [(t, inc.first_activity)], self._rc(None), sign=-1.0)
            inc.first_activity = t

    def _hang_between(self, a: float, b: float) -> list[tuple[float, float]]:
        """Hang time in [a, b]: what no step or checkpoint already counts."""
        return _gaps(a, b, self.steps_iv, self.ckpt_iv)

    # -- what happened ---------------------------------------------------------------------------------------------
    def step(self, step: int, start: float, end: float, data_s: float, ckpt_s: float, ratio: float,
             restart_count: int | None = None) -> None:
        rc = self.restart_count if restart_count is None else restart_count
        key = (rc, step)
        if key in self.counted_steps:
            return  # one rank's span counts for the job (the ranks of a synchronous job share their step time)
        self.counted_steps.add(key)
        if len(self.counted_steps) > 100_000:
            self.counted_steps = set(sorted(self.counted_steps)[-50_000:])
        inc = self._inc(rc)
        if self._rc(rc) == self.restart_count:
            self._earlier_activity(inc, start)
        if inc.first_step_start is None:
            inc.first_step_start = start
            if self.first_step_start is None:
                self.first_step_start = start
            begin = self.first_seen if inc.first_activity is None else inc.first_activity
            inc.startup_from = begin
            # a checkpoint restored (or saved) before the first step is in its own bucket, not in startup
            self._add(B.STARTUP, _gaps(begin, start, self.ckpt_iv), rc)
        elif start < inc.first_step_start:
            # an earlier step seen late: start-up ended at it (what it counted from then on is this step's)
            a = max(start, inc.startup_from if inc.startup_from is not None else start)
            self._add(B.STARTUP, _gaps(a, inc.first_step_start, self.ckpt_iv), rc, sign=-1.0)
            inc.first_step_start = start
        if self.hang_since is not None and start > self.hang_since:
            self._add(B.HANG, self._hang_between(self.hang_since, start), rc)  # the job moved again
            self.hang_since = None
        duration = max(0.0, end - start)
        # Only time not counted yet (another rank's overlapping step, checkpoint spans that came first) is
        # counted here: a checkpoint span seen before comes off this step's checkpoint_time, the rest off its work.
        pieces = _gaps(start, end, self.steps_iv, self.ckpt_iv)
        uncovered = _length(pieces)
        ckpt_seen = _covered(start, end, self.ckpt_iv)
        self.steps_iv.add(start, end)
        data_s = min(max(0.0, data_s), duration)
        ckpt_s = min(max(0.0, ckpt_s), duration - data_s)
        ckpt_new = min(max(0.0, ckpt_s - ckpt_seen), uncovered)
        data_s = min(data_s, uncovered - ckpt_new)
        work = max(0.0, uncovered - ckpt_new - data_s)
        self.last_step_end = max(self.last_step_end, end)
        base = statistics.median(self.baseline) if len(self.baseline) >= 5 else None
        excess = 0.0
        if base is not None and work > ratio * base:
            excess = work - base
        elif work > 0:
            self.baseline.append(work)
        # Where in the step: the wait for data first, then the work, a save last.
        data_iv, work_iv, slow_iv, ckpt_iv = _split(pieces, [data_s, work - excess, excess, ckpt_new])
        self._add(B.DATA_LOADING, data_iv, rc)
        self._add(B.SLOWDOWN, slow_iv, rc)
        self._add(B.CHECKPOINT_SAVE, ckpt_iv, rc)
        productive = self._add(PRODUCTIVE, work_iv, rc)
        if productive > 0 and (self.last_checkpoint_end is None or end > self.last_checkpoint_end):
            self.since_checkpoint.append((end, productive, self._rc(rc), work_iv))

    def checkpoint(self, kind: str, start: float, end: float, inside_step: bool = False,
                   restart_count: int | None = None) -> None:
        """A checkpoint span of any rank. The union over ranks counts; its part inside a counted step is that
        step's checkpoint_time already."""
        if end <= start:
            return
        new = _gaps(start, end, self.steps_iv, self.ckpt_iv)
        inc = self._inc(restart_count)
        if self._rc(restart_count) == self.restart_count:
            self._earlier_activity(inc, start)
        if inc.first_step_start is not None and inc.startup_from is not None:
            # counted in startup already (the first step came before this span): that part moves to its bucket
            a, b = max(start, inc.startup_from), min(end, inc.first_step_start)
            self._add(B.STARTUP, _gaps(a, b, self.steps_iv, self.ckpt_iv), restart_count, sign=-1.0)
        self.ckpt_iv.add(start, end)
        if kind == "save":
            if not inside_step:
                self._add(B.CHECKPOINT_SAVE, new, restart_count)
            self.last_checkpoint_end = max(end, self.last_checkpoint_end or end)
            kept = [entry for entry in self.since_checkpoint if entry[0] > self.last_checkpoint_end]
            self.since_checkpoint.clear()
            self.since_checkpoint.extend(kept)
        else:
            self._add(B.CHECKPOINT_RESTORE, new, restart_count)

    def _move(self, moved: list[tuple[int, list[tuple[float, float]]]], to: B | str, away: B | str) -> None:
        for rc, pieces in moved:
            self._add(away, pieces, rc, sign=-1.0)
            self._add(to, pieces, rc)

    def failure(self, kind: str, onset: float, detected: float, failure_id: str | None = None,
                withdrawn: bool = False) -> None:
        if failure_id:
            if withdrawn:
                moved = self.failure_ids.pop(failure_id, None)
                if moved is not None:  # a false alarm: the progress it called lost was not
                    self.failures -= 1
                    self._move(moved, PRODUCTIVE, B.WASTED_PROGRESS)
                    if kind == "hang":
                        self.hang_since = None
                        self.incarnation_end = None
                return
            if failure_id in self.failure_ids:
                return  # a revision of a failure already counted
        self.failures += 1
        # Progress since the last checkpoint is lost: it moves from productive to wasted, where it was made.
        # Progress made after the last save and before the failure began is lost (steps after its onset are not
        # progress the failure took away).
        budget = self.timeline.total(PRODUCTIVE, self._rc(None))
        moved: list[tuple[int, list[tuple[float, float]]]] = []
        for t, w, rc, pieces in self.since_checkpoint:
            if t > max(onset, detected) or budget <= 0:
                continue
            if w > budget:  # never more than the incarnation made
                pieces = _split(pieces[::-1], [budget])[0][::-1]
                w = budget
            moved.append((rc, pieces))
            budget -= w
        self._move(moved, B.WASTED_PROGRESS, PRODUCTIVE)
        self.since_checkpoint.clear()
        if failure_id:
            self.failure_ids[failure_id] = moved
            if len(self.failure_ids) > 1000:
                self.failure_ids.pop(next(iter(self.failure_ids)))
        if kind == "hang" and self.hang_since is None:
            self.hang_since = max(onset, self.last_step_end)  # time already counted in a step is not hang time
        if kind in ("crash", "hang"):
            self.incarnation_end = detected

    # -- reading ---------------------------------------------------------------------------------------------------
    def summary(self, now: float | None = None) -> dict:
        """The job's accounting; its numbers are the sums of its ``timeline`` (what the picture draws)."""
        end = self.last_seen if now is None else max(self.last_seen, min(now, self.last_seen + 5.0))
        wall = max(0.0, end - self.first_seen)
        order = sorted(self.incarnations)
        spans = {n: (self.incarnations[n].start, self.incarnations[order[i + 1]].start if i + 1 < len(order) else end)
                 for i, n in enumerate(order)}
        open_hang = self._hang_between(self.hang_since, end) if self.hang_since is not None else []
        timeline = self.timeline.export(end, spans, (B.HANG.value, self._rc(None), open_hang))
        totals: dict[str, float] = {}
        incarnations = []
        for inc in timeline["incarnations"]:
            sums = {k: math.fsum(v[1]) for k, v in inc["seconds"].items()}
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + v
            inc_wall = max(0.0, inc["end"] - inc["start"])
            b = {bucket.value: sums.get(bucket.value, 0.0) for bucket in B}
            b[B.OTHER.value] = max(0.0, inc_wall - sum(sums.values()))
            incarnations.append({"restart_count": inc["restart_count"], "wall_time_s": round(inc_wall, 3),
                                 "productive_time_s": round(sums.get(PRODUCTIVE, 0.0), 3),
                                 "badput_s": {k: round(v, 3) for k, v in b.items()}})
        productive = totals.get(PRODUCTIVE, 0.0)
        badput = {bucket.value: totals.get(bucket.value, 0.0) for bucket in B}
        badput[B.OTHER.value] = max(0.0, wall - sum(totals.values()))
        return {"job_id": self.job_id, "ettr": round(productive / wall, 4) if wall > 0 else None,
                "wall_time_s": round(wall, 3), "productive_time_s": round(productive, 3),
                "badput_s": {k: round(v, 3) for k, v in badput.items()}, "failures": self.failures,
                "restarts": self.restart_count, "first_seen": round(self.first_seen, 3),
                "last_seen": round(self.last_seen, 3), "incarnations": incarnations, "timeline": timeline}
