"""The attribution engine: per-job, per-rank and per-node state, and the detectors that turn it into failure records.

Pure logic with no OTLP and no threads: the processor decodes batches into observations (``_observations``), calls
``observe_*``, and calls :meth:`Engine.tick` with the current time. Every structure is bounded (deques with maxlen,
jobs and nodes evicted when idle), so a long-running collector's memory does not grow with time.

Principles:
- The first cause wins; what follows is a consequence. When rank 3 dies, ranks 0-2 failing in their next collective
  ("connection closed by peer") are consequences and never the culprit.
- Hardware evidence on the culprit's GPU or node (XID, uncorrectable ECC, link down, throttling) outranks the software
  symptom it caused: a hang on a rank whose GPU fell off the bus is gpu_fell_off_bus, not rank_not_in_collective.
- One crash or hang per job incarnation: after a crash the survivors hang, and after a hang the job is killed; both
  are consequences of the first record. A restart (new restart count) re-arms.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.processors.attribution._observations import (ExceptionSeen, ExitSeen, GpuSample, Heartbeat, Identity, NicSample,
                                                  SpanSeen, Stacks, StepSeen, XidSeen)
from otel_gpu.processors.attribution._record import Culprit, FailureRecord, evidence
from otel_gpu.schema.failure import Category, Action, Kind, RootCause

__all__ = ["Engine", "EngineSettings"]

_logger = logging.getLogger(__name__)

# XID codes that mean the GPU (or its memory) failed, per NVIDIA's catalog (REFERENCE.md).
_XID_FELL_OFF_BUS = {79}
_XID_ECC = {48, 94, 95, 63, 64}
_XID_NVLINK = {74}
_XID_FATAL = {31, 43, 45, 46, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 154, 13}
# Exception hints that are what a healthy rank sees when a peer failed: consequences, not causes.
_CONSEQUENCE_HINTS = {"peer_failure", "dist_timeout", "keyboard_interrupt"}
_COMM_HINTS = {"gloo_error", "nccl_error"}
# Signals a launcher (torchrun, Slurm) sends to the survivors after a failure, or a scheduler sends to stop a job.
_STOP_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP"}
# Clock-event reasons (NVML) that point at hardware, by root cause.
_THROTTLE_CAUSES = (
    ({"hw_thermal_slowdown", "sw_thermal_slowdown"}, RootCause.GPU_THERMAL_THROTTLE),
    ({"hw_power_brake_slowdown", "sw_power_cap"}, RootCause.GPU_POWER_THROTTLE),
    ({"hw_slowdown"}, RootCause.GPU_HW_SLOWDOWN),
)
_NIC_ERROR_COUNTERS = ("symbol_error", "link_error_recovery", "port_rcv_errors", "local_link_integrity_errors",
                       "port_rcv_remote_physical_errors", "excessive_buffer_overrun_errors", "rx_errors",
                       "tx_errors", "rx_crc_errors")
_NIC_READ_COUNTERS = frozenset(_NIC_ERROR_COUNTERS + ("link_downed",))
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", "/otel_gpu/instrumentation/")


@dataclass
class EngineSettings:
    hang_timeout_s: float = 15.0
    hang_step_factor: float = 5.0  # the hang timeout is at least this many median step times
    heartbeat_timeout_s: float = 8.0  # a rank silent this long (with others stuck) is treated as gone
    crash_settle_s: float = 1.2
    slowdown_ratio: float = 1.5
    slowdown_min_excess_s: float = 0.05
    slowdown_warmup_steps: int = 5
    slowdown_window: int = 30
    slowdown_confirm: int = 3  # slow steps among the last slowdown_confirm + 1 to declare a slowdown
    checkpoint_stall_s: float = 10.0  # a blocking checkpoint longer than this (and 3x its usual) is a stall
    stack_grace_s: float = 3.0  # how long a hang decision may wait for the culprit's stack
    hardware_lookback_s: float = 120.0
    job_idle_evict_s: float = 3600.0
    max_jobs: int = 1000
    max_ranks_per_job: int = 65536


@dataclass
class _Rank:
    who: Identity
    last_heartbeat: Heartbeat | None = None
    last_seen: float = 0.0
    stacks: Stacks | None = None
    exception: ExceptionSeen | None = None
    exit: ExitSeen | None = None
    # StepSeen. Only the newest is read (_close_steps); a short deque keeps per-rank memory small at aggregator
    # scale (64 per rank held ~100 MB for a 4k-rank job; benchmarks/aggregator_scale.py).
    steps: deque = field(default_factory=lambda: deque(maxlen=2))
    compute_baseline: deque = field(default_factory=lambda: deque(maxlen=32))  # healthy compute seconds
    data_baseline: deque = field(default_factory=lambda: deque(maxlen=32))
    checkpoints: deque = field(default_factory=lambda: deque(maxlen=16))  # durations


@dataclass
class _Job:
    job_id: str
    world_size: int | None = None
    restart_count: int = 0
    ranks: dict[int, _Rank] = field(default_factory=dict)
    last_activity: float = 0.0
    terminal_reported: bool = False  # a crash or hang was reported for this incarnation
    finished: bool = False  # every rank exited 0
    incident_open: float | None = None  # first crash signal time (collector clock)
    incident_deadline: float | None = None
    incident_extended: bool = False
    step_times: dict[int, dict[int, StepSeen]] = field(default_factory=dict)  # step -> rank -> StepSeen
    step_done: deque = field(default_factory=lambda: deque(maxlen=256))  # (step, job step seconds), in order
    baseline: deque = field(default_factory=lambda: deque(maxlen=30))
    slow_flags: deque = field(default_factory=lambda: deque(maxlen=8))
    slow_steps: list = field(default_factory=list)  # steps of the current slowdown episode
    slowdown_active: RootCause | None = None
    last_step_closed: int = -1


@dataclass(slots=True)
class _Series:
    """Cumulative counter samples of one signal, bounded, for "is it rising" questions.

    Only changes are kept: a sample equal to the previous one adds nothing to ``increase`` or
    ``first_increase_time`` (both look at consecutive differences), so dropping it changes no answer, and a healthy
    counter costs one point instead of 256. (Memory at aggregator scale: a node has ~150 counter series; a deque of
    256 per series held ~0.6 KB each even when empty. See benchmarks/aggregator_scale.py.)
    """

    points: list = field(default_factory=list)

    def add(self, t: float, v: float) -> None:
        points = self.points
        if points and points[-1][1] == v:
            return
        if len(points) >= 256:
            del points[0]
        points.append((t, v))

    def increase(self, since: float) -> float:
        """Increase since ``since``, counting resets (a drop) as a new baseline."""
        total, prev = 0.0, None
        for t, v in self.points:
            if prev is not None and t >= since:
                total += v - prev if v >= prev else v
            prev = v
        return total

    def first_increase_time(self, since: float) -> float | None:
        prev = None
        for t, v in self.points:
            if prev is not None and t >= since and v > prev:
                return t
            prev = v
        return None


@dataclass
class _Gpu:
    host: str
    gpu: str
    uuid: str | None = None
    clock_events: frozenset[str] = frozenset()
    clock_events_since: float = 0.0
    counters: dict[str, _Series] = field(default_factory=dict)
    xids: deque = field(default_factory=lambda: deque(maxlen=32))  # XidSeen
    pids: tuple[int, ...] = ()
    last_seen: float = 0.0


@dataclass
class _Port:
    host: str
    port: str
    up: bool | None = None
    down_since: float | None = None
    counters: dict[str, _Series] = field(default_factory=dict)
    last_seen: float = 0.0


def _user_frame(frames: list[dict]) -> dict | None:
    """Innermost frame in the user's code (not a library, not the standard library, not us)."""
    for frame in reversed(frames):
        file = str(frame.get("file", ""))
        if not any(marker in file for marker in _LIBRARY_MARKERS):
            return frame
    return None


def _fmt_frame(frame: dict | None) -> str | None:
    if not frame:
        return None
    return f"{frame.get('file', '?')}:{frame.get('line', '?')} {frame.get('function', '?')}"


class Engine:
    """Keeps state and produces :class:`FailureRecord` objects from :meth:`tick`."""

    def __init__(self, settings: EngineSettings | None = None):
        self.settings = settings or EngineSettings()
        self.jobs: dict[str, _Job] = {}
        self.gpus: dict[tuple[str, str], _Gpu] = {}
        self.ports: dict[tuple[str, str], _Port] = {}
        self._pending: list[FailureRecord] = []

    # -- observations ----------------------------------------------------------------------------------------------
    def _job(self, who: Identity, now: float) -> _Job:
        job = self.jobs.get(who.job_id)
        if job is None:
            if len(self.jobs) >= self.settings.max_jobs:
                oldest = min(self.jobs.values(), key=lambda j: j.last_activity)
                del self.jobs[oldest.job_id]
            job = self.jobs[who.job_id] = _Job(who.job_id, restart_count=who.restart_count)
        if who.restart_count > job.restart_count:
            # A new incarnation after a restart: re-arm crash/hang detection, keep the slowdown baseline.
            job.restart_count = who.restart_count
            job.terminal_reported = job.finished = False
            job.incident_open = job.incident_deadline = None
            job.ranks.clear()
        if who.world_size:
            job.world_size = who.world_size
        job.last_activity = max(job.last_activity, now)
        return job

    def _rank(self, who: Identity, now: float) -> tuple[_Job, _Rank]:
        job = self._job(who, now)
        rank = job.ranks.get(who.rank)
        if rank is None:
            if len(job.ranks) >= self.settings.max_ranks_per_job:
                raise OverflowError("too many ranks")
            rank = job.ranks[who.rank] = _Rank(who)
        elif rank.who != who:
            rank.who = _merge(rank.who, who)
        return job, rank

    def observe_heartbeat(self, hb: Heartbeat, now: float) -> None:
        job, rank = self._rank(hb.who, now)
        if rank.last_heartbeat is None or hb.time >= rank.last_heartbeat.time:
            rank.last_heartbeat = hb
        rank.last_seen = max(rank.last_seen, now)

    def observe_stacks(self, stacks: Stacks, now: float) -> None:
        _, rank = self._rank(stacks.who, now)
        rank.stacks = stacks
        rank.last_seen = max(rank.last_seen, now)

    def observe_exception(self, exc: ExceptionSeen, now: float) -> None:
        job, rank = self._rank(exc.who, now)
        if rank.exception is None:
            rank.exception = exc
        self._open_incident(job, now)

    def observe_exit(self, ex: ExitSeen, now: float) -> None:
        job, rank = self._rank(ex.who, now)
        if rank.exit is None:
            rank.exit = ex
        if ex.code in (0, None) and ex.signal is None:
            if job.world_size and sum(1 for r in job.ranks.values() if r.exit and r.exit.code == 0) >= job.world_size:
                job.finished = True
            return
        self._open_incident(job, now)

    def observe_step(self, step: StepSeen, now: float) -> None:
        job, rank = self._rank(step.who, now)
        rank.steps.append(step)
        rank.last_seen = max(rank.last_seen, now)
        if step.step <= job.last_step_closed:
            return
        job.step_times.setdefault(step.step, {})[step.who.rank] = step
        self._close_steps(job, now)

    def observe_span(self, span: SpanSeen, now: float) -> None:
        job, rank = self._rank(span.who, now)
        if span.kind == "checkpoint_save":
            duration = span.end - span.start
            usual = statistics.median(rank.checkpoints) if rank.checkpoints else None
            rank.checkpoints.append(duration)
            stall = duration > self.settings.checkpoint_stall_s and (usual is None or duration > 3 * usual)
            if stall and not job.terminal_reported:
                rec = self._record(job, Kind.SLOWDOWN, RootCause.CHECKPOINT_STALL, span.start, now, 0.8,
                                   Culprit(rank.who.rank, rank.who.host, rank.who.gpu),
                                   [evidence("otel_gpu.checkpoint.save.duration_s", round(duration, 2), span.start)]
                                   + ([evidence("usual_checkpoint_s", round(usual, 2))] if usual else []),
                                   f"a blocking checkpoint save on rank {rank.who.rank} took {duration:.1f} s",
                                   {"reason": "checkpoint_save"})
                self._pending.append(rec)

    def observe_gpu(self, sample: GpuSample) -> None:
        key = (sample.host, sample.gpu)
        gpu = self.gpus.get(key)
        if gpu is None:
            gpu = self.gpus[key] = _Gpu(sample.host, sample.gpu)
        gpu.uuid = sample.uuid or gpu.uuid
        gpu.last_seen = sample.time
        if sample.clock_events is not None and sample.clock_events != gpu.clock_events:
            gpu.clock_events = sample.clock_events
            gpu.clock_events_since = sample.time
        for name, value in sample.counters.items():
            gpu.counters.setdefault(name, _Series()).add(sample.time, value)
        if sample.pids:
            gpu.pids = sample.pids

    def observe_xid(self, xid: XidSeen) -> None:
        gpu_id = xid.gpu if xid.gpu is not None else "?"
        key = (xid.host, gpu_id)
        gpu = self.gpus.get(key)
        if gpu is None:
            gpu = self.gpus[key] = _Gpu(xid.host, gpu_id)
        gpu.xids.append(xid)

    def observe_nic(self, sample: NicSample) -> None:
        key = (sample.host, sample.port)
        port = self.ports.get(key)
        if port is None:
            port = self.ports[key] = _Port(sample.host, sample.port)
        port.last_seen = sample.time
        if sample.up is not None:
            if port.up is not False and sample.up is False:
                port.down_since = sample.time
            if sample.up:
                port.down_since = None
            port.up = sample.up
        for name, value in sample.counters.items():
            if name in _NIC_READ_COUNTERS:  # only the counters _nic_fault reads are kept (memory at scale)
                port.counters.setdefault(name, _Series()).add(sample.time, value)

    # -- hardware questions ----------------------------------------------------------------------------------------
    def _rank_gpu(self, who: Identity, host_gpus: list[_Gpu] | None = None) -> _Gpu | None:
        """The GPU a rank uses: by pid (NVML process list), else CUDA device index, else local rank. ``host_gpus``:
        the GPUs of ``who.host`` when the caller has them at hand."""
        if who.host is None:
            return None
        candidates = host_gpus if host_gpus is not None else [g for (host, _), g in self.gpus.items()
                                                              if host == who.host]
        if who.pid is not None:
            for g in candidates:
                if who.pid in g.pids:
                    return g
        index = who.gpu if who.gpu is not None else (str(who.local_rank) if who.local_rank is not None else None)
        return self.gpus.get((who.host, index)) if index is not None else None

    def _gpu_fault(self, gpu: _Gpu, since: float) -> tuple[RootCause, float, list[str], dict] | None:
        """An XID or uncorrectable-ECC fault on ``gpu`` since ``since``: (cause, onset, evidence, details)."""
        for xid in gpu.xids:
            if xid.time >= since and xid.code in _XID_FATAL:
                if xid.code in _XID_FELL_OFF_BUS:
                    cause = RootCause.GPU_FELL_OFF_BUS
                elif xid.code in _XID_ECC:
                    cause = RootCause.GPU_ECC_UNCORRECTABLE
                elif xid.code in _XID_NVLINK:
                    cause = RootCause.NVLINK_ERROR
                else:
                    cause = RootCause.GPU_XID
                return cause, xid.time, [evidence("gpu.xid", xid.code, xid.time)], {"xid": xid.code}
        for name in ("ecc_uncorrected", "row_remap_failure"):
            series = gpu.counters.get(name)
            if series is not None and series.increase(since) > 0:
                t = series.first_increase_time(since) or since
                return (RootCause.GPU_ECC_UNCORRECTABLE, t,
                        [evidence(f"gpu.{name}", f"+{series.increase(since):g}", t)], {"reason": name})
        return None

    def _throttle(self, gpu: _Gpu) -> tuple[RootCause, float, list[str], dict] | None:
        for reasons, cause in _THROTTLE_CAUSES:
            active = gpu.clock_events & reasons
            if active:
                name = sorted(active)[0]
                return (cause, gpu.clock_events_since, [evidence("gpu.clock_event", name, gpu.clock_events_since)],
                        {"reason": name})
        for name, cause in (("nvlink_errors", RootCause.NVLINK_ERROR), ("pcie_replay", RootCause.PCIE_ERROR)):
            series = gpu.counters.get(name)
            if series is not None and series.increase(gpu.last_seen - 30) > 0:
                t = series.first_increase_time(gpu.last_seen - 30) or gpu.last_seen
                return cause, t, [evidence(f"gpu.{name}", f"+{series.increase(gpu.last_seen - 30):g}", t)], \
                    {"reason": name}
        return None

    def _nic_fault(self, host: str, since: float, *, errors_window_s: float = 30.0,
                   host_ports: list[_Port] | None = None):
        """Link down since ``since`` (any port of host), or error counters rising in the last window. ``host_ports``:
        the ports of ``host`` when the caller has them at hand."""
        if host_ports is None:
            host_ports = [p for (h, _), p in self.ports.items() if h == host]
        for port in host_ports:
            name = port.port
            if port.up is False and port.down_since is not None:
                return (RootCause.NIC_LINK_DOWN, port.down_since, [evidence(f"nic.{name}.state", "down",
                                                                            port.down_since)], {"reason": "link_down"})
            downed = port.counters.get("link_downed")
            if downed is not None and downed.increase(since) > 0:
                t = downed.first_increase_time(since) or since
                return (RootCause.NIC_LINK_DOWN, t, [evidence(f"nic.{name}.link_downed", f"+{downed.increase(since):g}",
                                                              t)], {"reason": "link_downed"})
        for port in host_ports:
            name = port.port
            for counter in _NIC_ERROR_COUNTERS:
                series = port.counters.get(counter)
                if series is None:
                    continue
                window_start = max(since, port.last_seen - errors_window_s)
                rise = series.increase(window_start)
                if rise > 0:
                    t = series.first_increase_time(window_start) or window_start
                    return (RootCause.NIC_ERRORS, t, [evidence(f"nic.{name}.{counter}", f"+{rise:g}", t)],
                            {"reason": counter})
        return None

    def _hardware_for(self, ranks: list[_Rank], since: float, *, include_throttle: bool = False):
        """First hardware or network fault on the GPUs/nodes of ``ranks``: (rank, cause, onset, evidence, details)."""
        found = []
        # Performance (aggregator scale, benchmarks/aggregator_scale.py): index GPUs and ports by host once and ask
        # each host's NICs once, rather than scanning every GPU and port of the cluster for every rank, which made a
        # hang tick of a 16k-rank job O(ranks x nodes).
        gpus_by_host: dict[str, list[_Gpu]] = {}
        for (host, _), g in self.gpus.items():
            gpus_by_host.setdefault(host, []).append(g)
        ports_by_host: dict[str, list[_Port]] = {}
        for (host, _), p in self.ports.items():
            ports_by_host.setdefault(host, []).append(p)
        nic_by_host: dict[str, Any] = {}
        for rank in ranks:
            gpu = self._rank_gpu(rank.who, gpus_by_host.get(rank.who.host, []))
            if gpu is not None:
                fault = self._gpu_fault(gpu, since) or (self._throttle(gpu) if include_throttle else None)
                if fault:
                    found.append((fault[1], rank, fault, gpu))
            if rank.who.host:
                host = rank.who.host
                if host not in nic_by_host:
                    nic_by_host[host] = self._nic_fault(host, since, host_ports=ports_by_host.get(host, []))
                fault = nic_by_host[host]
                if fault:
                    found.append((fault[1], rank, fault, None))
        if not found:
            return None
        found.sort(key=lambda item: item[0])
        _, rank, (cause, onset, ev, details), gpu = found[0]
        gpu_name = None if gpu is None else (gpu.uuid or gpu.gpu)
        return rank, cause, onset, ev, details, gpu_name

    # -- records -----------------------------------------------------------------------------------------------------
    def _record(self, job: _Job, kind: Kind, cause: RootCause, onset: float, now: float, confidence: float,
                culprit: Culprit, ev: list[str], summary: str, details: dict | None = None,
                category: Category | None = None, action: Action | None = None) -> FailureRecord:
        auto = None if action is None else action in (Action.AUTO_RESTART, Action.EXCLUDE_NODE_AND_RESTART)
        return FailureRecord(kind=kind, root_cause=cause, job_id=job.job_id, onset_time=onset, detected_time=now,
                             confidence=confidence, culprit=culprit, evidence=ev[:12], summary=summary,
                             details=details or {}, category=category, action=action, auto_remediable=auto)

    def _culprit(self, rank: _Rank, gpu: str | None = None) -> Culprit:
        if gpu is None:
            g = self._rank_gpu(rank.who)
            gpu = None if g is None else (g.uuid or g.gpu)
        return Culprit(rank.who.rank, rank.who.host, gpu if gpu is not None else rank.who.gpu)

    # -- crash ---------------------------------------------------------------------------------------------------------
    def _open_incident(self, job: _Job, now: float) -> None:
        if job.terminal_reported or job.incident_open is not None:
            return
        job.incident_open = now
        job.incident_deadline = now + self.settings.crash_settle_s

    def _decide_crash(self, job: _Job, now: float) -> FailureRecord | None:
        ranks = list(job.ranks.values())
        failed = [r for r in ranks if r.exception or (r.exit and (r.exit.code not in (0, None) or r.exit.signal))]
        if not failed:
            return None
        first_time = min(min((r.exception.time for r in failed if r.exception), default=now),
                         min((r.exit.time for r in failed if r.exit), default=now))
        hw = self._hardware_for(failed, first_time - self.settings.hardware_lookback_s)
        if hw is not None:
            rank, cause, onset, ev, details, gpu = hw
            return self._record(job, Kind.CRASH, cause, min(onset, first_time), now, 0.9, self._culprit(rank, gpu),
                                ev + self._crash_evidence(rank), self._hw_summary(cause, rank, details), details)
        primaries: list[tuple[float, _Rank, RootCause, list[str], dict, str]] = []
        consequences: list[_Rank] = []
        for r in failed:
            exc = r.exception
            if exc is not None and exc.hint not in _CONSEQUENCE_HINTS and not (
                    exc.hint in _COMM_HINTS and len(failed) > 1):
                cause = RootCause.CUDA_OOM if exc.hint == "cuda_oom" else RootCause.PYTHON_EXCEPTION
                summary = f"rank {r.who.rank} raised {exc.type}: {exc.message[:160]}"
                details = {"exception_type": exc.type, "stack_top": _last_line_of(exc.stack)}
                primaries.append((exc.time, r, cause, [evidence("exception.type", exc.type, exc.time),
                                                       evidence("exception.hint", exc.hint, exc.time)], details,
                                  summary))
            elif exc is None and r.exit is not None and r.exit.signal in _STOP_SIGNALS and any(
                    x is not r and (x.exception or (x.exit and x.exit.signal not in _STOP_SIGNALS)) for x in failed):
                consequences.append(r)  # the launcher stops the survivors once one rank failed
            elif exc is None and r.exit is not None and r.exit.signal in _STOP_SIGNALS and len(failed) > 1 and all(
                    x.exception is None and x.exit is not None and x.exit.signal in _STOP_SIGNALS for x in failed):
                consequences.append(r)  # the whole job was stopped (scheduler, Ctrl-C): not a crash
            elif exc is None and r.exit is not None:
                how = f"was killed by {r.exit.signal}" if r.exit.signal else f"exited with code {r.exit.code}"
                summary = f"rank {r.who.rank} {how} without raising an exception"
                if r.exit.signal == "SIGKILL":
                    summary += " (the OOM killer or an external kill)"
                primaries.append((r.exit.time, r, RootCause.RANK_PROCESS_DIED,
                                  [evidence("process.exit.signal" if r.exit.signal else "process.exit.code",
                                            r.exit.signal or r.exit.code, r.exit.time)],
                                  {"signal": r.exit.signal or f"exit:{r.exit.code}"}, summary))
            else:
                consequences.append(r)
        if not primaries and consequences and all(
                c.exception is None and c.exit is not None and c.exit.signal in _STOP_SIGNALS for c in consequences):
            return None
        if not primaries:
            # Everyone who failed blames a peer: the culprit is the rank that went silent (or never failed).
            silent = [r for r in ranks if r not in failed and r.last_seen < now - self.settings.heartbeat_timeout_s]
            missing = self._missing_ranks(job)
            if silent or missing:
                if silent:
                    r = min(silent, key=lambda x: x.last_seen)
                    culprit = self._culprit(r)
                    ev = [evidence("otel_gpu.progress.last_seen", round(r.last_seen, 3))]
                    who = f"rank {r.who.rank}"
                else:
                    culprit, ev, who = Culprit(missing[0], None, None), [], f"rank {missing[0]}"
                ev += [evidence("peer_failure_on_ranks", ",".join(str(c.who.rank) for c in consequences))]
                return self._record(job, Kind.CRASH, RootCause.RANK_PROCESS_DIED, first_time, now, 0.6, culprit, ev,
                                    f"{who} went away; the others failed in their next collective", {})
            r = min(consequences, key=lambda x: x.exception.time if x.exception else now)
            exc = r.exception
            return self._record(job, Kind.CRASH, RootCause.UNKNOWN, first_time, now, 0.3, self._culprit(r),
                                [evidence("exception.type", exc.type if exc else "?")],
                                "ranks failed with communication errors; no first cause found", {})
        primaries.sort(key=lambda p: p[0])
        t, r, cause, ev, details, summary = primaries[0]
        if consequences:
            ev.append(evidence("consequence_ranks", ",".join(str(c.who.rank) for c in consequences)))
        confidence = 0.95 if len(primaries) == 1 else 0.8
        return self._record(job, Kind.CRASH, cause, t, now, confidence, self._culprit(r), ev, summary, details)

    def _crash_evidence(self, rank: _Rank) -> list[str]:
        if rank.exception:
            return [evidence("exception.type", rank.exception.type, rank.exception.time)]
        if rank.exit:
            return [evidence("process.exit", rank.exit.signal or rank.exit.code, rank.exit.time)]
        return []

    @staticmethod
    def _hw_summary(cause: RootCause, rank: _Rank, details: dict) -> str:
        what = {RootCause.GPU_FELL_OFF_BUS: "its GPU fell off the bus (XID 79)",
                RootCause.GPU_ECC_UNCORRECTABLE: "its GPU reported an uncorrectable ECC error",
                RootCause.NVLINK_ERROR: "its GPU's NVLink failed",
                RootCause.NIC_LINK_DOWN: "its node's network link went down",
                RootCause.NIC_ERRORS: "its node's network link is logging errors",
                RootCause.GPU_XID: f"its GPU raised XID {details.get('xid')}"}.get(cause, cause.value)
        return f"rank {rank.who.rank} on {rank.who.host}: {what}"

    def _missing_ranks(self, job: _Job) -> list[int]:
        if not job.world_size:
            return []
        return [r for r in range(job.world_size) if r not in job.ranks]

    # -- hang ----------------------------------------------------------------------------------------------------------
    def hang_timeout(self, job: _Job) -> float:
        recent = [d for _, d in list(job.step_done)[-20:]]
        if recent:
            return max(self.settings.hang_timeout_s, self.settings.hang_step_factor * statistics.median(recent))
        return self.settings.hang_timeout_s

    @staticmethod
    def _stalled_for(r: _Rank, now: float) -> float:
        """How long the rank has made no progress: its watchdog's own count (stalled_s) or the age of its in-flight
        operation, plus the time since that heartbeat arrived."""
        hb = r.last_heartbeat
        if hb is None:
            return 0.0
        own = hb.stalled_s if hb.stalled_s is not None else 0.0
        if hb.inflight is not None:
            own = max(own, hb.time - hb.inflight.since)
        return own + max(0.0, now - r.last_seen)

    def _decide_hang(self, job: _Job, now: float) -> FailureRecord | None:
        timeout = self.hang_timeout(job)
        live = [r for r in job.ranks.values() if r.exit is None and r.last_heartbeat is not None]
        hung = [r for r in live if self._stalled_for(r, now) >= timeout]
        if not hung:
            return None
        # Where each rank is in each process group: the highest collective it started (heartbeat counters, or the
        # one it reports in flight). The front of a group is the highest any rank reached; a rank below the front
        # never reached that collective. (A rank reporting an older collective of the group as in flight has in fact
        # finished it: its peers could not have started the next one otherwise. Gloo's flight recorder never marks
        # completion, so this happens.)
        started: dict[str, dict[int, int]] = {}
        for r in live:
            hb = r.last_heartbeat
            for pg, seq in hb.last_started_seq.items():
                started.setdefault(pg, {})[r.who.rank] = seq
            if hb.inflight and hb.inflight.kind == "collective" and hb.inflight.seq is not None \
                    and hb.inflight.pg is not None:
                row = started.setdefault(hb.inflight.pg, {})
                row[r.who.rank] = max(row.get(r.who.rank, 0), hb.inflight.seq)
        pg, seq, behind_nos = None, None, []
        for name, row in sorted(started.items(), key=lambda kv: -max(kv[1].values())):
            front = max(row.values())
            lagging = [rank for rank, s_ in row.items() if s_ < front]
            lagging += [r.who.rank for r in live if r.who.rank not in row and name == "0"]
            if lagging:
                pg, seq, behind_nos = name, front, lagging
                break
        at_front = [r for r in live if pg is not None and started[pg].get(r.who.rank) == seq]
        waiting = [r for r in (at_front or hung) if self._stalled_for(r, now) >= timeout]
        if pg is not None and not waiting:
            return None
        dead_or_silent = [r for r in job.ranks.values() if r.exit is not None
                          or r.last_seen < now - self.settings.heartbeat_timeout_s]
        behind = [job.ranks[n] for n in behind_nos if n in job.ranks] + [r for r in dead_or_silent
                                                                          if r.who.rank not in behind_nos]
        reference = waiting or hung
        onset_rank = max(reference, key=lambda r: self._stalled_for(r, now))
        onset = now - self._stalled_for(onset_rank, now)
        ops = [r.last_heartbeat.inflight.op for r in reference
               if r.last_heartbeat.inflight and r.last_heartbeat.inflight.kind == "collective"]
        op = max(set(ops), key=ops.count) if ops else None
        if op is None and pg is None:
            # No group disagrees: the ranks stand in one place. Data or checkpoint stalls show as what is in flight.
            infl = [(r, r.last_heartbeat.inflight) for r in hung if r.last_heartbeat.inflight is not None]
            non_coll = [(r, i) for r, i in infl if i.kind in ("data", "checkpoint")]
            if non_coll:
                r, i = non_coll[0]
                cause = RootCause.CHECKPOINT_STALL if i.kind == "checkpoint" else RootCause.DATALOADER_STALL
                hw = self._hardware_for([r], i.since - self.settings.hardware_lookback_s)
                if hw:
                    return self._hang_hw(job, hw, i.since, now)
                return self._record(job, Kind.HANG, cause, i.since, now, 0.8, self._culprit(r),
                                    [evidence("training.state", i.kind, i.since),
                                     evidence("training.inflight.duration", round(now - i.since, 1))],
                                    f"rank {r.who.rank} has been in {i.kind} for {now - i.since:.0f} s",
                                    {"reason": i.kind, "stack_top": self._stack_top(r)})
            coll = [(r, i) for r, i in infl if i.kind == "collective"]
            if coll:
                pg, seq = coll[0][1].pg, coll[0][1].seq
                op = coll[0][1].op
        if pg is None:
            # Every rank is at the same place in every group: name the collective they are in.
            for r in hung:
                i = r.last_heartbeat.inflight
                if i is not None and i.kind == "collective" and i.pg is not None:
                    pg, seq = i.pg, i.seq
                    break
        if pg is None and not behind and len(hung) < len(live):
            return None  # some ranks still progress: not a job-wide hang (yet)
        lookback = onset - self.settings.hardware_lookback_s
        hw = self._hardware_for(behind + (at_front or hung), lookback)
        if hw is not None:
            return self._hang_hw(job, hw, onset, now, op, seq)
        what = f"{op or 'collective'} seq {seq}" if seq is not None else (op or "a collective")
        base_ev = [evidence("stuck_ranks", ",".join(str(r.who.rank) for r in sorted(reference, key=_rank_no))),
                   evidence("collective", f"{op or '?'} pg={pg} seq={seq}", onset),
                   evidence("hang_timeout_s", round(timeout, 1))]
        if behind:
            behind.sort(key=lambda r: (started.get(pg, {}).get(r.who.rank, -1), r.who.rank))
            culprit = behind[0]
            hb = culprit.last_heartbeat
            silent = culprit.last_seen < now - self.settings.heartbeat_timeout_s
            if self._fresh_stacks(culprit, onset) is None:
                culprit_stacks, culprit.stacks = culprit.stacks, None  # a stale capture must not decide
                if not silent and culprit.exit is None and now < onset + timeout + self.settings.stack_grace_s:
                    culprit.stacks = culprit_stacks
                    return None  # its watchdog sends the stack soon: where it is decides user vs software
                return None  # its watchdog sends the stack soon: where it is decides user vs software
            where = self._stack_top(culprit)
            state = hb.state if hb else None
            ev = list(base_ev)
            if hb:
                ev.append(evidence(f"rank{culprit.who.rank}.last_started_seq", started.get(pg, {}).get(
                    culprit.who.rank, 0), hb.time))
                if hb.inflight is not None and hb.inflight.kind != "collective":
                    state = hb.inflight.kind
            if silent:
                ev.append(evidence(f"rank{culprit.who.rank}.last_heartbeat", round(culprit.last_seen, 3)))
            if where:
                ev.append(evidence(f"rank{culprit.who.rank}.stack", where))
            cause, category, action = RootCause.RANK_NOT_IN_COLLECTIVE, None, None
            if state == "data":
                cause = RootCause.DATALOADER_STALL
            elif state == "checkpoint":
                cause = RootCause.CHECKPOINT_STALL
            else:
                category, action = self._category_by_stack(culprit)
            others = [r.who.rank for r in behind[1:]]
            summary = (f"rank {culprit.who.rank} never reached {what} (pg {pg}); "
                       f"{len(reference)} rank(s) wait in it" + (f"; it is at {where}" if where else "")
                       + (f"; it has sent no heartbeat for {now - culprit.last_seen:.0f} s" if silent else "")
                       + (f"; ranks {others} are behind too" if others else ""))
            confidence = 0.9 if len(behind) == 1 else 0.7
            return self._record(job, Kind.HANG, cause, onset, now, confidence, self._culprit(culprit), ev, summary,
                                {"op": op, "pg": pg, "seq": seq, "stack_top": where, "reason": state,
                                 "waiting": self._waiting(reference, now, op, pg, seq)},
                                category=category, action=action)
        never_seen = sorted((set(range(job.world_size)) if job.world_size else set()) - set(job.ranks))
        if never_seen:
            return self._record(job, Kind.HANG, RootCause.RANK_NOT_IN_COLLECTIVE, onset, now, 0.6,
                                Culprit(never_seen[0], None, None), base_ev,
                                f"rank {never_seen[0]} never reported; the others wait in {what}",
                                {"op": op, "pg": pg, "seq": seq})
        in_coll = [r for r in hung if r.last_heartbeat.inflight and r.last_heartbeat.inflight.kind == "collective"]
        sigs = {(r.last_heartbeat.inflight.op, r.last_heartbeat.inflight.bytes) for r in in_coll}
        if len(sigs) > 1:
            by_sig: dict[tuple, list[int]] = {}
            for r in in_coll:
                i = r.last_heartbeat.inflight
                by_sig.setdefault((i.op, i.bytes), []).append(r.who.rank)
            for ranks_ in by_sig.values():
                ranks_.sort()
            minority = min(by_sig.values(), key=len)
            odd = job.ranks[minority[0]]
            ev = base_ev + [evidence(f"ranks{','.join(map(str, ranks))}", f"{sig[0]} bytes={sig[1]}")
                            for sig, ranks in sorted(by_sig.items(), key=lambda kv: kv[1])]
            return self._record(job, Kind.HANG, RootCause.COLLECTIVE_MISMATCH, onset, now, 0.85, self._culprit(odd),
                                ev, f"ranks called different collectives at seq {seq} (pg {pg}): " + "; ".join(
                                    f"ranks {ranks}: {sig[0]}" + (f" ({sig[1]} bytes)" if sig[1] else "")
                                    for sig, ranks in by_sig.items()),
                                {"op": "/".join(sorted(str(x[0]) for x in by_sig)), "pg": pg, "seq": seq})
        return self._record(job, Kind.HANG, RootCause.UNKNOWN, onset, now, 0.4, Culprit(), base_ev,
                            f"every rank waits in {what} and no hardware or network fault was seen",
                            {"op": op, "pg": pg, "seq": seq})

    def _waiting(self, ranks: list[_Rank], now: float, op, pg, seq, limit: int = 64) -> list[dict]:
        """The ranks that wait in the hung collective (at most ``limit``), for the stuck-collective spans."""
        out = []
        for r in sorted(ranks, key=_rank_no)[:limit]:
            out.append({"rank": r.who.rank, "host": r.who.host, "since": round(now - self._stalled_for(r, now), 3),
                        "op": op, "pg": pg, "seq": seq})
        return out

    def _hang_hw(self, job: _Job, hw, onset: float, now: float, op=None, seq=None) -> FailureRecord:
        rank, cause, hw_onset, ev, details, gpu = hw
        details = dict(details, op=op, seq=seq)
        return self._record(job, Kind.HANG, cause, min(onset, hw_onset), now, 0.85, self._culprit(rank, gpu),
                            ev + [evidence("collective", f"{op} seq={seq}", onset)] if op else ev,
                            self._hw_summary(cause, rank, details) + (f"; the job hangs in {op} seq {seq}" if op else ""),
                            details)

    def _fresh_stacks(self, rank: _Rank, onset: float) -> Stacks | None:
        """The rank's latest stacks, when taken after ``onset`` (an older capture shows where it was, not is)."""
        return rank.stacks if rank.stacks is not None and rank.stacks.time >= onset else None

    def _stack_top(self, rank: _Rank) -> str | None:
        if rank.stacks is not None:
            return _fmt_frame(_user_frame(rank.stacks.frames)) or rank.stacks.top
        hb = rank.last_heartbeat
        return hb.stack_top if hb else None

    def _category_by_stack(self, rank: _Rank) -> tuple[Category, Action]:
        """User code at the top of the culprit's stack: the user must fix it. Otherwise (inside a library, or no stack)
        it is a software fault that a restart usually clears."""
        frames = rank.stacks.frames if rank.stacks else []
        if frames:
            innermost = frames[-1]
            user = _user_frame(frames)
            if user is not None and (user is innermost or _is_blocking_stdlib(innermost)):
                return Category.USER, Action.USER_FIX
            return Category.SOFTWARE, Action.AUTO_RESTART
        hb = rank.last_heartbeat
        if hb and hb.stack_top and not any(m in hb.stack_top for m in _LIBRARY_MARKERS):
            return Category.USER, Action.USER_FIX
        return Category.SOFTWARE, Action.AUTO_RESTART

    # -- slowdown ------------------------------------------------------------------------------------------------------
    def _close_steps(self, job: _Job, now: float) -> None:
        """A step is closed once every rank reported it (or a later step arrived from every reporting rank)."""
        expected = job.world_size or len(job.ranks)
        for step in sorted(job.step_times):
            per_rank = job.step_times[step]
            newer = all(r.steps and r.steps[-1].step > step for r in job.ranks.values() if r.exit is None)
            if len(per_rank) < expected and not newer:
                break
            del job.step_times[step]
            job.last_step_closed = step
            self._evaluate_step(job, step, per_rank, now)

    def _evaluate_step(self, job: _Job, step: int, per_rank: dict[int, StepSeen], now: float) -> None:
        s = self.settings
        duration = max(x.duration for x in per_rank.values())
        job.step_done.append((step, duration))
        if len(job.step_done) <= s.slowdown_warmup_steps:
            return
        if len(job.baseline) < 5:
            job.baseline.append(duration)
            self._learn_rank_baselines(job, per_rank)
            return
        base = statistics.median(job.baseline)
        mad = statistics.median(abs(d - base) for d in job.baseline)
        limit = max(base * s.slowdown_ratio, base + s.slowdown_min_excess_s, base + 6 * 1.4826 * mad)
        slow = duration > limit
        job.slow_flags.append(slow)
        if not slow:
            job.baseline.append(duration)
            self._learn_rank_baselines(job, per_rank)
            if job.slowdown_active is not None and not any(list(job.slow_flags)[-s.slowdown_confirm:]):
                job.slowdown_active = None  # recovered: a later slowdown is a new record
                job.slow_steps.clear()
            if not job.slowdown_active:
                job.slow_steps.clear()
            return
        job.slow_steps.append((step, per_rank))
        # Bounded: only the last slowdown_confirm + 2 are read (_attribute_slowdown), and each holds one StepSeen per
        # rank, so a long slowdown of a 16k-rank job would otherwise grow without limit.
        del job.slow_steps[:-(s.slowdown_confirm + 2)]
        recent = list(job.slow_flags)[-(s.slowdown_confirm + 1):]
        if job.slowdown_active is None and sum(recent) >= s.slowdown_confirm and not job.terminal_reported:
            record = self._attribute_slowdown(job, base, now)
            job.slowdown_active = record.root_cause
            self._pending.append(record)

    def _learn_rank_baselines(self, job: _Job, per_rank: dict[int, StepSeen]) -> None:
        for rank_no, st in per_rank.items():
            rank = job.ranks.get(rank_no)
            if rank is None:
                continue
            compute = _compute_s(st)
            if compute is not None:
                rank.compute_baseline.append(compute)
            if st.data_s is not None:
                rank.data_baseline.append(st.data_s)

    def _attribute_slowdown(self, job: _Job, base: float, now: float) -> FailureRecord:
        episode = job.slow_steps[-(self.settings.slowdown_confirm + 2):]
        onset_step, first = episode[0]
        onset = min(x.start for x in first.values())
        slow_duration = statistics.median(max(x.duration for x in pr.values()) for _, pr in episode)
        ev = [evidence("otel_gpu.step.duration", f"{slow_duration:.3f}s vs baseline {base:.3f}s", onset),
              evidence("first_slow_step", onset_step)]
        # Which rank's own work grew: compute (straggler) or data loading; collective time grows on the others.
        growth: dict[int, tuple[float, float]] = {}
        for rank_no, rank in job.ranks.items():
            computes = [_compute_s(pr[rank_no]) for _, pr in episode if rank_no in pr]
            datas = [pr[rank_no].data_s for _, pr in episode if rank_no in pr and pr[rank_no].data_s is not None]
            c_base = statistics.median(rank.compute_baseline) if rank.compute_baseline else None
            d_base = statistics.median(rank.data_baseline) if rank.data_baseline else None
            dc = statistics.median(computes) - c_base if computes and None not in computes and c_base is not None \
                else 0.0
            dd = statistics.median(datas) - d_base if datas and d_base is not None else 0.0
            growth[rank_no] = (dc, dd)
        culprit_rank, kind_of = None, None
        if growth:
            excess = slow_duration - base
            rank_no, (dc, dd) = max(growth.items(), key=lambda kv: max(kv[1]))
            others = sorted(max(g) for r, g in growth.items() if r != rank_no)
            runner_up = others[-1] if others else 0.0
            if max(dc, dd) > 0.5 * excess and max(dc, dd) > 2 * max(runner_up, 0.0) + 0.01:
                culprit_rank, kind_of = rank_no, ("data" if dd > dc else "compute")
                ev.append(evidence(f"rank{rank_no}.{kind_of}_s_increase", f"{max(dc, dd):.3f}"))
            elif all(dd > 0.5 * excess for _, (dc_, dd) in growth.items()):
                kind_of = "data_all"
        ranks = list(job.ranks.values())
        suspects = [job.ranks[culprit_rank]] if culprit_rank is not None else ranks
        hw = self._hardware_for(suspects, onset - self.settings.hardware_lookback_s, include_throttle=True)
        if hw is not None:
            rank, cause, hw_onset, hw_ev, details, gpu = hw
            return self._record(job, Kind.SLOWDOWN, cause, onset, now, 0.85, self._culprit(rank, gpu), hw_ev + ev,
                                self._hw_summary_slow(cause, rank, details, slow_duration, base), details)
        if kind_of == "data" or kind_of == "data_all":
            rank = job.ranks[culprit_rank] if culprit_rank is not None else None
            return self._record(job, Kind.SLOWDOWN, RootCause.DATALOADER_STALL, onset, now, 0.8,
                                self._culprit(rank) if rank else Culprit(), ev,
                                f"steps take {slow_duration:.2f} s instead of {base:.2f} s: "
                                + (f"rank {rank.who.rank} waits for data" if rank else "every rank waits for data"),
                                {"reason": "data"})
        if kind_of == "compute":
            rank = job.ranks[culprit_rank]
            return self._record(job, Kind.SLOWDOWN, RootCause.STRAGGLER_COMPUTE, onset, now, 0.8,
                                self._culprit(rank), ev,
                                f"steps take {slow_duration:.2f} s instead of {base:.2f} s: rank {rank.who.rank} "
                                f"computes slower than its peers, with no hardware signal", {"reason": "compute"})
        # Collective time grew everywhere: look for a network or interconnect fault anywhere in the job.
        return self._record(job, Kind.SLOWDOWN, RootCause.UNKNOWN, onset, now, 0.4, Culprit(), ev,
                            f"steps take {slow_duration:.2f} s instead of {base:.2f} s; no rank, device or link "
                            f"stands out", {"reason": "unexplained"})

    @staticmethod
    def _hw_summary_slow(cause: RootCause, rank: _Rank, details: dict, slow: float, base: float) -> str:
        what = {RootCause.GPU_THERMAL_THROTTLE: "its GPU is thermally throttled",
                RootCause.GPU_POWER_THROTTLE: "its GPU is power-capped",
                RootCause.GPU_HW_SLOWDOWN: "its GPU is in hardware slowdown",
                RootCause.NIC_ERRORS: f"its node's NIC is logging {details.get('reason', 'errors')}",
                RootCause.NIC_LINK_DOWN: "its node's network link went down",
                RootCause.NVLINK_ERROR: "NVLink errors are rising on its GPU",
                RootCause.PCIE_ERROR: "PCIe replays are rising on its GPU"}.get(cause, cause.value)
        return f"steps take {slow:.2f} s instead of {base:.2f} s: rank {rank.who.rank} on {rank.who.host}: {what}"

    # -- driving -------------------------------------------------------------------------------------------------------
    def tick(self, now: float) -> list[FailureRecord]:
        """Runs the time-driven detectors; returns new failure records (each reported once)."""
        out, self._pending = self._pending, []
        for job in list(self.jobs.values()):
            if job.last_activity < now - self.settings.job_idle_evict_s:
                del self.jobs[job.job_id]
                continue
            if job.terminal_reported or job.finished:
                continue
            record = None
            if job.incident_open is not None:
                if now >= job.incident_deadline:
                    record = self._decide_crash(job, now)
                    if record is None:
                        job.finished = True  # stopped on purpose (every rank got SIGTERM/SIGINT): nothing to name
                        continue
                    unexplained = record.root_cause in (RootCause.UNKNOWN,)
                    if unexplained and not job.incident_extended:
                        job.incident_extended = True  # wait once more for the exit of the rank that died
                        job.incident_deadline = now + self.settings.crash_settle_s
                        record = None
            else:
                record = self._decide_hang(job, now)
                if record is None:
                    record = self._decide_silent_rank(job, now)
            if record is not None:
                job.terminal_reported = True
                out.append(record)
        self._evict_hardware(now)
        return out

    def _decide_silent_rank(self, job: _Job, now: float) -> FailureRecord | None:
        """A rank whose heartbeats stopped while its peers still report: its process died without anyone telling us
        (no launcher), or it is frozen. Treated as a crash when the peers are stuck waiting or failing."""
        if not job.ranks or len(job.ranks) < 2:
            return None
        silent = [r for r in job.ranks.values() if r.last_heartbeat is not None and r.exit is None
                  and r.last_seen < now - self.settings.heartbeat_timeout_s]
        alive = [r for r in job.ranks.values() if r.last_seen >= now - self.settings.heartbeat_timeout_s]
        if not silent or not alive:
            return None
        waiting = [r for r in alive if r.last_heartbeat and r.last_heartbeat.inflight
                   and r.last_heartbeat.inflight.kind == "collective"]
        if not waiting:
            return None
        r = min(silent, key=lambda x: x.last_seen)
        return self._record(job, Kind.CRASH, RootCause.RANK_PROCESS_DIED, r.last_seen, now, 0.7, self._culprit(r),
                            [evidence(f"rank{r.who.rank}.last_heartbeat", round(r.last_seen, 3)),
                             evidence("waiting_ranks", ",".join(str(w.who.rank) for w in waiting))],
                            f"rank {r.who.rank} stopped sending heartbeats {now - r.last_seen:.0f} s ago while its "
                            f"peers wait for it: its process is gone or frozen", {"signal": "silent"})

    def _evict_hardware(self, now: float) -> None:
        horizon = now - self.settings.job_idle_evict_s
        for table in (self.gpus, self.ports):
            for key in [k for k, v in table.items() if v.last_seen and v.last_seen < horizon]:
                del table[key]


def _merge(known: Identity, new: Identity) -> Identity:
    """Fills what ``known`` lacks from ``new``; never overwrites (a launcher's report about a rank carries the
    launcher's own pid and no local rank)."""
    fields = {f: getattr(known, f) if getattr(known, f) is not None else getattr(new, f)
              for f in ("host", "pid", "local_rank", "world_size", "gpu")}
    return Identity(known.job_id, known.rank, restart_count=max(known.restart_count, new.restart_count), **fields)


def _compute_s(st: StepSeen) -> float | None:
    if st.collective_s is None:
        return None
    return max(0.0, st.duration - st.collective_s - (st.data_s or 0.0) - (st.checkpoint_s or 0.0))


def _inflight_at(rank: _Rank, pg, seq) -> bool:
    hb = rank.last_heartbeat
    return bool(hb and hb.inflight and hb.inflight.kind == "collective" and hb.inflight.pg == pg
                and hb.inflight.seq == seq and rank.exit is None)


def _rank_no(rank: _Rank) -> int:
    return rank.who.rank


def _last_line_of(stack: str) -> str | None:
    lines = [line.strip() for line in stack.strip().splitlines() if line.strip().startswith("File ")]
    return lines[-1] if lines else None


def _is_blocking_stdlib(frame: dict) -> bool:
    return str(frame.get("function")) in {"sleep", "acquire", "wait", "join", "get", "select", "poll", "recv", "read",
                                          "_wait_for_tstate_lock"}
