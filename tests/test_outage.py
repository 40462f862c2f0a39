"""Nothing lost across outages: the otlp exporter's persistent queue (backend outage, SIGKILLed collector, bounds)
and the training process's bounded buffer across a collector restart."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost, ExportResult
from otel_gpu.config import ConfigError, build
from otel_gpu.exporters.otlp import OtlpExporter, OtlpExporterConfig
from otel_gpu.pdata import Batch, Signal
from otel_gpu.testing.otlp_sink import OtlpSink

from collector_proc import free_port, start_collector

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from outage import collector_config, failure_request, record_ids, run_outage, send_load, span_ids

EXPORTED, DROPPED = "otel_gpu.collector.exported", "otel_gpu.collector.dropped"


def _rows(queue_dir: Path) -> int:
    files = list(queue_dir.glob("*.sqlite"))
    if not files:
        return 0
    with sqlite3.connect(f"file:{files[0]}?mode=ro", uri=True) as db:
        return db.execute("SELECT COUNT(*) FROM queue").fetchone()[0]


# -- the collector's exporter -----------------------------------------------------------------------------------------
def test_backend_outage_during_load_loses_nothing(tmp_path):
    """8 s backend outage under load (1,000 spans/s + 10 failure records/s): every id arrives once the sink is back."""
    res = run_outage(tmp_path, outage_s=8, load_s=12, outage_at_s=2, rate_hz=50, spans_per_request=20,
                     records_every=5, drain_timeout_s=30)
    print(json.dumps(res))
    assert res["spans_sent"] >= 10000 and res["records_sent"] >= 100
    assert res["spans_lost"] == 0, res
    assert res["records_lost"] == 0, res
    assert res["client_retries"] == 0 and res["max_call_s"] < 1.0, res  # receivers were never blocked
    assert res["collector_alive"]


def test_sigkilled_collector_replays_its_disk_queue(tmp_path):
    """Backend down, batches acknowledged by the collector sit on disk; SIGKILL; restart on the same storage: the
    backend gets every one of them."""
    sink_port, recv_port = free_port(), free_port()
    queue_dir = tmp_path / "queue"
    text = collector_config(recv_port, sink_port, queue_dir)
    collector = start_collector(text, tmp_path / "c1")
    try:
        sent = send_load(f"127.0.0.1:{recv_port}", duration_s=1.5, rate_hz=40, spans_per_request=10,
                         records_every=2)
        assert sent["client_retries"] == 0
        # acknowledged to the client means committed: every request is a row before export() returned
        assert _rows(queue_dir) == sent["requests"] + sent["records"]
        collector.proc.send_signal(signal.SIGKILL)
        collector.proc.wait(5)
    finally:
        collector.kill()
    with OtlpSink(port=sink_port) as sink:
        with start_collector(text, tmp_path / "c2") as again:
            ok = sink.wait_for(lambda s: len(span_ids(s)) >= sent["spans"] and len(record_ids(s)) >= sent["records"],
                               20)
            assert ok, (len(span_ids(sink)), sent, again.stderr_text()[-2000:])
            assert "replaying" in again.stderr_text()
            assert span_ids(sink) == set(range(sent["spans"]))
            assert record_ids(sink) == set(range(sent["records"]))
            deadline = time.monotonic() + 10
            while _rows(queue_dir) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _rows(queue_dir) == 0  # acknowledged batches are deleted
            assert again.stop() == 0


def _batch(i: int, nspans: int = 40) -> Batch:
    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for j in range(nspans):
        sp = ss.spans.add()
        sp.name, sp.trace_id, sp.span_id = f"b{i}-" + "x" * 200, b"\1" * 16, (i * 1000 + j + 1).to_bytes(8, "big")
    return Batch.from_bytes(Signal.TRACES, req.SerializeToString())


def _exporter(endpoint: str, queue_dir: Path, **persistent):
    telemetry = PrometheusSelfTelemetry()
    cfg = build(OtlpExporterConfig, {
        "endpoint": endpoint, "compression": "none",
        "retry_on_failure": {"initial_interval": "50ms", "max_interval": "200ms", "max_elapsed_time": "0s"},
        "sending_queue": {"num_consumers": 1, "persistent": {"path": str(queue_dir), **persistent}}},
        "exporters.otlp")
    exporter = OtlpExporter(cfg, ComponentHost("otlp/disk", telemetry))
    exporter.start()
    return exporter, telemetry


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
def test_full_disk_queue_drops_by_policy_counts_and_never_blocks(tmp_path, policy):
    port = free_port()  # nothing listens: the backend is down
    size = len(_batch(0).to_bytes())
    exporter, telemetry = _exporter(f"127.0.0.1:{port}", tmp_path / "q", max_size_mib=6.5 * size / 2**20,
                                    full_policy=policy)
    try:
        slowest = 0.0
        for i in range(20):
            t0 = time.monotonic()
            result = exporter.export(_batch(i))
            slowest = max(slowest, time.monotonic() - t0)
            if result is ExportResult.FAILURE:  # the runtime counts a refused batch; do it here as it would
                telemetry.dropped("otlp/disk", Signal.TRACES, 40)
            if i == 0:
                time.sleep(0.3)  # let the sender take batch 0 (in flight from then on)
        assert slowest < 0.5
        # 6 batches fit; one is held by the single sender (in flight, retrying) and never evicted
        assert telemetry.value(DROPPED, "otlp/disk", Signal.TRACES) == 14 * 40
        assert _rows(tmp_path / "q") == 6
    finally:
        exporter.shutdown(0.5)
    # the next start (backend up now) delivers what was kept: the first (in flight) + the newest 5, or the first 6
    with OtlpSink(port=port) as sink:
        exporter, telemetry = _exporter(f"127.0.0.1:{port}", tmp_path / "q", max_size_mib=6.5 * size / 2**20,
                                        full_policy=policy)
        try:
            assert sink.wait_for(lambda s: s.span_count() >= 6 * 40, 10)
            batches = sorted({int.from_bytes(s.span_id, "big") // 1000 for s in sink.spans()})
            assert batches == ([0, 15, 16, 17, 18, 19] if policy == "drop_oldest" else [0, 1, 2, 3, 4, 5])
            assert exporter.force_flush(5)
            assert telemetry.value(EXPORTED, "otlp/disk", Signal.TRACES) == 6 * 40
        finally:
            exporter.shutdown(2)
        assert _rows(tmp_path / "q") == 0


def test_one_store_per_process(tmp_path):
    port = free_port()
    exporter, _ = _exporter(f"127.0.0.1:{port}", tmp_path / "q")
    try:
        script = textwrap.dedent(f"""
            from otel_gpu.exporters.otlp._persistent import PersistentStore, StoreLocked
            try:
                PersistentStore({str(tmp_path / 'q' / 'otlp_disk.sqlite')!r})
            except StoreLocked as exc:
                print("locked:", exc)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
        assert "locked:" in out.stdout and "same sending_queue.persistent.path" in out.stdout, out
    finally:
        exporter.shutdown(0.5)


def test_persistent_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"exporters\.otlp\.sending_queue\.persistent\.max_size_mib must be > 0"):
        build(OtlpExporterConfig, {"endpoint": "a:1", "sending_queue": {"persistent": {"path": "/tmp/x",
                                                                                      "max_size_mib": 0}}},
              "exporters.otlp")
    with pytest.raises(ConfigError, match=r"full_policy must be drop_oldest or drop_newest"):
        build(OtlpExporterConfig, {"endpoint": "a:1", "sending_queue": {"persistent": {"full_policy": "block"}}},
              "exporters.otlp")


# -- the training process ---------------------------------------------------------------------------------------------
TRAIN = textwrap.dedent("""
    import json, os, sys, time
    import otel_gpu
    from otel_gpu.instrumentation import _runtime
    otel_gpu.instrument(endpoint=sys.argv[1], heartbeat_s=0.5, export_interval_s=0.2, crash_hooks=False)
    rt = _runtime.current()
    stop_file = sys.argv[2]  # trains until the test creates it
    gloo = "RANK" in os.environ
    if gloo:  # a real gloo job: one all_reduce per step, which also carries the stop flag
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.zeros(4096)
    print("training", flush=True)
    gap, last, n, stop = 0.0, time.monotonic(), 0, False
    while not stop:
        with otel_gpu.step(n):
            stop = os.path.exists(stop_file)
            if gloo:
                t.zero_()
                t[0] = float(stop)
                dist.all_reduce(t)
                stop = t[0].item() > 0
            time.sleep(0.01)
        now = time.monotonic()
        gap, last, n = max(gap, now - last), now, n + 1
    steps = n
    hb = rt.progress()[1]["counters"]
    if gloo:
        dist.barrier()
        dist.destroy_process_group()
    otel_gpu.uninstrument()   # final flush: sends what is still buffered
    c = rt.client
    print(json.dumps({"steps": steps, "max_step_s": gap, "heartbeat_counters": hb,
                      "spans_sent": rt.counters["spans_sent"],
                      "spans_dropped": rt.counters["spans_dropped"], "buffer_dropped": c.buffer_dropped,
                      "buffered": c.buffered, "left_in_buffer": c.buffer_requests}))
""")


def _resource_spans(sink: OtlpSink, service: str, rank: int | None = None):
    for r in sink.traces:
        for rs in r.resource_spans:
            attrs = {kv.key: kv.value for kv in rs.resource.attributes}
            if attrs.get("service.name") is None or attrs["service.name"].string_value != service:
                continue
            if rank is not None and ("training.rank" not in attrs or attrs["training.rank"].int_value != rank):
                continue
            yield rs


def _ids(sink: OtlpSink, service: str, span_name: str, key: str, rank: int | None = None) -> set[int]:
    return {a.value.int_value for rs in _resource_spans(sink, service, rank) for ss in rs.scope_spans
            for s in ss.spans if s.name == span_name for a in s.attributes if a.key == key}


def _steps_at(sink: OtlpSink, service: str, rank: int | None = None) -> set[int]:
    return _ids(sink, service, "otel_gpu.step", "training.step", rank)


def _drained_since(sink: OtlpSink, service: str, rank: int | None, since_ns: int) -> bool:
    """A heartbeat sent after ``since_ns`` says the process's buffer is empty again."""
    for r in sink.logs:
        for rl in r.resource_logs:
            attrs = {kv.key: kv.value for kv in rl.resource.attributes}
            if attrs.get("service.name") is None or attrs["service.name"].string_value != service:
                continue
            if rank is not None and ("training.rank" not in attrs or attrs["training.rank"].int_value != rank):
                continue
            for sl in rl.scope_logs:
                for lr in sl.log_records:
                    if lr.event_name == "otel_gpu.progress" and lr.time_unix_nano > since_ns:
                        if json.loads(lr.body.string_value)["counters"]["export_buffered"] == 0:
                            return True
    return False


def _spans_of(sink: OtlpSink, service: str) -> int:
    return sum(len(ss.spans) for rs in _resource_spans(sink, service) for ss in rs.scope_spans)


def test_training_processes_buffer_across_a_collector_restart(tmp_path):
    """A 2-rank gloo job (8 MiB buffers) and a single training process with a 4 KB buffer, while their collector is
    stopped (SIGTERM) for 3 s and started again: the gloo ranks lose no step or collective span; the tiny one loses
    some, counts every one it lost in its heartbeat counters, and delivers all it accepted. None ever waits for the
    collector."""
    recv_port, master_port, stop_file = free_port(), free_port(), tmp_path / "stop"
    sink = OtlpSink().start()
    text = collector_config(recv_port, sink.port, tmp_path / "queue")
    collector = start_collector(text, tmp_path / "c1")
    endpoint = f"http://127.0.0.1:{recv_port}"
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, mib, extra in (
                ("rank0", 8, {"RANK": "0", "WORLD_SIZE": "2", "OTEL_SERVICE_NAME": "gloo"}),
                ("rank1", 8, {"RANK": "1", "WORLD_SIZE": "2", "OTEL_SERVICE_NAME": "gloo"}),
                ("tiny", 0.004, {"OTEL_SERVICE_NAME": "tiny"})):
            env = {**os.environ, "OTEL_GPU_EXPORT_BUFFER_MIB": str(mib), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(master_port), **extra}
            procs[name] = subprocess.Popen([sys.executable, "-c", TRAIN, endpoint, str(stop_file)], env=env, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for p in procs.values():
            assert p.stdout.readline().strip() == "training", p.communicate(timeout=30)[1][-3000:]
        time.sleep(1.5)
        assert collector.stop() == 0  # the collector goes away while the job trains
        time.sleep(3.0)
        collector = start_collector(text, tmp_path / "c2")
        back_ns, back = time.time_ns(), time.monotonic()
        # training goes on with the collector back until every process says (in a heartbeat) its buffer is empty
        reconnected = sink.wait_for(lambda s: all(_drained_since(s, svc, r, back_ns)
                                                  for svc, r in (("gloo", 0), ("gloo", 1), ("tiny", None))), 20)
        print(f"buffers drained {time.monotonic() - back:.1f}s after the collector was back")
        stop_file.touch()
        assert reconnected, [(lr.time_unix_nano - back_ns, lr.body.string_value[-300:])
                             for lr in sink.log_records() if lr.event_name == "otel_gpu.progress"][-6:]
        res = {}
        for name, p in procs.items():
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-3000:]
            res[name] = json.loads(out.strip().splitlines()[-1])
            print(name, res[name])
        assert res["rank0"]["steps"] == res["rank1"]["steps"] > 200
        all_steps = set(range(res["rank0"]["steps"]))
        tiny = res["tiny"]
        assert sink.wait_for(lambda s: all(_steps_at(s, "gloo", r) >= all_steps for r in (0, 1))
                             and _spans_of(s, "tiny") >= tiny["spans_sent"], 15)
        # the gloo ranks: every step span and every all_reduce span (by collective.seq) of both ranks arrived
        for r in (0, 1):
            assert _steps_at(sink, "gloo", r) == all_steps
            seqs = _ids(sink, "gloo", "otel_gpu.collective", "collective.seq", r)
            want = set(range(1, len(all_steps) + 1))
            assert want <= seqs, sorted(want - seqs)[:10]
            rank = res[f"rank{r}"]
            assert rank["buffered"] > 0 and rank["buffer_dropped"] == 0 and rank["spans_dropped"] == 0
            assert rank["left_in_buffer"] == 0
        hb = [lr for lr in sink.log_records() if lr.event_name == "otel_gpu.progress"]
        assert hb and all("export_buffer_dropped" in lr.body.string_value for lr in hb)
        # tiny: what did not fit is counted (spans_dropped is in the heartbeat), what it accepted arrived
        assert tiny["left_in_buffer"] == 0
        missing = set(range(tiny["steps"])) - _steps_at(sink, "tiny")
        assert missing, "a 4 KB buffer cannot hold 3 s of steps"
        assert tiny["spans_dropped"] >= len(missing)
        assert tiny["heartbeat_counters"]["spans_dropped"] > 0
        assert _spans_of(sink, "tiny") == tiny["spans_sent"]
        for r in res.values():  # no step waited for the collector (slack: 2 shared cores, 3 jobs, a collector start)
            assert r["max_step_s"] < 2.0, r
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        collector.stop()
        sink.stop()


def test_a_damaged_queue_file_is_set_aside_not_fatal(tmp_path):
    queue_dir = tmp_path / "q"
    queue_dir.mkdir()
    (queue_dir / "otlp_disk.sqlite").write_bytes(b"this is not a database" * 100)
    port = free_port()
    exporter, _ = _exporter(f"127.0.0.1:{port}", queue_dir)
    try:
        assert exporter.export(_batch(1)) is ExportResult.QUEUED
        assert _rows(queue_dir) == 1
        assert list(queue_dir.glob("otlp_disk.sqlite.corrupt-*"))
    finally:
        exporter.shutdown(0.3)


def test_client_buffers_in_order_and_counts_what_is_lost_at_exit(caplog):
    """The training-side client alone: requests made while nothing listens are buffered and arrive in order once a
    sink appears; a process ending while it is still down says how many items it lost."""
    from otel_gpu.instrumentation import _export

    port = free_port()
    client = _export.OtlpClient(f"127.0.0.1:{port}", timeout_s=1, buffer_mib=1)
    t0 = time.monotonic()
    for i in range(20):
        assert client.send_logs(failure_request(i))  # accepted: buffered
    assert time.monotonic() - t0 < 1.5 and client.buffer_requests == 20 and client.failed == 1
    with OtlpSink(port=port) as sink:
        deadline = time.monotonic() + 10
        while client.buffer_requests and time.monotonic() < deadline:  # the backoff ends within 2 s
            client.send_logs(failure_request(100 + int(time.monotonic() * 1000) % 1000000))
            time.sleep(0.1)
        got = [kv.value.int_value for lr in sink.log_records() for kv in lr.attributes if kv.key == "record.id"]
        assert got[:20] == list(range(20))  # in order, before anything newer
    client.close()
    down = _export.OtlpClient(f"127.0.0.1:{free_port()}", timeout_s=1, buffer_mib=1)
    for i in range(3):
        down.send_logs(failure_request(i))
    down.close()
    assert down.lost_at_close == 3 and "3 spans and log records" in caplog.text


def test_otlphttp_exporter_keeps_its_queue_across_a_restart(tmp_path):
    """The same persistent queue under the HTTP exporter: batches queued while the backend is down survive the
    exporter's shutdown and reach an OTLP/HTTP receiver after the next start, byte for byte."""
    from otel_gpu.exporters.otlp import OtlpHttpExporter, OtlpHttpExporterConfig
    from otel_gpu.receivers.otlp import OtlpReceiver, OtlpReceiverConfig

    port = free_port()
    settings = {"endpoint": f"http://127.0.0.1:{port}", "compression": "gzip",
                "retry_on_failure": {"initial_interval": "50ms", "max_interval": "200ms", "max_elapsed_time": "0s"},
                "sending_queue": {"num_consumers": 2, "persistent": {"path": str(tmp_path / "q")}}}
    telemetry = PrometheusSelfTelemetry()
    exporter = OtlpHttpExporter(build(OtlpHttpExporterConfig, settings, "exporters.otlphttp"),
                                ComponentHost("otlphttp", telemetry))
    exporter.start()
    batches = [_batch(i, 5) for i in range(6)]
    for b in batches:
        assert exporter.export(b) is ExportResult.QUEUED
    exporter.shutdown(0.5)
    assert telemetry.value(DROPPED, "otlphttp", Signal.TRACES) == 0  # kept, not dropped
    assert _rows(tmp_path / "q") == 6

    got = []

    class Keep:
        def consume(self, batch):
            got.append(batch.to_bytes())

    receiver = OtlpReceiver(build(OtlpReceiverConfig, {"grpc": None, "http": {"endpoint": f"127.0.0.1:{port}"}}, "r"),
                            ComponentHost("otlp", PrometheusSelfTelemetry(), {s: Keep() for s in Signal}))
    receiver.start()
    try:
        telemetry = PrometheusSelfTelemetry()
        exporter = OtlpHttpExporter(build(OtlpHttpExporterConfig, settings, "exporters.otlphttp"),
                                    ComponentHost("otlphttp", telemetry))
        exporter.start()
        assert exporter.force_flush(10)
        assert sorted(got) == sorted(b.to_bytes() for b in batches)
        assert telemetry.value(EXPORTED, "otlphttp", Signal.TRACES) == 30
        exporter.shutdown(2)
        assert _rows(tmp_path / "q") == 0
    finally:
        receiver.shutdown(2)


def test_client_drops_what_the_collector_refuses_for_good_and_keeps_going():
    """A permanent error (INVALID_ARGUMENT, or UNIMPLEMENTED for a signal without a pipeline) is not retried and does
    not block the buffer behind it; UNAVAILABLE is retried."""
    import grpc

    from otel_gpu.instrumentation import _export

    with OtlpSink() as sink:
        client = _export.OtlpClient(sink.endpoint, timeout_s=1, buffer_mib=1)
        sink.fail_next(1, grpc.StatusCode.INVALID_ARGUMENT)
        assert not client.send_logs(failure_request(0))  # refused for good: the caller counts it as dropped
        assert client.rejected == 1 and client.failed == 0 and not client.buffer_requests
        sink.fail_next(1, grpc.StatusCode.UNAVAILABLE)
        assert client.send_logs(failure_request(1))  # retryable: buffered
        assert client.buffer_requests == 1
        deadline = time.monotonic() + 5
        while client.buffer_requests and time.monotonic() < deadline:
            client.send_logs(failure_request(2))
            time.sleep(0.1)
        assert not client.buffer_requests
        assert record_ids(sink) >= {1, 2}
        client.close()
