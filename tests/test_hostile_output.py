"""Hostile input against what acts and what prints (issue 21, items 2 and 3): culprit fields never reach a shell,
every control character a sender puts in a printed field comes out escaped, the record formatter never raises
(hypothesis), one poison record leaves the rest of the report standing, and a supervisor fed malformed verdicts
keeps supervising its job (a real ``otel-gpu run``)."""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import time
import unicodedata
from contextlib import closing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.commands.report import main as report_main
from otel_gpu.component import ComponentHost
from otel_gpu.config import ConfigError, build
from otel_gpu.exporters.store import StoreExporter, StoreExporterConfig, db
from otel_gpu.exporters.verdict import FACTORY, VerdictExporterConfig
from otel_gpu.failure import UnreadableRecord, format_failure, from_json, printable
from otel_gpu.instrumentation import _export
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import failure as F
from otel_gpu.schema import health as H
from otel_gpu.supervisor import Supervisor, load_policy_text
from otel_gpu.supervisor._hooks import HookRefused, hook_fields, run_hook, split_template
from otel_gpu.supervisor.supervisor import INTERNAL_ERROR

REPO = Path(__file__).resolve().parent.parent
UUID = "GPU-8a1c7b2e-57a5-4c4e-9f7e-0d7a3b1c2d3e"
#: Every C0 control, DEL and every C1 control: 65 code points.
CONTROLS = [chr(c) for c in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]]
assert len(CONTROLS) == 65
INJECTIONS = ["gpu_xid$(touch X)", "GPU-$(touch X)", "0$(touch X)", ";rm -rf CANARY", "a\nb", "node'\"x",
              "`touch X`", "node-1 && touch X", "--output=X", "| touch X", "$(touch${IFS}X)"]


def good(**over) -> dict:
    record = {"kind": "crash", "root_cause": "gpu_fell_off_bus", "category": "hardware",
              "action": "exclude_node_and_restart", "auto_remediable": True, "job_id": "job-good",
              "culprit": {"rank": 5, "host": "node-b", "gpu": UUID}, "onset_time": 1_700_000_100.0,
              "detected_time": 1_700_000_100.4, "confidence": 0.99, "evidence": ["hw.gpu.xid=79 @1700000100.0"],
              "signature": "sig-79", "recurrence": 0, "failure_id": "job-good/1", "version": 1,
              "summary": "", "details": {"xid": 79}}
    record.update(over)
    return record


def _is_control(ch: str) -> bool:
    return unicodedata.category(ch) in ("Cc", "Cs") or ch in "\u061c\u200e\u200f\u2028\u2029\ufeff" or \
        "\u202a" <= ch <= "\u202e" or "\u2066" <= ch <= "\u2069"


def assert_printable(text: str) -> None:
    """Nothing a terminal acts on: only the lines' own newlines."""
    bad = sorted({f"U+{ord(ch):04X}" for ch in text if ch != "\n" and _is_control(ch)})
    assert not bad, f"raw control characters {bad} in:\n{text[-2000:]}"


# -- hooks: argv, never a shell -------------------------------------------------------------------------------------
@pytest.mark.parametrize("payload", INJECTIONS)
@pytest.mark.parametrize("field", ["host", "gpu", "rank", "root_cause"])
def test_an_injected_culprit_field_is_refused_before_anything_runs(field, payload):
    """Every field is validated: a forged value is refused by name, by the record reader or the hook's check."""
    record = good()
    if field == "root_cause":
        record["root_cause"] = payload
    else:
        record["culprit"] = {**record["culprit"], field: payload}
    with pytest.raises(UnreadableRecord) as err:
        from_json(record)
    assert err.value.key in ("root_cause", f"culprit.{field}")
    args = {"root_cause": "gpu_xid", field: payload}
    with pytest.raises(HookRefused, match=re.escape("root_cause" if field == "root_cause" else f"culprit.{field}")):
        hook_fields(**args)


@pytest.mark.parametrize("template", [
    "scontrol update nodename={host} state=drain reason=\"otel-gpu: {root_cause} on {gpu_uuid}\"",  # docs' old one
    "printf '%s|' {host} {gpu_uuid} {gpu_index} {rank} {root_cause} {job_id}",
    "sh -c 'printf \"%s|\" \"$@\"; printf \"%s|\" \"$OTEL_GPU_CULPRIT_HOST\" \"$OTEL_GPU_ROOT_CAUSE\"' hook {host} "
    "{gpu_uuid} {gpu_index} {rank} {root_cause}",
])
def test_injected_fields_never_reach_a_shell_even_unvalidated_and_nothing_is_created(tmp_path, monkeypatch,
                                                                                     template):
    """The real hook runner with a real template, fed the payloads raw (past the validation, to prove the argv
    layer alone): each stays one argument, and no file appears, nothing is removed."""
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text("#!/bin/sh\nprintf '%s|' \"$@\"\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    canary = tmp_path / "CANARY"
    canary.mkdir()
    argv = split_template(template)
    for payload in INJECTIONS:
        fields = {"host": payload, "gpu_uuid": payload, "gpu_index": payload, "rank": payload,
                  "root_cause": payload, "job_id": payload}
        result = run_hook(argv, fields, timeout_s=20)
        assert result["exit_code"] == 0, result
        assert payload in result["output"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["CANARY", "bin"], (payload, result)
    assert canary.is_dir()


def test_a_hook_that_outlives_its_timeout_is_killed_with_its_children(tmp_path):
    argv = split_template(f"sh -c 'sleep 30 & echo $! > {tmp_path}/child; wait' hook")
    started = time.monotonic()
    result = run_hook(argv, hook_fields("gpu_xid"), timeout_s=1.0)
    assert result["exit_code"] is None and "timed out" in result["output"]
    assert time.monotonic() - started < 10
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        try:
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or \
        Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_hook_template_is_checked_once_at_load_and_errors_name_the_key():
    assert load_policy_text("hooks: {exclude: 'x {host}'}").hooks.exclude_argv == ["x", "{host}"]
    for text, needle in (("hooks: {exclude: \"x 'open\"}", "hooks.exclude: does not split"),
                         ("hooks: {exclude: \"sh -c 'kubectl cordon {host}'\"}", "hooks.exclude: {host} inside"),
                         ("hooks: {exclude: 'x {host!r}'}", "hooks.exclude: placeholder {host} takes no"),
                         ("hooks: {exclude: 'x {hots}'}", "did you mean 'host'"),
                         ("hooks: {exclude: [x, y]}", "hooks.exclude")):
        with pytest.raises(ConfigError) as err:
            load_policy_text(text)
        assert needle in str(err.value), str(err.value)


def test_every_yaml_example_in_docs_restart_md_loads_through_the_policy_loader():
    text = (REPO / "docs" / "restart.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    for block in blocks:
        policy = load_policy_text(block, "docs/restart.md")
        if policy.hooks.exclude:
            assert policy.hooks.exclude_argv and all(isinstance(a, str) for a in policy.hooks.exclude_argv)


def test_a_verdict_whose_culprit_does_not_validate_is_reported_and_never_acted_on(tmp_path):
    """A record that reads (underscores are a host name to print) but not to hand a hook: STOP, nothing run."""
    marker = tmp_path / "ran"
    policy = load_policy_text(f"hooks: {{exclude: 'touch {marker}'}}")
    out = io.StringIO()
    sup = Supervisor(["true"], "auto", policy, None, "job-good", "http://127.0.0.1:9", out=out)

    class Launch:
        status, client = 1, None

        @staticmethod
        def torchelastic_restarts():
            return 0

    record = from_json(good(culprit={"rank": 1, "host": "node_7", "gpu": "GPU-1234"}))
    decision = sup._decide(Launch(), 0, 0, time.time() - 1, {"rc": 1, "record": record, "trigger": "exit",
                                                             "printed": False, "ended": time.time()})
    assert decision.decision == "stop" and "culprit.host" in decision.reason
    assert not marker.exists() and "verdict not acted on" in out.getvalue()


# -- output: every control character escaped ------------------------------------------------------------------------
def fill(folder: Path, events: list[tuple[str, object]], resources: dict | None = None) -> None:
    """Through the real store exporter, as the collector writes."""
    exporter = StoreExporter(build(StoreExporterConfig, {"path": str(folder)}, "exporters.store"),
                             ComponentHost("store", PrometheusSelfTelemetry()))
    exporter.start()
    try:
        req = ExportLogsServiceRequest()
        rl = req.resource_logs.add()
        for key, value in (resources or {}).items():
            rl.resource.attributes.append(KeyValue(key=key, value=AnyValue(string_value=str(value))))
        sl = rl.scope_logs.add()
        for name, body in events:
            sl.log_records.add(event_name=name, body=AnyValue(string_value=json.dumps(body)))
        exporter.export(Batch.from_message(Signal.LOGS, req))
        assert exporter.force_flush(5)
    finally:
        exporter.shutdown()


def report(store: Path, fmt: str = "text") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = report_main(argparse.Namespace(store=str(store), format=fmt, job=None, limit=50), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("ch", CONTROLS, ids=[f"U+{ord(c):04X}" for c in CONTROLS])
def test_every_control_character_in_every_printed_field_comes_out_escaped(tmp_path, ch):
    evil = f"evil{ch}X"
    shown = printable(evil)
    assert shown != evil and ch not in shown
    failure = good(job_id=evil, summary=evil, evidence=[evil, f"{evil}=1 @1700000100.0"], signature=evil,
                   failure_id=evil, details={evil: evil, "op": evil})
    unreadable = good(job_id=evil, failure_id=f"bad-{evil}", root_cause=evil)
    device = {"device_id": f"gpu:{evil}", "kind": "gpu", "host": evil, "uuid": evil, "gpu_index": 1,
              "serial": evil, "state": "drain", "since": 1_700_000_000.0, "time": 1_700_000_000.0, "score": 90,
              "evidence": [evil]}
    decision = {"job_id": evil, "incarnation": 0, "restart_count": 0, "time": 1_700_000_000.0, "trigger": evil,
                "exit_status": 1, "decision": evil, "reason": evil, "root_cause": evil, "action": evil,
                "excluded": evil, "backoff_s": 1.0, "incarnation_start": 1_700_000_000.0}
    goodput = {"job_id": evil, "ettr": 0.5, "wall_time_s": 100.0, "productive_time_s": 50.0,
               "badput_s": {evil: 10.0}}
    fill(tmp_path, [(F.FAILURE_EVENT.name, failure), (F.FAILURE_EVENT.name, unreadable),
                    (H.STATE_CHANGE_EVENT.name, device), ("otel_gpu.restart.decision", decision),
                    (F.GOODPUT_EVENT.name, goodput)],
         resources={"training.job.id": evil, "host.name": "node-a", "training.rank": 0})
    code, out, err = report(tmp_path)
    assert code == 0, err
    assert_printable(out)
    assert_printable(err)
    assert f"CRASH in job {shown}: {shown}" in out
    assert "unreadable record bad-" + shown + ": root_cause:" in out
    assert not any(line.startswith("X") for line in out.splitlines())  # a newline never starts a forged line
    # The supervisor's printed diagnosis, and its decision line.
    printed = io.StringIO()
    sup = Supervisor(["true"], "auto", load_policy_text(""), None, evil, "http://127.0.0.1:9", out=printed)
    record = from_json(good(job_id=evil, summary=evil, evidence=[evil], details={"op": evil}, action="user_fix"))
    sup.say(f"the job failed and needs a person: {evil}", format_failure(record))

    class Launch:
        status, client = 1, None

    sup._decide(Launch(), 0, 0, time.time() - 1, {"rc": 1, "record": record, "trigger": "exit", "printed": False,
                                                  "ended": time.time()})
    assert_printable(printed.getvalue())
    assert f"CRASH in job {shown}: {shown}" in printed.getvalue()


def test_bidi_controls_line_separators_and_lone_surrogates_are_escaped_too():
    for ch in ("\u202e", "\u2066", "\u2028", "\u2029", "\u200f", "\ufeff", "\ud800"):
        assert printable(f"a{ch}b") == f"a\\u{ord(ch):04x}b"
    assert printable("\x1b[2J") == "\\x1b[2J" and printable("\n") == "\\n" and printable("plain é 日本") == "plain é 日本"

    class Hostile:
        def __str__(self):
            raise RuntimeError("no")

        def __repr__(self):
            raise RuntimeError("no")

    assert printable(Hostile()) == "<Hostile>"


# -- the formatter is total -----------------------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)
FIELDS = ["kind", "root_cause", "category", "action", "auto_remediable", "culprit", "job_id", "onset_time",
          "detected_time", "confidence", "evidence", "signature", "recurrence", "failure_id", "version",
          "withdrawn", "summary", "details", "previous_root_cause", "status", "xid"]


def _check(data) -> None:
    try:
        record = from_json(data)
    except UnreadableRecord:
        record = None
    if record is not None:  # round trip
        again = from_json(record.to_json())
        assert again.to_dict() == from_json(again.to_json()).to_dict()
    text = format_failure(data)
    assert isinstance(text, str) and text.endswith("\n")
    assert_printable(text)
    if record is not None:
        assert_printable(format_failure(record))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JSON)
def test_from_json_and_format_failure_over_arbitrary_json_raise_nothing_but_unreadable_record(data):
    _check(data)
    _check(json.dumps(data))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
       st.dictionaries(st.sampled_from(["rank", "host", "gpu"]), JSON, max_size=3))
def test_a_good_record_with_any_fields_replaced_never_breaks_the_formatter(replaced, culprit):
    data = good(**replaced)
    if culprit and isinstance(data.get("culprit"), dict):
        data["culprit"] = {**data["culprit"], **culprit}
    _check(data)


def test_forged_infinity_wrong_types_and_missing_keys_print_as_unreadable():
    for forged, key in ((good(recurrence=float("inf")), "recurrence"), (good(evidence=5), "evidence"),
                        (good(confidence=float("nan")), "confidence"), ({"kind": "crash"}, "root_cause"),
                        (good(culprit={"rank": True}), "culprit.rank"), (good(version=-1), "version"),
                        (good(onset_time="soon"), "onset_time"), (good(details=[1]), "details")):
        with pytest.raises(UnreadableRecord) as err:
            from_json(forged)
        assert err.value.key == key
        assert format_failure(forged).startswith(f"unreadable record job-good/1: {key}:") or key == "root_cause"
    assert format_failure(b"\xff\xfe").startswith("unreadable record ?: record: not JSON")
    assert format_failure('{"recurrence": Infinity}').startswith("unreadable record ?: kind: missing")


# -- one poison record, the rest stands ---------------------------------------------------------------------------
def test_a_report_over_a_store_with_poison_records_prints_every_good_one(tmp_path):
    goods = [good(job_id=f"job-{i}", failure_id=f"job-{i}/1", detected_time=1_700_000_100.0 + i) for i in range(4)]
    poison = [good(failure_id="p1", recurrence=float("inf")), good(failure_id="p2", evidence=5),
              good(failure_id="p3", culprit={"rank": "0; rm -rf /"}), good(failure_id="p4", kind=["crash"])]
    fill(tmp_path, [(F.FAILURE_EVENT.name, r) for r in goods[:2] + poison + goods[2:]]
         + [("otel_gpu.restart.decision", {"job_id": "job-1", "incarnation": 0, "decision": "restart",
                                           "backoff_s": "abc", "time": "x", "incarnation_start": float("inf")}),
            (F.GOODPUT_EVENT.name, {"job_id": "job-1", "ettr": "NaN", "wall_time_s": float("inf"),
                                    "badput_s": {"hang": "abc"}, "incarnations": 5})])
    code, out, err = report(tmp_path)
    assert code == 0 and not err, err
    for i in range(4):
        assert f"CRASH in job job-{i}:" in out
    assert out.splitlines()[0] == "4 failures (newest first), 4 unreadable records"
    for fid, key in (("p1", "recurrence"), ("p2", "evidence"), ("p3", "culprit.rank"), ("p4", "kind")):
        assert f"unreadable record {fid}: {key}:" in out, out
    assert "backoff unreadable" in out
    code, text, _ = report(tmp_path, "json")
    body = json.loads(text)
    assert code == 0 and [f["failure_id"] for f in body["failures"]] == ["job-3/1", "job-2/1", "job-1/1", "job-0/1"]
    assert sorted(u["id"] for u in body["unreadable"]) == ["p1", "p2", "p3", "p4"]
    done = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr and done.stdout == out
    with closing(db.open_reader(tmp_path)) as conn:
        rows = db.read_failures(conn)
        assert [r.record.job_id for r in rows] == ["job-3", "job-2", "job-1", "job-0"]
        assert sorted((u.name, u.reason.split(":")[0]) for u in rows.unreadable) == [
            ("p1", "recurrence"), ("p2", "evidence"), ("p3", "culprit.rank"), ("p4", "kind")]
        assert len(db.failures(conn)) == 4 and len(db.failures(conn).unreadable) == 4


def test_the_verdict_client_returns_typed_verdicts_and_lists_the_unreadable_ones():
    from otel_gpu.supervisor._verdict import VerdictClient

    exporter = _verdict_api([good(job_id="j1", failure_id="ok"), good(job_id="j1", failure_id="bad", evidence=5),
                             good(job_id="j2", failure_id="other")])
    try:
        verdicts = VerdictClient(exporter.url).failures("j1")
    finally:
        exporter.shutdown()
    assert [(v.failure_id, v.culprit.host) for v in verdicts] == [("ok", "node-b")]
    assert [(name, reason.split(":")[0]) for name, reason in verdicts.unreadable] == [("bad", "evidence")]


# -- the supervisor keeps supervising -------------------------------------------------------------------------------
class _Telemetry:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _verdict_api(records: list) -> object:
    exporter = FACTORY.create(build(VerdictExporterConfig, {"endpoint": "127.0.0.1:0"}, "exporters.verdict"),
                              ComponentHost("verdict", _Telemetry()))
    exporter.start()
    req = _export.logs_request(_export.make_resource({"service.name": "otel-gpu"}),
                               [(F.FAILURE_EVENT.name, 1, {}, r, _export.ERROR) for r in records])
    exporter.export(Batch.from_message(Signal.LOGS, req))
    return exporter


def test_a_supervisor_fed_malformed_verdicts_keeps_supervising_and_runs_nothing(tmp_path):
    """Real ``otel-gpu run --restart auto``: forged records for its job (recurrence Infinity, evidence 5, a culprit
    host with a command in it, a root cause outside the taxonomy, an escape sequence) arrive while it runs; the
    job runs to its end (exit 0, DONE), the hook never runs, every printed line is escaped."""
    job = "hostile-job"
    now = time.time()
    forged = [good(job_id=job, failure_id="f-inf", kind="hang", recurrence=float("inf"), onset_time=now,
                   detected_time=now + 1),
              good(job_id=job, failure_id="f-ev", kind="hang", evidence=5, onset_time=now, detected_time=now + 1),
              good(job_id=job, failure_id="f-host\x1b]0;owned\x07", culprit={"host": "node$(touch X)"},
                   onset_time=now, detected_time=now + 1),
              good(job_id=job, failure_id="f-cause", root_cause="gpu_xid$(touch X)", onset_time=now,
                   detected_time=now + 1),
              {"job_id": job, "kind": "hang", "backoff_s": "abc", "failure_id": "f-min", "detected_time": now + 1}]
    exporter = _verdict_api(forged)
    marker = tmp_path / "finished"
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"hooks: {{exclude: 'touch {tmp_path}/hook-ran'}}\nverdict: {{poll_interval: 200ms}}\n")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "otel_gpu", "run", "--restart", "auto", "--policy", str(policy), "--verdict-url",
             exporter.url, "--job-id", job, "--", sys.executable, "-c",
             f"import time, pathlib; time.sleep(4); pathlib.Path({str(marker)!r}).write_text('ok')"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    finally:
        exporter.shutdown()
    assert done.returncode == 0, done.stderr[-4000:]
    assert marker.read_text() == "ok"
    assert "-> DONE" in done.stderr and "Traceback" not in done.stderr
    for fid in ("f-inf", "f-ev", "f-cause", "f-min"):
        assert f"unreadable record {fid} from the verdict API" in done.stderr, done.stderr[-4000:]
    assert "unreadable record f-host\\x1b]0;owned\\x07" in done.stderr
    assert_printable(done.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["finished", "policy.yaml"]  # no X, no hook-ran


def test_an_error_of_the_supervisor_stops_the_jobs_process_tree_before_it_exits(tmp_path):
    exporter = _verdict_api([])
    pids = tmp_path / "pids"
    cmd = ["sh", "-c", f"sleep 60 & echo $! > {pids}; echo $$ >> {pids}; wait"]
    out = io.StringIO()
    sup = Supervisor(cmd, "auto", load_policy_text("verdict: {poll_interval: 200ms}\nstop_grace: 2s\n"),
                     "http://127.0.0.1:9", "job-err", exporter.url, out=out)

    def broken(since):
        raise RuntimeError("a bug of ours")

    sup._failures = broken
    try:
        started = time.monotonic()
        assert sup.run() == INTERNAL_ERROR
        assert time.monotonic() - started < 30
    finally:
        exporter.shutdown()
    assert "stopping the job's process tree" in out.getvalue() and "internal error (RuntimeError" in out.getvalue()
    for pid in (int(p) for p in pids.read_text().split()):
        alive = Path(f"/proc/{pid}").exists() and \
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        assert not alive, f"pid {pid} survived the supervisor's error"
