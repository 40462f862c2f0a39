"""``otel-gpu report --plot``: the goodput timeline of each job as SVG and PNG, and the text report's one-line
timeline, from a store filled through the real store exporter with a job that starts, trains, hangs, restarts."""
from __future__ import annotations

import io
import json
import random
import struct
import xml.etree.ElementTree as ET
import zlib

import pytest

from otel_gpu.commands.cli import main as cli_main
from otel_gpu.commands.plot import KINDS, job_timeline, one_line, render_svg

from test_report import fill

SVG = "{http://www.w3.org/2000/svg}"
T0 = 1_700_000_000.0


def _history(rng: random.Random) -> tuple[list[dict], dict]:
    """Cumulative summaries every 5 s as the goodput processor reports them: start-up, training with data stalls and a
    checkpoint, a hang (detected), a restart with its gap and restore, training again."""
    phases = [("startup", 10), ("productive", 40), ("data_loading", 5), ("productive", 30), ("checkpoint_save", 5),
              ("productive", 20), ("hang", 30), ("restart_gap", 15), ("checkpoint_restore", 5), ("productive", 40)]
    acc = {k: 0.0 for k in KINDS}
    t, restarts, failures, out = 0.0, 0, 0, []
    hang_at = None
    for kind, length in phases:
        for _ in range(int(length / 5)):
            t += 5
            acc[kind] += 5 * rng.uniform(0.9, 1.0)
            acc["other"] = t - sum(v for k, v in acc.items() if k != "other")
            if kind == "hang" and hang_at is None:
                hang_at, failures = T0 + t - 2.5, failures + 1
            if kind == "restart_gap" and restarts == 0:
                restarts = 1
            wall = t
            out.append({"job_id": "job-p", "ettr": round(acc["productive"] / wall, 4), "wall_time_s": wall,
                        "productive_time_s": round(acc["productive"], 3), "first_seen": T0, "last_seen": T0 + t,
                        "badput_s": {k: round(v, 3) for k, v in acc.items() if k != "productive"},
                        "failures": failures, "restarts": restarts})
    failure = {"kind": "hang", "root_cause": "rank_not_in_collective", "category": "software", "action": "user_fix",
               "job_id": "job-p", "onset_time": hang_at - 8, "detected_time": hang_at, "confidence": 0.9,
               "culprit": {"rank": 0, "host": "n", "gpu": None}, "signature": "s", "recurrence": 0,
               "failure_id": "f1", "version": 1}
    return out, failure


@pytest.fixture
def store(tmp_path):
    history, failure = _history(random.Random(7))
    folder = tmp_path / "store"
    fill(folder, [("otel_gpu.goodput", h) for h in history] + [("otel_gpu.failure", failure)],
         {"training.job.id": "job-p", "training.rank": 0, "host.name": "n"})
    return folder, history, failure


def _report(*args) -> tuple[int, str, str]:
    import contextlib

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["report", *args])
    return code, out.getvalue(), err.getvalue()


def test_svg_has_one_lane_per_job_with_ettr_segments_and_markers(store, tmp_path):
    folder, history, failure = store
    path = tmp_path / "goodput.svg"
    code, _, err = _report("--store", str(folder), "--plot", str(path))
    assert code == 0 and "written to" in err
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    (lane,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "job"]
    assert lane.get("data-job") == "job-p"
    title = next(t.text for t in lane.iter(f"{SVG}text") if t.get("class") == "title")
    assert f"ETTR {history[-1]['ettr'] * 100:.1f}%" in title and "1 failure" in title and "1 restart" in title
    rects = [r for r in lane.iter(f"{SVG}rect") if (r.get("class") or "").startswith("segment")]
    kinds = [r.get("class").split()[1] for r in rects]
    # in time order: start-up, training, the hang, the restart's gap and restore, training again
    order = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    for expected in (["startup", "productive", "hang", "restart_gap", "checkpoint_restore", "productive"],
                     ["data_loading"], ["checkpoint_save"]):
        it = iter(order)
        assert all(k in it for k in expected), order
    xs = sorted((float(r.get("x")), float(r.get("width"))) for r in rects)
    assert xs[0][0] == pytest.approx(20, abs=0.5) and xs[-1][0] + xs[-1][1] == pytest.approx(940, abs=1)
    widths = {k: sum(float(r.get("width")) for r in rects if r.get("class").split()[1] == k) for k in set(kinds)}
    assert widths["productive"] > widths["hang"] > widths["checkpoint_save"]
    markers = {g.get("class"): g for g in lane.iter(f"{SVG}g") if (g.get("class") or "").startswith("marker")}
    assert set(markers) == {"marker failure", "marker restart"}
    fail_x = float(markers["marker failure"].find(f"{SVG}line").get("x1"))
    hang_rects = [r for r in rects if "hang" in r.get("class")]
    assert float(hang_rects[0].get("x")) - 25 <= fail_x <= float(hang_rects[-1].get("x")) + 25
    assert "rank_not_in_collective" in "".join(markers["marker failure"].itertext())


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert (depth, colour) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    rows = [raw[i * stride + 1:(i + 1) * stride] for i in range(height)]
    assert all(raw[i * stride] == 0 for i in range(height))
    return width, height, rows


def test_png_has_the_size_the_layout_says_and_the_colours_of_the_buckets(store, tmp_path):
    folder, _, _ = store
    path = tmp_path / "goodput.png"
    code, _, _ = _report("--store", str(folder), "--plot", str(path), "--job", "job-p")
    assert code == 0
    width, height, rows = _png_pixels(path.read_bytes())
    assert (width, height) == (960, 16 + 96 + 3 * 22 + 10)  # one lane, three legend rows
    pixels = [bytes(row[i:i + 3]) for row in rows for i in range(0, len(row), 3)]
    non_white = sum(1 for p in pixels if p != b"\xff\xff\xff")
    assert 0.05 < non_white / len(pixels) < 0.6
    bar = {bytes(rows[16 + 30 + 15][i:i + 3]) for i in range(0, 3 * width, 3)}
    for kind in ("productive", "hang", "restart_gap", "startup"):
        colour = bytes(int(KINDS[kind][0][j:j + 2], 16) for j in (1, 3, 5))
        assert colour in bar, kind
    title_row_pixels = sum(1 for y in range(18, 28) for i in range(0, 3 * width, 3) if rows[y][i:i + 3] != b"\xff" * 3)
    assert title_row_pixels > 200  # the title is drawn


def test_text_report_has_a_one_line_timeline_per_job(store):
    folder, history, _ = store
    code, out, _ = _report("--store", str(folder))
    assert code == 0
    line = next(t.strip() for t in out.splitlines() if t.strip().startswith("[") and t.strip().endswith("]"))
    assert line[1] == "s" and "#" in line and "H" in line and "!" in line and "|" in line
    assert line.index("s") < line.index("#") < line.index("!") < line.index("|")
    assert "timeline: # productive" in out
    code, out, _ = _report("--store", str(folder), "--format", "json")
    job = json.loads(out)["jobs"][0]
    assert job["timeline"] == line


def test_plot_needs_svg_or_png_and_an_empty_store_plots_an_empty_lane(tmp_path, store):
    folder, _, _ = store
    code, _, err = _report("--store", str(folder), "--plot", str(tmp_path / "x.pdf"))
    assert code == 1 and "write a .svg or .png file" in err
    empty = job_timeline("none", [])
    assert one_line(empty, 10) == "[          ]"
    assert "no goodput history" in render_svg([empty])
