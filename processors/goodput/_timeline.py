"""Where in time each counted second of a job went: per incarnation and bucket, the seconds in each time bin.

The ledger counts every second through :meth:`Timeline.add` with the interval it lies in, and its buckets are the
sums of these bins: the picture (``otel-gpu report --plot``) draws the same bins, so it cannot disagree with the
numbers. Bounded: at most :data:`MAX_BINS` bins of content; when a job outgrows them, the bin width doubles and
neighbouring bins merge (their sums unchanged), so a day-long job keeps bins of ~100 s and a 15 s demo bins of 0.04 s.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["MAX_BINS", "PRODUCTIVE", "Timeline"]

#: Bins of content kept per job: ~1.8 px each on a 920 px lane, and ~10 KB of JSON in the job's summary.
MAX_BINS = 512
#: The timeline's name of productive time (the badput buckets go by their BadputBucket values).
PRODUCTIVE = "productive"
_FIRST_BIN_S = 0.01


class Timeline:
    """Seconds per (incarnation, bucket) per bin; bin ``i`` covers ``[origin + i * bin_s, origin + (i + 1) * bin_s)``.

    Example:
        >>> tl = Timeline(100.0)
        >>> tl.add("hang", 0, [(100.0, 103.5)])
        3.5
        >>> tl.export(104.0, {0: (100.0, 104.0)})["incarnations"][0]["seconds"]["hang"][0]
        0
    """

    __slots__ = ("origin", "bin_s", "series", "lo", "hi")

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.bin_s = _FIRST_BIN_S
        self.series: dict[tuple[int, str], dict[int, float]] = {}
        self.lo: int | None = None  # bin range with content
        self.hi: int | None = None

    def _index(self, t: float) -> int:
        return math.floor((t - self.origin) / self.bin_s)

    def _fit(self, a: float, b: float) -> None:
        """Coarsens until [a, b] and what is already there fit in MAX_BINS bins."""
        while True:
            ia, ib = self._index(a), self._index(b)
            lo = ia if self.lo is None else min(self.lo, ia)
            hi = ib if self.hi is None else max(self.hi, ib)
            if hi - lo < MAX_BINS:
                self.lo, self.hi = lo, hi
                return
            self.bin_s *= 2
            for key, bins in self.series.items():
                merged: dict[int, float] = {}
                for i, v in bins.items():
                    merged[i // 2] = merged.get(i // 2, 0.0) + v
                self.series[key] = merged
            if self.lo is not None:
                self.lo, self.hi = self.lo // 2, self.hi // 2

    def add(self, bucket: str, restart_count: int, pieces: Iterable[tuple[float, float]], sign: float = 1.0
            ) -> float:
        """Counts (``sign`` -1: takes back) the intervals ``pieces`` in ``bucket``; returns their length."""
        total = 0.0
        for a, b in pieces:
            if not b > a:
                continue
            self._fit(a, b)
            bins = self.series.setdefault((restart_count, bucket), {})
            total += b - a
            i = self._index(a)
            while a < b:
                edge = self.origin + (i + 1) * self.bin_s
                if edge <= a:  # float rounding at a bin's edge
                    i += 1
                    continue
                e = min(b, edge)
                bins[i] = bins.get(i, 0.0) + sign * (e - a)
                a, i = e, i + 1
        return total

    def total(self, bucket: str, restart_count: int | None = None) -> float:
        return sum(sum(bins.values()) for (rc, b), bins in self.series.items()
                   if b == bucket and (restart_count is None or rc == restart_count))

    def export(self, end: float, incarnations: dict[int, tuple[float, float]],
               extra: tuple[str, int, list[tuple[float, float]]] | None = None) -> dict:
        """The JSON form (what the summary carries and the picture draws): ``{"origin", "bin_s", "end",
        "incarnations": [{"restart_count", "start", "end", "seconds": {bucket: [first_bin, [seconds, ...]]}}]}``,
        seconds rounded to the microsecond. ``extra``: intervals counted in this copy only (a hang still open)."""
        if extra is not None and extra[2]:
            for a, b in extra[2]:
                self._fit(a, b)
        series = self.series
        if extra is not None and extra[2]:
            bucket, rc, pieces = extra
            series = dict(series)
            scratch = Timeline(self.origin)
            scratch.bin_s, scratch.lo, scratch.hi = self.bin_s, self.lo, self.hi
            scratch.series = {(rc, bucket): dict(series.get((rc, bucket), {}))}
            scratch.add(bucket, rc, pieces)
            if scratch.bin_s == self.bin_s:  # fitted above: the scratch copy never coarsens
                series[(rc, bucket)] = scratch.series[(rc, bucket)]
        out = []
        for rc, (start, stop) in sorted(incarnations.items()):
            seconds = {}
            for (n, bucket), bins in sorted(series.items(), key=lambda kv: kv[0][1]):
                if n != rc:
                    continue
                kept = sorted((i, r) for i, r in ((i, round(v, 6)) for i, v in bins.items()) if r > 0)
                if kept:
                    first = kept[0][0]
                    values: list[float] = [0] * (kept[-1][0] - first + 1)
                    for i, r in kept:
                        values[i - first] = r
                    seconds[bucket] = [first, values]
            out.append({"restart_count": rc, "start": round(start, 6), "end": round(stop, 6), "seconds": seconds})
        return {"origin": self.origin, "bin_s": self.bin_s, "end": round(end, 6), "incarnations": out}
