"""Faults stay in the store (issue 21): a real collector on loopback with a broken, corrupted, shared or killed store.

A store that cannot open or write degrades the store alone (the collector runs, says which file and what to do, the
health check names it, OTLP -> prometheus and the verdict API go on); a second collector on one store is refused
the store with the first one's pid; records answered 200 survive a SIGKILL; a poison record drops alone.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import grpc
import pytest
from collector_proc import free_port, start_collector
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.config import build
from otel_gpu.exporters.store import StoreExporter, StoreExporterConfig, db
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import collector as names

pytestmark = pytest.mark.timeout(120)


class Ports:
    def __init__(self) -> None:
        self.grpc, self.prom, self.health, self.verdict = free_port(), free_port(), free_port(), free_port()


def config(ports: Ports, store: Path, **store_settings) -> str:
    settings = {"path": str(store), "reopen_interval": "500ms", **store_settings}
    return f"""
receivers:
  otlp: {{grpc: {{endpoint: 127.0.0.1:{ports.grpc}}}, http: null, trusted_forwarders: {{bearer_token: {FORWARDER}}}}}
processors:
  goodput: {{}}
exporters:
  prometheus: {{endpoint: 127.0.0.1:{ports.prom}}}
  store: {json.dumps(settings)}
  verdict: {{endpoint: 127.0.0.1:{ports.verdict}}}
extensions:
  health_check: {{endpoint: 127.0.0.1:{ports.health}}}
service:
  extensions: [health_check]
  pipelines:
    metrics: {{receivers: [otlp], processors: [goodput], exporters: [prometheus, store]}}
    logs: {{receivers: [otlp], processors: [goodput], exporters: [store, verdict]}}
"""


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _attrs(attributes, values: dict) -> None:
    for key, value in values.items():
        attributes.append(KeyValue(key=key, value=AnyValue(string_value=value) if isinstance(value, str)
                                   else AnyValue(int_value=value)))


def failures_request(job: str, n: int, start: int = 0, poison: dict[int, dict] | None = None) -> \
        ExportLogsServiceRequest:
    """``n`` failure records of ``job`` in one request; ``poison`` replaces fields of the records at those indexes."""
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    _attrs(rl.resource.attributes, {"service.name": "otel-gpu", "training.job.id": job, "host.name": "node-a"})
    sl = rl.scope_logs.add()
    now = time.time()
    for i in range(start, start + n):
        body = {"kind": "crash", "root_cause": "gpu_xid", "job_id": job, "signature": f"sig-{job}-{i}",
                "detected_time": now, "onset_time": now - 1.0, "confidence": 0.9,
                "culprit": {"rank": 0, "host": "node-a"}, "seq": i}
        body.update((poison or {}).get(i - start, {}))
        sl.log_records.add(event_name="otel_gpu.failure", time_unix_nano=time.time_ns(),
                           body=AnyValue(string_value=json.dumps(body)))
    return req


def metrics_request(value: float = 42.0) -> ExportMetricsServiceRequest:
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    _attrs(rm.resource.attributes, {"service.name": "train", "training.job.id": "job-m"})
    metric = rm.scope_metrics.add().metrics.add(name="faults.test.gauge", unit="1")
    metric.gauge.data_points.add(as_double=value, time_unix_nano=time.time_ns())
    return req


# The records sent here act (failures): they come as a trusted forwarder's (receivers.otlp.trusted_forwarders).
FORWARDER = "forwarder-token-for-the-store-tests"
AS_FORWARDER = (("authorization", f"Bearer {FORWARDER}"),)


def send(port: int, request) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        if isinstance(request, ExportLogsServiceRequest):
            logs_service_pb2_grpc.LogsServiceStub(channel).Export(request, timeout=20, metadata=AS_FORWARDER)
        else:
            metrics_service_pb2_grpc.MetricsServiceStub(channel).Export(request, timeout=20)


def stored_failures(store: Path, job: str | None = None) -> int:
    with closing(db.open_reader(store)) as conn:
        return len(db.failures(conn, job_id=job))


def metric_value(port: int, line_start: str) -> float:
    _, page = get(port, "/metrics")
    values = [float(ln.rsplit(" ", 1)[1]) for ln in page.splitlines() if ln.startswith(line_start)]
    return sum(values)


def wait_for(predicate, timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def assert_rest_of_the_pipeline_goes_on(ports: Ports) -> None:
    """OTLP metrics reach prometheus, the verdict API answers, the health check answers 200 naming the store."""
    send(ports.grpc, metrics_request(42.0))
    wait_for(lambda: "faults_test_gauge" in get(ports.prom, "/metrics")[1], what="the metric on /metrics")
    status, body = get(ports.verdict, "/api/v1/failures?job_id=job-v")
    assert status == 200 and "failures" in json.loads(body), body
    status, body = get(ports.health, "/")
    doc = json.loads(body)
    assert status == 200 and doc["status"] == "Server available", body
    assert doc["components"]["exporters.store"]["status"] == "degraded", body


# -- a broken store at start ---------------------------------------------------------------------------------------

def test_a_corrupt_store_file_degrades_the_store_alone_and_every_other_component_starts(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / db.DB_FILE).write_bytes(b"this is not an sqlite file " * 200)
    ports = Ports()
    with start_collector(config(ports, store), tmp_path / "c") as proc:
        log = proc.stderr_text()
        assert "store store degraded, the rest of the collector goes on" in log, log
        assert str(store / db.DB_FILE) in log and "move" in log and "aside" in log, log  # the file and the fix
        send(ports.grpc, failures_request("job-v", 3))  # the store drops them, counted; nothing blocks
        assert_rest_of_the_pipeline_goes_on(ports)
        wait_for(lambda: metric_value(ports.prom, 'otel_gpu_collector_dropped_total{otel_gpu_component="store"') >= 3,
                 what="the store's dropped records counted")
        assert metric_value(ports.prom, 'otel_gpu_collector_degraded{otel_gpu_component="store"}') == 1.0
        assert proc.alive
        assert proc.stop() == 0


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return done.returncode == 0


def test_a_full_disk_degrades_the_store_alone_and_the_store_comes_back_when_space_is_freed(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("needs root and mount(8) for a 1 MiB tmpfs (a full disk)")
    try:
        filler = disk / "filler"
        with open(filler, "wb") as f:  # fill the disk to the last block
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        store = disk / "store"
        ports = Ports()
        with start_collector(config(ports, store), tmp_path / "c") as proc:
            log = proc.stderr_text()
            assert "store store degraded" in log and str(store / db.DB_FILE) in log, log
            assert "free space on the disk" in log, log  # the fix
            assert_rest_of_the_pipeline_goes_on(ports)
            filler.unlink()  # space again: the store opens on its next try (reopen_interval 500ms)
            wait_for(lambda: "writes" in proc.stderr_text() and "again" in proc.stderr_text(), what="store back")
            send(ports.grpc, failures_request("job-disk", 5))
            assert stored_failures(store, "job-disk") == 5
            status, body = get(ports.health, "/")
            assert status == 200 and "components" not in json.loads(body), body
            assert proc.stop() == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# -- corrupted while running ---------------------------------------------------------------------------------------

def test_a_store_corrupted_while_running_logs_a_clear_error_and_the_collector_stays_up(tmp_path):
    store = tmp_path / "store"
    ports = Ports()
    with start_collector(config(ports, store, check_interval="1s"), tmp_path / "c") as proc:
        send(ports.grpc, failures_request("job-x", 20))
        assert stored_failures(store, "job-x") == 20
        before = proc.stderr_text()
        assert "store store degraded" not in before and "is corrupt" not in before, before
        file = store / db.DB_FILE
        with closing(sqlite3.connect(file)) as conn:  # the records in the main file, as after any checkpoint
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = file.stat().st_size
        with open(file, "r+b") as f:  # bytes overwritten under the running collector: header and pages
            f.write(os.urandom(100))
            f.seek(4096)
            f.write(os.urandom(max(0, size - 4096)))
            os.fsync(f.fileno())
        wait_for(lambda: "is corrupt" in proc.stderr_text(), what="an error naming the corrupt store")
        log = proc.stderr_text()
        assert str(file) in log and ".recover" in log, log
        send(ports.grpc, failures_request("job-x", 5, start=20))  # still answered, counted if not written
        assert proc.alive
        assert_rest_of_the_pipeline_goes_on(ports)
        assert metric_value(ports.prom, 'otel_gpu_collector_degraded{otel_gpu_component="store"}') == 1.0
        assert proc.stop() == 0


# -- two collectors, one store -------------------------------------------------------------------------------------

def test_a_second_collector_on_one_store_is_refused_naming_the_first_ones_pid_and_takes_over_when_it_exits(tmp_path):
    store = tmp_path / "store"
    first_ports, second_ports = Ports(), Ports()
    first = start_collector(config(first_ports, store), tmp_path / "first")
    try:
        send(first_ports.grpc, failures_request("job-1", 4))
        with start_collector(config(second_ports, store), tmp_path / "second") as second:
            log = second.stderr_text()
            assert f"is in use by another collector (pid {first.pid}" in log, log
            assert str(store / "otel-gpu.db.lock") in log, log
            assert_rest_of_the_pipeline_goes_on(second_ports)
            send(second_ports.grpc, failures_request("job-2", 3))  # dropped and counted, never half-written
            # readers are unaffected by the lock
            report = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(store), "--format",
                                     "json"], capture_output=True, text=True, timeout=60)
            assert report.returncode == 0, report.stderr
            assert {f["job_id"] for f in json.loads(report.stdout)["failures"]} == {"job-1"}
            assert first.stop() == 0  # the lock goes with it; the second takes the store over
            wait_for(lambda: "writes" in second.stderr_text() and "again" in second.stderr_text(),
                     what="the second collector writing the store")
            send(second_ports.grpc, failures_request("job-2", 3, start=3))
            assert stored_failures(store, "job-2") == 3 and stored_failures(store, "job-1") == 4
            assert second.stop() == 0
    finally:
        first.kill()


# -- durable before the answer -------------------------------------------------------------------------------------

def test_failure_records_answered_200_survive_a_sigkill_of_the_collector(tmp_path):
    """1,200 failure records in 120 requests from 4 concurrent senders, every one answered OK, then SIGKILL at once:
    reopened, the store holds every one (floor: 0 acknowledged failure records lost)."""
    store = tmp_path / "store"
    ports = Ports()
    proc = start_collector(config(ports, store), tmp_path / "c")
    acknowledged = []
    lock = threading.Lock()

    def sender(k: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
            stub = logs_service_pb2_grpc.LogsServiceStub(channel)
            for i in range(30):
                stub.Export(failures_request("job-kill", 10, start=(k * 30 + i) * 10), timeout=20,
                            metadata=AS_FORWARDER)
                with lock:
                    acknowledged.append(10)

    try:
        threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.proc.wait(10)
    finally:
        proc.kill()
    assert sum(acknowledged) == 1200
    with closing(db.open_reader(store)) as conn:
        seqs = {json.loads(r)["seq"] for (r,) in conn.execute("SELECT record FROM failures WHERE job_id = 'job-kill'")}
    assert len(seqs) == 1200, f"{1200 - len(seqs)} acknowledged failure records lost"


# -- a poison record -----------------------------------------------------------------------------------------------

def test_a_poison_record_drops_alone_counted_and_logged_and_its_batch_is_written(tmp_path):
    store = tmp_path / "store"
    ports = Ports()
    lone = "\\ud800"  # JSON text for a lone surrogate: valid on the wire, refused by SQLite's UTF-8 encoder
    with start_collector(config(ports, store), tmp_path / "c") as proc:
        req = failures_request("job-p", 500)
        poisoned = json.loads(req.resource_logs[0].scope_logs[0].log_records[250].body.string_value)
        req.resource_logs[0].scope_logs[0].log_records[250].body.string_value = \
            json.dumps(poisoned).replace('"kind": "crash"', f'"kind": "{lone}"')
        send(ports.grpc, req)
        assert stored_failures(store, "job-p") == 499
        send(ports.grpc, failures_request("job-p", 10, start=500, poison={3: {"job_id": "job-p\ud800"}}))
        assert stored_failures(store, "job-p") == 508  # the second poison (a job id) costs only itself too
        wait_for(lambda: metric_value(ports.prom, 'otel_gpu_collector_poison_records_total{otel_gpu_component='
                                                  '"store"}') >= 2, what="two poison records counted")
        log = proc.stderr_text()
        assert log.count("dropped one otel_gpu.failure record that SQLite or JSON refuses") == 1, log  # rate-limited
        assert "the rest of its batch was written" in log and "UnicodeEncodeError" in log, log
        assert proc.stop() == 0


def test_a_poison_record_in_one_transaction_with_499_others_costs_only_itself(tmp_path, caplog):
    """Deterministic batching: the writer is held at its commit while 500 records (one poison) queue, so that they
    are written as one transaction; it is retried one record at a time and only the poison drops."""
    telemetry = PrometheusSelfTelemetry()
    exporter = StoreExporter(build(StoreExporterConfig, {"path": str(tmp_path / "s"), "durable_timeout": 0},
                                   "exporters.store"), ComponentHost("store", telemetry))
    exporter.start()
    try:
        with exporter.history.commit_lock:  # the writer takes the first record, then waits here to commit it
            exporter.export(Batch.from_message(Signal.LOGS, failures_request("job-first", 1)))
            time.sleep(0.3)
            exporter.export(Batch.from_message(Signal.LOGS, failures_request(
                "job-t", 500, poison={77: {"root_cause": "gpu\ud800"}})))
        assert exporter.force_flush(10)
        with closing(db.open_reader(tmp_path / "s")) as conn:
            assert len(db.failures(conn, job_id="job-t")) == 499
        assert exporter.poisoned == 1
        assert telemetry.value(names.POISON_RECORDS.name, "store") == 1
        assert telemetry.value(names.DROPPED.name, "store", Signal.LOGS) == 1
        assert telemetry.value(names.EXPORTED.name, "store", Signal.LOGS) == 500
    finally:
        exporter.shutdown()


def test_record_times_outside_the_window_are_indexed_as_their_receipt_and_counted(tmp_path):
    telemetry = PrometheusSelfTelemetry()
    exporter = StoreExporter(build(StoreExporterConfig, {"path": str(tmp_path / "s")}, "exporters.store"),
                             ComponentHost("store", telemetry))
    exporter.start()
    try:
        before = time.time()
        exporter.export(Batch.from_message(Signal.LOGS, failures_request("job-w", 3, poison={
            0: {"detected_time": 4_102_444_800.0, "seq": "2100"}, 1: {"detected_time": 0.0, "seq": "1970"}})))
        with closing(db.open_reader(tmp_path / "s")) as conn:
            rows = conn.execute("SELECT detected_time, record FROM failures ORDER BY id").fetchall()
            newest = db.failures(conn, limit=1)[0]
        assert [json.loads(r)["detected_time"] for _, r in rows][:2] == [4_102_444_800.0, 0.0]  # the JSON as sent
        assert all(before - 1 <= t <= time.time() + 1 for t, _ in rows), rows  # indexed as received
        assert newest["seq"] != "2100"  # a 2100 detection time no longer sorts on top for ever
        assert telemetry.value(names.OUT_OF_WINDOW.name, "store") == 2
    finally:
        exporter.shutdown()


def test_a_sigkilled_collector_leaves_no_stale_lock_behind(tmp_path):
    """The flock goes with the process, however it ends: a collector SIGKILLed leaves no stale lock behind."""
    store = tmp_path / "store"
    ports = Ports()
    proc = start_collector(config(ports, store), tmp_path / "a")
    os.kill(proc.pid, signal.SIGKILL)
    proc.proc.wait(10)
    assert (store / "otel-gpu.db.lock").read_text().strip() == str(proc.pid)
    with start_collector(config(Ports(), store), tmp_path / "b") as again:
        assert "in use by another collector" not in again.stderr_text()
        assert "degraded" not in again.stderr_text()
        assert again.stop() == 0
