"""The aggregator role (docs/scale.md): node sidecars forward compact per-rank records to the job's aggregator.

- The example configs (docs/examples/sidecar.yaml, aggregator.yaml) load with our config loader.
- The compact processor keeps heartbeats and step records, drops collective spans, and never changes the batch that
  the full-traces pipeline exports.
- Two real collector subprocesses on loopback (sidecar -> aggregator): a 4-rank job that hangs on rank 2 ends up as a
  hang record naming rank 2 in the aggregator's store (``otel-gpu report --format json``); the collective spans reach
  the backend through the sidecar but never the aggregator.
- Every resource the sidecar forwards (traces, metrics, logs, node GPU records included) carries training.job.id, the
  routing key of the OpenTelemetry Collector's loadbalancing exporter.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector_proc import free_port, start_collector
from otel_gpu.collector.config import load_file, load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.otlp_build import LogsBuilder, MetricsBuilder, attributes
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import gpu as G
from otel_gpu.schema import training as T
from otel_gpu.testing.otlp_sink import OtlpSink

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
JOB = "job-agg-7"
WORLD = 4


def _resource(rank: int, host: str = "node-a") -> dict:
    return {"training.job.id": JOB, "training.rank": rank, "training.world_size": WORLD, "training.local_rank": rank,
            "host.name": host, "process.pid": 100 + rank, "service.name": "train"}


def _spans(rank: int, steps: range, collectives_per_step: int = 6, t0: float | None = None) -> ExportTraceServiceRequest:
    """A rank's step spans, each with its collective spans, as the instrumentation sends them."""
    t0 = time.time() - len(steps) if t0 is None else t0
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.extend(attributes(_resource(rank)))
    ss = rs.scope_spans.add()
    ss.scope.name = "otel_gpu.instrumentation"
    for i, step in enumerate(steps):
        start = t0 + i
        span = ss.spans.add(name=T.STEP_SPAN.name, trace_id=bytes([rank + 1]) * 16, span_id=bytes([step % 250 + 1]) * 8,
                            start_time_unix_nano=int(start * 1e9), end_time_unix_nano=int((start + 0.9) * 1e9))
        span.attributes.extend(attributes({str(T.STEP): step, str(T.STEP_COLLECTIVE_S): 0.3}))
        for c in range(collectives_per_step):
            coll = ss.spans.add(name=T.COLLECTIVE_SPAN.name, trace_id=bytes([rank + 1]) * 16,
                                span_id=bytes([c + 1]) * 8, start_time_unix_nano=int((start + 0.1 * c) * 1e9),
                                end_time_unix_nano=int((start + 0.1 * c + 0.05) * 1e9))
            coll.attributes.extend(attributes({str(T.COLL_OP): "all_reduce", str(T.COLL_PG): "0",
                                               str(T.COLL_SEQ): step * collectives_per_step + c}))
    return req


def _hang_logs(rank: int, now: float):
    """Heartbeats of a job that hangs in all_reduce seq 8: rank 2 never reached it (asleep in user code)."""
    lb = LogsBuilder(_resource(rank), scope="otel_gpu.instrumentation")
    if rank == 2:
        body = {"step": 5, "state": "step", "inflight": None, "last_started_seq": {"0": 7}, "stalled_s": 5.0}
        lb.event(T.STACKS_EVENT, {"threads": [{"name": "MainThread", "main": True, "frames": [
            {"file": "/home/me/train.py", "line": 88, "function": "main"}]}], "top": "/home/me/train.py:88 main"})
    else:
        body = {"step": 5, "state": "collective", "stalled_s": 5.0, "last_started_seq": {"0": 8},
                "inflight": {"kind": "collective", "op": "all_reduce", "pg": "0", "seq": 8, "since": now - 5}}
    lb.event(T.PROGRESS_EVENT, body)
    return lb.build()


def _example(name: str, **overrides) -> dict:
    """An example config as a mapping, with the given top-level sections' entries replaced (ports, fakes)."""
    data = yaml.safe_load((EXAMPLES / name).read_text())
    for path, value in overrides.items():
        section, _, cid = path.partition("__")
        data[section][cid.replace("_SLASH_", "/")] = value
    return data


# -- configs ----------------------------------------------------------------------------------------------------------
def test_example_configs_load_with_our_loader(monkeypatch):
    monkeypatch.setenv("OTEL_GPU_AGGREGATOR_ENDPOINT", "agg-0.example:4317")
    monkeypatch.setenv("OTEL_GPU_BACKEND_ENDPOINT", "tempo.example:4317")
    monkeypatch.delenv("OTEL_GPU_JOB_ID", raising=False)
    sidecar = load_file(EXAMPLES / "sidecar.yaml")
    pipes = {p.name: p for p in sidecar.pipelines}
    assert pipes["traces/backend"].processors == [] and pipes["traces/backend"].exporters == ["otlp/backend"]
    for name in ("traces/aggregator", "metrics/aggregator", "logs"):
        assert pipes[name].processors == ["compact"] and pipes[name].exporters == ["otlp/aggregator"]
    assert sidecar.component("exporter", "otlp/aggregator").config.endpoint == "agg-0.example:4317"
    assert not sidecar.component("processor", "compact").config.job_id  # learned from the training processes
    aggregator = load_file(EXAMPLES / "aggregator.yaml")
    pipes = {p.name: p for p in aggregator.pipelines}
    for p in aggregator.pipelines:
        assert p.receivers == ["otlp"] and p.processors[:2] == ["attribution", "goodput"] and "store" in p.exporters
    # The job's verdicts, drained devices and board of nodes (otel-gpu run --restart auto on every node).
    assert pipes["metrics"].processors[2:] == ["health"] and pipes["logs"].processors[2:] == ["health"]
    assert "verdict" in pipes["logs"].exporters
    assert aggregator.component("exporter", "verdict").config.endpoint == "127.0.0.1:4319"  # loopback by default
    monkeypatch.delenv("OTEL_GPU_AGGREGATOR_ENDPOINT")
    with pytest.raises(Exception, match="OTEL_GPU_AGGREGATOR_ENDPOINT"):
        load_file(EXAMPLES / "sidecar.yaml")


def test_compact_config_errors_name_the_key():
    with pytest.raises(Exception, match="processors.compact.job_idle must be > 0"):
        load_text("receivers: {otlp: {}}\nprocessors: {compact: {job_idle: 0s}}\nexporters: {debug: {}}\n"
                  "service: {pipelines: {logs: {receivers: [otlp], processors: [compact], exporters: [debug]}}}")


# -- the processor in a real Collector --------------------------------------------------------------------------------
@pytest.fixture
def sidecar_in_process(capture_exporter):
    config = {"receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": None}},
              "processors": {"compact": {"batch_interval": "0s"}},
              "exporters": {"capture/backend": {}, "capture/aggregator": {}},
              "service": {"pipelines": {
                  "traces/backend": {"receivers": ["otlp"], "exporters": ["capture/backend"]},
                  "traces/aggregator": {"receivers": ["otlp"], "processors": ["compact"],
                                        "exporters": ["capture/aggregator"]},
                  "metrics": {"receivers": ["otlp"], "processors": ["compact"], "exporters": ["capture/aggregator"]},
                  "logs": {"receivers": ["otlp"], "processors": ["compact"], "exporters": ["capture/aggregator"]}}}}
    c = Collector(load_text(yaml.safe_dump(config)))
    c.start()
    yield c
    c.shutdown()


def _names(batches) -> list[str]:
    return [s.name for b in batches for rs in b.message.resource_spans for ss in rs.scope_spans for s in ss.spans]


def test_compact_drops_collective_spans_and_leaves_the_backend_batch_whole(sidecar_in_process):
    c = sidecar_in_process
    out = c.component("receiver", "otlp").host.consumer(Signal.TRACES)
    batch = Batch.from_message(Signal.TRACES, _spans(0, range(1, 4)))
    raw = batch.to_bytes()
    out.consume(batch)
    backend, aggregator = c.component("exporter", "capture/backend"), c.component("exporter", "capture/aggregator")
    assert _names(backend.of(Signal.TRACES)).count(T.COLLECTIVE_SPAN.name) == 18
    assert backend.of(Signal.TRACES)[0].to_bytes() == raw  # untouched, still the received bytes
    assert _names(aggregator.of(Signal.TRACES)) == [T.STEP_SPAN.name] * 3
    # Heartbeats with the job on their resource pass through as they are (no copy); other events are dropped.
    logs = _hang_logs(1, time.time())
    lb = LogsBuilder(_resource(1))
    lb.event("my.app.event", {"x": 1})
    c.component("receiver", "otlp").host.consumer(Signal.LOGS).consume(Batch.from_message(Signal.LOGS, logs))
    c.component("receiver", "otlp").host.consumer(Signal.LOGS).consume(Batch.from_message(Signal.LOGS, lb.build()))
    (kept,) = aggregator.of(Signal.LOGS)
    assert kept.message is logs
    # Node metrics without a job get the job the training processes reported; utilisation is not forwarded.
    mb = MetricsBuilder({"host.name": "node-a"}, scope="otel_gpu.receivers.nvml")
    gpu0 = attributes({"gpu.index": 0, "hw.id": "GPU-0"})
    mb.record(G.UTILIZATION, 0.9, gpu0)
    mb.record(G.XID_ERRORS, 1, gpu0, {str(G.XID_CODE): 79})
    c.component("receiver", "otlp").host.consumer(Signal.METRICS).consume(Batch.from_message(Signal.METRICS,
                                                                                                mb.build()))
    (metrics,) = aggregator.of(Signal.METRICS)
    (rm,) = metrics.message.resource_metrics
    assert {kv.key: kv.value.string_value for kv in rm.resource.attributes}["training.job.id"] == JOB
    assert [m.name for sm in rm.scope_metrics for m in sm.metrics] == [G.XID_ERRORS.name]


def test_compact_holds_back_node_records_until_a_job_is_known(capture_exporter):
    pipe = {"receivers": ["otlp"], "processors": ["compact"], "exporters": ["capture"]}
    config = {"receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": None}},
              "processors": {"compact": {}}, "exporters": {"capture": {}},
              "service": {"pipelines": {"logs": pipe}}}
    c = Collector(load_text(yaml.safe_dump(config)))
    lb = LogsBuilder({"host.name": "node-a"})
    lb.event(G.XID_EVENT, {"code": 79}, {"gpu.index": 1}, {str(G.XID_CODE): 79})
    assert c.component("processor", "compact").process(Batch.from_message(Signal.LOGS, lb.build())) is None
    assert c.component("processor", "compact").stats["logs"]["unassigned"] == 1


def test_compact_forwards_unchanged_node_metrics_only_on_refresh():
    from otel_gpu.component import ComponentHost
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.config import build
    from otel_gpu.processors.compact import CompactConfig, CompactProcessor

    compact = CompactProcessor(build(CompactConfig, {"job_id": JOB, "metrics_refresh": "30s", "batch_interval": "0s"},
                                     "processors.compact"),
                               ComponentHost("compact", PrometheusSelfTelemetry()))
    clock = [1000.0]
    compact._clock = lambda: clock[0]
    gpu0, gpu1 = attributes({"gpu.index": 0}), attributes({"gpu.index": 1})

    def poll(ecc1: int, mem: float, pids=(4100, 4101)) -> list[str]:
        mb = MetricsBuilder({"host.name": "node-a"}, scope="otel_gpu.receivers.nvml")  # new timestamps every poll
        for g, v in ((gpu0, 0), (gpu1, ecc1)):
            mb.record(G.ECC_ERRORS, v, g, {"error.type": "uncorrected", "gpu.ecc.counter": "volatile"})
        for g, pid in zip((gpu0, gpu1), pids):
            mb.record(G.PROCESS_MEMORY, mem, g, {"process.pid": pid})
        out = compact.process(Batch.from_message(Signal.METRICS, mb.build()))
        clock[0] += 1.0
        return [] if out is None else [m.name for rm in out.message.resource_metrics for sm in rm.scope_metrics
                                       for m in sm.metrics]

    both = [G.ECC_ERRORS.name, G.PROCESS_MEMORY.name]
    assert poll(0, 1e9) == both  # first sight
    assert poll(0, 1e9) == []  # same points, newer timestamps: held back
    assert poll(0, 2e9) == []  # a process's memory changed, not which process is on which GPU
    assert poll(1, 2e9) == [G.ECC_ERRORS.name]  # GPU 1's ECC counter rose: the whole metric (both GPUs) goes
    assert poll(1, 2e9, pids=(4100, 4199)) == [G.PROCESS_MEMORY.name]  # a new process on GPU 1
    clock[0] += 30
    assert poll(1, 2e9, pids=(4100, 4199)) == both  # refresh
    assert compact.stats["metrics"]["unchanged"] == 2 + 2 + 1 + 1


def test_compact_sends_a_rank_exception_at_once_with_what_waited():
    from otel_gpu.component import ComponentHost
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.config import build
    from otel_gpu.processors.compact import CompactConfig, CompactProcessor

    compact = CompactProcessor(build(CompactConfig, {"job_id": JOB, "batch_interval": "1s"}, "processors.compact"),
                               ComponentHost("compact", PrometheusSelfTelemetry()))

    def send(rank: int, event, attrs=None):
        lb = LogsBuilder({"training.job.id": JOB, "training.rank": rank})
        lb.event(event, {"step": 3}, attrs=attrs or {})
        return compact.process(Batch.from_message(Signal.LOGS, lb.build()))

    assert send(0, T.PROGRESS_EVENT) is None  # a heartbeat waits for the batch interval
    out = send(1, T.EXCEPTION_EVENT, {"exception.type": "RuntimeError"})
    assert out is not None  # the exception goes now, and the heartbeat with it
    assert [r.event_name for rl in out.message.resource_logs for sl in rl.scope_logs for r in sl.log_records] == [
        T.PROGRESS_EVENT.name, T.EXCEPTION_EVENT.name]
    assert send(2, T.PROGRESS_EVENT) is None


def test_compact_forwards_node_metrics_at_once_when_a_new_job_comes_to_the_node():
    """The node's metrics went to job A's aggregator; job B starts on the node: its aggregator must learn the
    node's devices at the next poll, not at the next refresh (up to metrics_refresh_s later)."""
    from otel_gpu.component import ComponentHost
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.config import build
    from otel_gpu.processors.compact import CompactConfig, CompactProcessor

    compact = CompactProcessor(build(CompactConfig, {"metrics_refresh": "30s", "batch_interval": "0s"},
                                     "processors.compact"), ComponentHost("compact", PrometheusSelfTelemetry()))
    clock = [1000.0]
    compact._clock = lambda: clock[0]

    def rank_of(job: str) -> None:
        lb = LogsBuilder({"training.job.id": job, "training.rank": 0})
        lb.event(T.PROGRESS_EVENT, {"step": 1})
        compact.process(Batch.from_message(Signal.LOGS, lb.build()))

    def poll() -> list[str]:
        mb = MetricsBuilder({"host.name": "node-a"}, scope="otel_gpu.receivers.nvml")
        mb.record(G.XID_ERRORS, 0, attributes({"gpu.index": 0}))
        out = compact.process(Batch.from_message(Signal.METRICS, mb.build()))
        clock[0] += 1.0
        return [] if out is None else sorted(kv.value.string_value for rm in out.message.resource_metrics
                                             for kv in rm.resource.attributes if kv.key == "training.job.id")

    rank_of("job-a")
    assert poll() == ["job-a"] and poll() == []  # first sight, then held back as unchanged
    rank_of("job-b")
    assert poll() == ["job-a", "job-b"]  # at once, for both jobs on the node
    assert poll() == []


def test_compact_forwards_the_nic_counters_the_aggregator_reads_and_a_creeping_other_one_changes_nothing():
    """A busy InfiniBand port's congestion counter (port_xmit_wait) climbs every poll. It is no evidence for any
    processor at the aggregator; forwarded, it made the port's whole hw.errors metric "changed" every second."""
    from otel_gpu.component import ComponentHost
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.config import build
    from otel_gpu.processors.attribution._evidence import NIC_READ_COUNTERS
    from otel_gpu.processors.compact import CompactConfig, CompactProcessor
    from otel_gpu.processors.compact.config import DEFAULT_NIC_COUNTERS
    from otel_gpu.processors.health.processor import _FLAPS, _NIC_ERROR_COUNTERS

    assert set(DEFAULT_NIC_COUNTERS) >= NIC_READ_COUNTERS | _NIC_ERROR_COUNTERS | {_FLAPS}
    compact = CompactProcessor(build(CompactConfig, {"job_id": JOB, "batch_interval": "0s"}, "processors.compact"),
                               ComponentHost("compact", PrometheusSelfTelemetry()))
    clock = [1000.0]
    compact._clock = lambda: clock[0]
    port = attributes({"hw.name": "mlx5_0", "nic.port": 1, "nic.kind": "infiniband"})

    def poll(wait: int, symbol: int, ecc: int = 0) -> list[tuple[str, int]]:
        mb = MetricsBuilder({"host.name": "node-a"}, scope="otel_gpu.receivers.nic")
        mb.record(G.HW_ERRORS, wait, port, {"error.type": "port_xmit_wait"})
        mb.record(G.HW_ERRORS, symbol, port, {"error.type": "symbol_error"})
        mb.record(G.HW_ERRORS, ecc, attributes({"gpu.index": 0}), {"error.type": "uncorrected"})
        out = compact.process(Batch.from_message(Signal.METRICS, mb.build()))
        clock[0] += 1.0
        if out is None:
            return []
        return sorted((dict((kv.key, kv.value.string_value) for kv in p.attributes)["error.type"], p.as_int)
                      for rm in out.message.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                      for p in m.sum.data_points)

    assert poll(10_000, 0) == [("symbol_error", 0), ("uncorrected", 0)]  # first sight, without the congestion
    assert poll(25_000, 0) == []  # only port_xmit_wait climbed: nothing changed for the aggregator
    assert poll(40_000, 7) == [("symbol_error", 7), ("uncorrected", 0)]  # a counter the rules read rose
    assert poll(55_000, 7, ecc=1) == [("symbol_error", 7), ("uncorrected", 1)]  # the GPU's points always go
    assert compact.stats["metrics"]["nic_counters_dropped"] == 4


def test_compact_merges_the_ranks_of_a_node_into_one_request(capture_exporter):
    pipe = {"receivers": ["otlp"], "processors": ["compact"], "exporters": ["capture"]}
    config = {"receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": None}},
              "processors": {"compact": {"batch_interval": "300ms", "batch_max_items": 100}},
              "exporters": {"capture": {}}, "service": {"pipelines": {"logs": pipe, "traces": pipe}}}
    c = Collector(load_text(yaml.safe_dump(config)))
    c.start()
    try:
        logs = c.component("receiver", "otlp").host.consumer(Signal.LOGS)
        capture = c.component("exporter", "capture")
        for rank in range(WORLD):
            logs.consume(Batch.from_message(Signal.LOGS, _hang_logs(rank, time.time())))
        assert capture.wait_for(lambda e: e.of(Signal.LOGS), timeout_s=5)
        (merged,) = capture.of(Signal.LOGS)  # one request, every rank's resource in it
        ranks = [kv.value.int_value for rl in merged.message.resource_logs for kv in rl.resource.attributes
                 if kv.key == "training.rank"]
        assert ranks == list(range(WORLD)) and merged.item_count() == WORLD + 1  # + rank 2's stacks
        # A full request goes at once, without waiting for the clock: 50 step spans of 2 ranks, 100 items.
        traces = c.component("receiver", "otlp").host.consumer(Signal.TRACES)
        traces.consume(Batch.from_message(Signal.TRACES, _spans(0, range(1, 51), collectives_per_step=1)))
        assert not capture.of(Signal.TRACES)
        traces.consume(Batch.from_message(Signal.TRACES, _spans(1, range(1, 51), collectives_per_step=1)))
        (full,) = capture.of(Signal.TRACES)
        assert full.item_count() == 100
        traces.consume(Batch.from_message(Signal.TRACES, _spans(2, range(1, 3))))
    finally:
        c.shutdown()
    assert capture.of(Signal.TRACES)[-1].item_count() == 2  # what waited at shutdown went out


# -- two real collectors ----------------------------------------------------------------------------------------------
def _export(endpoint: str, signal: Signal, request) -> None:
    stub = {Signal.TRACES: trace_service_pb2_grpc.TraceServiceStub,
            Signal.METRICS: metrics_service_pb2_grpc.MetricsServiceStub,
            Signal.LOGS: logs_service_pb2_grpc.LogsServiceStub}[signal]
    with grpc.insecure_channel(endpoint) as channel:
        stub(channel).Export(request, timeout=10)


def _report(store: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(store), "--format", "json"],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def test_hang_of_a_4_rank_job_reaches_the_aggregator_store_through_the_sidecar(tmp_path):
    sidecar_port, agg_port = free_port(), free_port()
    store = tmp_path / "agg-store"
    with OtlpSink() as full_backend, OtlpSink() as agg_backend:
        aggregator = _example("aggregator.yaml",
                              receivers__otlp={"grpc": {"endpoint": f"127.0.0.1:{agg_port}"}, "http": None},
                              processors__attribution={"hang_timeout": "2s", "tick_interval": "300ms"},
                              processors__goodput={"report_interval": "1s"},
                              exporters__store={"path": str(store)},
                              exporters__prometheus={"endpoint": f"127.0.0.1:{free_port()}"},
                              exporters__otlp_SLASH_backend={"endpoint": agg_backend.endpoint, "compression": "none"})
        sidecar = _example("sidecar.yaml",
                           receivers__otlp={"grpc": {"endpoint": f"127.0.0.1:{sidecar_port}"}, "http": None},
                           receivers__nvml={"backend": "fake",
                                            "scenario": str(ROOT / "tests/testdata/fake_nvml_sidecar.yaml")},
                           receivers__xid={"path": str(tmp_path / "kern.log"), "backend": "none"},
                           exporters__otlp_SLASH_aggregator={"endpoint": f"127.0.0.1:{agg_port}",
                                                             "retry_on_failure": {"initial_interval": "200ms"}},
                           exporters__otlp_SLASH_backend={"endpoint": full_backend.endpoint})
        (tmp_path / "kern.log").write_text("")
        with start_collector(yaml.safe_dump(aggregator), tmp_path / "agg") as agg, \
                start_collector(yaml.safe_dump(sidecar), tmp_path / "sidecar") as side:
            endpoint = f"127.0.0.1:{sidecar_port}"
            t0 = time.time() - 10
            for rank in range(WORLD):
                _export(endpoint, Signal.TRACES, _spans(rank, range(1, 6), t0=t0))
            now = time.time()
            for rank in range(WORLD):
                _export(endpoint, Signal.LOGS, _hang_logs(rank, now))
            deadline = time.monotonic() + 30
            report: dict = {}
            while time.monotonic() < deadline and not report.get("failures"):
                time.sleep(0.5)
                report = _report(store)
            assert report.get("failures"), (side.stderr_text()[-3000:], agg.stderr_text()[-3000:])
            (failure,) = [f for f in report["failures"] if f["job_id"] == JOB]
            assert (failure["kind"], failure["root_cause"], failure["culprit"]["rank"]) == \
                ("hang", "rank_not_in_collective", 2)
            assert failure["category"] == "user"
            assert full_backend.wait_for(lambda s: sum(sp.name == T.COLLECTIVE_SPAN.name for sp in s.spans()) >= 120,
                                         timeout_s=10)
            assert agg_backend.wait_for(lambda s: any(sp.name == "otel_gpu.failure" for sp in s.spans()),
                                        timeout_s=10)
            assert side.stop() == 0 and agg.stop() == 0
    # What reached the aggregator went on to its backend: the 20 step spans, the failure span and the stuck-collective
    # spans the aggregator made itself, never a collective span of the instrumentation.
    scopes = [(ss.scope.name, s.name) for req in agg_backend.traces for rs in req.resource_spans
              for ss in rs.scope_spans for s in ss.spans]
    assert sum(1 for scope, name in scopes if name == T.STEP_SPAN.name) == WORLD * 5
    assert not [1 for scope, name in scopes if name == T.COLLECTIVE_SPAN.name and scope == "otel_gpu.instrumentation"]
    assert sum(1 for scope, name in scopes if name == T.COLLECTIVE_SPAN.name) == 3  # stuck spans of ranks 0, 1, 3


def test_every_signal_the_sidecar_forwards_names_the_job(tmp_path):
    sidecar_port = free_port()
    with OtlpSink() as aggregator, OtlpSink() as backend:
        sidecar = _example("sidecar.yaml",
                           receivers__otlp={"grpc": {"endpoint": f"127.0.0.1:{sidecar_port}"}, "http": None},
                           receivers__nvml={"backend": "fake", "interval": "500ms",
                                            "scenario": str(ROOT / "tests/testdata/fake_nvml_sidecar.yaml")},
                           receivers__xid={"path": str(tmp_path / "kern.log"), "backend": "none"},
                           exporters__otlp_SLASH_aggregator={"endpoint": aggregator.endpoint, "compression": "none"},
                           exporters__otlp_SLASH_backend={"endpoint": backend.endpoint})
        (tmp_path / "kern.log").write_text("")
        with start_collector(yaml.safe_dump(sidecar), tmp_path / "sidecar") as side:
            endpoint = f"127.0.0.1:{sidecar_port}"
            for rank in range(2):  # the two ranks of this node
                _export(endpoint, Signal.TRACES, _spans(rank, range(1, 3)))
                _export(endpoint, Signal.LOGS, _hang_logs(rank, time.time()))
                mb = MetricsBuilder(_resource(rank), scope="otel_gpu.instrumentation")
                mb.record(T.STEP_DURATION, 0.9)
                _export(endpoint, Signal.METRICS, mb.build())
            # The node's own records: XID 79 and its ECC error at 4 s, GPU metrics every poll.
            assert aggregator.wait_for(lambda s: any(r.event_name == G.XID_EVENT.name for r in s.log_records())
                                       and G.ECC_ERRORS.name in s.metric_names(), timeout_s=20), side.stderr_text()
            assert side.stop() == 0
        requests = {"traces": (aggregator.traces, "resource_spans"), "metrics": (aggregator.metrics, "resource_metrics"),
                    "logs": (aggregator.logs, "resource_logs")}
        for signal, (reqs, field) in requests.items():
            resources = [rx.resource for req in reqs for rx in getattr(req, field)]
            assert resources, signal
            for res in resources:
                attrs = {kv.key: kv.value.string_value for kv in res.attributes}
                assert attrs.get("training.job.id") == JOB, (signal, attrs)
        node_metrics = {m.name for req in aggregator.metrics for rm in req.resource_metrics
                        if not any(kv.key == "training.rank" for kv in rm.resource.attributes)
                        for sm in rm.scope_metrics for m in sm.metrics}
        assert G.ECC_ERRORS.name in node_metrics and G.UTILIZATION.name not in node_metrics
        # The backend got the node's full metrics (utilisation too) and every collective span.
        assert G.UTILIZATION.name in backend.metric_names()
        assert sum(s.name == T.COLLECTIVE_SPAN.name for s in backend.spans()) == 2 * 2 * 6
