"""The ``compact`` processor: what a node sidecar forwards to its job's aggregator.

Cross-rank attribution needs each rank's heartbeats, stacks, exceptions and exits, its step/data/checkpoint spans and
the node's hardware evidence, not every collective span (tens per step per rank: most of a training job's telemetry).
This processor keeps the first and drops the rest, and stamps ``training.job.id`` on the node's own signals (GPU, NIC,
XID), so that every resource it forwards names its job: the OpenTelemetry Collector's loadbalancing exporter can then
route all of a job's data to one aggregator.

It never changes the batch it is given (a receiver hands the same batch to every pipeline, and the full traces still
go to the backend through another one): it passes it on as it is when nothing is to be dropped or stamped, and builds
a new, smaller request otherwise. With ``batch_interval_s`` > 0 (default 1 s) what it keeps is merged into one request
per signal and passed on every ``batch_interval_s`` (or once ``batch_max_items`` are waiting): the ranks of a node
then share requests to the aggregator, whose per-request cost dominates at scale.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from opentelemetry.proto.metrics.v1 import metrics_pb2

from otel_gpu.component import Processor
from otel_gpu.otlp_build import LogsBuilder
from otel_gpu.pdata import Batch, Signal, attribute, attributes_dict, body_object, data_points
from otel_gpu.processors.compact._digest import NodeDigests
from otel_gpu.schema import gpu as G
from otel_gpu.schema import identity as I
from otel_gpu.schema import training as T

__all__ = ["CompactProcessor"]

_logger = logging.getLogger(__name__)

_JOB = I.JOB_ID
_GPU_INDEX, _ERROR_TYPE, _HW_ERRORS = I.GPU_INDEX, G.ERROR_TYPE, G.HW_ERRORS.name
_URGENT = frozenset((T.EXCEPTION_EVENT.name, T.EXIT_EVENT.name, T.SIGNAL_EVENT.name))
_MAX_SERIES = 20_000  # metric series remembered for change detection (a node has a few dozen)
# signal -> (resource list, scope list, item list, the item's name field)
_SHAPE = {signal: (*signal.fields, "event_name" if signal is Signal.LOGS else "name") for signal in Signal}
_ABSENT = object()
_RANK = I.RANK
_DIGEST_SCOPE = "otel_gpu.processors.compact"


def _job_of(attributes) -> str | None:
    job = attribute(attributes, _JOB, _ABSENT)
    if job is _ABSENT:
        return None
    if isinstance(job, str):
        return job or None
    # A job id of another type still names the job: never add a second training.job.id beside it.
    return str(job) if isinstance(job, (int, float)) else "?"


class CompactProcessor(Processor):
    """Keeps what the aggregator needs, names the job on every resource. See the module docstring."""

    def __init__(self, config, host):
        super().__init__(config, host)
        self._nic_counters = frozenset(config.nic_counters)
        self._keep = {Signal.TRACES: frozenset(config.spans), Signal.LOGS: frozenset(config.events),
                      Signal.METRICS: frozenset(config.metrics)}
        self._lock = threading.Lock()
        self._jobs: dict[str, float] = {}  # job id -> when its training processes last sent something here
        self._clock = time.monotonic
        self._identity_only = frozenset(config.identity_only_metrics)
        self._sent: dict[tuple, tuple[int, float]] = {}  # (resource, scope, metric) -> (fingerprint, when forwarded)
        #: per signal: items passed on, filtered out by name, metrics held back as unchanged, and node items dropped
        #: because no job was known yet
        self._pending: dict[Signal, tuple[Any, int]] = {}  # signal -> (merged request, items), under _lock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats: dict[str, dict[str, int]] = {
            s.value: {"kept": 0, "filtered": 0, "unchanged": 0, "unassigned": 0, "nic_counters_dropped": 0}
            for s in Signal}
        self._wall = time.time
        #: node digests (config.digests): heartbeats and step spans of this node's ranks, summarised per interval
        self.digests: NodeDigests | None = NodeDigests(
            os.uname().nodename, self._wall, config.digest_refresh_s, config.batch_interval_s) \
            if config.digests else None

    # -- batching ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.config.batch_interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="otel-gpu-compact-flush", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.flush()  # the exporters stop after the processors: what is waiting still goes out

    def _run(self) -> None:
        while not self._stop.wait(self.config.batch_interval_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the flush clock must keep running
                self.host.log_once("flush", logging.ERROR, "compact: flush failed (logged once)", exc_info=True)

    def flush(self) -> None:
        """Passes on every merged request that is waiting."""
        digest = self._digest_request()
        with self._lock:
            pending, self._pending = self._pending, {}
        if digest is not None:
            merged, _ = pending.get(Signal.LOGS, (None, 0))
            if merged is None:
                pending[Signal.LOGS] = (digest, 1)
            else:
                merged.MergeFrom(digest)
        for signal, (request, _) in pending.items():
            self.host.emit(Batch.from_message(signal, request))

    def _digest_request(self):
        """One ``otel_gpu.node.digest`` record per job with ranks on this node (None: digests off or no ranks)."""
        if self.digests is None:
            return None
        now = self._wall()
        with self._lock:
            bodies = [(job, body, self.digests.restart_count(job)) for job, body in self.digests.bodies(now)]
        if not bodies:
            return None
        out = None
        for job, body, restarts in bodies:
            resource = {_JOB: job, I.HOST_NAME: body["host"], I.SERVICE_NAME: "otel-gpu-sidecar"}
            if restarts is not None:
                resource[I.RESTART_COUNT] = restarts
            lb = LogsBuilder(resource, scope=_DIGEST_SCOPE)
            lb.event(T.NODE_DIGEST_EVENT, body, time_ns=int(now * 1e9))
            if out is None:
                out = lb.build()
            else:
                out.MergeFrom(lb.build())
        return out

    def _absorb(self, signal: Signal, res_attrs: dict[str, Any], item) -> bool:
        """Digests on: True when ``item`` (a rank's record) is folded into its node digest instead of forwarded."""
        digests = self.digests
        if digests is None:
            return False
        if signal is Signal.TRACES:
            name = item.name
            if name == T.STEP_SPAN.name:
                attrs = attributes_dict(item.attributes)
                step = attrs.get(T.STEP)
                if not isinstance(step, int) or isinstance(step, bool):
                    return False
                start, end = item.start_time_unix_nano / 1e9, item.end_time_unix_nano / 1e9
                with self._lock:
                    return digests.step(res_attrs, step, start, end, _float(attrs.get(T.STEP_COLLECTIVE_S)),
                                        _float(attrs.get(T.STEP_DATA_S)),
                                        _float(attrs.get(T.STEP_CHECKPOINT_S)))
            return name == T.DATA_SPAN.name and res_attrs.get(_RANK) is not None  # read by nothing downstream
        name = item.event_name
        if name == T.PROGRESS_EVENT.name or name == T.STACKS_EVENT.name:
            body = body_object(item)
            if not isinstance(body, dict):
                return False
            with self._lock:
                if name == T.STACKS_EVENT.name:
                    return digests.stacks_held(res_attrs, body)
                t = (item.time_unix_nano or item.observed_time_unix_nano) / 1e9 or self._wall()
                return digests.heartbeat(res_attrs, body, t)
        if name == T.EXIT_EVENT.name:
            with self._lock:
                digests.exited(res_attrs, attributes_dict(item.attributes))
        return False

    def _enqueue(self, batch: Batch, items: int, urgent: bool = False) -> Batch | None:
        """Adds a kept batch to its signal's merged request; returns the merged request once it is full (or at once
        when ``urgent``)."""
        with self._lock:
            merged, count = self._pending.get(batch.signal, (None, 0))
            if merged is None:
                merged = batch.signal.request_type()()
            merged.MergeFrom(batch.message)  # repeated resources are appended
            count += items
            if count < self.config.batch_max_items and not urgent:
                self._pending[batch.signal] = (merged, count)
                return None
            self._pending.pop(batch.signal, None)
        return Batch.from_message(batch.signal, merged)

    # -- filtering ----------------------------------------------------------------------------------------------------
    def jobs(self) -> list[str]:
        """The jobs node signals are stamped with now: the configured one, else those seen within job_idle_s."""
        if self.config.job_id:
            return [self.config.job_id]
        horizon = self._clock() - self.config.job_idle_s
        with self._lock:
            for job in [j for j, t in self._jobs.items() if t < horizon]:
                del self._jobs[job]
            return sorted(self._jobs)

    def _learn(self, job: str, now: float) -> None:
        with self._lock:
            if job not in self._jobs:
                if len(self._jobs) >= 64:  # bounded: a node runs a handful of jobs at most
                    del self._jobs[min(self._jobs, key=self._jobs.__getitem__)]
                # A job new on this node: its aggregator knows nothing of the node's devices yet, so every node
                # metric goes at its next poll rather than at its next refresh (up to metrics_refresh_s later).
                self._sent.clear()
            self._jobs[job] = now

    def process(self, batch: Batch) -> Batch | None:
        signal = batch.signal
        res_field, scope_field, item_field, name_field = _SHAPE[signal]
        keep = self._keep[signal]
        stats = self.stats[signal.value]
        now = self._clock()
        request = batch.message
        plan: list[tuple[Any, list[str] | None, list[tuple[Any, list[Any]]]]] = []
        changed = False
        node_jobs: list[str] | None = None
        dedupe = signal is Signal.METRICS and self.config.metrics_refresh_s > 0
        for res in getattr(request, res_field):
            job = _job_of(res.resource.attributes)
            if job is not None:
                self._learn(job, now)
            scopes = []
            res_key = hash(res.resource.SerializeToString(deterministic=True)) if dedupe else 0
            if dedupe and job is None:
                if node_jobs is None:
                    node_jobs = self.jobs()
                # What cannot be forwarded (no job yet) must not count as forwarded for change detection.
                res_dedupe = bool(node_jobs)
            else:
                res_dedupe = dedupe
            res_attrs = attributes_dict(res.resource.attributes) \
                if self.digests is not None and signal is not Signal.METRICS else None
            for scope in getattr(res, scope_field):
                items = getattr(scope, item_field)
                kept = [item for item in items if getattr(item, name_field) in keep]
                if res_attrs is not None:
                    kept = [item for item in kept if not self._absorb(signal, res_attrs, item)]
                if len(kept) != len(items):
                    changed = True
                    stats["filtered"] += len(items) - len(kept)
                if signal is Signal.METRICS and self._nic_counters:
                    trimmed = [self._trim_nic(m) if m.name == _HW_ERRORS else m for m in kept]
                    if any(a is not b for a, b in zip(trimmed, kept)):
                        changed = True
                        kept = [m for m in trimmed if len(data_points(m))]
                if res_dedupe and kept:
                    fresh = [m for m in kept if self._metric_changed((res_key, scope.scope.name, m.name), m, now)]
                    if len(fresh) != len(kept):
                        changed = True
                        stats["unchanged"] += len(kept) - len(fresh)
                        kept = fresh
                if kept:
                    scopes.append((scope, kept))
            if not scopes:
                changed = True
                continue
            jobs: list[str] | None = None
            if job is None:
                changed = True
                jobs = self._jobs_in_items(signal, scopes)
                if not jobs:
                    if node_jobs is None:
                        node_jobs = self.jobs()
                    jobs = node_jobs
                if not jobs:
                    n = sum(len(k) for _, k in scopes)
                    stats["unassigned"] += n
                    self.host.log_once("unassigned", logging.INFO, "compact: node %s arrived before any training "
                                       "process reported a job; they are not forwarded until one does (set "
                                       "processors.compact.job_id to name the job up front; logged once)",
                                       signal.value)
                    continue
            plan.append((res, jobs, scopes))
            stats["kept"] += sum(len(k) for _, k in scopes) * (len(jobs) if jobs else 1)
        if not plan:
            return None
        if not changed:
            return self._out(batch, plan)
        out = signal.request_type()()
        out_resources = getattr(out, res_field)
        for res, jobs, scopes in plan:
            for job in jobs or (None,):
                r = out_resources.add()
                r.resource.CopyFrom(res.resource)
                if res.schema_url:
                    r.schema_url = res.schema_url
                if job is not None:
                    r.resource.attributes.add(key=_JOB).value.string_value = job
                out_scopes = getattr(r, scope_field)
                for scope, kept in scopes:
                    s = out_scopes.add()
                    s.scope.CopyFrom(scope.scope)
                    if scope.schema_url:
                        s.schema_url = scope.schema_url
                    getattr(s, item_field).extend(kept)
        return self._out(Batch.from_message(signal, out), plan)

    def _out(self, batch: Batch, plan) -> Batch | None:
        if self.config.batch_interval_s <= 0:
            return batch
        # A rank's exception, exit or stop signal opens a crash incident at the aggregator: it goes at once, with
        # what waited (the crash is named within a second of the first rank's death; waiting for the batch
        # interval would add up to batch_interval_s).
        urgent = batch.signal is Signal.LOGS and any(
            item.event_name in _URGENT for _, _, scopes in plan for _, kept in scopes for item in kept)
        return self._enqueue(batch, sum(len(k) for _, jobs, scopes in plan for _, k in scopes), urgent)

    def _trim_nic(self, metric):
        """``metric`` (hw.errors) without the points of NIC counters not in ``nic_counters``; itself when none is
        dropped. A GPU's points (they carry gpu.index) always stay."""
        points = data_points(metric)
        keep = [p for p in points if _counter_kept(p, self._nic_counters)]
        if len(keep) == len(points):
            return metric
        out = metrics_pb2.Metric()
        out.CopyFrom(metric)
        kept_points = data_points(out)
        del kept_points[:]
        kept_points.extend(keep)
        self.stats[Signal.METRICS.value]["nic_counters_dropped"] += len(points) - len(keep)
        return out

    def _metric_changed(self, key: tuple, metric, now: float) -> bool:
        """True when the metric's points differ from what was last forwarded, or the refresh time has come."""
        fp = metrics_pb2.Metric()
        fp.CopyFrom(metric)
        kind = fp.WhichOneof("data")
        if kind is not None:
            identity_only = metric.name in self._identity_only and kind in ("gauge", "sum")
            for p in data_points(fp):
                p.time_unix_nano = 0
                p.start_time_unix_nano = 0
                if identity_only:
                    p.ClearField("as_double")
                    p.ClearField("as_int")
        fingerprint = hash(fp.SerializeToString(deterministic=True))
        with self._lock:
            last = self._sent.get(key)
            if last is not None and last[0] == fingerprint and now - last[1] < self.config.metrics_refresh_s:
                return False
            if last is None and len(self._sent) >= _MAX_SERIES:
                del self._sent[min(self._sent, key=lambda k: self._sent[k][1])]
            self._sent[key] = (fingerprint, now)
        return True

    @staticmethod
    def _jobs_in_items(signal: Signal, scopes) -> list[str]:
        """A launcher's log records may name the job in their attributes rather than the resource."""
        if signal is not Signal.LOGS:
            return []
        found = []
        for _, kept in scopes:
            for record in kept:
                job = _job_of(record.attributes)
                if job is not None and job not in found:
                    found.append(job)
        return found[:1]


def _counter_kept(point, counters: frozenset[str]) -> bool:
    """A hw.errors point is forwarded unless it is a NIC counter (no gpu.index) outside ``counters``."""
    counter = None
    for kv in point.attributes:
        if kv.key == _GPU_INDEX:
            return True
        if kv.key == _ERROR_TYPE:
            counter = kv.value.string_value
    return counter is None or counter in counters


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
