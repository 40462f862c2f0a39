"""``otel-gpu report``: text and JSON from a store filled through the real store exporter."""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otel_gpu.commands.cli import main as cli_main
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.config import build
from otel_gpu.exporters.store import StoreExporter, StoreExporterConfig, db
from otel_gpu.pdata import Batch, Signal
from otel_gpu.commands.report import main
from otel_gpu.schema.failure import RECORD_KEYS

HANG = {"kind": "hang", "root_cause": "rank_not_in_collective", "category": "software", "action": "user_fix",
        "auto_remediable": False, "culprit": {"rank": 2, "host": "node-a", "gpu": None}, "job_id": "job-x",
        "onset_time": 1_700_000_000.0, "detected_time": 1_700_000_007.8, "confidence": 0.9,
        "evidence": [{"metric": "training.collective.seq", "value": 40, "time": 1_700_000_000.0, "rank": 2},
                     "training.collective.in_flight=all_reduce @1700000001"],
        "signature": "hang/rank_not_in_collective/all_reduce", "recurrence": 3,
        "summary": "rank 2 never reached all_reduce seq 41", "details": {"op": "all_reduce", "seq": 41}}
XID = {"kind": "crash", "root_cause": "gpu_fell_off_bus", "category": "hardware",
       "action": "exclude_node_and_restart", "auto_remediable": True,
       "culprit": {"rank": 5, "host": "node-b", "gpu": "GPU-1234"}, "job_id": "job-y",
       "onset_time": 1_700_000_100.0, "detected_time": 1_700_000_100.4, "confidence": 0.99,
       "evidence": [{"metric": "hw.gpu.xid", "value": 79, "time": 1_700_000_100.0}], "signature": "xid79/GPU-1234",
       "recurrence": 0, "xid": 79}
GOODPUT_X = {"job_id": "job-x", "ettr": 0.873, "wall_time_s": 1000.0, "productive_time_s": 873.0,
             "badput_s": {"startup": 20.0, "hang": 90.0, "checkpoint_save": 17.0}}


def fill(folder, events, resources=None) -> None:
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


def run(store, fmt="text", job=None, limit=50) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argparse.Namespace(store=str(store), format=fmt, job=job, limit=limit), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def store(tmp_path):
    folder = tmp_path / "data"
    fill(folder, [("otel_gpu.failure", HANG), ("otel_gpu.goodput", GOODPUT_X)],
         resources={"training.job.id": "job-x", "host.name": "node-a", "training.rank": 0})
    fill(folder, [("otel_gpu.failure", XID)])
    return folder


def test_text_report_reads_like_an_explanation(store):
    code, out, err = run(store)
    assert code == 0 and not err
    lines = out.splitlines()
    assert lines[0] == "2 failures (newest first)"
    crash = next(i for i, line in enumerate(lines) if line.startswith("CRASH"))
    hang = next(i for i, line in enumerate(lines) if line.startswith("HANG"))
    assert crash < hang  # newest first
    assert lines[hang] == ("HANG in job job-x: rank 2 never reached all_reduce seq 41 (rank_not_in_collective, "
                           "software) -> action: user_fix; confidence 0.9; detected 7.8 s after onset")
    assert lines[crash].startswith("CRASH in job job-y: gpu fell off bus (XID 79) on rank 5, host node-b, GPU GPU-1234 "
                                   "(gpu_fell_off_bus, hardware) -> action: exclude_node_and_restart")
    hang_block = "\n".join(lines[hang:])
    assert "  culprit: rank 2, host node-a" in hang_block
    assert "    - training.collective.seq = 40 (rank 2) at +0.0 s from onset" in hang_block
    assert "    - training.collective.in_flight=all_reduce at +1.0 s from onset" in hang_block
    assert "  details: op all_reduce, seq 41" in hang_block
    assert "  recurrence: seen 3 times before (signature hang/rank_not_in_collective/all_reduce)" in hang_block
    assert "  recurrence: first time seen" in out
    assert "goodput (job job-x): ETTR 87.3% (productive 14.6 min of 16.7 min wall time)" in out
    badput = [line.split()[0] for line in lines if line.startswith("    ") and "% of wall time" in line]
    assert badput == ["hang", "startup", "checkpoint_save"]  # by size
    assert any(line.startswith("  job-x: 1 rank on 1 host") and line.endswith("ETTR 87.3%") for line in lines)


def test_json_report_is_the_public_contract(store):
    code, out, _ = run(store, fmt="json")
    assert code == 0
    report = json.loads(out)
    # restarts: run --restart decisions; unreadable: stored records that do not read as failure records
    assert set(report) == {"failures", "unreadable", "goodput", "jobs", "devices", "restarts"}
    assert report["unreadable"] == []
    assert report["devices"] == []  # devices to drain / to watch (none in this store)
    assert report["failures"] == [XID, HANG]
    for record in report["failures"]:
        assert set(RECORD_KEYS) <= set(record)
    assert report["goodput"] == GOODPUT_X
    jobs = {j["job_id"]: j for j in report["jobs"]}
    assert set(jobs) == {"job-x", "job-y"}  # job-y is known from its failure record only
    assert {"job_id", "first_seen", "last_seen", "ranks", "hosts", "goodput"} <= set(jobs["job-x"])
    assert (jobs["job-x"]["ranks"], jobs["job-x"]["hosts"], jobs["job-x"]["goodput"]) == (1, 1, GOODPUT_X)
    assert jobs["job-y"]["goodput"] is None


def test_job_filter_and_limit(store):
    report = json.loads(run(store, fmt="json", job="job-y")[1])
    assert report["failures"] == [XID] and report["goodput"] is None
    assert [j["job_id"] for j in report["jobs"]] == ["job-y"]
    assert json.loads(run(store, fmt="json", limit=1)[1])["failures"] == [XID]
    code, out, _ = run(store, job="nope")
    assert code == 0 and out.startswith("no failures recorded\ngoodput: no data")


def test_missing_and_empty_store(tmp_path):
    code, out, err = run(tmp_path / "absent")
    assert code == 1 and not out
    assert "no otel-gpu store at" in err and "--store" in err
    empty = tmp_path / "empty"
    db.open_writer(empty).close()
    assert run(empty) == (0, "no failures recorded\ngoodput: no data\n", "")
    assert json.loads(run(empty, fmt="json")[1]) == {"failures": [], "unreadable": [], "goodput": None, "jobs": [],
                                                     "devices": [], "restarts": []}


def test_not_a_store_is_a_clear_error(tmp_path):
    (tmp_path / db.DB_FILE).write_text("this is not sqlite " * 100)
    code, _, err = run(tmp_path)
    assert code == 1 and "cannot read the store" in err


def test_report_reads_while_a_collector_writes(tmp_path):
    folder = tmp_path / "live"
    exporter = StoreExporter(build(StoreExporterConfig, {"path": str(folder)}, "exporters.store"),
                             ComponentHost("store", PrometheusSelfTelemetry()))
    exporter.start()
    try:
        counts = []
        for i in range(20):
            req = ExportLogsServiceRequest()
            req.resource_logs.add().scope_logs.add().log_records.add(
                event_name="otel_gpu.failure", body=AnyValue(string_value=json.dumps({**HANG, "detected_time": i})))
            exporter.export(Batch.from_message(Signal.LOGS, req))
            code, out, _ = run(folder, fmt="json", limit=None)
            assert code == 0
            counts.append(len(json.loads(out)["failures"]))
        exporter.force_flush()
        assert len(json.loads(run(folder, fmt="json", limit=-1)[1])["failures"]) == 20
        assert counts == sorted(counts)
    finally:
        exporter.shutdown()
    before = os.stat(db.db_path(folder)).st_mtime_ns
    assert run(folder)[0] == 0
    assert os.stat(db.db_path(folder)).st_mtime_ns == before  # read-only


def test_cli_entry_point(store, capsys):
    assert cli_main(["report", "--store", str(store), "--format", "json", "--limit", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["failures"] == [XID]
    proc = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(store)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HANG in job job-x" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(store) + "-missing"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no otel-gpu store" in proc.stderr


def test_otel_sdk_event_to_collector_subprocess_to_report(tmp_path):
    """The real path: an OTel SDK log event -> OTLP gRPC -> `otel-gpu collector` (store) -> `otel-gpu report`; the
    SDK sends as a trusted forwarder (records that act from anyone else are dropped: tests/test_hostile_trust.py)."""
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.resources import Resource

    from collector_proc import free_port, start_collector

    grpc_port = free_port()
    store = tmp_path / "store"
    config = f"""
receivers: {{otlp: {{protocols: {{grpc: {{endpoint: "127.0.0.1:{grpc_port}"}}}},
                     trusted_forwarders: {{bearer_token: forwarder-token}}}}}}
exporters: {{store: {{path: "{store}"}}}}
service: {{pipelines: {{logs: {{receivers: [otlp], exporters: [store]}}}}}}
"""
    with start_collector(config, tmp_path) as collector:
        provider = LoggerProvider(resource=Resource.create({"training.job.id": "job-x", "training.rank": 0,
                                                            "host.name": "node-a"}))
        provider.add_log_record_processor(BatchLogRecordProcessor(
            OTLPLogExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True,
                            headers={"authorization": "Bearer forwarder-token"})))
        logger = provider.get_logger("e2e")
        logger.emit(event_name="otel_gpu.failure", body=json.dumps(HANG))
        logger.emit(event_name="otel_gpu.goodput", body=json.dumps(GOODPUT_X))
        provider.shutdown()
        deadline = time.monotonic() + 15
        report = {"failures": []}
        while time.monotonic() < deadline and not report["failures"]:  # read while the collector runs
            proc = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(store), "--format",
                                   "json"], capture_output=True, text=True, timeout=60)
            if proc.returncode == 0:
                report = json.loads(proc.stdout)
            time.sleep(0.2)
        assert report["failures"] == [HANG] and report["goodput"] == GOODPUT_X
        assert collector.stop() == 0
    job = json.loads(run(store, fmt="json")[1])["jobs"][0]
    assert (job["job_id"], job["ranks"], job["hosts"]) == ("job-x", 1, 1)


def test_report_shows_the_latest_version_history_in_json_and_withdrawn_verdicts(tmp_path):
    folder = tmp_path / "data"
    died = {**XID, "root_cause": "rank_process_died", "category": "infrastructure", "action": "auto_restart",
            "failure_id": "job-y/1", "version": 1, "evidence": []}
    xid = {**XID, "failure_id": "job-y/1", "version": 2}
    hang = {**HANG, "failure_id": "job-x/1", "version": 1}
    fill(folder, [("otel_gpu.failure", died), ("otel_gpu.failure", hang)])
    fill(folder, [("otel_gpu.failure", xid),
                  ("otel_gpu.failure", {**hang, "version": 2, "status": "withdrawn",
                                        "withdrawn_reason": "every rank resumed after 41.0 s"})])
    code, out, _ = run(folder, fmt="json")
    assert code == 0
    report = json.loads(out)
    by_id = {f["failure_id"]: f for f in report["failures"]}
    assert set(by_id) == {"job-y/1", "job-x/1"}
    assert by_id["job-y/1"]["root_cause"] == "gpu_fell_off_bus" and by_id["job-y/1"]["version"] == 2
    assert [v["record"]["root_cause"] for v in by_id["job-y/1"]["versions"]] == ["rank_process_died",
                                                                               "gpu_fell_off_bus"]
    assert by_id["job-x/1"]["status"] == "withdrawn"
    code, out, _ = run(folder)
    lines = out.splitlines()
    assert lines[0] == "1 failure (newest first), 1 withdrawn verdict"
    assert any(line.startswith("CRASH in job job-y") for line in lines)
    assert "  revisions: v1 crash/rank_process_died (rank 5, host node-b, GPU GPU-1234) -> " \
           "v2 crash/gpu_fell_off_bus (rank 5, host node-b, GPU GPU-1234)" in lines
    assert any(line.startswith("WITHDRAWN HANG in job job-x") for line in lines)
    assert "  status: withdrawn (every rank resumed after 41.0 s); not counted as a failure" in lines


def test_withdrawn_as_the_attribution_processor_writes_it(tmp_path):
    folder = tmp_path / "data"
    hang = {**HANG, "failure_id": "job-x/2", "version": 1}
    fill(folder, [("otel_gpu.failure", hang),
                  ("otel_gpu.failure", {**hang, "version": 2, "withdrawn": True,
                                        "summary": "withdrawn: the ranks progressed again; " + HANG["summary"]})])
    code, out, _ = run(folder)
    assert code == 0
    assert out.splitlines()[0] == "0 failures (newest first), 1 withdrawn verdict"
    assert "  status: withdrawn (the ranks progressed again); not counted as a failure" in out.splitlines()
