"""Fuzzing the attribution and goodput processors and the store exporter with hostile-but-valid OTLP.

Every batch here is a well-formed OTLP request (it would pass the receiver), but with what a buggy or hostile sender
could put in it: a progress event whose body is not JSON, or JSON of the wrong shape and types; a failure event with a
huge or deeply nested body; resources without job ids or with a rank that is a float, NaN, a list or a kvlist; spans
and metric points whose attributes have the wrong types; absurd timestamps. ``process()`` / ``export()`` must never
raise, the attribution clock (``tick``) and the goodput report must keep working, the store writer must log no error
and must still write the valid records that were queued with the hostile ones.

Bounded for CI (derandomized); ``OTEL_GPU_FUZZ_SCALE`` / ``OTEL_GPU_FUZZ_RANDOM`` run a longer campaign
(benchmarks/fuzz/README.md).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.config import build
from otel_gpu.exporters.store import FACTORY as STORE
from otel_gpu.exporters.store import db
from otel_gpu.pdata import Batch, Signal, set_any
from otel_gpu.processors.attribution import FACTORY as ATTRIBUTION
from otel_gpu.processors.goodput import FACTORY as GOODPUT


def fuzz(examples: int):
    """Hypothesis settings: ``examples`` scaled by OTEL_GPU_FUZZ_SCALE; derandomized unless OTEL_GPU_FUZZ_RANDOM=1."""
    scale = float(os.environ.get("OTEL_GPU_FUZZ_SCALE", "1") or 1)
    return settings(max_examples=max(1, int(examples * scale)), deadline=None, database=None,
                    derandomize=os.environ.get("OTEL_GPU_FUZZ_RANDOM") != "1",
                    suppress_health_check=list(HealthCheck), print_blob=True)


EVENTS = ["otel_gpu.progress", "otel_gpu.stacks", "otel_gpu.exception", "otel_gpu.process.exit", "otel_gpu.signal",
          "gpu.xid", "otel_gpu.failure", "otel_gpu.goodput", "something.else", ""]
SPANS = ["otel_gpu.step", "otel_gpu.data.wait", "otel_gpu.checkpoint.save", "otel_gpu.checkpoint.load",
         "otel_gpu.collective", "other"]
METRICS = ["gpu.row_remap.failure", "gpu.pcie.replay", "gpu.nvlink.errors", "gpu.xid.errors", "gpu.clock_event.active",
           "hw.errors", "gpu.process.memory.usage", "hw.network.up", "otel_gpu.nic.errors.rate", "gpu.other"]
RESOURCE_KEYS = ["training.job.id", "training.rank", "host.name", "process.pid", "training.local_rank",
                 "training.world_size", "gpu.index", "training.restart_count", "service.name"]
ATTR_KEYS = RESOURCE_KEYS + ["training.step", "training.step.collective_time", "training.step.data_time",
                             "training.step.checkpoint_time", "exception.type", "exception.message", "exception.hint",
                             "exception.stacktrace", "process.exit.signal", "process.exit.code", "gpu.xid.code",
                             "gpu.clock_event.reason", "error.type", "gpu.ecc.counter", "hw.name", "nic.port",
                             "nic.kind", "nic.counter", "hw.type", "hw.id", "gpu.pci.bus_id", "event.name"]
BODY_KEYS = ["step", "state", "inflight", "kind", "op", "pg", "seq", "since", "bytes", "last_seq", "last_started_seq",
             "stack_top", "user_top", "stalled_s", "threads", "main", "frames", "top", "job_id", "onset_time",
             "detected_time", "signature", "root_cause", "rank", "file", "line", "function", "0", "1"]

_I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_U64 = st.integers(min_value=0, max_value=2**64 - 1)
_scalar = st.one_of(st.none(), st.booleans(), _I64, st.floats(), st.text(max_size=12), st.binary(max_size=8),
                    st.sampled_from(["job-a", "0", "-1", "nan", "1e999", "collective", "hang", "crash", "x" * 5000]))
# A Python value that becomes an AnyValue (lists -> array_value, dicts -> kvlist_value, None -> no value).
_any = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(BODY_KEYS), inner, max_size=3), max_leaves=8)
# A JSON document shaped like our event bodies, with the wrong types anywhere.
_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(),
                         st.text(max_size=10), st.sampled_from(["collective", "data", "checkpoint", "0", "nan"]))
_json = st.recursive(_json_scalar, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(BODY_KEYS), inner, max_size=5), max_leaves=16)


_set = set_any  # the product's own conversion (otel_gpu.pdata)


def _attrs(target, pairs) -> None:
    for key, value in pairs:
        _set(target.add(key=key).value, value)


_pairs = st.lists(st.tuples(st.sampled_from(ATTR_KEYS), _any), max_size=6)
_resource = st.one_of(
    st.lists(st.tuples(st.sampled_from(RESOURCE_KEYS), _any), max_size=6),
    st.builds(lambda rank, extra: [("training.job.id", "job-f"), ("training.rank", rank), *extra],
              st.integers(0, 7) | _any, st.lists(st.tuples(st.sampled_from(RESOURCE_KEYS), _any), max_size=3)),
)
_body = st.one_of(
    st.fixed_dictionaries({}, optional={k: _json for k in BODY_KEYS}).map(json.dumps),  # our keys, any types
    _json.map(json.dumps),  # JSON of the wrong shape
    st.text(max_size=40),  # not JSON
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),  # nested deeper than json.loads' recursion limit
    st.integers(1, 3000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.just(json.dumps({"job_id": "job-f", "kind": "crash", "summary": "x" * (1 << 20)})),  # a huge failure body
    _any,  # not a string at all
)
_times = st.one_of(_U64, st.sampled_from([0, 1, 2**63, 2**64 - 1, 1_700_000_000_000_000_000]))


@st.composite
def hostile_logs(draw) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    for _ in range(draw(st.integers(1, 3))):
        rl = req.resource_logs.add()
        _attrs(rl.resource.attributes, draw(_resource))
        sl = rl.scope_logs.add()
        for _ in range(draw(st.integers(1, 4))):
            record = sl.log_records.add(event_name=draw(st.sampled_from(EVENTS)), time_unix_nano=draw(_times),
                                        observed_time_unix_nano=draw(_times))
            body = draw(_body)
            if isinstance(body, str):
                record.body.string_value = body
            else:
                _set(record.body, body)
            _attrs(record.attributes, draw(_pairs))
    return req


@st.composite
def hostile_spans(draw) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 3))):
        rs = req.resource_spans.add()
        _attrs(rs.resource.attributes, draw(_resource))
        ss = rs.scope_spans.add()
        for _ in range(draw(st.integers(1, 4))):
            span = ss.spans.add(name=draw(st.sampled_from(SPANS)), start_time_unix_nano=draw(_times),
                                end_time_unix_nano=draw(_times), trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
            _attrs(span.attributes, draw(_pairs))
    return req


@st.composite
def hostile_metrics(draw) -> ExportMetricsServiceRequest:
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    _attrs(rm.resource.attributes, draw(_resource))
    sm = rm.scope_metrics.add()
    for _ in range(draw(st.integers(1, 4))):
        m = sm.metrics.add(name=draw(st.sampled_from(METRICS)))
        kind = draw(st.sampled_from(["gauge", "sum", "histogram", None]))
        if kind is None:
            continue
        for _ in range(draw(st.integers(0, 3))):
            p = getattr(m, kind).data_points.add(time_unix_nano=draw(_times))
            if kind != "histogram":
                if draw(st.booleans()):
                    p.as_double = draw(st.floats())
                else:
                    p.as_int = draw(_I64)
            _attrs(p.attributes, draw(_pairs))
    return req


batches = st.one_of(hostile_logs().map(lambda r: Batch.from_message(Signal.LOGS, r)),
                    hostile_spans().map(lambda r: Batch.from_message(Signal.TRACES, r)),
                    hostile_metrics().map(lambda r: Batch.from_message(Signal.METRICS, r)))


class Keep:
    def __init__(self):
        self.batches: list[Batch] = []

    def consume(self, batch: Batch) -> None:
        batch.to_bytes()  # what the processors emit must serialize
        self.batches.append(batch)


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            trace = logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
            self.records.append(f"{record.name}: {record.getMessage()}\n{trace}")


@pytest.fixture(scope="module")
def errors():
    handler = _Errors()
    logging.getLogger("otel_gpu").addHandler(handler)
    yield handler
    logging.getLogger("otel_gpu").removeHandler(handler)


def _host(cid: str) -> ComponentHost:
    keep = Keep()
    return ComponentHost(cid, PrometheusSelfTelemetry(), {s: keep for s in Signal})


@pytest.fixture(scope="module")
def attribution():
    proc = ATTRIBUTION.create(build(ATTRIBUTION.config_class, {"tick_interval": "1h"}, "processors.attribution"),
                              _host("attribution"))
    yield proc
    proc.shutdown(1)


@pytest.fixture(scope="module")
def goodput():
    proc = GOODPUT.create(build(GOODPUT.config_class, {"report_interval": "1h"}, "processors.goodput"),
                          _host("goodput"))
    yield proc
    proc.shutdown(1)


@fuzz(200)
@given(batch=batches)
def test_attribution_never_raises_and_its_clock_keeps_running(attribution, errors, batch):
    out = attribution.process(batch)
    assert out is batch
    out.to_bytes()
    attribution.tick(time.time())
    attribution.tick(time.time() + 3600)  # far enough ahead for every timeout to fire on what was observed
    assert not errors.records, errors.records[:3]


@fuzz(150)
@given(batch=batches)
def test_goodput_never_raises_and_reports(goodput, errors, batch):
    assert goodput.process(batch) is batch
    goodput.report()
    for summary in goodput.summaries():
        json.dumps(summary)
    assert not errors.records, errors.records[:3]


def _valid_failure_logs(job: str) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    _attrs(rl.resource.attributes, [("training.job.id", job), ("training.rank", 0), ("host.name", "node-a")])
    record = rl.scope_logs.add().log_records.add(event_name="otel_gpu.failure", time_unix_nano=1)
    record.body.string_value = json.dumps({"job_id": job, "kind": "crash", "root_cause": "gpu_hardware",
                                           "signature": f"sig-{job}", "detected_time": 1.0})
    return req


DEEP = (100, 5000)


def test_store_exporter_takes_hostile_batches_and_still_writes_the_valid_ones(tmp_path, errors):
    store = STORE.create(build(STORE.config_class, {"path": str(tmp_path), "flush_interval": "50ms"},
                               "exporters.store"), _host("store"))
    store.start()
    examples: list[Batch] = []

    @fuzz(150)
    @given(batch=batches)
    def collect(batch):
        examples.append(batch)
        store.export(batch)  # never raises, whatever the batch holds
        # Written before the example ends: Hypothesis raises the recursion limit while an example runs, so a body
        # decoded in here could otherwise be too deep to encode in the writer afterwards (a test artifact).
        assert store.force_flush(10)

    try:
        # Outside Hypothesis (which raises the recursion limit while an example runs): a body nested past json's
        # recursion limit is ignored, the valid record beside it is kept.
        for depth in DEEP:
            req = _valid_failure_logs(f"job-deep-{depth}")
            deep = req.resource_logs[0].scope_logs[0].log_records.add(event_name="otel_gpu.failure")
            deep.body.string_value = '{"job_id": "deep", "kind": ' + '{"a":' * depth + "1" + "}" * depth + "}"
            store.export(Batch.from_message(Signal.LOGS, req))
        collect()
        # The valid records go into the same writer batches as the hostile ones: none may be lost with them.
        valid = [f"job-valid-{i}" for i in range(20)]
        for i, job in enumerate(valid):
            store.export(Batch.from_message(Signal.LOGS, _valid_failure_logs(job)))
            store.export(examples[(i * 7) % len(examples)])
        assert store.force_flush(10)
    finally:
        store.shutdown(5)
    assert not errors.records, errors.records[:3]
    conn = sqlite3.connect(db.db_path(tmp_path))
    try:
        stored = {row[0] for row in conn.execute("SELECT job_id FROM failures")}
    finally:
        conn.close()
    assert set(valid) | {f"job-deep-{d}" for d in DEEP} <= stored, sorted(set(valid) - stored)[:5]


def test_progress_body_edge_cases_are_ignored_not_crashed(attribution, goodput, errors):
    """Known-bad inputs, as a fixed regression list next to the random search."""
    cases = [
        {"step": 1, "inflight": {"kind": "collective", "since": "soon"}},
        {"step": 1, "last_seq": [1, 2]},
        {"step": 1, "last_seq": {"0": "x"}},
        {"step": 1, "last_started_seq": {"0": 1e400}},
        {"step": "inf", "stalled_s": "nan"},
        {"threads": [1, "x", None, {"main": True, "frames": 5}]},
        {"threads": 7},
        [1, 2, 3],
        "[" * 5000 + "]" * 5000,  # past json's recursion limit (outside Hypothesis, which raises the limit)
        '{"a":' * 5000 + "1" + "}" * 5000,
    ]
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    _attrs(rl.resource.attributes, [("training.job.id", "job-edge"), ("training.rank", float("inf"))])
    rl2 = req.resource_logs.add()
    _attrs(rl2.resource.attributes, [("training.job.id", "job-edge"), ("training.rank", 1)])
    for body in cases:
        for target in (rl, rl2):
            for name in ("otel_gpu.progress", "otel_gpu.stacks", "otel_gpu.failure"):
                record = target.scope_logs.add().log_records.add(event_name=name, time_unix_nano=1)
                record.body.string_value = body if isinstance(body, str) else json.dumps(body)
    batch = Batch.from_message(Signal.LOGS, req)
    attribution.process(batch)
    attribution.tick(time.time() + 3600)
    goodput.process(batch)
    goodput.report()
    assert not errors.records, errors.records[:3]
    assert math.isfinite(time.time())
