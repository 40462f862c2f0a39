"""Goodput pictures: per job, where its wall time went (productive time and badput buckets), one lane per
incarnation, failures and restarts marked.

Drawn from the job's latest goodput summary: its ``timeline`` is the goodput ledger's own record of where each second
went (``processors/goodput/_timeline.py``), the bins whose sums *are* the summary's buckets. So the picture cannot
disagree with the numbers: a hang starts at its onset (the ledger counts it from there once the failure is known),
and "other" is drawn only where the ledger has none of its buckets. Failures come from the store's failure records
(a line at their detection time).

Three outputs of one model (:class:`JobTimeline`):

- a one-line text timeline (``otel-gpu report``): each character one 1/width of the job's time, as many characters
  of each bucket as its share (within one), ``!`` a failure and ``|`` a restart inserted where they happened;
- SVG (``--plot FILE.svg``), written here, no dependency;
- PNG (``--plot FILE.png``) through matplotlib, an optional extra: ``pip install 'otel-gpu[plot]'``. Without it,
  asking for a PNG is an error that says so (no file is written under a name that promised another format).

Example:
    >>> summary = {"job_id": "j", "ettr": 0.5, "wall_time_s": 20, "productive_time_s": 10, "badput_s": {"hang": 10},
    ...            "timeline": {"origin": 0.0, "bin_s": 5.0, "end": 20.0, "incarnations": [
    ...                {"restart_count": 0, "start": 0.0, "end": 20.0,
    ...                 "seconds": {"productive": [0, [5, 5]], "hang": [2, [5, 5]]}}]}}
    >>> tl = job_timeline("j", summary, [{"kind": "hang", "detected_time": 17.0, "root_cause": "rank_not_in_collective"}])
    >>> one_line(tl, width=20)
    '[##########HHHHHHH!HHH]'
    >>> render_svg([tl]).count('class="segment')
    2
"""
from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

from otel_gpu.failure import printable

__all__ = ["KINDS", "JobTimeline", "Lane", "Marker", "PlotUnavailable", "Segment", "job_timeline", "legend_line",
           "one_line", "render_figure", "render_png", "render_svg", "write"]

#: kind -> (fill colour, text-timeline character, label), in the legend's order. The kinds are the goodput ledger's:
#: ``productive`` and the BadputBucket values.
KINDS: dict[str, tuple[str, str, str]] = {
    "productive": ("#2e9d4a", "#", "productive"),
    "startup": ("#f0a03c", "s", "startup"),
    "data_loading": ("#e5d23a", "d", "data loading"),
    "checkpoint_save": ("#3a7be5", "c", "checkpoint save"),
    "checkpoint_restore": ("#7fb2f0", "r", "checkpoint restore"),
    "hang": ("#d62f2f", "H", "hang"),
    "wasted_progress": ("#8e4fc2", "w", "wasted progress"),
    "restart_gap": ("#8a5a3c", "g", "restart gap"),
    "slowdown": ("#e07fb0", "~", "slowdown"),
    "other": ("#b9b9b9", ".", "other"),
}
_FAILURE_COLOUR, _RESTART_COLOUR = "#111111", "#1f4fbf"
# Inside one bin of the ledger's timeline (the order there is not recorded): what usually comes first in time first.
_ORDER = ("restart_gap", "startup", "checkpoint_restore", "data_loading", "productive", "wasted_progress", "slowdown",
          "checkpoint_save", "hang", "other")
_MAX_BINS_READ = 4 * 512  # the ledger writes at most 512 per bucket and incarnation (processors/goodput/_timeline.py)
_TINY_S = 1e-6  # float noise (unix times carry ~0.2 us; the bins are rounded to 1 us), not a segment


class PlotUnavailable(RuntimeError):
    """A PNG was asked for and matplotlib is not installed."""


@dataclass
class Segment:
    t0: float
    t1: float
    kind: str  # a key of KINDS


@dataclass
class Marker:
    t: float
    kind: str  # "failure" or "restart"
    label: str


@dataclass
class Lane:
    """One incarnation of the job (its ``training.restart_count``): its part of the wall time and its segments."""

    restart_count: int
    start: float
    end: float
    segments: list[Segment] = field(default_factory=list)


@dataclass
class JobTimeline:
    job_id: str
    start: float
    end: float
    ettr: float | None
    productive_s: float
    wall_s: float
    lanes: list[Lane] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    badput_s: dict[str, float] = field(default_factory=dict)  # the summary's buckets, for the subtitle
    note: str = ""  # why there is nothing to draw

    @property
    def segments(self) -> list[Segment]:
        return [s for lane in self.lanes for s in lane.segments]

    def drawn_s(self, kind: str) -> float:
        """Seconds of ``kind`` in the segments (what the picture draws)."""
        return sum(s.t1 - s.t0 for s in self.segments if s.kind == kind)

    @property
    def title(self) -> str:
        ettr = f"{self.ettr * 100:.1f}%" if self.ettr is not None else "unknown"
        failures = sum(1 for m in self.markers if m.kind == "failure")
        restarts = max(0, len(self.lanes) - 1)
        return (f"job {self.job_id}: ETTR {ettr} (productive {_dur(self.productive_s)} of {_dur(self.wall_s)}; "
                f"{failures} failure{'s' if failures != 1 else ''}, {restarts} restart{'s' if restarts != 1 else ''})")

    @property
    def subtitle(self) -> str:
        parts = [(k, v) for k, v in self.badput_s.items() if k in KINDS and v >= _LEGEND_MIN_S]
        parts.sort(key=lambda kv: -kv[1])
        return "badput: " + (", ".join(f"{KINDS[k][2]} {_dur(v)}" for k, v in parts) or "none")


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _num(value: Any, default: float = 0.0) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return out if math.isfinite(out) else default


def _lane(inc: dict[str, Any], origin: float, bin_s: float, job: tuple[float, float]) -> Lane:
    """A lane's segments from its bins: in each bin its buckets in :data:`_ORDER`, then what none of them counts
    ("other") up to the bin's end; what a bin holds is drawn whole, so each kind's width is its sum. Bins outside
    the job's time, or more than the ledger ever writes, come from no ledger and are left out."""
    lane = Lane(int(_num(inc.get("restart_count"))), _num(inc.get("start")), _num(inc.get("end")))
    bins: dict[int, dict[str, float]] = {}
    seconds = inc.get("seconds") if isinstance(inc.get("seconds"), dict) else {}
    lo, hi = math.floor((job[0] - origin) / bin_s) - 1, math.floor((job[1] - origin) / bin_s) + 1
    for kind, entry in seconds.items():
        if kind not in KINDS or kind == "other" or not isinstance(entry, list) or len(entry) != 2 \
                or not isinstance(entry[1], list):
            continue
        first = int(_num(entry[0]))
        for j, v in enumerate(entry[1][:_MAX_BINS_READ]):
            v = _num(v)
            if v > 0 and lo <= first + j <= hi:
                bins.setdefault(first + j, {})[kind] = v
    out = lane.segments

    def put(t0: float, t1: float, kind: str) -> None:
        if t1 - t0 < _TINY_S:
            return
        if out and out[-1].kind == kind and abs(out[-1].t1 - t0) < _TINY_S:
            out[-1].t1 = t1
        else:
            out.append(Segment(t0, t1, kind))

    at = lane.start
    for i in sorted(bins):
        b0 = origin + i * bin_s
        x = max(at, b0, lane.start)
        put(at, x, "other")
        for kind in _ORDER:
            v = bins[i].get(kind, 0.0)
            if v > 0:
                put(x, x + v, kind)
                x += v
        cap = min(b0 + bin_s, lane.end)
        put(x, cap, "other")
        at = max(x, cap)
    put(at, lane.end, "other")
    return lane


def _decision_label(restart_count: int, decision: dict[str, Any] | None) -> str:
    """A restart's marker label: which nodes left and joined (many nodes) and what a blind restart would have cost.

    >>> _decision_label(1, {"decision": "exclude_and_restart", "exclude_hosts": ["node1"], "joined": ["node2"],
    ...                     "time_saved_s": 2400})
    'restart 1: without node1, spare node2 joined, saved ~40.0 min'
    """
    if not isinstance(decision, dict):
        return f"restart {restart_count}"
    parts = []
    left = decision.get("exclude_hosts")
    if isinstance(left, list) and left:
        parts.append("without " + ", ".join(printable(h) for h in left[:8]))
    elif decision.get("excluded"):
        parts.append(f"without {printable(decision['excluded'])}")
    joined = decision.get("joined")
    if isinstance(joined, list) and joined:
        parts.append("spare " + ", ".join(printable(h) for h in joined[:8]) + " joined")
    saved = _num(decision.get("time_saved_s"), math.nan)
    if math.isfinite(saved) and saved > 0:
        parts.append(f"saved ~{_dur(saved)}")
    return f"restart {restart_count}" + (": " + ", ".join(parts) if parts else "")


def job_timeline(job_id: str, summary: dict[str, Any] | None, failures: list[dict[str, Any]] | None = None,
                 decisions: list[dict[str, Any]] | None = None) -> JobTimeline:
    """The timeline of one job from its latest goodput summary, its failure records and its restart decisions
    (``otel-gpu run --restart``: a restart's marker says which nodes left and joined)."""
    summary = summary if isinstance(summary, dict) else {}
    raw = summary.get("timeline")
    ettr = summary.get("ettr")
    badput = summary.get("badput_s") if isinstance(summary.get("badput_s"), dict) else {}
    tl = JobTimeline(str(job_id), 0.0, 0.0, _num(ettr) if ettr is not None else None,
                     _num(summary.get("productive_time_s")), _num(summary.get("wall_time_s")),
                     badput_s={str(k): _num(v) for k, v in badput.items()})
    if not isinstance(raw, dict) or not isinstance(raw.get("incarnations"), list) or not raw["incarnations"]:
        tl.note = "no goodput history" if not summary else "no timeline in this summary (written by an older otel-gpu)"
        return tl
    origin, bin_s = _num(raw.get("origin")), _num(raw.get("bin_s"), 1.0)
    incs = [inc for inc in raw["incarnations"] if isinstance(inc, dict)]
    bounds = [_num(inc.get(k)) for inc in incs for k in ("start", "end")]
    if bin_s <= 0 or not bounds or not math.isfinite((max(bounds) - origin) / bin_s):
        tl.note = "a timeline this otel-gpu cannot read"
        return tl
    tl.lanes = [_lane(inc, origin, bin_s, (min(bounds), max(bounds))) for inc in incs]
    tl.lanes.sort(key=lambda lane: (lane.start, lane.restart_count))
    tl.start = min(lane.start for lane in tl.lanes)
    tl.end = max([_num(raw.get("end"), tl.start)] + [lane.end for lane in tl.lanes]
                 + [s.t1 for s in tl.segments])
    by_incarnation = {d.get("incarnation"): d for d in decisions or [] if isinstance(d, dict)
                      and d.get("decision") in ("restart", "exclude_and_restart")}
    for lane in tl.lanes[1:]:
        label = _decision_label(lane.restart_count, by_incarnation.get(lane.restart_count - 1))
        tl.markers.append(Marker(lane.start, "restart", label))
    for f in failures or []:
        if isinstance(f, dict) and f.get("detected_time") is not None and f.get("status") != "withdrawn" \
                and f.get("withdrawn") is not True:
            t = _num(f.get("detected_time"), math.nan)
            if math.isfinite(t) and tl.start <= t <= tl.end + 60:
                tl.markers.append(Marker(t, "failure", str(f.get("root_cause") or f.get("kind") or "failure")))
                tl.end = max(tl.end, t)
    tl.markers.sort(key=lambda m: (m.t, m.kind != "failure"))  # a restart follows the failure it answers
    return tl


# -- text ----------------------------------------------------------------------------------------------------------
def _cells(tl: JobTimeline, width: int) -> list[str]:
    """Kinds (or "" for no lane) of ``width`` equal cells: each kind gets its share of cells (largest remainder,
    so within one of seconds / cell), placed in time order where its deficit is largest."""
    span = tl.end - tl.start
    cell = span / width
    pieces = sorted(((s.t0, s.t1, s.kind) for s in tl.segments), key=lambda p: p[0])
    covered = sum(t1 - t0 for t0, t1, _ in pieces)
    totals: dict[str, float] = {"": max(0.0, span - covered)}
    for _, _, t1_kind in pieces:
        totals.setdefault(t1_kind, 0.0)
    for t0, t1, kind in pieces:
        totals[kind] += t1 - t0
    exact = {k: v / cell for k, v in totals.items()}
    quota = {k: math.floor(v) for k, v in exact.items()}
    rest = width - sum(quota.values())
    for k in sorted(exact, key=lambda k: -(exact[k] - quota[k]))[:max(0, rest)]:
        quota[k] += 1
    # cumulative seconds of each kind up to each cell's end, by a sweep over the segments (gaps are "")
    cum = {k: 0.0 for k in totals}
    given = {k: 0 for k in totals}
    out, j, at, partial = [], 0, tl.start, None
    for i in range(width):
        edge = tl.start + span * (i + 1) / width
        while at < edge:
            if partial is None and j < len(pieces):
                partial = list(pieces[j])
                j += 1
            if partial is None:
                cum[""] += edge - at
                at = edge
                break
            t0, t1, kind = partial
            if t0 > at:  # a gap before the next segment
                step = min(t0, edge) - at
                cum[""] += step
                at += step
                continue
            stop = min(t1, edge)
            cum[kind] += max(0.0, stop - max(t0, at))
            at = max(at, stop)
            if t1 <= edge:
                partial = None
        choices = [k for k in totals if given[k] < quota[k]]
        best = max(choices, key=lambda k: cum[k] / cell - given[k])
        given[best] += 1
        out.append(best)
    return out


def one_line(tl: JobTimeline, width: int = 60) -> str:
    """``[sss###d###!HHHH|gg####]``: ``width`` characters, one per 1/width of the job's time, each bucket's
    character as many times as its share (:data:`KINDS`: ``#`` productive, ``H`` hang, ...); ``!`` a failure and
    ``|`` a restart are inserted before the character of the time they happened."""
    if tl.end - tl.start <= 0 or not tl.segments:
        return "[" + " " * width + "]"
    cells = [KINDS[k][1] if k else " " for k in _cells(tl, width)]
    span = tl.end - tl.start
    inserts: dict[int, str] = {}
    for m in tl.markers:
        i = min(width - 1, max(0, int((m.t - tl.start) / span * width)))
        inserts[i] = inserts.get(i, "") + ("!" if m.kind == "failure" else "|")
    return "[" + "".join(inserts.get(i, "") + c for i, c in enumerate(cells)) + "]"


def legend_line() -> str:
    return "  ".join(f"{ch} {label}" for _, ch, label in KINDS.values()) + "  ! failure  | restart"


# -- layout shared by SVG and PNG ------------------------------------------------------------------------------------
def _ticks(span: float, target: int = 8) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten) from 0 to ``span`` seconds."""
    if span <= 0:
        return [0.0]
    raw = span / target
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def _tick_label(s: float) -> str:
    return f"{s:g}"


_LEGEND_MIN_S = 0.05  # what the report prints as 0.0 s is no colour to look for (an onset rounded to the ms)


def _kinds_present(timelines: list[JobTimeline]) -> list[str]:
    """The legend's kinds: those drawn for at least 0.05 s in some job, in :data:`KINDS` order."""
    present = {k for tl in timelines for k in KINDS if tl.drawn_s(k) >= _LEGEND_MIN_S}
    return [k for k in KINDS if k in present] or ["productive"]


def _marker_legend(timelines: list[JobTimeline]) -> list[tuple[str, str]]:
    kinds = {m.kind for tl in timelines for m in tl.markers}
    return ([(_FAILURE_COLOUR, "failure detected")] if "failure" in kinds else []) + \
        ([(_RESTART_COLOUR, "restart")] if "restart" in kinds else [])


def _lane_label(lane: Lane) -> str:
    return f"incarnation {lane.restart_count}"


# -- SVG -------------------------------------------------------------------------------------------------------------
_W, _PAD, _LABEL_W = 960, 20, 110
_BAR_X0, _BAR_X1 = _PAD + _LABEL_W, _W - _PAD  # 130 .. 940: 810 px of time
_TITLE_H, _LANE_H, _LANE_GAP, _AXIS_H, _JOB_GAP = 52, 24, 6, 40, 18
_LEGEND_PER_ROW, _LEGEND_STEP, _LEGEND_ROW_H = 5, 185, 22
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _esc(text: Any) -> str:
    """Text from telemetry (job ids, root causes) as XML character data or attribute value: escaped, and
    without the characters XML 1.0 forbids (controls shown escaped, as the report shows them)."""
    return escape(_XML_BAD.sub("\ufffd", printable(text)), {'"': "&quot;", "'": "&#39;"})


def _job_height(tl: JobTimeline) -> int:
    lanes = max(1, len(tl.lanes))
    return _TITLE_H + lanes * (_LANE_H + _LANE_GAP) + _AXIS_H + _JOB_GAP


def _svg_size(timelines: list[JobTimeline]) -> tuple[int, int]:
    legend_rows = -(-(len(_kinds_present(timelines)) + len(_marker_legend(timelines))) // _LEGEND_PER_ROW)
    return _W, _PAD + sum(_job_height(tl) for tl in timelines or [JobTimeline("", 0, 0, None, 0, 0)]) \
        + legend_rows * _LEGEND_ROW_H + _PAD


def _px_per_s(tl: JobTimeline) -> float:
    span = tl.end - tl.start
    return (_BAR_X1 - _BAR_X0) / span if span > 0 else 0.0


def render_svg(timelines: list[JobTimeline]) -> str:
    """An SVG document: per job its title (job id, ETTR), its badput in words, one lane per incarnation with its
    segments, failure and restart lines, a time axis in seconds; then the legend. Every segment and marker carries a
    ``<title>`` tooltip; each job's group says its scale (``data-px-per-s``)."""
    width, height = _svg_size(timelines)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">',
           "<title>otel-gpu goodput timeline</title>",
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>']
    y = _PAD
    for tl in timelines:
        scale = _px_per_s(tl)
        out.append(f'<g class="job" data-job="{_esc(tl.job_id)}" data-px-per-s="{scale:.6f}" '
                   f'data-start="{tl.start:.6f}">')
        out.append(f'<text class="title" x="{_PAD}" y="{y + 14}" font-size="14" font-weight="bold">'
                   f'{_esc(tl.title)}</text>')
        out.append(f'<text class="subtitle" x="{_PAD}" y="{y + 32}" fill="#444">{_esc(tl.subtitle)}</text>')
        top = y + _TITLE_H
        if not tl.lanes:
            out.append(f'<text x="{_BAR_X0}" y="{top + 16}" fill="#666">{_esc(tl.note or "nothing to draw")}</text>')
        for k, lane in enumerate(tl.lanes):
            ly = top + k * (_LANE_H + _LANE_GAP)
            out.append(f'<g class="lane" data-restart-count="{lane.restart_count}">')
            out.append(f'<text class="lane-label" x="{_BAR_X0 - 8}" y="{ly + _LANE_H / 2 + 4:.1f}" '
                       f'text-anchor="end">{_esc(_lane_label(lane))}</text>')
            for seg in lane.segments:
                x0 = _BAR_X0 + (seg.t0 - tl.start) * scale
                colour, _, label = KINDS[seg.kind]
                out.append(f'<rect class="segment {seg.kind}" x="{x0:.3f}" y="{ly}" '
                           f'width="{(seg.t1 - seg.t0) * scale:.3f}" height="{_LANE_H}" fill="{colour}">'
                           f'<title>{_esc(label)}: {seg.t1 - seg.t0:.2f} s (at {seg.t0 - tl.start:.2f} s to '
                           f'{seg.t1 - tl.start:.2f} s)</title></rect>')
            out.append("</g>")
        bottom = top + max(1, len(tl.lanes)) * (_LANE_H + _LANE_GAP) - _LANE_GAP
        for m in tl.markers:
            x = _BAR_X0 + (m.t - tl.start) * scale
            colour = _FAILURE_COLOUR if m.kind == "failure" else _RESTART_COLOUR
            dash = "" if m.kind == "failure" else ' stroke-dasharray="4 3"'
            out.append(f'<g class="marker {m.kind}"><line x1="{x:.2f}" y1="{top - 6}" x2="{x:.2f}" y2="{bottom + 4}" '
                       f'stroke="{colour}" stroke-width="2"{dash}/>'
                       + (f'<text x="{x + 4:.2f}" y="{top - 2}" font-size="10" fill="{colour}">{_esc(m.label)}</text>'
                          if m.kind == "failure" or ":" in m.label else "")  # a plain restart: its lane says it
                       + f'<title>{m.kind}: {_esc(m.label)} at {m.t - tl.start:.2f} s</title></g>')
        if tl.lanes:
            ay = bottom + 6
            out.append(f'<g class="axis"><line x1="{_BAR_X0}" y1="{ay}" x2="{_BAR_X1}" y2="{ay}" stroke="#555"/>')
            for s in _ticks(tl.end - tl.start):
                x = _BAR_X0 + s * scale
                out.append(f'<line x1="{x:.2f}" y1="{ay}" x2="{x:.2f}" y2="{ay + 4}" stroke="#555"/>'
                           f'<text x="{x:.2f}" y="{ay + 16}" font-size="10" text-anchor="middle" fill="#333">'
                           f'{_tick_label(s)}</text>')
            out.append(f'<text x="{(_BAR_X0 + _BAR_X1) / 2}" y="{ay + 31}" font-size="11" text-anchor="middle" '
                       f'fill="#333">seconds since the job started</text></g>')
        out.append("</g>")
        y += _job_height(tl)
    out.append('<g class="legend">')
    items = [(KINDS[k][0], KINDS[k][2], False) for k in _kinds_present(timelines)]
    items += [(colour, label, True) for colour, label in _marker_legend(timelines)]
    for j, (colour, label, line) in enumerate(items):
        x, ly = _PAD + (j % _LEGEND_PER_ROW) * _LEGEND_STEP, y + (j // _LEGEND_PER_ROW) * _LEGEND_ROW_H
        if line:
            out.append(f'<line x1="{x + 6}" y1="{ly}" x2="{x + 6}" y2="{ly + 12}" stroke="{colour}" stroke-width="2"'
                       + ('' if label.startswith("failure") else ' stroke-dasharray="4 3"') + "/>")
        else:
            out.append(f'<rect x="{x}" y="{ly}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text class="legend-label" x="{x + 18}" y="{ly + 11}">{_esc(label)}</text>')
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


# -- PNG (matplotlib) --------------------------------------------------------------------------------------------------
PNG_DPI, PNG_WIDTH_IN = 100, 12.0


def _mpl_text(text: Any) -> str:
    """Telemetry text for matplotlib: a ``$`` would start mathtext (and a bad formula fails the whole drawing);
    control characters have no glyph (shown escaped, as the report shows them)."""
    return _XML_BAD.sub("\ufffd", printable(text)).replace("$", r"\$")


def png_size(timelines: list[JobTimeline]) -> tuple[int, int]:
    """The PNG's size in pixels: 1200 wide; per job a title, its lanes and an axis; the legend."""
    height_in = 0.9 + sum(1.25 + 0.38 * max(1, len(tl.lanes)) for tl in timelines or [None])
    return int(round(PNG_WIDTH_IN * PNG_DPI)), int(round(height_in * PNG_DPI))


def render_figure(timelines: list[JobTimeline]):
    """The picture as a matplotlib Figure (Agg, no pyplot: no global state, no display). Raises PlotUnavailable
    without matplotlib."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise PlotUnavailable("writing a PNG needs matplotlib: pip install 'otel-gpu[plot]' (or write an .svg, "
                              "which needs nothing)") from exc
    timelines = timelines or [JobTimeline("", 0.0, 0.0, None, 0.0, 0.0, note="no jobs")]
    w, h = png_size(timelines)
    fig = Figure(figsize=(w / PNG_DPI, h / PNG_DPI), dpi=PNG_DPI, layout="constrained")
    axes = fig.subplots(len(timelines), 1, squeeze=False,
                        height_ratios=[1.25 + 0.38 * max(1, len(tl.lanes)) for tl in timelines])[:, 0]
    for ax, tl in zip(axes, timelines):
        ax.set_title(_mpl_text(tl.title) + "\n" + _mpl_text(tl.subtitle), loc="left", fontsize=10)
        span = tl.end - tl.start
        if not tl.lanes or span <= 0:
            ax.text(0.5, 0.5, _mpl_text(tl.note or "nothing to draw"), ha="center", va="center",
                    transform=ax.transAxes, color="#666666")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        n = len(tl.lanes)
        for k, lane in enumerate(tl.lanes):
            row = n - 1 - k  # the first incarnation on top
            by_kind: dict[str, list[tuple[float, float]]] = {}
            for seg in lane.segments:
                by_kind.setdefault(seg.kind, []).append((seg.t0 - tl.start, seg.t1 - seg.t0))
            for kind, bars in by_kind.items():
                ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=KINDS[kind][0], edgecolor="none", linewidth=0,
                               label=f"_{kind}", gid=f"segment {kind}")
        for m in tl.markers:
            failure = m.kind == "failure"
            ax.axvline(m.t - tl.start, color=_FAILURE_COLOUR if failure else _RESTART_COLOUR, linewidth=1.6,
                       linestyle="-" if failure else "--")
            if failure:  # in the headroom above the first lane
                ax.annotate(_mpl_text(m.label), (m.t - tl.start, n - 0.62), xytext=(3, 0), textcoords="offset points",
                            fontsize=8, color=_FAILURE_COLOUR, va="bottom", ha="left", annotation_clip=False)
            elif ":" in m.label:  # a restart that says which nodes left and joined: beside its line, below
                ax.annotate(_mpl_text(m.label), (m.t - tl.start, -0.45), xytext=(3, 0), textcoords="offset points",
                            fontsize=7, color=_RESTART_COLOUR, va="bottom", ha="left", annotation_clip=False)
        ax.set_ylim(-0.5, n - 0.2)
        ax.set_yticks(range(n), [_lane_label(lane) for lane in reversed(tl.lanes)], fontsize=9)
        ax.set_xlim(0, span)
        ax.set_xlabel("seconds since the job started", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        ax.tick_params(axis="y", length=0)
    handles = [Patch(facecolor=KINDS[k][0], label=KINDS[k][2]) for k in _kinds_present(timelines)]
    handles += [Line2D([], [], color=colour, linewidth=1.6, linestyle="-" if label.startswith("failure") else "--",
                       label=label) for colour, label in _marker_legend(timelines)]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(6, len(handles)), fontsize=9, frameon=False)
    return fig


def render_png(timelines: list[JobTimeline]) -> bytes:
    """The picture as PNG bytes (:func:`png_size` pixels). Raises PlotUnavailable without matplotlib."""
    fig = render_figure(timelines)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI, metadata={"Software": "otel-gpu"})
    return buf.getvalue()


def write(path: str, timelines: list[JobTimeline]) -> None:
    """Writes ``path`` as SVG or PNG by its suffix.

    Raises:
        ValueError: another suffix.
        PlotUnavailable: a PNG without matplotlib (``pip install 'otel-gpu[plot]'``); nothing is written.
    """
    lower = str(path).lower()
    if lower.endswith(".svg"):
        data = render_svg(timelines).encode()
    elif lower.endswith(".png"):
        data = render_png(timelines)
    else:
        raise ValueError(f"--plot {path}: write a .svg or .png file")
    with open(path, "wb") as f:
        f.write(data)
