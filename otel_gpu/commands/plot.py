"""Goodput pictures: per job, a timeline of productive time and badput buckets with failures and restarts marked.

Built from the store's goodput history (cumulative summaries the goodput processor reports every few seconds): what
each bucket gained between two summaries is laid out over that interval, in the order of the legend (the order inside
one interval is not recorded). Failures come from the store's failure records (their detection time), restarts from
the summaries' restart count.

Three outputs share one model (:class:`JobTimeline`): a one-line text timeline (``otel-gpu report``), an SVG written by
hand (``--plot FILE.svg``) and a PNG (``--plot FILE.png``) rasterized here and written with zlib: no plotting library
(matplotlib alone is ~40 MB with its dependencies, for a chart of rectangles and a few labels). The PNG's labels use a
built-in 3x5 pixel font (upper case, digits, a few signs).

Example:
    >>> history = [{"job_id": "j", "first_seen": 0, "last_seen": 10, "ettr": 0.8, "productive_time_s": 8,
    ...             "badput_s": {"startup": 2}, "failures": 0, "restarts": 0},
    ...            {"job_id": "j", "first_seen": 0, "last_seen": 20, "ettr": 0.5, "productive_time_s": 10,
    ...             "badput_s": {"startup": 2, "hang": 8}, "failures": 1, "restarts": 0}]
    >>> tl = job_timeline("j", history, [{"kind": "hang", "detected_time": 15.0, "root_cause": "rank_not_in_collective"}])
    >>> one_line(tl, width=20)
    '[ss##########HHH!HHHH]'
    >>> render_svg([tl]).count('class="segment')
    3
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JobTimeline", "Marker", "Segment", "job_timeline", "one_line", "render_png", "render_svg", "write"]

#: kind -> (fill colour, text-timeline character, label), in the legend's order.
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
# Inside one interval between two summaries: what usually comes first in time comes first (a restart's gap, start-up
# and restore before training; a hang runs to the interval's end).
_ORDER = ("restart_gap", "startup", "checkpoint_restore", "productive", "data_loading", "checkpoint_save", "slowdown",
          "wasted_progress", "hang", "other")


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
class JobTimeline:
    job_id: str
    start: float
    end: float
    ettr: float | None
    productive_s: float
    wall_s: float
    segments: list[Segment] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)

    @property
    def title(self) -> str:
        ettr = f"{self.ettr * 100:.1f}%" if self.ettr is not None else "unknown"
        failures = sum(1 for m in self.markers if m.kind == "failure")
        restarts = sum(1 for m in self.markers if m.kind == "restart")
        return (f"job {self.job_id}: ETTR {ettr} (productive {_dur(self.productive_s)} of {_dur(self.wall_s)}; "
                f"{failures} failure{'s' if failures != 1 else ''}, {restarts} restart{'s' if restarts != 1 else ''})")


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _num(value: Any, default: float = 0.0) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return out if out == out else default  # NaN


def job_timeline(job_id: str, history: list[dict[str, Any]], failures: list[dict[str, Any]] | None = None
                 ) -> JobTimeline:
    """The timeline of one job from its goodput summaries (any order) and failure records."""
    snaps = sorted((h for h in history if isinstance(h, dict)), key=lambda h: _num(h.get("last_seen")))
    if not snaps:
        return JobTimeline(job_id, 0.0, 0.0, None, 0.0, 0.0)
    start = min(_num(h.get("first_seen"), _num(h.get("last_seen"))) for h in snaps)
    prev_t, prev = start, {k: 0.0 for k in KINDS}
    prev_restarts, prev_failures = 0, 0
    segments: list[Segment] = []
    markers: list[Marker] = []
    counted_failures: list[float] = []
    for snap in snaps:
        t = _num(snap.get("last_seen"))
        badput = snap.get("badput_s") if isinstance(snap.get("badput_s"), dict) else {}
        cur = {"productive": _num(snap.get("productive_time_s"))}
        cur.update({k: _num(badput.get(k)) for k in KINDS if k != "productive"})
        restarts, n_failures = int(_num(snap.get("restarts"))), int(_num(snap.get("failures")))
        dt = t - prev_t
        if dt > 0:
            gains = {k: max(0.0, cur[k] - prev[k]) for k in KINDS}
            total = sum(gains.values())
            if total <= 0:
                gains, total = {"other": dt}, dt
            x = prev_t
            for kind in _ORDER:
                if gains.get(kind, 0.0) > 0:
                    width = gains[kind] * dt / total
                    if segments and segments[-1].kind == kind and abs(segments[-1].t1 - x) < 1e-9:
                        segments[-1].t1 = x + width
                    else:
                        segments.append(Segment(x, x + width, kind))
                    x += width
            if restarts > prev_restarts:
                gap = next((s for s in reversed(segments) if s.kind == "restart_gap" and s.t0 >= prev_t), None)
                for _ in range(restarts - prev_restarts):
                    markers.append(Marker(gap.t0 if gap else t, "restart", "restart"))
            if n_failures > prev_failures:
                counted_failures += [t] * (n_failures - prev_failures)
            prev_t = t
        prev, prev_restarts, prev_failures = cur, max(prev_restarts, restarts), max(prev_failures, n_failures)
    records = [f for f in failures or [] if isinstance(f, dict) and f.get("detected_time") is not None]
    if records:
        for f in records:
            label = str(f.get("root_cause") or f.get("kind") or "failure")
            markers.append(Marker(_num(f.get("detected_time")), "failure", label))
    else:  # no records (e.g. trimmed by retention): where the summaries' failure count grew
        markers += [Marker(t, "failure", "failure") for t in counted_failures]
    last = snaps[-1]
    end = max(prev_t, max((m.t for m in markers), default=prev_t))
    ettr = last.get("ettr")
    return JobTimeline(job_id, start, end, _num(ettr) if ettr is not None else None,
                       _num(last.get("productive_time_s")), _num(last.get("wall_time_s"), end - start),
                       segments, sorted(markers, key=lambda m: m.t))


# -- text ----------------------------------------------------------------------------------------------------------
def one_line(tl: JobTimeline, width: int = 60) -> str:
    """``[sss######dd##!HHHH|gg####]``: each character the bucket that filled most of its share of the job's time;
    ``!`` a failure, ``|`` a restart. Legend: :data:`KINDS` (``#`` productive, ``H`` hang, ...)."""
    span = tl.end - tl.start
    if span <= 0 or not tl.segments:
        return "[" + " " * width + "]"
    cells = []
    for i in range(width):
        c0, c1 = tl.start + span * i / width, tl.start + span * (i + 1) / width
        best, best_cover = "other", 0.0
        for seg in tl.segments:
            cover = min(c1, seg.t1) - max(c0, seg.t0)
            if cover > best_cover:
                best, best_cover = seg.kind, cover
        cells.append(KINDS[best][1] if best_cover > 0 else " ")
    for m in tl.markers:  # drawn over the cell they fall in
        i = min(width - 1, max(0, int((m.t - tl.start) / span * width)))
        cells[i] = "!" if m.kind == "failure" else "|"
    return "[" + "".join(cells) + "]"


def legend_line() -> str:
    return "  ".join(f"{ch} {label}" for _, ch, label in KINDS.values()) + "  ! failure  | restart"


# -- layout shared by SVG and PNG ------------------------------------------------------------------------------------
_W, _LEFT, _RIGHT, _LANE, _BAR_Y, _BAR_H, _TOP = 960, 20, 20, 96, 30, 30, 16


_LEGEND_PER_ROW, _LEGEND_STEP = 5, 185


def _layout(timelines: list[JobTimeline]) -> tuple[int, int]:
    legend_rows = -(-(len(KINDS) + 2) // _LEGEND_PER_ROW)
    return _W, _TOP + _LANE * max(1, len(timelines)) + 22 * legend_rows + 10


def _x(tl: JobTimeline, t: float) -> float:
    span = tl.end - tl.start
    return _LEFT + (_W - _LEFT - _RIGHT) * ((t - tl.start) / span if span > 0 else 0.0)


def _ticks(tl: JobTimeline, n: int = 6) -> list[tuple[float, str]]:
    span = tl.end - tl.start
    if span <= 0:
        return []
    return [(tl.start + span * i / (n - 1), "+" + _dur(span * i / (n - 1))) for i in range(n)]


def _esc(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;"))


def render_svg(timelines: list[JobTimeline]) -> str:
    """An SVG document: one lane per job (title with ETTR, the bar of segments, failure and restart markers, a time
    axis), then the legend. Every segment and marker carries a ``<title>`` tooltip."""
    width, height = _layout(timelines)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           "<title>otel-gpu goodput timeline</title>",
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>']
    for i, tl in enumerate(timelines):
        y = _TOP + i * _LANE
        out.append(f'<g class="job" data-job="{_esc(tl.job_id)}">')
        out.append(f'<text class="title" x="{_LEFT}" y="{y + 14}" font-weight="bold">{_esc(tl.title)}</text>')
        bar_y = y + _BAR_Y
        if not tl.segments:
            out.append(f'<text x="{_LEFT}" y="{bar_y + 20}">no goodput history</text>')
        for seg in tl.segments:
            x0, x1 = _x(tl, seg.t0), _x(tl, seg.t1)
            colour, _, label = KINDS[seg.kind]
            out.append(f'<rect class="segment {seg.kind}" x="{x0:.2f}" y="{bar_y}" width="{max(0.5, x1 - x0):.2f}" '
                       f'height="{_BAR_H}" fill="{colour}"><title>{_esc(label)}: {_dur(seg.t1 - seg.t0)} '
                       f'(+{_dur(seg.t0 - tl.start)} to +{_dur(seg.t1 - tl.start)})</title></rect>')
        for m in tl.markers:
            x = _x(tl, m.t)
            colour = _FAILURE_COLOUR if m.kind == "failure" else _RESTART_COLOUR
            dash = "" if m.kind == "failure" else ' stroke-dasharray="4 3"'
            out.append(f'<g class="marker {m.kind}"><line x1="{x:.2f}" y1="{bar_y - 6}" x2="{x:.2f}" '
                       f'y2="{bar_y + _BAR_H + 6}" stroke="{colour}" stroke-width="2"{dash}/>'
                       f'<text x="{x + 3:.2f}" y="{bar_y - 8}" font-size="10" fill="{colour}">{_esc(m.label)}</text>'
                       f'<title>{m.kind}: {_esc(m.label)} at +{_dur(m.t - tl.start)}</title></g>')
        for t, label in _ticks(tl):
            x = _x(tl, t)
            anchor = "start" if x <= _LEFT + 1 else "end" if x >= _W - _RIGHT - 1 else "middle"
            out.append(f'<line class="tick" x1="{x:.2f}" y1="{bar_y + _BAR_H}" x2="{x:.2f}" y2="{bar_y + _BAR_H + 4}" '
                       f'stroke="#555"/><text x="{x:.2f}" y="{bar_y + _BAR_H + 17}" font-size="10" '
                       f'text-anchor="{anchor}" fill="#555">{_esc(label)}</text>')
        out.append("</g>")
    y = _TOP + _LANE * max(1, len(timelines))
    out.append('<g class="legend">')
    items = [(colour, label, False) for colour, _, label in KINDS.values()]
    items += [(_FAILURE_COLOUR, "failure", True), (_RESTART_COLOUR, "restart", True)]
    for j, (colour, label, line) in enumerate(items):
        x, ly = _LEFT + (j % _LEGEND_PER_ROW) * _LEGEND_STEP, y + (j // _LEGEND_PER_ROW) * 22
        if line:
            out.append(f'<line x1="{x + 6}" y1="{ly}" x2="{x + 6}" y2="{ly + 12}" stroke="{colour}" stroke-width="2"/>')
        else:
            out.append(f'<rect x="{x}" y="{ly}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 18}" y="{ly + 11}">{_esc(label)}</text>')
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


# -- PNG -------------------------------------------------------------------------------------------------------------
# 3x5 glyphs, rows top to bottom; drawn at 2x. Lower case is drawn as upper case; unknown characters as blanks.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    "%": "101001010100101", ".": "000000000000010", ":": "000010000010000", "-": "000000111000000",
    "_": "000000000000111", "(": "001010010010001", ")": "100010010010100", "/": "001001010100100",
    "+": "000010111010000", "!": "010010010000010", ",": "000000000010100", "=": "000111000111000",
    ";": "000010000010100",
}


def _rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def rect(self, x0: float, y0: float, x1: float, y1: float, colour: str) -> None:
        xa, xb = max(0, int(round(x0))), min(self.width, max(int(round(x1)), int(round(x0)) + 1))
        ya, yb = max(0, int(y0)), min(self.height, int(y1))
        if xa >= xb:
            return
        span = bytes(_rgb(colour)) * (xb - xa)
        for y in range(ya, yb):
            self.rows[y][3 * xa:3 * xb] = span

    def text(self, x: float, y: float, text: str, colour: str = "#222222", scale: int = 2) -> None:
        """``y`` is the glyphs' top."""
        cx = int(x)
        for ch in text.upper():
            glyph = _FONT.get(ch)
            if glyph is not None:
                for i, bit in enumerate(glyph):
                    if bit == "1":
                        gx, gy = cx + (i % 3) * scale, int(y) + (i // 3) * scale
                        self.rect(gx, gy, gx + scale, gy + scale, colour)
            cx += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + \
            chunk(b"IEND", b"")


def render_png(timelines: list[JobTimeline]) -> bytes:
    """The SVG's picture as an RGB PNG (same geometry; labels in the built-in pixel font)."""
    width, height = _layout(timelines)
    canvas = _Canvas(width, height)
    for i, tl in enumerate(timelines):
        y = _TOP + i * _LANE
        canvas.text(_LEFT, y + 2, tl.title)
        bar_y = y + _BAR_Y
        for seg in tl.segments:
            canvas.rect(_x(tl, seg.t0), bar_y, _x(tl, seg.t1), bar_y + _BAR_H, KINDS[seg.kind][0])
        for m in tl.markers:
            x = _x(tl, m.t)
            colour = _FAILURE_COLOUR if m.kind == "failure" else _RESTART_COLOUR
            if m.kind == "failure":
                canvas.rect(x - 1, bar_y - 6, x + 1, bar_y + _BAR_H + 6, colour)
                canvas.text(x + 4, bar_y - 13, m.label, colour, scale=1)
            else:
                for yy in range(bar_y - 6, bar_y + _BAR_H + 6, 7):
                    canvas.rect(x - 1, yy, x + 1, min(yy + 4, bar_y + _BAR_H + 6), colour)
        for t, label in _ticks(tl):
            x = _x(tl, t)
            canvas.rect(x, bar_y + _BAR_H, x + 1, bar_y + _BAR_H + 4, "#555555")
            w = len(label) * 8
            tx = x if x <= _LEFT + 1 else x - w if x >= _W - _RIGHT - 1 else x - w / 2
            canvas.text(tx, bar_y + _BAR_H + 7, label, "#555555")
    y = _TOP + _LANE * max(1, len(timelines))
    items = [(colour, label, False) for colour, _, label in KINDS.values()]
    items += [(_FAILURE_COLOUR, "failure", True), (_RESTART_COLOUR, "restart", True)]
    for j, (colour, label, line) in enumerate(items):
        x, ly = _LEFT + (j % _LEGEND_PER_ROW) * _LEGEND_STEP, y + (j // _LEGEND_PER_ROW) * 22
        if line:
            canvas.rect(x + 5, ly, x + 7, ly + 12, colour)
        else:
            canvas.rect(x, ly, x + 12, ly + 12, colour)
        canvas.text(x + 18, ly + 1, label)
    return canvas.png()


def write(path: str, timelines: list[JobTimeline]) -> None:
    """Writes ``path`` as SVG or PNG by its suffix. Raises ValueError for another suffix."""
    lower = str(path).lower()
    if lower.endswith(".svg"):
        data = render_svg(timelines).encode()
    elif lower.endswith(".png"):
        data = render_png(timelines)
    else:
        raise ValueError(f"--plot {path}: write a .svg or .png file")
    with open(path, "wb") as f:
        f.write(data)
