"""The ``goodput`` processor: accounts each job's wall time into productive step time and badput buckets, and emits
ETTR and badput as live metrics and as an ``otel_gpu.goodput`` event (what the store and ``otel-gpu report`` show).

Place it after ``attribution`` in the logs pipeline so that it sees failure events (hang time, wasted progress).
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otel_gpu.component import Processor
from otel_gpu.otlp_build import LogsBuilder, MetricsBuilder, merge
from otel_gpu.pdata import Batch, Signal, attribute, attributes_dict, body_object
from otel_gpu.processors.goodput._ledger import JobLedger
from otel_gpu.schema import collector as C
from otel_gpu.schema import failure as F
from otel_gpu.schema import gpu as G
from otel_gpu.schema import health as H
from otel_gpu.schema import identity as I
from otel_gpu.schema import training as T

__all__ = ["GoodputProcessor"]

_logger = logging.getLogger(__name__)
_CKPT = {T.CKPT_SAVE_SPAN.name: "save", T.CKPT_LOAD_SPAN.name: "load"}
_SCOPE = "otel_gpu.processors.goodput"
_JOB, _RESTARTS, _RANK = I.JOB_ID, I.RESTART_COUNT, I.RANK
_DIGEST = T.NODE_DIGEST_EVENT.name
#: Events of a node's hardware and of our own processors: a sidecar stamps them with the job its node serves (for
#: ``job_idle_s`` after the job's last record, or for as long as it runs with a configured job id), so they say
#: which job the node serves, not that the job still runs, and they do not lengthen its wall time.
_NOT_ACTIVITY = frozenset({G.XID_EVENT.name, H.STATE_CHANGE_EVENT.name, F.GOODPUT_EVENT.name})


_JOBS_OF: dict[bytes, tuple[str | None, int]] = {}  # a resource's encoding -> its job (senders repeat a few)


def _job_of(resource) -> tuple[str | None, int, bool]:
    """The resource's job id (a non-empty string, else None), restart count (an int, else 0), and whether it is a
    training process's (it names a rank) rather than a node's."""
    key = resource.SerializeToString()
    found = _JOBS_OF.get(key)
    if found is not None:
        return found
    attrs = attributes_dict(resource.attributes)
    job, restarts = attrs.get(_JOB), attrs.get(_RESTARTS)
    found = (job if isinstance(job, str) and job else None, restarts if type(restarts) is int else 0,
             attrs.get(_RANK) is not None)
    if len(key) <= 4096:
        if len(_JOBS_OF) >= 65536:
            _JOBS_OF.clear()
        _JOBS_OF[key] = found
    return found


def _attr(span, key: str, default: Any = None) -> Any:
    value = attribute(span.attributes, key)
    return default if value is None else value


def _seconds(value: Any, default: float) -> float:
    """A finite number of seconds from an attribute or body value; ``default`` for anything else (hostile input)."""
    try:
        out = float(value or default)
    except (TypeError, ValueError):
        return default
    return out if math.isfinite(out) else default


def _step(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError, OverflowError):  # hostile input: a list, "x", inf
        return None


class GoodputProcessor(Processor):
    def __init__(self, config, host):
        super().__init__(config, host)
        self._jobs: dict[str, JobLedger] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.out_of_window = 0  # span and event times refused or replaced (outside the window around receipt)

    def _window(self, now: float) -> tuple[float, float]:
        return now - self.config.time_window_past_s, now + self.config.time_window_future_s

    def _out_of_window(self, n: int, what: str) -> None:
        self.out_of_window += n
        count = getattr(self.host.telemetry, "count", None)
        if count is not None:
            count(C.OUT_OF_WINDOW, self.host.component_id, n)
        self.host.log_once(("window", what), logging.WARNING, "goodput %s: %s outside the accepted window around "
                           "receipt (time_window_past %s s, time_window_future %s s) are %s and counted in "
                           "otel_gpu_collector_out_of_window_total (logged once)", self.host.component_id, what,
                           f"{self.config.time_window_past_s:g}", f"{self.config.time_window_future_s:g}",
                           "refused" if what != "failure times" else "replaced by the receipt time")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-gpu-goodput", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.report()

    def _run(self) -> None:
        while not self._stop.wait(self.config.report_interval_s):
            try:
                self.report()
            except Exception:  # noqa: BLE001
                self.host.log_once("report", logging.ERROR, "goodput report failed (logged once)", exc_info=True)

    def _ledger(self, job: str, t: float, restarts: int) -> JobLedger:
        ledger = self._jobs.get(job)
        if ledger is None:
            if len(self._jobs) >= self.config.max_jobs:
                del self._jobs[min(self._jobs.values(), key=lambda j: j.last_seen).job_id]
            ledger = self._jobs[job] = JobLedger(job, t, t, restarts)
        ledger.touch(t, restarts)
        return ledger

    def summaries(self, now: float | None = None) -> list[dict]:
        with self._lock:
            return [j.summary(now) for j in self._jobs.values()]

    def process(self, batch: Batch) -> Batch | None:
        msg = batch.message
        with self._lock:
            if batch.signal is Signal.TRACES:
                self._spans(msg)
            elif batch.signal is Signal.LOGS:
                self._logs(msg, batch)
            else:
                for rm in msg.resource_metrics:
                    job, restarts, of_rank = _job_of(rm.resource)
                    if job is not None and of_rank:  # a node's GPU/NIC metrics stamped with the job: not its activity
                        self._ledger(job, time.time(), restarts)
        return batch

    def _spans(self, msg) -> None:
        step_name = T.STEP_SPAN.name
        lo, hi = self._window(time.time())
        refused = 0
        for rs in msg.resource_spans:
            job, restarts, _ = _job_of(rs.resource)
            if job is None:
                continue
            ledger = None
            for ss in rs.scope_spans:
                for span in ss.spans:
                    start, end = span.start_time_unix_nano / 1e9, span.end_time_unix_nano / 1e9
                    if not (lo <= start <= hi and lo <= end <= hi):  # a span the job's wall time cannot hold
                        refused += 1
                        continue
                    if ledger is None:
                        ledger = self._ledger(job, start, restarts)
                    # Both ends: a span that began before anything else of the job was seen (a rank's first step
                    # span starts when the instrumentation does) is inside the job's wall time, or productive time
                    # exceeds it (a real 4-rank torchrun job showed ETTR 141%: 5.9 s productive of 4.2 s).
                    if start < ledger.first_seen:
                        ledger.touch(start, restarts)
                    ledger.touch(end, restarts)
                    if span.name == step_name:
                        step = _step(_attr(span, T.STEP))
                        if step is not None:
                            ledger.step(step, start, end, _seconds(_attr(span, T.STEP_DATA_S), 0.0),
                                        _seconds(_attr(span, T.STEP_CHECKPOINT_S), 0.0),
                                        self.config.slowdown_ratio, restart_count=restarts)
                    elif span.name in _CKPT:
                        # Every rank's span comes; the ledger counts their union once, and the part inside a
                        # counted step is that step's checkpoint_time.
                        ledger.checkpoint(_CKPT[span.name], start, end, restart_count=restarts)
        if refused:
            self._out_of_window(refused, "span times")

    def _logs(self, msg, batch: Batch) -> None:
        now = time.time()
        lo, hi = self._window(now)
        refused = replaced = 0
        for i, rl in enumerate(msg.resource_logs):
            job, restarts, _ = _job_of(rl.resource)
            for j, sl in enumerate(rl.scope_logs):
                for k, record in enumerate(sl.log_records):
                    t = (record.time_unix_nano or record.observed_time_unix_nano) / 1e9 or now
                    if not lo <= t <= hi:
                        if record.event_name != F.FAILURE_EVENT.name:
                            refused += 1
                            continue
                        t, replaced = now, replaced + 1  # a failure still counts, at the time it arrived
                    if record.event_name == F.FAILURE_EVENT.name:
                        body = body_object(record)
                        if body is None:  # hostile input: not JSON, "null", a list, a number
                            continue
                        fjob = body.get("job_id") or job
                        if fjob:
                            fjob = str(fjob)
                            ledger = self._ledger(fjob, t, restarts if fjob == job else 0)
                            fid = body.get("failure_id")
                            onset, detected = _seconds(body.get("onset_time"), t), _seconds(body.get("detected_time"), t)
                            if not lo <= onset <= hi:
                                onset, replaced = t, replaced + 1
                            if not lo <= detected <= hi:
                                detected, replaced = t, replaced + 1
                            ledger.failure(str(body.get("kind")), onset, detected,
                                           failure_id=str(fid) if fid else None,
                                           withdrawn=body.get("withdrawn") is True)
                    elif job is not None and record.event_name == _DIGEST:
                        self._digest(job, restarts, batch.body((i, j, k), record), t)
                    elif job is not None and record.event_name and record.event_name not in _NOT_ACTIVITY:
                        self._ledger(job, t, restarts)
        if refused:
            self._out_of_window(refused, "event times")
        if replaced:
            self._out_of_window(replaced, "failure times")

    def _digest(self, job: str, restarts: int, body: dict | None, t: float) -> None:
        """A node digest (compact processor, digests on): its step rows count as the ranks' step spans would (one
        rank's step counts for the job; a row carries its node's lowest rank's start, end, data and checkpoint
        seconds)."""
        rows = body.get("step_rows") if isinstance(body, dict) else None
        ledger = self._ledger(job, t, restarts)
        if not isinstance(rows, list):
            return
        counted = ledger.counted_steps
        for row in rows:
            if not isinstance(row, list) or len(row) < 7:
                continue
            step = _step(row[0])
            if step is None or (restarts, step) in counted:
                continue  # another node's row of this step counted it (16,384 rows of one step at 131,072 ranks)
            start, end = _seconds(row[2], t), _seconds(row[3], t)
            if start < ledger.first_seen:
                ledger.touch(start, restarts)
            ledger.touch(end, restarts)
            ledger.step(step, start, end, _seconds(row[5], 0.0), _seconds(row[6], 0.0), self.config.slowdown_ratio,
                        restart_count=restarts)

    def report(self) -> None:
        now = time.time()
        with self._lock:
            for job in [j for j in self._jobs.values() if j.last_seen < now - self.config.job_idle_s]:
                del self._jobs[job.job_id]
            summaries = [j.summary(now) for j in self._jobs.values()]
        if not summaries:
            return
        if self.host.has_consumer(Signal.METRICS):
            self.host.emit(Batch.from_message(Signal.METRICS, _metrics(summaries)))
        if self.host.has_consumer(Signal.LOGS):
            self.host.emit(Batch.from_message(Signal.LOGS, _events(summaries)))


def _job_resource(job_id: str) -> dict[str, Any]:
    return {_JOB: job_id, I.SERVICE_NAME: "otel-gpu"}


def _metrics(summaries: list[dict]) -> ExportMetricsServiceRequest:
    now = time.time_ns()
    requests = []
    for s in summaries:
        # The job's accounting started when it was first seen: the start of its cumulative sums (never after now:
        # span times from a hostile sender can lie far in the future).
        mb = MetricsBuilder(_job_resource(s["job_id"]), scope=_SCOPE, time_ns=now,
                            start_time_ns=min(int(s["first_seen"] * 1e9), now))
        if s["ettr"] is not None:
            mb.record(F.ETTR, float(s["ettr"]))
        mb.record(F.PRODUCTIVE_TIME, float(s["productive_time_s"]))
        mb.record(F.WALL_TIME, float(s["wall_time_s"]))
        for bucket, seconds in s["badput_s"].items():
            mb.record(F.BADPUT, float(seconds), {F.BADPUT_BUCKET: bucket})
        requests.append(mb.build())
    return merge(requests) or ExportMetricsServiceRequest()


def _events(summaries: list[dict]) -> ExportLogsServiceRequest:
    now = time.time_ns()
    requests = []
    for s in summaries:
        lb = LogsBuilder(_job_resource(s["job_id"]), scope=_SCOPE)
        lb.event(F.GOODPUT_EVENT, json.dumps(s), time_ns=now, observed_time_ns=now)
        requests.append(lb.build())
    return merge(requests) or ExportLogsServiceRequest()
