"""The store exporter: OTLP batches in, SQLite rows out, read back through the same queries the report runs."""
from __future__ import annotations

import json
from contextlib import closing
import sqlite3
import threading
import time

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1 import logs_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import COMPONENT_STATUS, FAILURE_HISTORY, ComponentHost
from otel_gpu.config import ConfigError, build
from otel_gpu.exporters.store import StoreExporter, StoreExporterConfig, db
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import collector as names
from otel_gpu.schema.failure import RECORD_KEYS


def kv(key, value) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def resource_attrs(job="job-1", rank=0, host="node-a", world=4) -> list[KeyValue]:
    attrs = {"service.name": "train", "training.job.id": job, "training.rank": rank, "host.name": host,
             "training.world_size": world}
    return [kv(k, v) for k, v in attrs.items() if v is not None]


def failure(job="job-1", signature="sig-a", detected=1000.0, **extra) -> dict:
    record = {"kind": "hang", "root_cause": "rank_not_in_collective", "category": "software", "action": "user_fix",
              "auto_remediable": False, "culprit": {"rank": 2, "host": "node-a", "gpu": None}, "job_id": job,
              "onset_time": detected - 7.8, "detected_time": detected, "confidence": 0.9,
              "evidence": [{"metric": "training.collective.seq", "value": 40, "time": detected - 7.8}],
              "signature": signature, "recurrence": 0}
    record.update(extra)
    return record


def logs_batch(events: list[tuple[str, dict | str]], plain: int = 0, **resource) -> Batch:
    rl = logs_pb2.ResourceLogs()
    rl.resource.attributes.extend(resource_attrs(**resource))
    sl = rl.scope_logs.add()
    for name, body in events:
        sl.log_records.add(event_name=name, time_unix_nano=time.time_ns(),
                           body=AnyValue(string_value=body if isinstance(body, str) else json.dumps(body)))
    for i in range(plain):
        sl.log_records.add(body=AnyValue(string_value=f"plain log {i}"))
    return Batch.from_message(Signal.LOGS, ExportLogsServiceRequest(resource_logs=[rl]))


def traces_batch(ranks, host="node-a", job="job-1", spans=50) -> Batch:
    req = ExportTraceServiceRequest()
    for rank in ranks:
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(resource_attrs(job=job, rank=rank, host=host))
        ss = rs.scope_spans.add()
        for i in range(spans):
            ss.spans.add(name="step", trace_id=bytes(16), span_id=i.to_bytes(8, "big"))
    return Batch.from_message(Signal.TRACES, req)


def make(tmp_path, start=True, **settings) -> tuple[StoreExporter, PrometheusSelfTelemetry, ComponentHost]:
    telemetry = PrometheusSelfTelemetry()
    host = ComponentHost("store", telemetry)
    config = build(StoreExporterConfig, {"path": str(tmp_path / "data"), **settings}, "exporters.store")
    exporter = StoreExporter(config, host)
    if start:
        exporter.start()
    return exporter, telemetry, host


def read(tmp_path):
    return closing(db.open_reader(tmp_path / "data"))


def test_failures_and_goodput_are_written_whole_and_read_back(tmp_path):
    exp, telemetry, _ = make(tmp_path)
    try:
        t0 = time.time() - 3000.0  # detection times inside the store's window (time_window_past: 1 day)
        older = failure(detected=t0 + 1000.0, extra_key={"nested": [1, 2]})
        newer = failure(job="job-2", signature="sig-b", detected=t0 + 2000.0, kind="crash", root_cause="gpu_xid",
                        xid=79)
        goodput = {"job_id": "job-1", "ettr": 0.8, "wall_time_s": 100.0, "productive_time_s": 80.0,
                   "badput_s": {"hang": 15.0, "startup": 5.0}, "steps": 42}
        assert exp.export(logs_batch([("otel_gpu.failure", older), ("otel_gpu.goodput", goodput)], plain=3)).value \
            == "queued"
        exp.export(logs_batch([("otel_gpu.failure", newer)]))
        assert exp.force_flush(5.0)
        with read(tmp_path) as conn:
            records = db.failures(conn)
            assert records == [newer, older]  # newest first, every key kept (extra ones too)
            assert set(RECORD_KEYS) <= set(records[0])
            assert db.failures(conn, job_id="job-1") == [older]
            assert db.failures(conn, limit=1) == [newer]
            assert db.goodput(conn, "job-1") == goodput
            assert db.goodput(conn, "job-2") is None
            indexed = conn.execute("SELECT kind, root_cause, job_id, signature, detected_time FROM failures "
                                   "ORDER BY id").fetchall()
            assert indexed == [("hang", "rank_not_in_collective", "job-1", "sig-a", t0 + 1000.0),
                               ("crash", "gpu_xid", "job-2", "sig-b", t0 + 2000.0)]
        # 3 stored records + 3 plain log records counted as exported; nothing dropped
        assert telemetry.value(names.EXPORTED.name, "store", Signal.LOGS) == 6
        assert telemetry.value(names.DROPPED.name, "store", Signal.LOGS) == 0
    finally:
        exp.shutdown()


def test_goodput_keeps_latest_per_job_and_bounded_history(tmp_path):
    exp, _, _ = make(tmp_path, max_goodput_history=3, retention_interval="50ms")
    try:
        for i in range(6):
            exp.export(logs_batch([("otel_gpu.goodput", {"job_id": "j", "ettr": i / 10})]))
        exp.force_flush()
        time.sleep(0.15)
        exp.force_flush()
        with read(tmp_path) as conn:
            assert db.goodput(conn, "j")["ettr"] == 0.5
            assert [g["ettr"] for g in db.goodput_history(conn, "j")] == [0.5, 0.4, 0.3]
    finally:
        exp.shutdown()


def test_recurrence_counts_across_jobs_queued_and_after_restart(tmp_path):
    exp, _, host = make(tmp_path, start=False)
    history = host.services[FAILURE_HISTORY]  # published at construction, before start
    assert history.recurrence("sig-a") == 0 and history.record_count() == 0
    exp.export(logs_batch([("otel_gpu.failure", failure(job="j1"))]))
    assert history.recurrence("sig-a") == 1  # still queued: counted
    exp.start()
    try:
        exp.export(logs_batch([("otel_gpu.failure", failure(job="j2")), ("otel_gpu.failure", failure(job="j3")),
                               ("otel_gpu.failure", failure(signature="sig-z"))]))
        assert history.recurrence("sig-a") == 3
        exp.force_flush()
        assert history.recurrence("sig-a") == 3 and history.recurrence("sig-z") == 1
        assert history.recurrence("never") == 0 and history.record_count() == 4
    finally:
        exp.shutdown()
    again, _, host2 = make(tmp_path)
    try:
        assert host2.services[FAILURE_HISTORY].recurrence("sig-a") == 3
    finally:
        again.shutdown()


def test_recurrence_is_exact_while_the_writer_commits(tmp_path):
    """Every read sees each record exactly once (queued or stored), never twice, never zero times."""
    exp, _, host = make(tmp_path)
    history = host.services[FAILURE_HISTORY]
    errors = []
    try:
        for i in range(200):
            exp.export(logs_batch([("otel_gpu.failure", failure(signature="s"))]))
            got = history.recurrence("s")
            if got != i + 1:
                errors.append((i + 1, got))
        assert not errors, errors[:5]
    finally:
        exp.shutdown()


def test_jobs_from_resources_of_every_signal(tmp_path):
    exp, _, _ = make(tmp_path, flush_interval="50ms")
    try:
        exp.export(traces_batch([0, 1], host="node-a"))
        exp.export(traces_batch([2, 3], host="node-b"))
        exp.export(traces_batch([0, 1], host="node-a"))
        metrics = ExportMetricsServiceRequest()
        rm = metrics.resource_metrics.add()
        rm.resource.attributes.extend(resource_attrs(job="job-2", rank=0, host="node-c", world=1))
        rm.scope_metrics.add().metrics.add(name="m", gauge=metrics_pb2.Gauge(
            data_points=[metrics_pb2.NumberDataPoint(as_double=1.0)]))
        exp.export(Batch.from_message(Signal.METRICS, metrics))
        no_job = ExportTraceServiceRequest()
        no_job.resource_spans.add().resource.attributes.extend([kv("service.name", "other")])
        exp.export(Batch.from_message(Signal.TRACES, no_job))
        exp.force_flush()
        time.sleep(0.05)
        exp.export(traces_batch([3], host="node-b"))
        exp.force_flush()
        with read(tmp_path) as conn:
            jobs = {j["job_id"]: j for j in db.jobs(conn)}
        assert set(jobs) == {"job-1", "job-2"}
        assert (jobs["job-1"]["ranks"], jobs["job-1"]["hosts"], jobs["job-1"]["world_size"]) == (4, 2, 4)
        assert (jobs["job-2"]["ranks"], jobs["job-2"]["hosts"], jobs["job-2"]["world_size"]) == (1, 1, 1)
        assert jobs["job-1"]["last_seen"] - jobs["job-1"]["first_seen"] >= 0.04
    finally:
        exp.shutdown()


def test_full_queue_drops_and_counts_without_blocking(tmp_path):
    exp, telemetry, _ = make(tmp_path, start=False, queue_size=5)  # no writer yet: the queue fills
    start = time.perf_counter()
    for _ in range(4):
        exp.export(logs_batch([("otel_gpu.failure", failure()), ("otel_gpu.failure", failure())]))
    assert time.perf_counter() - start < 0.5
    assert telemetry.value(names.DROPPED.name, "store", Signal.LOGS) == 3
    assert exp.history.recurrence("sig-a") == 5  # dropped records are not counted
    exp.start()
    try:
        exp.force_flush()
        with read(tmp_path) as conn:
            assert db.failure_count(conn) == 5
    finally:
        exp.shutdown()


def test_concurrent_reads_while_writing(tmp_path):
    exp, _, _ = make(tmp_path)
    stop = threading.Event()
    views: list[list[int]] = [[], []]
    problems: list[BaseException] = []

    def reader(seen: list[int]):
        try:
            while not stop.is_set():
                with read(tmp_path) as conn:
                    seen.append(len(db.failures(conn)))
                    db.jobs(conn)
        except BaseException as exc:  # noqa: BLE001 - reported below
            problems.append(exc)

    threads = [threading.Thread(target=reader, args=(view,)) for view in views]
    try:
        for t in threads:
            t.start()
        for i in range(300):
            exp.export(logs_batch([("otel_gpu.failure", failure(signature=f"s{i % 7}", detected=float(i)))]))
            if i % 50 == 0:
                time.sleep(0.01)
        exp.force_flush()
        time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        exp.shutdown()
    assert not problems, problems
    for seen in views:
        assert len(seen) > 5 and seen[-1] == 300
        assert seen == sorted(seen)  # each reader's view only grows


def test_retention_by_count_and_age(tmp_path):
    exp, _, _ = make(tmp_path, max_failures=10, retention_interval="50ms")
    try:
        for i in range(25):
            exp.export(logs_batch([("otel_gpu.failure", failure(detected=float(i)))]))
        exp.force_flush()
        time.sleep(0.1)
        exp.force_flush()
        with read(tmp_path) as conn:
            kept = [r["detected_time"] for r in db.failures(conn)]
        assert kept == [float(i) for i in range(24, 14, -1)]
    finally:
        exp.shutdown()
    exp, _, _ = make(tmp_path, max_age_days=0.2 / 86400)  # 0.2 s; retention also runs at start
    exp.shutdown()
    time.sleep(0.25)
    exp, _, _ = make(tmp_path, max_age_days=0.2 / 86400)
    try:
        with read(tmp_path) as conn:
            assert db.failure_count(conn) == 0 and db.jobs(conn) == []
    finally:
        exp.shutdown()


def test_schema_version_and_newer_file_is_refused(tmp_path):
    exp, _, _ = make(tmp_path)
    exp.shutdown()
    path = db.db_path(tmp_path / "data")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(db.SCHEMA_VERSION,)]
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.execute("UPDATE schema_version SET version = 99")
    conn.close()
    newer, _, host = make(tmp_path)  # refused, the store alone: degraded, the collector would go on
    try:
        assert "schema version 99, newer" in newer.degraded
        assert [status() for status in host.services.get(COMPONENT_STATUS)] == [("exporters.store", newer.degraded)]
    finally:
        newer.shutdown()
    with pytest.raises(db.StoreTooNew):
        db.open_reader(tmp_path / "data")


def test_malformed_event_body_is_ignored_not_fatal(tmp_path, caplog):
    exp, _, _ = make(tmp_path)
    try:
        exp.export(logs_batch([("otel_gpu.failure", "not json"), ("otel_gpu.failure", "[1, 2]"),
                               ("otel_gpu.failure", failure())]))
        exp.force_flush()
        with read(tmp_path) as conn:
            assert db.failure_count(conn) == 1
    finally:
        exp.shutdown()


def test_through_a_collector_and_config_errors(tmp_path):
    collector = Collector(load_text(f"""
receivers: {{otlp: {{protocols: {{grpc: {{endpoint: "127.0.0.1:0"}}}}}}}}
exporters: {{store: {{path: "{tmp_path / 'c'}"}}}}
service:
  pipelines: {{logs: {{receivers: [otlp], exporters: [store]}}, traces: {{receivers: [otlp], exporters: [store]}}}}
"""))
    assert FAILURE_HISTORY in collector.services
    collector.start()
    try:
        receiver = collector.component("receiver", "otlp")
        receiver.accept_batch(logs_batch([("otel_gpu.failure", failure())]), trusted=True)  # a trusted forwarder
        receiver.accept_batch(traces_batch([0, 1]))
    finally:
        collector.shutdown()  # flushes the store
    with closing(db.open_reader(tmp_path / "c")) as conn:
        assert db.failure_count(conn) == 1 and db.jobs(conn)[0]["ranks"] == 2
    with pytest.raises(ConfigError, match="exporters.store.queue_size must be >= 1"):
        build(StoreExporterConfig, {"queue_size": 0}, "exporters.store")
    (tmp_path / "file").write_text("x")
    bad = Collector(load_text(f"""
receivers: {{otlp: {{protocols: {{grpc: {{endpoint: "127.0.0.1:0"}}}}}}}}
exporters: {{store: {{path: "{tmp_path / 'file'}"}}}}
service: {{pipelines: {{logs: {{receivers: [otlp], exporters: [store]}}}}}}
"""))
    bad.start()  # a store that cannot open degrades the store alone (issue 21), the collector runs
    try:
        (status,) = bad.services.get(COMPONENT_STATUS)
        name, why = status()
        assert name == "exporters.store" and "store cannot open" in why and "check exporters.store.path" in why
    finally:
        bad.shutdown()


def test_traces_export_walks_resources_only(tmp_path):
    """A 1,000-span batch costs the store about what its resources cost, not its spans."""
    exp, _, _ = make(tmp_path)
    try:
        small, big = traces_batch([0], spans=1), traces_batch([0], spans=1000)
        _ = small.message, big.message  # parse outside the timing
        timings = {"small": float("inf"), "big": float("inf")}
        for _ in range(7):  # the best of interleaved rounds: a loaded machine slows rounds, never speeds them up
            for name, batch in (("small", small), ("big", big)):
                start = time.perf_counter()
                for _ in range(30):
                    exp.export(batch)
                timings[name] = min(timings[name], (time.perf_counter() - start) / 30)
        # walking 1,000 spans would cost ~100x the one-span batch; the resources alone cost the same
        assert timings["big"] < 3 * timings["small"] + 20e-6, timings
    finally:
        exp.shutdown()


# -- verdicts that change (issue 10): failure_id + version -------------------------------------------------------
def test_revisions_keep_one_row_per_failure_with_every_version_in_history(tmp_path):
    exp, _, _ = make(tmp_path)
    try:
        v1 = failure(kind="crash", root_cause="rank_process_died", signature="sig-died", failure_id="f-1", version=1)
        v2 = failure(kind="crash", root_cause="gpu_fell_off_bus", signature="sig-xid79", failure_id="f-1", version=2,
                     culprit={"rank": 0, "host": "node-a", "gpu": "GPU-1"})
        other = failure(job="job-2", signature="sig-b", detected=500.0, failure_id="f-2", version=1)
        exp.export(logs_batch([("otel_gpu.failure", v1), ("otel_gpu.failure", other)]))
        assert exp.force_flush(5.0)
        assert exp.history.recurrence("sig-died") == 1
        exp.export(logs_batch([("otel_gpu.failure", v2)]))
        exp.export(logs_batch([("otel_gpu.failure", v1)]))  # redelivered after a replay: older, ignored
        assert exp.force_flush(5.0)
        with read(tmp_path) as conn:
            latest = db.failures(conn, history=True)
            assert [r["failure_id"] for r in latest] == ["f-1", "f-2"]
            assert latest[0]["root_cause"] == "gpu_fell_off_bus" and latest[0]["version"] == 2
            assert [(v["version"], v["record"]["root_cause"]) for v in latest[0]["versions"]] == \
                [(1, "rank_process_died"), (2, "gpu_fell_off_bus")]
            assert [v["version"] for v in latest[1]["versions"]] == [1]
            # Recurrence counts failures, not versions: the revised signature replaced the first one.
            assert db.failure_count(conn) == 2
            assert db.failure_count(conn, "sig-xid79") == 1 and db.failure_count(conn, "sig-died") == 0
        assert exp.history.recurrence("sig-xid79") == 1
    finally:
        exp.shutdown()


def test_versions_out_of_order_never_replace_a_newer_one(tmp_path):
    exp, _, _ = make(tmp_path)
    try:
        v1 = failure(failure_id="f-9", version=1, root_cause="rank_not_in_collective")
        v3 = failure(failure_id="f-9", version=3, root_cause="nic_link_down")
        exp.export(logs_batch([("otel_gpu.failure", v3), ("otel_gpu.failure", v1)]))
        assert exp.force_flush(5.0)
        with read(tmp_path) as conn:
            (only,) = db.failures(conn, history=True)
            assert only["version"] == 3 and only["root_cause"] == "nic_link_down"
            assert [v["version"] for v in only["versions"]] == [1, 3]
    finally:
        exp.shutdown()


def test_a_withdrawn_hang_is_kept_marked_and_not_counted(tmp_path):
    exp, _, _ = make(tmp_path)
    try:
        hang = failure(failure_id="h-1", version=1, signature="sig-hang")
        exp.export(logs_batch([("otel_gpu.failure", hang)]))
        assert exp.force_flush(5.0)
        assert exp.history.recurrence("sig-hang") == 1
        exp.export(logs_batch([("otel_gpu.failure", {**hang, "version": 2, "status": "withdrawn"})]))
        assert exp.force_flush(5.0)
        with read(tmp_path) as conn:
            (kept,) = db.failures(conn, history=True)
            assert db.is_withdrawn(kept) and kept["version"] == 2 and len(kept["versions"]) == 2
            assert db.failures(conn, withdrawn=False) == []
            assert db.failure_count(conn, "sig-hang") == 0
        assert exp.history.recurrence("sig-hang") == 0
    finally:
        exp.shutdown()


def test_a_version_1_store_is_migrated_and_its_records_kept(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    conn = sqlite3.connect(db.db_path(folder))
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in db._MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version VALUES (1)")
    old = failure(signature="sig-old")
    conn.execute("INSERT INTO failures (kind, root_cause, job_id, signature, detected_time, received_time, record) "
                 "VALUES ('hang', 'rank_not_in_collective', 'job-1', 'sig-old', 1000.0, ?, ?)",
                 (time.time(), json.dumps(old)))
    conn.commit()
    conn.close()
    with closing(db.open_reader(folder)) as reader:  # a reader of an unmigrated file still works
        assert db.failures(reader, history=True) == [old]
    exp, _, _ = make(tmp_path)
    try:
        new = failure(signature="sig-new", detected=2000.0, failure_id="f-1", version=1)
        exp.export(logs_batch([("otel_gpu.failure", new)]))
        assert exp.force_flush(5.0)
        with read(tmp_path) as conn2:
            assert conn2.execute("SELECT max(version) FROM schema_version").fetchone()[0] == db.SCHEMA_VERSION
            records = db.failures(conn2, history=True)
            assert [r["signature"] for r in records] == ["sig-new", "sig-old"]
            assert "versions" not in records[1]
    finally:
        exp.shutdown()
