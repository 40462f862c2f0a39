"""``otel-gpu report --plot``: the goodput timeline of each job as SVG and PNG, and the text report's one-line
timeline, checked against the ledger's own buckets. The jobs are real: step and checkpoint spans and failure events
of 4 ranks go through the goodput processor, whose summaries (and the failure records) go through the real store
exporter, and ``otel-gpu report`` reads the store."""
from __future__ import annotations

import contextlib
import io
import json
import struct
import time
import xml.etree.ElementTree as ET
import zlib

import pytest

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.commands.cli import main as cli_main
from otel_gpu.commands.plot import KINDS, JobTimeline, job_timeline, one_line, png_size, render_svg
from otel_gpu.component import ComponentHost
from otel_gpu.config import build
from otel_gpu.exporters.store import StoreExporter, StoreExporterConfig, db
from otel_gpu.failure import Culprit, FailureRecord
from otel_gpu.otlp_build import LogsBuilder, SpansBuilder
from otel_gpu.pdata import Batch, Signal
from otel_gpu.processors.goodput import GoodputConfig, GoodputProcessor
from otel_gpu.schema import failure as F
from otel_gpu.schema.failure import Kind, RootCause
from otel_gpu.schema import identity as I
from otel_gpu.schema import training as T

SVG = "{http://www.w3.org/2000/svg}"
BADPUT = [k for k in KINDS if k != "productive"]


class _Job:
    """A job of ``ranks`` ranks as the instrumentation reports it, through the goodput processor into a store."""

    def __init__(self, folder, job_id: str, ranks: int = 4):
        self.job_id, self.ranks = job_id, ranks
        self.store = StoreExporter(build(StoreExporterConfig, {"path": str(folder)}, "exporters.store"),
                                   ComponentHost("store", PrometheusSelfTelemetry()))
        self.store.start()
        sink = type("Sink", (), {"consume": lambda _, batch: self.store.export(batch)})()
        self.goodput = GoodputProcessor(build(GoodputConfig, {}, "processors.goodput"),
                                        ComponentHost("goodput", PrometheusSelfTelemetry(), {Signal.LOGS: sink}))

    def _resource(self, rank: int, restart: int) -> dict:
        return {str(I.JOB_ID): self.job_id, str(I.RANK): rank, str(I.RESTART_COUNT): restart, "host.name": "node-a"}

    def _send(self, signal: Signal, message) -> None:
        out = self.goodput.process(Batch.from_message(signal, message))  # then on down the pipeline, to the store
        if out is not None:
            self.store.export(out)

    def started(self, t: float, restart: int = 0) -> None:
        for rank in range(self.ranks):
            logs = LogsBuilder(self._resource(rank, restart))
            logs.event("training.process.start", {"rank": rank}, time_ns=int(t * 1e9))
            self._send(Signal.LOGS, logs.build())

    def steps(self, first: int, count: int, t: float, step_s: float, data_s: float, restart: int = 0,
              save_after: int | None = None, save_s: float = 0.0, restore_s: float = 0.0) -> float:
        """``count`` steps from ``first`` at ``t`` (a restore of ``restore_s`` before them, a save of ``save_s`` after
        step ``save_after``), every rank reporting each; returns when the last ended."""
        for rank in range(self.ranks):
            spans, at = SpansBuilder(self._resource(rank, restart)), t
            if restore_s:
                spans.span(T.CKPT_LOAD_SPAN.name, int(at * 1e9), int((at + restore_s) * 1e9))
                at += restore_s
            for step in range(first, first + count):
                jitter = 0.003 * rank
                spans.span(T.STEP_SPAN.name, int((at + jitter) * 1e9), int((at + step_s + jitter) * 1e9),
                           {str(T.STEP): step, str(T.STEP_DATA_S): data_s})
                at += step_s
                if step == save_after:
                    spans.span(T.CKPT_SAVE_SPAN.name, int(at * 1e9), int((at + save_s) * 1e9))
                    at += save_s
            self._send(Signal.TRACES, spans.build())
        return at

    def failure(self, kind: str, root_cause: str, onset: float, detected: float, rank: int,
                restart: int = 0) -> dict:
        """The attribution processor's failure event (the public record), down the pipeline."""
        record = FailureRecord(Kind(kind), RootCause(root_cause), self.job_id, onset, detected, 0.9,
                               Culprit(rank, "node-a"), failure_id=f"{self.job_id}/{rank}").to_dict()
        logs = LogsBuilder({str(I.JOB_ID): self.job_id, str(I.RESTART_COUNT): restart, "service.name": "otel-gpu"})
        logs.event(F.FAILURE_EVENT, record, time_ns=int(detected * 1e9))
        self._send(Signal.LOGS, logs.build())
        return record

    def close(self) -> dict:
        """The processor's last summary, as the store keeps it (what ``otel-gpu report`` shows)."""
        self.goodput.shutdown()  # its last report
        assert self.store.force_flush(5)
        self.store.shutdown()
        return _read(self.store.config.path, lambda conn: db.goodput(conn, self.job_id))


def _read(folder, query):
    conn = db.open_reader(folder)
    try:
        return query(conn)
    finally:
        conn.close()


def _hang_job(folder) -> dict:
    """The demo's default: 4 ranks start (1.2 s), train 30 steps of 0.1 s with a save after step 19; rank 2 then
    never enters the next collective; the hang is detected 7.8 s after its onset and the job is killed 2.5 s later."""
    t0 = time.time() - 120  # a job that ended a while ago: its last summary is final
    job = _Job(folder, "demo-hang")
    job.started(t0)
    onset = job.steps(0, 30, t0 + 1.2, 0.1, 0.02, save_after=19, save_s=0.3)
    job.failure("hang", "rank_not_in_collective", onset, onset + 7.8, rank=2)
    job.started(onset + 10.3)  # the supervisor's last sighting of the ranks before it kills them
    return job.close()


def _restart_job(folder) -> dict:
    """Three incarnations: rank 1 dies at step 15 (a save after step 9), the job restarts from the checkpoint; rank
    3 dies at step 27; the third incarnation finishes."""
    t0 = time.time() - 200
    job = _Job(folder, "demo-restart")
    job.started(t0)
    end = job.steps(0, 16, t0 + 2.0, 0.2, 0.03, save_after=9, save_s=0.5)
    job.failure("crash", "rank_process_died", end - 0.05, end + 0.4, rank=1)
    job.started(end + 3.0, restart=1)
    end = job.steps(10, 18, end + 4.0, 0.2, 0.03, restart=1, save_after=19, save_s=0.5, restore_s=0.8)
    job.failure("crash", "rank_process_died", end - 0.05, end + 0.4, rank=3, restart=1)
    job.started(end + 2.5, restart=2)
    end = job.steps(20, 20, end + 3.5, 0.2, 0.03, restart=2, restore_s=0.8)
    job.started(end, restart=2)
    return job.close()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plot")
    hang, restart = folder / "hang", folder / "restart"
    return {"hang": (hang, _hang_job(hang)), "restart": (restart, _restart_job(restart))}


def _report(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["report", *args])
    return code, out.getvalue(), err.getvalue()


def _svg_widths(path) -> tuple[dict[str, float], float, list]:
    """Seconds drawn per kind (segment widths over the job's scale), the scale, and the job's lane groups."""
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    (job,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "job"]
    scale = float(job.get("data-px-per-s"))
    drawn: dict[str, float] = {}
    for rect in job.iter(f"{SVG}rect"):
        cls = (rect.get("class") or "").split()
        if cls and cls[0] == "segment":
            drawn[cls[1]] = drawn.get(cls[1], 0.0) + float(rect.get("width")) / scale
    return drawn, scale, [g for g in job.iter(f"{SVG}g") if g.get("class") == "lane"]


@pytest.mark.parametrize("scenario", ["hang", "restart"])
def test_each_colour_in_the_svg_and_the_text_timeline_is_its_bucket_of_the_ledger(stores, scenario, tmp_path):
    folder, summary = stores[scenario]
    path = tmp_path / "goodput.svg"
    code, _, err = _report("--store", str(folder), "--plot", str(path))
    assert code == 0 and "written to" in err
    drawn, scale, lanes = _svg_widths(path)
    pixel_s = 1.0 / scale
    for kind in KINDS:
        expected = summary["productive_time_s"] if kind == "productive" else summary["badput_s"][kind]
        assert drawn.get(kind, 0.0) == pytest.approx(expected, abs=pixel_s), (kind, drawn, summary["badput_s"])
    assert sum(drawn.values()) == pytest.approx(summary["wall_time_s"], abs=pixel_s)
    assert len(lanes) == len(summary["incarnations"])  # one lane per incarnation
    for lane, inc in zip(lanes, summary["incarnations"]):
        assert int(lane.get("data-restart-count")) == inc["restart_count"]
        widths: dict[str, float] = {}
        for rect in lane.iter(f"{SVG}rect"):
            kind = rect.get("class").split()[1]
            widths[kind] = widths.get(kind, 0.0) + float(rect.get("width")) / scale
        for kind in BADPUT:
            assert widths.get(kind, 0.0) == pytest.approx(inc["badput_s"][kind], abs=pixel_s), (kind, inc)

    code, out, _ = _report("--store", str(folder), "--format", "json")
    line = json.loads(out)["jobs"][0]["timeline"]
    cells = line[1:-1].replace("!", "").replace("|", "")
    assert len(cells) == 60
    cell_s = summary["wall_time_s"] / 60
    for kind, (_, char, _) in KINDS.items():
        expected = summary["productive_time_s"] if kind == "productive" else summary["badput_s"][kind]
        assert abs(cells.count(char) - expected / cell_s) <= 1.0, (kind, line, expected)


def test_the_demos_hang_is_drawn_from_its_onset_and_no_other_where_the_ledger_has_none(stores, tmp_path):
    folder, summary = stores["hang"]
    b = summary["badput_s"]
    assert b["other"] < 0.05 and b["hang"] > 10.0  # what `otel-gpu report` says: the hang, and nothing unexplained
    (failure,) = _read(folder, lambda conn: db.failures(conn, "demo-hang", None))
    tl = job_timeline("demo-hang", summary, [failure])
    hang = [s for s in tl.segments if s.kind == "hang"]  # one, but for the record's onset rounded to the ms
    assert hang[0].t0 == pytest.approx(failure["onset_time"], abs=0.05)  # at its onset, not at its detection
    assert hang[-1].t1 == pytest.approx(tl.end, abs=0.05)
    assert tl.drawn_s("hang") == pytest.approx(tl.end - hang[0].t0, abs=0.01)
    assert tl.drawn_s("other") < 0.05
    (marker,) = [m for m in tl.markers if m.kind == "failure"]
    assert marker.t == pytest.approx(failure["detected_time"]) and marker.label == "rank_not_in_collective"
    line = one_line(tl, 60)
    assert line[1] == "s" and "." not in line
    assert line.index("s") < line.index("#") < line.index("c") < line.index("H") < line.index("!")
    path = tmp_path / "hang.svg"
    assert _report("--store", str(folder), "--plot", str(path))[0] == 0
    root = ET.parse(path).getroot()
    texts = [t.text for t in root.iter(f"{SVG}text")]
    title = next(t.text for t in root.iter(f"{SVG}text") if t.get("class") == "title")
    assert title.startswith("job demo-hang: ETTR ") and f"{summary['ettr'] * 100:.1f}%" in title
    assert "seconds since the job started" in texts and "incarnation 0" in texts
    legend = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "legend-label"]
    assert legend == ["productive", "startup", "data loading", "checkpoint save", "hang", "wasted progress",
                      "failure detected"]


def test_restarts_are_lanes_of_their_incarnations_with_the_gap_at_the_start_of_the_next(stores):
    folder, summary = stores["restart"]
    assert [i["restart_count"] for i in summary["incarnations"]] == [0, 1, 2]
    failures = _read(folder, lambda conn: db.failures(conn, "demo-restart", None))
    tl = job_timeline("demo-restart", summary, failures)
    assert [lane.restart_count for lane in tl.lanes] == [0, 1, 2]
    for lane in tl.lanes[1:]:
        kinds = [s.kind for s in lane.segments]
        assert kinds[:3] == ["restart_gap", "startup", "checkpoint_restore"], kinds
        assert lane.segments[0].t0 == pytest.approx(lane.start)
    assert [m.kind for m in tl.markers] == ["failure", "restart", "failure", "restart"]
    assert summary["badput_s"]["wasted_progress"] > 0  # steps since the save, lost at each crash
    line = one_line(tl, 80)
    assert line.count("|") == 2 and line.count("!") == 2 and "g" in line and "r" in line


def _png_header(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos = 8
    chunks = []
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    return struct.unpack(">II", chunks[0][1][:8])


def test_png_is_drawn_by_matplotlib_with_a_legend_lanes_and_the_ledgers_widths(stores, tmp_path):
    pytest.importorskip("matplotlib", reason="the test extra installs it (the plot extra)")
    from otel_gpu.commands.plot import render_figure

    folder, summary = stores["restart"]
    path = tmp_path / "goodput.png"
    code, _, err = _report("--store", str(folder), "--plot", str(path), "--job", "demo-restart")
    assert code == 0, err
    tl = _read(folder, lambda conn: job_timeline("demo-restart", db.goodput(conn, "demo-restart"),
                                                 db.failures(conn, "demo-restart", None)))
    assert _png_header(path.read_bytes()) == png_size([tl])
    fig = render_figure([tl])
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    seconds = {"productive": summary["productive_time_s"], **summary["badput_s"]}
    assert labels == [label for k, (_, _, label) in KINDS.items() if seconds[k] >= 0.05] + ["failure detected",
                                                                                      "restart"]
    assert "restart gap" in labels and "checkpoint restore" in labels and "wasted progress" in labels
    (ax,) = fig.axes
    assert ax.get_title(loc="left").startswith("job demo-restart: ETTR ")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["incarnation 2", "incarnation 1", "incarnation 0"]
    assert ax.get_xlabel() == "seconds since the job started"
    drawn: dict[str, float] = {}
    for coll in ax.collections:
        kind = coll.get_gid().split()[1]
        for x, w in (p.get_extents().bounds[0::2] for p in coll.get_paths()):
            drawn[kind] = drawn.get(kind, 0.0) + w
    for kind in BADPUT:
        assert drawn.get(kind, 0.0) == pytest.approx(summary["badput_s"][kind], abs=summary["wall_time_s"] / 1000)


def test_png_without_matplotlib_says_which_extra_to_install(stores, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    folder, _ = stores["hang"]
    path = tmp_path / "goodput.png"
    code, _, err = _report("--store", str(folder), "--plot", str(path))
    assert code == 1 and "pip install 'otel-gpu[plot]'" in err and not path.exists()
    assert _report("--store", str(folder), "--plot", str(tmp_path / "still.svg"))[0] == 0  # SVG needs nothing


def test_plot_needs_svg_or_png_and_an_empty_store_plots_an_empty_lane(tmp_path, stores):
    folder, _ = stores["hang"]
    code, _, err = _report("--store", str(folder), "--plot", str(tmp_path / "x.pdf"))
    assert code == 1 and "write a .svg or .png file" in err
    empty = job_timeline("none", None)
    assert one_line(empty, 10) == "[          ]"
    assert "no goodput history" in render_svg([empty])
    old = job_timeline("old", {"job_id": "old", "ettr": 0.5, "badput_s": {"hang": 1}})
    assert "older otel-gpu" in render_svg([old])


def test_a_summary_no_ledger_wrote_draws_what_it_can_and_never_raises():
    pytest.importorskip("matplotlib", reason="the test extra installs it (the plot extra)")
    from otel_gpu.commands.plot import render_png

    inc = {"restart_count": 0, "start": 0.0, "end": 10.0}
    bad = [{"timeline": {"origin": 0, "bin_s": -1, "incarnations": [inc]}},
           {"timeline": {"origin": 0, "bin_s": 1e-300, "incarnations": [{**inc, "end": 1e300}]}},
           {"timeline": {"origin": "x", "bin_s": "y", "incarnations": ["z", inc]}},
           {"timeline": {"origin": 0, "bin_s": 1, "incarnations": [{**inc, "seconds": {
               "hang": [10**12, [1, 1]], "productive": ["a", [float("inf"), -1, "q", 1]], "nope": [0, [1]],
               "startup": [0, list(range(10**5))], "slowdown": 7}}]}},
           {"timeline": {"incarnations": "no"}, "ettr": "high", "badput_s": {"hang": "long"}}]
    for summary in bad:
        tl = job_timeline("j", summary, [{"detected_time": "soon"}, {"detected_time": float("nan")}, "x"])
        ET.fromstring(render_svg([tl]))
        one_line(tl)
        assert render_png([tl])[:4] == b"\x89PNG"


def test_text_from_telemetry_is_escaped_in_the_svg_and_printable_in_matplotlib(stores):
    folder, summary = stores["hang"]
    hostile = 'job <&>"\x01 $x^$'
    tl = job_timeline(hostile, summary, [{"detected_time": summary["last_seen"], "root_cause": "<script>$\\"}])
    root = ET.fromstring(render_svg([tl]))  # valid XML
    # A control character shows escaped, as the report prints it (XML 1.0 forbids it even as a reference).
    assert any(hostile.replace("\x01", "\\x01") in (t.text or "") for t in root.iter(f"{SVG}text"))
    pytest.importorskip("matplotlib", reason="the test extra installs it (the plot extra)")
    from otel_gpu.commands.plot import render_png

    assert render_png([tl, JobTimeline("empty", 0, 0, None, 0, 0)])[:8] == b"\x89PNG\r\n\x1a\n"


def test_on_any_timeline_the_picture_draws_each_bucket_for_as_long_as_the_ledger_counts_it():
    """Random jobs (steps, checkpoints of every rank, restores, failures revised and withdrawn, restarts; the
    goodput tests' generator): every kind's drawn seconds, ``other`` included, are the summary's."""
    from hypothesis import HealthCheck, given, settings

    from test_goodput import _NO_LONG_SHRINK, _timelines, replay

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], phases=_NO_LONG_SHRINK)
    @given(_timelines())
    def check(events):
        job = replay(events)
        summary = job.summary()
        tl = job_timeline("j", summary, [])
        assert [lane.restart_count for lane in tl.lanes] == [i["restart_count"] for i in summary["incarnations"]]
        for kind in KINDS:
            expected = summary["productive_time_s"] if kind == "productive" else summary["badput_s"][kind]
            assert tl.drawn_s(kind) == pytest.approx(expected, abs=0.01), (kind, summary)

    check()
