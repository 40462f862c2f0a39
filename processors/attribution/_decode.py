"""OTLP in, observations out: the attribution processor's decoder.

Every request the processor sees becomes plain records for the engine (``_observations``: heartbeats, stacks,
exceptions, exits, process states, steps, spans, GPU and NIC samples, XIDs, node digests); no protobuf passes this
point. A rank's resource is decoded once per distinct resource (its identity is cached, bounded).
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_gpu.component import ComponentHost
from otel_gpu.pdata import Batch, attributes_dict, body_object, data_points, number_points, point_value, to_python
from otel_gpu.processors.attribution import _digest
from otel_gpu.processors.attribution._engine import Engine
from otel_gpu.processors.attribution.config import AttributionConfig
from otel_gpu.processors.attribution._evidence import NIC_READ_COUNTERS
from otel_gpu.processors.attribution._metric_memo import MetricMemo
from otel_gpu.processors.attribution._observations import (ExceptionSeen, ExitSeen, GpuSample, Heartbeat, Identity,
                                                           Inflight, NicSample, SpanSeen, Stacks, StateSeen, StepSeen,
                                                           XidSeen)
from otel_gpu.schema import gpu as G
from otel_gpu.schema import identity as I
from otel_gpu.schema import nic as N
from otel_gpu.schema import training as T

_logger = logging.getLogger(__name__)

_SPAN_KINDS = {T.DATA_SPAN.name: "data", T.CKPT_SAVE_SPAN.name: "checkpoint_save",
               T.CKPT_LOAD_SPAN.name: "checkpoint_load"}
_TRAINING_EVENTS = {T.PROGRESS_EVENT.name, T.STACKS_EVENT.name, T.EXCEPTION_EVENT.name, T.EXIT_EVENT.name,
                    T.SIGNAL_EVENT.name, T.STATE_EVENT.name}
_DIGEST = T.NODE_DIGEST_EVENT.name
_GPU_COUNTERS = {G.REMAP_FAILURE.name: "row_remap_failure", G.PCIE_REPLAY.name: "pcie_replay",
                 G.NVLINK_ERRORS.name: "nvlink_errors", G.XID_ERRORS.name: "xid"}
_NIC_ERRORS = {N.IB_ERRORS.name, N.ETH_ERRORS.name}
_NIC_UP = {N.IB_UP.name, N.ETH_UP.name}
# The instrumentation says where an in-flight operation was seen; the engine needs only what it is.
_INFLIGHT_KINDS = {"collective": "collective", "wait": "collective", "flight_recorder": "collective",
                   "p2p": "collective", "data": "data", "checkpoint": "checkpoint"}


_GPU_KEYS = frozenset((I.GPU_INDEX, I.HW_ID))
_GPU_WANTED = {G.CLOCK_EVENT_ACTIVE.name: _GPU_KEYS | {G.CLOCK_EVENT_REASON},
               G.ECC_ERRORS.name: _GPU_KEYS | {G.ERROR_TYPE, G.ECC_COUNTER},
               G.PROCESS_MEMORY.name: _GPU_KEYS | {I.PROCESS_PID}}
_NIC_KEYS = frozenset((N.DEVICE, N.PORT, G.ERROR_TYPE, N.COUNTER))
_NIC_NAMES = {name: name for name in NIC_READ_COUNTERS}


class _Layouts:
    """Where the attributes a decoder reads sit in a metric's data points.

    A receiver writes every point of a metric with the same attributes in the same order (a GPU's identity, then
    what the point counts), and most of them are not read (vendor, model, driver, PCI id). Decoding every attribute
    of every point was most of the aggregator's cost for a node's first metrics (about 3 ms a node;
    benchmarks/aggregator_scale.py). After one full scan of a point, the next points of that metric and length are
    read at those positions only, each checked by its key; a point laid out otherwise is scanned again.

    >>> from otel_gpu.otlp_build import attributes
    >>> lay = _Layouts()
    >>> a = attributes({"gpu.index": 0, "hw.vendor": "x", "error.type": "uncorrected"})
    >>> b = attributes({"gpu.index": 1, "hw.vendor": "x", "error.type": "corrected"})
    >>> lay.pick("hw.errors", "gpu", a, {"gpu.index", "error.type"}), lay.pick("hw.errors", "gpu", b, {"gpu.index"})
    ({'gpu.index': 0, 'error.type': 'uncorrected'}, {'gpu.index': 1})
    >>> lay.pick("hw.errors", "gpu", list(reversed(b)), {"gpu.index"})  # another order: scanned
    {'gpu.index': 1}
    """

    _MAX = 1024  # layouts remembered (metric x decoder x attribute count)

    def __init__(self) -> None:
        #: (metric, decoder, attribute count) -> (positions and names of the attributes read, those names)
        self._at: dict[tuple[str, str, int], tuple[tuple[tuple[int, str], ...], frozenset[str]]] = {}

    def pick(self, metric: str, decoder: str, attrs: Any, wanted: Any, required: str | None = None) -> dict[str, Any]:
        """The ``wanted`` attributes of one point (``attrs``: its repeated KeyValue); nothing when its layout has no
        ``required`` attribute (a NIC's point of hw.errors, for the GPU decoder)."""
        key = (metric, decoder, len(attrs))
        known = self._at.get(key)
        if known is not None:
            at, names = known
            if required is not None and required not in names:
                return {}
            out: dict[str, Any] = {}
            for i, name in at:
                kv = attrs[i]
                if kv.key != name:
                    break
                if name in wanted:
                    out[name] = to_python(kv.value)
            else:
                return out
        out, found = {}, []
        for i, kv in enumerate(attrs):
            name = kv.key
            if name in _ALL_WANTED:
                found.append((i, name))
                if name in wanted:
                    out[name] = to_python(kv.value)
        if len(self._at) >= self._MAX:
            self._at.clear()
        self._at[key] = (tuple(found), frozenset(name for _, name in found))
        return out


_ALL_WANTED = frozenset().union(_GPU_KEYS, *_GPU_WANTED.values(), _NIC_KEYS)


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None and v != "" else None
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf) from a double attribute
        return None


def _identity(res: dict[str, Any]) -> Identity | None:
    job, rank = res.get(I.JOB_ID), _int(res.get(I.RANK))
    if job is None or rank is None:
        return None
    gpu = res.get(I.GPU_INDEX)
    uuid = res.get(I.GPU_UUID)
    host = _text(res.get(I.HOST_NAME))
    return Identity(job_id=_shared(str(job)), rank=rank, host=None if host is None else _shared(host),
                    pid=_int(res.get(I.PROCESS_PID)),
                    local_rank=_int(res.get(I.LOCAL_RANK)), world_size=_int(res.get(I.WORLD_SIZE)),
                    gpu=None if gpu is None else str(gpu), restart_count=_int(res.get(I.RESTART_COUNT)) or 0,
                    gpu_uuid=str(uuid) if uuid else None, net_ifaces=_ifaces(res.get(NET_INTERFACES)),
                    started=_iso_seconds(res.get(I.PROCESS_CREATION_TIME)))


def _iso_seconds(value: Any) -> float | None:
    """An ISO 8601 time (``process.creation.time``) as unix seconds; None when absent or not a time.

    >>> _iso_seconds("2026-12-03T21:40:00.250Z"), _iso_seconds("yesterday"), _iso_seconds(None)
    (1796334000.25, None, None)
    """
    if not isinstance(value, str):
        return None
    try:
        t = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()


#: The network interfaces / HCAs a rank communicates over: only their ports can be network evidence for the job;
#: without it, the ports that were up when the job started.
NET_INTERFACES = I.NET_INTERFACES


def _text(value: Any) -> str | None:
    """A string attribute as text (hostile input: a list or a number where a name belongs must not break lookups)."""
    return None if value is None else (value if isinstance(value, str) else str(value))


def _shared(text: str) -> str:
    """One copy of a job id or host name for all the identities that carry it (131,072 ranks: 8 per host)."""
    return sys.intern(text) if len(text) <= 256 else text


_IFACES: dict[Any, frozenset[str] | None] = {}  # attribute value -> interface set, shared by the ranks that say it


def _ifaces(value: Any) -> frozenset[str] | None:
    """Interface names from an attribute: "eth0,ib0", ["mlx5_0:1", "mlx5_1"], NCCL's "=mlx5_0" (exact) prefix; a
    port suffix ":1" is dropped (ports are matched by device); "^..." (exclusions) tells nothing usable."""
    if not value:
        return None
    key = value if isinstance(value, str) else tuple(map(str, value)) if isinstance(value, list) else None
    if key is not None and key in _IFACES:
        return _IFACES[key]
    out = _parse_ifaces(value)
    if key is not None and len(str(key)) <= 1024:
        if len(_IFACES) >= 4096:
            _IFACES.clear()
        _IFACES[key] = out
    return out


def _parse_ifaces(value: Any) -> frozenset[str] | None:
    items = value if isinstance(value, list) else str(value).split(",")
    out = set()
    for item in items:
        name = str(item).strip().lstrip("=")
        if not name or name.startswith("^"):
            continue
        out.add(name.split(":", 1)[0])
    return frozenset(out) or None


class _ResourceView:
    """A resource's decoded attributes and, computed on first use, its rank identity (see ``_view``)."""

    __slots__ = ("attrs", "_who", "_done")

    def __init__(self, attrs: dict[str, Any]):
        self.attrs = attrs
        self._who: Identity | None = None
        self._done = False

    def identity(self) -> Identity | None:
        if not self._done:
            self._who = _identity(self.attrs)  # may raise on hostile input: then nothing is cached, as before
            self._done = True
        return self._who


_VIEW_CACHE_MAX = 65536  # distinct resources remembered (one per rank process, plus the nodes' receivers)
_WHOLE_MAX = 1 << 20  # bytes: a larger metrics request is decoded metric by metric
_ZERO8 = bytes(8)
_VIEW_KEY_MAX = 4096  # bytes; a rank's resource is a few hundred


def _seconds(nanos: int) -> float:
    return nanos / 1e9



def _float(v: Any) -> float | None:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None



class Decoder:
    """Turns export requests into engine observations (callers hold the processor's lock)."""

    def __init__(self, engine: Engine, config: AttributionConfig, host: ComponentHost, clock: Callable[[], float]):
        self.engine = engine
        self.config = config
        self.host = host
        self._clock = clock
        self._views: dict[bytes, _ResourceView] = {}
        self._metric_memo = MetricMemo()
        self._layouts = _Layouts()
        self._requests: dict[int, int] = {}  # a request's resources -> its last content (poll times masked)
        self._request_nodes: dict[int, tuple[tuple[str, int], ...]] = {}  # -> (host, resource key) of each

    def view(self, resource) -> _ResourceView:
        """Performance (aggregator scale, benchmarks/aggregator_scale.py): every request of a rank carries the same
        resource; decoding its attributes and building its Identity once per distinct resource, not once per request,
        was the largest per-request cost of an aggregator, and one shared Identity per rank keeps memory small."""
        key = resource.SerializeToString()
        view = self._views.get(key)
        if view is None:
            view = _ResourceView(attributes_dict(resource.attributes))
            if len(key) <= _VIEW_KEY_MAX:  # a huge (hostile) resource is decoded each time, never kept
                if len(self._views) >= _VIEW_CACHE_MAX:
                    self._views.clear()
                self._views[key] = view
        return view

    def logs(self, request: ExportLogsServiceRequest, now: float, batch: Batch | None = None) -> None:
        """``batch``: the request's Batch, whose decoded record bodies the next processors share (node digests)."""
        for i, rl in enumerate(request.resource_logs):
            view = None
            for j, sl in enumerate(rl.scope_logs):
                for k, record in enumerate(sl.log_records):
                    name = record.event_name
                    if not name:
                        continue
                    if name == G.XID_EVENT.name:
                        view = view if view is not None else self.view(rl.resource)
                        self._xid(record, view.attrs)
                    elif name == _DIGEST:
                        view = view if view is not None else self.view(rl.resource)
                        try:
                            body = batch.body((i, j, k), record) if batch is not None else body_object(record)
                            if isinstance(body, dict):
                                _digest.observe_digest(self.engine, view.attrs, body, now, _identity)
                        except (TypeError, ValueError, AttributeError, OverflowError, RecursionError, KeyError,
                                IndexError) as exc:
                            self.host.log_once(("malformed", name), logging.WARNING, "attribution: a malformed %s "
                                               "event was skipped (%s; logged once)", name, exc)
                    elif name in _TRAINING_EVENTS:
                        view = view if view is not None else self.view(rl.resource)
                        try:
                            self._training_event(name, record, view.attrs, now, view)
                        # Hostile input (fuzzing): a body of the wrong shape or types skips that record only.
                        except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
                            self.host.log_once(("malformed", name), logging.WARNING, "attribution: a malformed %s "
                                               "event was skipped (%s; logged once)", name, exc)

    def _training_event(self, name: str, record, res: dict[str, Any], now: float,
                        view: _ResourceView | None = None) -> None:
        attrs = attributes_dict(record.attributes)
        if view is not None and I.JOB_ID not in attrs and I.RANK not in attrs:
            who = view.identity()  # the usual case: the resource alone names the rank
        else:
            merged = {**res, **{k: v for k, v in attrs.items() if k in (I.JOB_ID, I.RANK)}}
            who = _identity(merged)
        if who is None:
            return
        t = _seconds(record.time_unix_nano or record.observed_time_unix_nano) or now
        body = body_object(record) or {}
        if name == T.PROGRESS_EVENT.name:
            inflight = body.get("inflight")
            infl = None
            if isinstance(inflight, dict) and inflight.get("since") is not None:
                infl = Inflight(kind=_INFLIGHT_KINDS.get(str(inflight.get("kind")), str(inflight.get("kind"))),
                                op=inflight.get("op"),
                                pg=None if inflight.get("pg") is None else str(inflight.get("pg")),
                                seq=_int(inflight.get("seq")), since=float(inflight["since"]),
                                bytes=_int(inflight.get("bytes")),
                                p2p=bool(inflight.get("p2p")) or inflight.get("kind") == "p2p")
            self.engine.observe_heartbeat(Heartbeat(
                who, t, _int(body.get("step")), body.get("state"), infl,
                {str(k): int(v) for k, v in (body.get("last_seq") or {}).items()},
                {str(k): int(v) for k, v in (body.get("last_started_seq") or {}).items()},
                body.get("stack_top") or body.get("user_top"), _float(body.get("stalled_s")),
                _int(counters.get("steps")) if isinstance(counters := body.get("counters"), dict) else None), now)
        elif name == T.STACKS_EVENT.name:
            frames: list[dict] = []
            for thread in body.get("threads") or []:
                if thread.get("main"):
                    frames = list(thread.get("frames") or [])
            self.engine.observe_stacks(Stacks(who, t, body.get("top"), frames), now)
        elif name == T.EXCEPTION_EVENT.name:
            self.engine.observe_exception(ExceptionSeen(
                who, t, str(attrs.get(T.EXC_TYPE, "?")), str(attrs.get(T.EXC_MESSAGE, "")),
                attrs.get(T.EXC_HINT), str(attrs.get(T.EXC_STACK, "")),
                thread=None if attrs.get(T.THREAD_NAME) is None else str(attrs.get(T.THREAD_NAME))), now)
        elif name == T.EXIT_EVENT.name:
            signal_name = attrs.get(T.EXIT_SIGNAL)
            how = attrs.get(T.EXIT_HOW) or body.get("how")
            self.engine.observe_exit(ExitSeen(who, t, _int(attrs.get(T.EXIT_CODE)), signal_name or None,
                                              None if how is None else str(how)), now)
        elif name == T.STATE_EVENT.name:
            frozen = attrs.get(T.PROCESS_FROZEN)
            self.engine.observe_state(StateSeen(who, t, str(attrs.get(T.PROCESS_STATE, "?")),
                                                None if not frozen else str(frozen),
                                                str(attrs.get(T.PROCESS_WCHAN) or ""),
                                                str(body.get("stack") or "")[:2000]), now)

    def _xid(self, record, res: dict[str, Any]) -> None:
        attrs = attributes_dict(record.attributes)
        host = self._host(res)
        code = _int(attrs.get(G.XID_CODE))
        if code is None:
            return
        gpu = attrs.get(I.GPU_INDEX)
        self.engine.observe_xid(XidSeen(host, None if gpu is None else str(gpu), code,
                                        _seconds(record.time_unix_nano) or self._clock(),
                                        attrs.get(I.GPU_PCI_BUS_ID), pid=_int(attrs.get(I.PROCESS_PID))))

    def _host(self, res: dict[str, Any]) -> str:
        return str(res.get(I.HOST_NAME) or self.config.default_host or os.uname().nodename)

    def metrics(self, request: ExportMetricsServiceRequest, now: float, batch: Batch | None = None) -> None:
        """``batch``: the request's Batch; while it holds the wire bytes, a request that repeats the last one of
        the same resources (timestamps aside: a node's refresh) is recognised from those bytes, with no metric
        encoded again (``_metric_memo`` encodes each metric: 0.3 ms a node, 0.15 CPU s a second at 16,384 nodes)."""
        whole = self._whole_request(request, batch)
        if whole is not None:
            key, fingerprint, t = whole
            if self._requests.get(key) == fingerprint:
                for host, res_key in self._request_nodes.get(key, ()):
                    gpus, ports = self._metric_memo.devices(res_key)
                    self.engine.devices.seen(host, list(gpus), list(ports), t or self._clock())
                return
        self._metrics(request)
        if whole is not None:
            key, fingerprint, _ = whole
            if len(self._requests) >= _VIEW_CACHE_MAX:
                self._requests.clear()
                self._request_nodes.clear()
            self._requests[key] = fingerprint
            self._request_nodes[key] = tuple(
                (self._host(self.view(rm.resource).attrs), hash(rm.resource.SerializeToString()))
                for rm in request.resource_metrics)

    @staticmethod
    def _whole_request(request: ExportMetricsServiceRequest, batch: Batch | None) -> tuple[int, int, float] | None:
        """(its resources and scopes, its content with the poll times masked, the poll time) from the wire bytes;
        None without them."""
        raw = batch.wire() if batch is not None else None
        if raw is None or len(raw) > _WHOLE_MAX:
            return None
        stamps: set[int] = set()
        resources: list[bytes | str] = []
        for rm in request.resource_metrics:
            resources.append(rm.resource.SerializeToString())
            for sm in rm.scope_metrics:
                # The scopes are in the key: a sidecar's nvml and nic receivers send the same resource, and their
                # requests would otherwise displace each other at every poll (found at 16,384 nodes: no hit at all).
                resources.append(sm.scope.name)
                for m in sm.metrics:
                    points = data_points(m)
                    if len(points):
                        stamps.add(points[0].time_unix_nano)
                        stamps.add(points[0].start_time_unix_nano)
        masked = raw
        for t in stamps:
            if t:
                masked = masked.replace(t.to_bytes(8, "little"), _ZERO8)
        return hash(tuple(resources)), hash(masked), max(stamps, default=0) / 1e9

    def _metrics(self, request: ExportMetricsServiceRequest) -> None:
        memo = self._metric_memo
        for rm in request.resource_metrics:
            host = None
            gpus: dict[str, GpuSample] = {}
            ports: dict[str, NicSample] = {}
            res_key = hash(rm.resource.SerializeToString())  # an int: the memo keeps one per node
            seen_at = None  # an unchanged metric's time: its node's devices were seen then (_metric_memo)
            for sm in rm.scope_metrics:
                # The scope is in the key: a sidecar's nvml and nic receivers share a resource, and each sends a
                # hw.errors metric (the GPUs', the ports'), which would otherwise displace the other every poll.
                memo_key = hash((res_key, sm.scope.name))  # an int: 16,384 nodes x 7 metrics of keys
                for m in sm.metrics:
                    name = m.name
                    gpu = name.startswith("gpu.") or name in (G.ECC_ERRORS.name,)
                    nic = name in _NIC_ERRORS or name in _NIC_UP  # hw.errors is both the GPUs' and the NICs'
                    if not (gpu or nic):
                        continue
                    host = host or self._host(self.view(rm.resource).attrs)
                    same = memo.unchanged(memo_key, m)
                    if same is not None:
                        seen_at = max(seen_at or 0.0, same or self._clock())
                        continue
                    if gpu:
                        self._gpu_metric(host, m, gpus)
                    if nic:
                        self._nic_metric(host, m, ports)
            if host is None:
                continue
            memo.learn(res_key, gpus, ports)
            if seen_at is not None:  # the node's other devices reported as before: they were seen then
                known_gpus, known_ports = memo.devices(res_key)
                self.engine.devices.seen(host, [k for k in known_gpus if k not in gpus],
                                         [k for k in known_ports if k not in ports], seen_at)
            for sample in gpus.values():
                self.engine.observe_gpu(sample)
            for sample in ports.values():
                self.engine.observe_nic(sample)

    def _gpu_metric(self, host: str, m, gpus: dict[str, GpuSample]) -> None:
        name = m.name
        if name not in _GPU_COUNTERS and name not in (G.CLOCK_EVENT_ACTIVE.name, G.ECC_ERRORS.name,
                                                      G.PROCESS_MEMORY.name):
            return
        pick, wanted = self._layouts.pick, _GPU_WANTED.get(name, _GPU_KEYS)
        clock = name == G.CLOCK_EVENT_ACTIVE.name
        no_gpu = -1  # an attribute count whose points name no GPU (a NIC's hw.errors points)
        for p in number_points(m):
            kvs = p.attributes
            if len(kvs) == no_gpu:
                continue
            value = point_value(p)
            # An inactive clock-event reason says only that its GPU reports: its index is all that is read.
            attrs = pick(name, "gpu", kvs, _GPU_KEYS if clock and value < 1 else wanted, I.GPU_INDEX)
            index = attrs.get(I.GPU_INDEX)
            if index is None:
                no_gpu = len(kvs)
                continue
            key = str(index)
            t = _seconds(p.time_unix_nano) or self._clock()
            sample = gpus.get(key)
            if sample is None:
                sample = gpus[key] = GpuSample(host, key, t, uuid=attrs.get(I.HW_ID))
            if clock:
                if sample.clock_events is None:
                    sample.clock_events = frozenset()
                if value >= 1:
                    sample.clock_events = sample.clock_events | {str(attrs.get(G.CLOCK_EVENT_REASON))}
            elif name == G.ECC_ERRORS.name:
                if attrs.get(G.ERROR_TYPE) == "uncorrected" and attrs.get(G.ECC_COUNTER) != "aggregate":
                    sample.counters["ecc_uncorrected"] = sample.counters.get("ecc_uncorrected", 0.0) + value
            elif name == G.PROCESS_MEMORY.name:
                pid = _int(attrs.get(I.PROCESS_PID))
                if pid is not None:
                    sample.pids = sample.pids + (pid,)
            else:
                counter = _GPU_COUNTERS[name]
                sample.counters[counter] = sample.counters.get(counter, 0.0) + value

    def _nic_metric(self, host: str, m, ports: dict[str, NicSample]) -> None:
        name, pick = m.name, self._layouts.pick
        up = name in _NIC_UP
        for p in number_points(m):
            attrs = pick(name, "nic", p.attributes, _NIC_KEYS)
            counter = None
            if not up:
                # the one copy of its name (every port's series are keyed by it): a counter no rule reads
                # (_evidence keeps only those) or a GPU's point is skipped
                counter = _NIC_NAMES.get(str(attrs.get(G.ERROR_TYPE) or attrs.get(N.COUNTER)))
                if counter is None:
                    continue
            device = attrs.get(N.DEVICE)
            if device is None:
                continue
            port_no = attrs.get(N.PORT)
            key = f"{device}/{port_no}" if port_no is not None else str(device)
            t = _seconds(p.time_unix_nano) or self._clock()
            sample = ports.get(key)
            if sample is None:
                sample = ports[key] = NicSample(host, key, t)
            if up:
                sample.up = point_value(p) >= 1
            else:
                sample.counters[counter] = point_value(p)

    def spans(self, request: ExportTraceServiceRequest, now: float) -> bool:
        """Feeds step, data and checkpoint spans to the engine. Collective spans are only counted per step (their
        time is what separates a straggler's compute from its peers' waiting)."""
        seen_training = False
        step_name, coll_name = T.STEP_SPAN.name, T.COLLECTIVE_SPAN.name
        for rs in request.resource_spans:
            who = None
            for ss in rs.scope_spans:
                for span in ss.spans:
                    name = span.name
                    if name == step_name:
                        if who is None:
                            who = self.view(rs.resource).identity()
                            if who is None:
                                break
                        seen_training = True
                        attrs = attributes_dict(span.attributes)
                        step = _int(attrs.get(T.STEP))
                        if step is None:
                            continue
                        self.engine.observe_step(StepSeen(
                            who, step, _seconds(span.start_time_unix_nano), _seconds(span.end_time_unix_nano),
                            _float(attrs.get(T.STEP_COLLECTIVE_S)), _float(attrs.get(T.STEP_DATA_S)),
                            _float(attrs.get(T.STEP_CHECKPOINT_S))), now)
                    elif name in _SPAN_KINDS:
                        if who is None:
                            who = self.view(rs.resource).identity()
                            if who is None:
                                break
                        seen_training = True
                        self.engine.observe_span(SpanSeen(who, _SPAN_KINDS[name], _seconds(span.start_time_unix_nano),
                                                          _seconds(span.end_time_unix_nano)), now)
                    elif name == coll_name:
                        seen_training = True
        return seen_training

    # -- output --------------------------------------------------------------------------------------------------------
