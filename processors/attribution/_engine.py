"""The attribution engine: keeps per-job, per-rank and per-device state and runs the detectors; it only orchestrates.

Pure logic with no OTLP and no threads: the processor decodes batches into observations (``_observations``), calls
``observe_*``, and calls :meth:`Engine.tick` with the current time. Every structure is bounded (deques with maxlen,
jobs and devices evicted when idle), so a long-running collector's memory does not grow with time.

The detectors: ``_crash`` (first cause of a crash), ``_hang`` (wait-for graph; silent ranks and lost nodes),
``_slowdown`` (steps against the job's own baseline; checkpoint stalls); ``_evidence`` holds device state with its
baselines and the causal windows that decide whether a hardware or network fact may explain a symptom.

Verdicts can change. Every record carries a stable ``failure_id`` and a ``version``:
- hardware or network evidence that arrives after the first verdict, and began inside its cause's window, revises
  it (same id, version + 1, ``previous_root_cause`` set when the cause changed);
- a hang whose ranks progress again, or a silent rank or node that reports again, is withdrawn (a revision with
  ``withdrawn: true``), and the engine re-arms: a later failure of the same incarnation is reported.
One crash or hang stands for an incarnation while it is not withdrawn: after a crash the survivors hang, after a
hang the job is killed; both are consequences. A restart (new restart count) re-arms. Slowdowns and checkpoint
stalls are reported each time they begin.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging

from otel_gpu.processors.attribution import _crash, _digest, _hang, _slowdown
from otel_gpu.processors.attribution._evidence import REVISE_FOR_S, DeviceEvidence, strongest
from otel_gpu.processors.attribution._observations import (ExceptionSeen, ExitSeen, GpuSample, Heartbeat, Identity,
                                                           NicSample, SpanSeen, Stacks, StateSeen, StepSeen, XidSeen)
from otel_gpu.failure import Culprit, FailureRecord
from otel_gpu.processors.attribution._state import JobState, OpenVerdict, RankState, merge_identity
from otel_gpu.processors.attribution._types import Fault, Finding
from otel_gpu.processors.attribution.config import AttributionConfig
from otel_gpu.schema.failure import Kind, RootCause

__all__ = ["Engine"]

_logger = logging.getLogger(__name__)


class Engine:
    """Keeps state and produces :class:`FailureRecord` objects (new ones and revisions) from :meth:`tick`."""

    def __init__(self, settings: AttributionConfig | None = None):
        self.settings = settings or AttributionConfig()
        self.jobs: dict[str, JobState] = {}
        self.devices = DeviceEvidence()
        self._pending: list[FailureRecord] = []
        self.incident_opened = False  # a crash incident opened since the processor last looked

    # -- observations ----------------------------------------------------------------------------------------------
    def _job(self, who: Identity, now: float) -> JobState:
        job = self.jobs.get(who.job_id)
        if job is None:
            if len(self.jobs) >= self.settings.max_jobs:
                oldest = min(self.jobs.values(), key=lambda j: j.last_activity)
                del self.jobs[oldest.job_id]
            job = self.jobs[who.job_id] = JobState(who.job_id, restart_count=who.restart_count, start_time=now)
        if who.restart_count > job.restart_count:
            job.new_incarnation(who.restart_count, now)
        if who.world_size:
            job.world_size = who.world_size
        job.last_activity = max(job.last_activity, now)
        return job

    def _rank(self, who: Identity, now: float, sync: bool = True) -> tuple[JobState, RankState]:
        """The rank's state (made on first sight), its job's pending node digests applied first unless ``sync`` is
        False (the digest path itself)."""
        job = self._job(who, now)
        if sync:
            self.sync(job)
        rank = job.ranks.get(who.rank)
        if rank is None:
            if len(job.ranks) >= self.settings.max_ranks_per_job:
                raise OverflowError("too many ranks")
            rank = job.ranks[who.rank] = RankState(who)
            if who.net_ifaces:
                job.net_ifaces = who.net_ifaces | (job.net_ifaces or frozenset())
        elif rank.who != who:
            rank.who = merge_identity(rank.who, who)
        return job, rank

    def observe_heartbeat(self, hb: Heartbeat, now: float) -> None:
        _, rank = self._rank(hb.who, now)
        if rank.last_heartbeat is None or hb.time >= rank.last_heartbeat.time:
            rank.last_heartbeat = hb
        rank.last_seen = max(rank.last_seen, now)

    def observe_stacks(self, stacks: Stacks, now: float) -> None:
        _, rank = self._rank(stacks.who, now)
        rank.stacks = stacks
        rank.last_seen = max(rank.last_seen, now)

    def observe_exception(self, exc: ExceptionSeen, now: float) -> None:
        job, rank = self._rank(exc.who, now)
        if exc.thread not in (None, "MainThread"):
            # A background thread: training may go on. A crash only if the rank then stops (observe_exit).
            if rank.background_exception is None:
                rank.background_exception = exc
            return
        if rank.exception is None:
            rank.exception = exc
        job.crash_reports += 1
        self._open_incident(job, now)

    def observe_exit(self, ex: ExitSeen, now: float) -> None:
        job, rank = self._rank(ex.who, now)
        if rank.exit is None:
            rank.exit = ex
        if ex.code in (0, None) and ex.signal is None and not ex.vanished:
            if job.world_size and sum(1 for r in job.ranks.values() if r.exited_clean()) >= job.world_size:
                job.finished = True
            return
        if rank.exception is None and rank.background_exception is not None and ex.signal is None:
            rank.exception = rank.background_exception  # it raised in a thread, then the rank stopped
        job.crash_reports += 1
        self._open_incident(job, now)

    def observe_state(self, st: StateSeen, now: float) -> None:
        """A rank's launcher saw it frozen (state T or D) or running again. Not a sign of life: its heartbeats are."""
        _, rank = self._rank(st.who, now)
        rank.frozen = st if st.frozen else None

    def observe_step(self, step: StepSeen, now: float) -> None:
        job, rank = self._rank(step.who, now)
        rank.note_step(step)
        rank.last_seen = max(rank.last_seen, now)
        if step.step <= job.last_step_closed:
            return
        job.step_times.setdefault(step.step, {})[step.who.rank] = step
        for finding in _slowdown.close_steps(self, job, now):
            self._pending.append(self._emit(job, finding, now))

    def observe_span(self, span: SpanSeen, now: float) -> None:
        job, rank = self._rank(span.who, now)
        if span.kind == "checkpoint_save":
            finding = _slowdown.checkpoint_span(self, job, rank, span)
            if finding is not None and job.terminal is None:
                self._pending.append(self._emit(job, finding, now))

    def observe_gpu(self, sample: GpuSample) -> None:
        self.devices.observe_gpu(sample)

    def observe_xid(self, xid: XidSeen) -> None:
        self.devices.observe_xid(xid)

    def observe_nic(self, sample: NicSample) -> None:
        self.devices.observe_nic(sample)

    # -- what the detectors ask ------------------------------------------------------------------------------------
    def missing_ranks(self, job: JobState) -> list[int]:
        if not job.world_size:
            return []
        return [r for r in range(job.world_size) if r not in job.ranks]

    def faults(self, job: JobState, ranks: list[int], symptom: float, *, throttle: bool,
               own: int | None) -> list[tuple[int, Fault]]:
        """Faults that passed the evidence rules on the GPUs and nodes of ``ranks``. Software XIDs (the
        application's) count only on ``own``, the rank the finding names."""
        out: list[tuple[int, Fault]] = []
        hosts_done: set[str] = set()
        for n in dict.fromkeys(ranks):
            r = job.ranks.get(n)
            if r is None:
                continue
            for f in self.devices.gpu_faults(r.who, symptom, throttle=throttle):
                if f.hardware or n == own:
                    out.append((n, f))
            host = r.who.host
            if host is not None and host not in hosts_done:
                hosts_done.add(host)
                out += [(n, f) for f in self.devices.nic_faults(host, symptom, ifaces=job.net_ifaces,
                                                                 job_start=job.start_time)]
        return out

    def explain(self, finding: Finding, job: JobState, *, throttle: bool) -> bool:
        """Puts the fault that explains ``finding`` (if any) in it: cause, culprit, onset, confidence from the
        strength of the evidence, a summary that says why."""
        if not finding.explainable_by:
            return False
        symptom = finding.symptom_time if finding.symptom_time is not None else finding.onset
        found = self.faults(job, finding.explainable_by, symptom, throttle=throttle, own=finding.rank)
        fault = strongest([f for _, f in found])
        if fault is None:
            return False
        rank_no = next(n for n, f in found if f is fault)
        rank = job.ranks[rank_no]
        # what the symptom's detector said without the hardware, less its "nothing seen" clause (now untrue)
        before = finding.summary.removesuffix(finding.no_fault_clause) if finding.no_fault_clause else finding.summary
        finding.no_fault_clause = ""
        finding.cause, finding.fault = fault.cause, fault
        finding.onset = min(finding.onset, fault.onset)
        finding.rank, finding.host, finding.gpu = rank_no, fault.host, fault.gpu
        finding.confidence = round(fault.strength - (0.05 if fault.onset > symptom else 0.0), 2)
        finding.evidence = list(fault.evidence) + [e for e in finding.evidence if e not in fault.evidence]
        finding.details = {k: v for k, v in finding.details.items() if k not in ("reason", "stack_top")}
        finding.details.update(fault.details)
        finding.category, finding.action = fault.category, fault.action
        dt = fault.onset - symptom
        when = f"{abs(dt):.1f} s {'before' if dt <= 0 else 'after'} the symptom"
        where = f"rank {rank.rank} on {fault.host}" + (f" (GPU {fault.gpu})" if fault.gpu else "")
        finding.summary = f"{where}: {fault.why}, {when}; {before}"
        return True

    # -- records ---------------------------------------------------------------------------------------------------
    def _culprit(self, job: JobState, finding: Finding) -> Culprit:
        if finding.rank is None:
            return Culprit(None, finding.host, finding.gpu)
        r = job.ranks.get(finding.rank)
        gpu = finding.gpu
        if gpu is None and r is not None:
            g = self.devices.rank_gpu(r.who)
            gpu = g.name if g is not None else (r.who.gpu_uuid or r.who.gpu)
        host = finding.host if finding.host is not None else (r.who.host if r is not None else None)
        return Culprit(finding.rank, host, gpu)

    def _record(self, job: JobState, finding: Finding, now: float, failure_id: str, version: int = 1,
                **extra) -> FailureRecord:
        auto = None if finding.action is None else finding.action.value in ("auto_restart",
                                                                            "exclude_node_and_restart")
        return FailureRecord(kind=finding.kind, root_cause=finding.cause, job_id=job.job_id, onset_time=finding.onset,
                             detected_time=now, confidence=finding.confidence, culprit=self._culprit(job, finding),
                             evidence=[str(e) for e in finding.evidence[:12]], summary=finding.summary,
                             details=dict(finding.details), category=finding.category, action=finding.action,
                             auto_remediable=auto, failure_id=failure_id, version=version, **extra)

    def sync(self, job: JobState) -> None:
        """Brings the job's rank states up to date with its node digests (:func:`_digest.sync`)."""
        if job.digest is not None:
            _digest.sync(self, job)

    def _emit(self, job: JobState, finding: Finding, now: float, *, terminal: bool = False) -> FailureRecord:
        self.sync(job)
        job.failures += 1
        fid = hashlib.sha256(f"{job.job_id}|{job.restart_count}|{job.failures}".encode()).hexdigest()[:16]
        record = self._record(job, finding, now, fid)
        symptom = finding.symptom_time if finding.symptom_time is not None else finding.onset
        verdict = OpenVerdict(record, finding, revise_until=max(now, symptom + REVISE_FOR_S),
                              devices_version=self.devices.version, crash_reports=job.crash_reports)
        if finding.kind is Kind.HANG or finding.details.get("signal") in ("silent", "node_silent"):
            verdict.progress = {n: _hang.progress_marker(r) for n, r in job.ranks.items()}
            verdict.last_seen = {n: r.last_seen for n, r in job.ranks.items()}
        if terminal:
            job.terminal = record
        if verdict.finding.explainable_by or terminal:
            job.open.append(verdict)
            del job.open[:-16]
        return record

    def _revise(self, job: JobState, verdict: OpenVerdict, finding: Finding, now: float, **extra) -> FailureRecord:
        old = verdict.record
        changed = finding.cause is not old.root_cause
        record = self._record(job, finding, now, old.failure_id, old.version + 1,
                              previous_root_cause=old.root_cause.value if changed else None, **extra)
        record.onset_time = min(record.onset_time, old.onset_time)
        if record.signature == old.signature:
            record.recurrence = old.recurrence
        verdict.record, verdict.finding = record, finding
        if job.terminal is not None and job.terminal.failure_id == old.failure_id:
            job.terminal = record
        return record

    def _review(self, job: JobState, now: float) -> list[FailureRecord]:
        """Revisions of the job's open verdicts: withdrawals (progress again) and late hardware evidence."""
        out: list[FailureRecord] = []
        keep: list[OpenVerdict] = []
        for v in job.open:
            record = v.record
            if v.progress and self._resumed(job, v, now):
                finding = dataclasses.replace(v.finding, summary="withdrawn: the ranks progressed again; "
                                              + v.finding.summary)
                revised = self._revise(job, v, finding, now, withdrawn=True)
                revised.root_cause = record.root_cause
                out.append(revised)
                if job.terminal is revised:
                    job.terminal = None
                    job.incident_open = job.incident_deadline = None
                    job.incident_extended = False
                continue
            in_time = now <= v.revise_until
            if in_time and record.kind is Kind.CRASH and job.terminal is record \
                    and job.crash_reports != v.crash_reports:
                # More reports came (the culprit's own exit often comes after its peers' errors): decide again.
                v.crash_reports = job.crash_reports
                again = _crash.decide_crash(self, job, now)
                if again is None:  # every rank was stopped on purpose after all: no crash
                    finding = dataclasses.replace(v.finding, summary="withdrawn: every rank was stopped on purpose; "
                                                  + v.finding.summary)
                    out.append(self._revise(job, v, finding, now, withdrawn=True))
                    job.finished = True
                    continue
                if _better(again, v.finding):
                    out.append(self._revise(job, v, again, now))
                    keep.append(v)
                    continue
            if in_time and self.devices.version != v.devices_version:
                v.devices_version = self.devices.version
                f = v.finding
                if f.explainable_by and (f.fault is None or not f.fault.hardware):
                    trial = dataclasses.replace(f, evidence=list(f.evidence), details=dict(f.details))
                    if self.explain(trial, job, throttle=f.kind is Kind.SLOWDOWN) and (
                            f.fault is None or trial.fault.hardware):
                        out.append(self._revise(job, v, trial, now))
            if in_time or (v.progress and job.terminal is v.record):
                keep.append(v)
        job.open = keep
        return out

    def _resumed(self, job: JobState, verdict: OpenVerdict, now: float) -> bool:
        """The ranks a hang (or a silent-rank crash) stood for progress again: every one that still lives has moved
        on and none is stalled past the hang timeout."""
        record = verdict.record
        if record.withdrawn:
            return False
        if record.kind is Kind.HANG:
            watched = [w["rank"] for w in record.details.get("waiting", [])] or list(verdict.progress)
        else:
            watched = [record.culprit.rank] + list(record.details.get("ranks", []))
        timeout = _hang.hang_timeout(self, job)
        ranks = [job.ranks[n] for n in dict.fromkeys(watched) if n in job.ranks and job.ranks[n].exit is None]
        if not ranks:
            return False
        for r in ranks:
            if r.last_seen <= verdict.last_seen.get(r.rank, 0.0) or r.last_seen < now - self.settings.heartbeat_timeout_s:
                return False
            if _hang.progress_marker(r) == verdict.progress.get(r.rank) or _hang.stalled_for(r, now) >= timeout:
                return False
        return True

    # -- driving ---------------------------------------------------------------------------------------------------
    def _open_incident(self, job: JobState, now: float) -> None:
        if job.terminal is not None or job.incident_open is not None:
            return
        job.incident_open = now
        job.incident_deadline = now + self.settings.crash_settle_s
        self.incident_opened = True

    def next_deadline(self) -> float | None:
        """The earliest time a crash decision is due (the processor ticks then, not a tick interval later)."""
        due = [j.incident_deadline for j in self.jobs.values()
               if j.incident_deadline is not None and j.terminal is None and not j.finished]
        return min(due) if due else None

    def tick(self, now: float) -> list[FailureRecord]:
        """Runs the time-driven detectors; returns new failure records and revisions (each reported once)."""
        out, self._pending = self._pending, []
        for job in list(self.jobs.values()):
            if job.last_activity < now - self.settings.job_idle_evict_s:
                del self.jobs[job.job_id]
                continue
            if job.open:
                self.sync(job)
                out += self._review(job, now)
            if job.terminal is not None or job.finished:
                continue
            finding = None
            if job.incident_open is not None:
                if now < job.incident_deadline:
                    continue
                self.sync(job)
                finding = _crash.decide_crash(self, job, now)
                if finding is None:
                    job.finished = True  # stopped on purpose (every rank got SIGTERM/SIGINT): nothing to name
                    continue
                if not job.incident_extended and (finding.cause is RootCause.UNKNOWN or _only_stopped(job)):
                    # Wait once more: for the exit of the rank that died, or for the other ranks' reports when all
                    # that came is a stop signal (a launcher or scheduler stops every rank; one alone is rare).
                    job.incident_extended = True
                    job.incident_deadline = now + self.settings.crash_settle_s * (
                        1 if finding.cause is RootCause.UNKNOWN else 3)
                    self.incident_opened = True
                    continue
                if finding.cause is RootCause.UNKNOWN and now < job.incident_open + self.settings.heartbeat_timeout_s \
                        + self.settings.crash_settle_s and _crash.quiet_hosts(job, now):
                    # A node whose ranks said nothing since the survivors failed: wait until its silence is certain
                    # (the heartbeat timeout), so that a lost node is named (node_lost) rather than "unknown".
                    job.incident_deadline = now + self.settings.crash_settle_s
                    continue
            elif job.digest is not None and _digest.quiet(self, job, now):
                continue  # the node digests show nobody stalled or silent: no walk over every rank (_digest)
            else:
                self.sync(job)
                finding = _hang.decide_hang(self, job, now) or _hang.decide_silent(self, job, now)
            if finding is not None:
                out.append(self._emit(job, finding, now, terminal=True))
        self.devices.evict(now - self.settings.job_idle_evict_s)
        return out


def _better(new: Finding, old: Finding) -> bool:
    """A crash verdict decided again replaces the first one when it names another cause or rank and is at least as
    sure, or the first one knew no cause."""
    if (new.cause, new.rank) == (old.cause, old.rank):
        return False
    return old.cause is RootCause.UNKNOWN or new.confidence >= old.confidence or new.onset < old.onset


def _only_stopped(job: JobState) -> bool:
    """Every failure so far is a stop signal (SIGTERM/SIGINT/SIGHUP) with no exception, and not every rank reported."""
    failed = [r for r in job.ranks.values() if r.failed()]
    if not failed or any(r.exception is not None or r.exit is None or r.exit.signal not in _crash.STOP_SIGNALS
                         for r in failed):
        return False
    return not job.world_size or len(failed) < job.world_size

