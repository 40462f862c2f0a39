"""The attribution processor inside a real Collector: OTLP heartbeats in; a failure span, stuck-collective spans, a
failure event and the failures counter out; later spans of the job tagged with failure.* attributes."""
from __future__ import annotations

import json
import time

import pytest
import yaml

from otel_gpu.collector import registry
from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.otlp_build import LogsBuilder
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import failure as F
from otel_gpu.schema import gpu as G
from otel_gpu.schema import training as T
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

JOB = "job-proc-1"


@pytest.fixture
def collector(monkeypatch):
    monkeypatch.setitem(registry.BUILTIN["exporter"], "capture", "otel_gpu.testing.capture")
    pipe = {"receivers": ["otlp"], "processors": ["attribution"], "exporters": ["capture"]}
    config = {"receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": None}},
              "processors": {"attribution": {"hang_timeout": "2s", "tick_interval": "1m"}},
              "exporters": {"capture": {}},
              "service": {"pipelines": {"traces": pipe, "metrics": pipe, "logs": pipe}}}
    c = Collector(load_text(yaml.safe_dump(config)))
    c.start()
    yield c
    c.shutdown()


def _resource(rank: int) -> dict:
    return {"training.job.id": JOB, "training.rank": rank, "training.world_size": 4, "training.local_rank": rank,
            "host.name": "node-a", "process.pid": 100 + rank, "service.name": "train"}


def _send(collector, signal, request) -> None:
    collector.component("receiver", "otlp").host.consumer(signal).consume(Batch.from_message(signal, request))


def test_hang_goes_out_as_failure_span_stuck_spans_event_and_metric_and_tags_later_spans(collector):
    now = time.time()
    for rank in range(4):
        lb = LogsBuilder(_resource(rank))
        if rank == 2:  # never reached seq 8: asleep in user code
            body = {"step": 5, "state": "step", "inflight": None, "last_started_seq": {"0": 7}, "stalled_s": 5.0}
            lb.event(T.STACKS_EVENT, {"threads": [{"name": "MainThread", "main": True, "frames": [
                {"file": "/home/me/train.py", "line": 88, "function": "main"}]}], "top": "/home/me/train.py:88 main"})
        else:
            body = {"step": 5, "state": "collective", "stalled_s": 5.0, "last_started_seq": {"0": 8},
                    "inflight": {"kind": "collective", "op": "all_reduce", "pg": "0", "seq": 8, "since": now - 5}}
        lb.event(T.PROGRESS_EVENT, body)
        _send(collector, Signal.LOGS, lb.build())
    attribution = collector.component("processor", "attribution")
    (record,) = attribution.tick()
    assert (record.kind.value, record.root_cause.value, record.culprit.rank) == ("hang", "rank_not_in_collective", 2)
    assert record.category.value == "user" and "/home/me/train.py:88" in record.summary
    capture = collector.component("exporter", "capture")
    spans = [s for b in capture.of(Signal.TRACES) for rs in b.message.resource_spans for ss in rs.scope_spans
             for s in ss.spans]
    failure_spans = [s for s in spans if s.name == F.FAILURE_SPAN.name]
    stuck = [s for s in spans if s.name == T.COLLECTIVE_SPAN.name]
    assert len(failure_spans) == 1 and len(stuck) == 3
    attrs = {kv.key: kv.value for kv in failure_spans[0].attributes}
    assert attrs["failure.kind"].string_value == "hang" and attrs["failure.culprit.rank"].int_value == 2
    assert {kv.key for kv in stuck[0].attributes} >= {"collective.op", "collective.seq", "failure.root_cause"}
    events = capture.log_records(F.FAILURE_EVENT.name)
    assert len(events) == 1 and json.loads(events[0][0].body.string_value)["culprit"]["rank"] == 2
    assert any(p for p in capture.points(F.FAILURES.name))
    # A span of the job that ends after the onset (e.g. the collective finally returning) is tagged.
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for key, value in _resource(0).items():
        kv = rs.resource.attributes.add(key=key)
        if isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
    rs.scope_spans.add().spans.add(name=T.COLLECTIVE_SPAN.name, trace_id=b"t" * 16, span_id=b"s" * 8,
                                   start_time_unix_nano=int((now - 5) * 1e9), end_time_unix_nano=time.time_ns())
    _send(collector, Signal.TRACES, req)
    last = capture.of(Signal.TRACES)[-1].message.resource_spans[0].scope_spans[0].spans[0]
    assert {kv.key: kv.value.string_value for kv in last.attributes}.get("failure.kind") == "hang"


def test_healthy_heartbeats_produce_nothing(collector):
    now = time.time()
    for rank in range(4):
        lb = LogsBuilder(_resource(rank))
        lb.event(T.PROGRESS_EVENT, {"step": 5, "state": "step", "inflight": None, "last_started_seq": {"0": 8},
                                    "stalled_s": 0.1, "since": now})
        _send(collector, Signal.LOGS, lb.build())
    assert collector.component("processor", "attribution").tick() == []


def test_a_revision_goes_out_again_with_the_same_failure_id_and_the_counter_counts_the_failure_once(collector):
    """A CUDA error first; the XID on its GPU arrives after the verdict: the failure event is emitted again with the
    same failure_id, version 2 and previous_root_cause; the failures counter shows one failure, by its latest cause."""
    attribution = collector.component("processor", "attribution")
    lb = LogsBuilder(_resource(1))
    lb.event(T.EXCEPTION_EVENT, {"type": "torch.AcceleratorError"}, attrs={
        "exception.type": "torch.AcceleratorError", "exception.message": "CUDA error: unspecified launch failure",
        "exception.hint": "cuda_error", "thread.name": "MainThread"})
    _send(collector, Signal.LOGS, lb.build())
    deadline = time.monotonic() + 5
    while not attribution.records and time.monotonic() < deadline:  # the tick thread names it when it falls due
        time.sleep(0.05)
    (first,) = attribution.records
    assert (first.root_cause.value, first.version) == ("python_exception", 1)
    xid = LogsBuilder({"host.name": "node-a", "service.name": "otel-gpu-collector"})
    xid.event(G.XID_EVENT, {"message": "fell off the bus"}, attrs={"gpu.xid.code": 79, "gpu.index": 1,
                                                                     "process.pid": 101})
    _send(collector, Signal.LOGS, xid.build())
    (revised,) = attribution.tick()
    assert (revised.root_cause.value, revised.version, revised.failure_id) == ("gpu_fell_off_bus", 2,
                                                                              first.failure_id)
    capture = collector.component("exporter", "capture")
    bodies = [json.loads(r.body.string_value) for r, _, _ in capture.log_records(F.FAILURE_EVENT.name)]
    assert [(b["failure_id"], b["version"], b.get("previous_root_cause")) for b in bodies] == [
        (first.failure_id, 1, None), (first.failure_id, 2, "python_exception")]
    _, point, attrs, _ = capture.points(F.FAILURES.name)[-1]
    assert (attrs["failure.root_cause"], point.as_int) == ("gpu_fell_off_bus", 1)
