"""Crash detector: after the first sign of a crash (an exception in a rank's main thread, a non-zero exit, a signal),
wait ``crash_settle_s`` for the other ranks' reports, then name the first cause.

Rules, in order:
- The first primary cause wins: a user exception, an out-of-memory error, a CUDA error, a process killed, exiting
  non-zero, or vanished (gone with no status anyone could read: never a clean exit) without an exception. "First"
  is when it happened (an exit record carries when the process ended), not when it was reported. What the other ranks report afterwards (a collective failing because a peer went
  away, a timeout, the launcher's SIGTERM) are consequences, never the culprit.
- A user-code exception (KeyError, ValueError, ...) or an out-of-memory error is never overridden by hardware: no GPU
  fault makes a KeyError. A CUDA error is linked to an XID on its GPU (or with its pid); a process that died without
  an exception, or ranks that all blame a peer, are explained by a hardware or network fault on their GPU or node
  that began inside that cause's window (``_evidence``).
- A rank that exited cleanly (code 0) before its peers failed is the culprit: ``rank_exited_early`` (uneven inputs).
- Every rank stopped by SIGTERM/SIGINT/SIGHUP with no other failure: the job was stopped on purpose, nothing to name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from otel_gpu.processors.attribution._state import JobState, RankState
from otel_gpu.processors.attribution._types import Evidence, Finding
from otel_gpu.schema.failure import Kind, RootCause

if TYPE_CHECKING:
    from otel_gpu.processors.attribution._engine import Engine

__all__ = ["decide_crash", "CONSEQUENCE_HINTS"]

# Exception hints that are what a healthy rank sees when a peer failed: consequences, not causes.
CONSEQUENCE_HINTS = {"peer_failure", "dist_timeout", "keyboard_interrupt"}
_COMM_HINTS = {"gloo_error", "nccl_error"}
# Exceptions that hardware may explain: the GPU or the link failed under them.
_DEVICE_HINTS = {"cuda_error", "nccl_error", "gloo_error"}
# Signals a launcher (torchrun, Slurm) sends to the survivors after a failure, or a scheduler sends to stop a job.
STOP_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP"}


def _last_line_of(stack: str) -> str | None:
    lines = [line.strip() for line in stack.strip().splitlines() if line.strip().startswith("File ")]
    return lines[-1] if lines else None


def decide_crash(engine: Engine, job: JobState, now: float) -> Finding | None:
    ranks = list(job.ranks.values())
    failed = [r for r in ranks if r.failed()]
    if not failed:
        return None
    first_time = min(min((r.exception.time for r in failed if r.exception), default=now),
                     min((r.exit.time for r in failed if r.exit), default=now))
    primaries: list[tuple[float, RankState, Finding]] = []
    consequences: list[RankState] = []
    for r in failed:
        exc = r.exception
        if exc is not None and exc.hint not in CONSEQUENCE_HINTS and not (exc.hint in _COMM_HINTS and len(failed) > 1):
            cause = RootCause.CUDA_OOM if exc.hint == "cuda_oom" else RootCause.PYTHON_EXCEPTION
            where = "" if exc.thread in (None, "MainThread") else f" in thread {exc.thread}"
            device = exc.hint in _DEVICE_HINTS  # a CUDA error may yet be explained by its GPU (revised then)
            finding = Finding(
                Kind.CRASH, cause, exc.time, 0.7 if device else 0.95, r.rank, r.who.host, None,
                [Evidence("exception.type", exc.type, exc.time), Evidence("exception.hint", exc.hint, exc.time)],
                f"rank {r.rank} raised {exc.type}{where}: {exc.message[:160]}",
                {"exception_type": exc.type, "stack_top": _last_line_of(exc.stack)},
                explainable_by=[r.rank] if device else [], symptom_time=exc.time)
            primaries.append((exc.time, r, finding))
        elif exc is None and r.exit is not None and r.exit.signal in STOP_SIGNALS and any(
                x is not r and (x.exception or (x.exit and x.exit.signal not in STOP_SIGNALS)) for x in failed):
            consequences.append(r)  # the launcher stops the survivors once one rank failed
        elif exc is None and r.exit is not None and r.exit.signal in STOP_SIGNALS and len(failed) > 1 and all(
                x.exception is None and x.exit is not None and x.exit.signal in STOP_SIGNALS for x in failed):
            consequences.append(r)  # the whole job was stopped (scheduler, Ctrl-C): not a crash
        elif exc is None and r.exit is not None:
            if r.exit.vanished:
                how = "vanished without an exit status (SIGKILL or os._exit)"
                ev = [Evidence("process.exit.how", "vanished", r.exit.time)]
            else:
                how = f"was killed by {r.exit.signal}" if r.exit.signal else f"exited with code {r.exit.code}"
                ev = [Evidence("process.exit.signal" if r.exit.signal else "process.exit.code",
                               r.exit.signal or r.exit.code, r.exit.time)]
            summary = f"rank {r.rank} {how} without raising an exception"
            if r.exit.signal == "SIGKILL":
                summary += " (the OOM killer or an external kill)"
            if r.background_exception is not None:
                bg = r.background_exception
                ev.append(Evidence("exception.type", bg.type, bg.time))
                summary += f" (after {bg.type} in thread {bg.thread})"
            finding = Finding(Kind.CRASH, RootCause.RANK_PROCESS_DIED, r.exit.time, 0.8 if r.exit.vanished else 0.9,
                              r.rank, r.who.host, None, ev, summary,
                              {"signal": "vanished" if r.exit.vanished else r.exit.signal or f"exit:{r.exit.code}"},
                              explainable_by=[r.rank], symptom_time=r.exit.time)
            primaries.append((r.exit.time, r, finding))
        else:
            consequences.append(r)
    if not primaries and consequences and all(
            c.exception is None and c.exit is not None and c.exit.signal in STOP_SIGNALS for c in consequences):
        return None
    if primaries:
        primaries.sort(key=lambda p: p[0])
        _, r, finding = primaries[0]
        if consequences:
            finding.evidence.append(Evidence("consequence_ranks", ",".join(str(c.rank) for c in consequences)))
        if len(primaries) > 1:
            finding.confidence = min(finding.confidence, 0.8)
        if finding.explainable_by:
            engine.explain(finding, job, throttle=False)
        return finding
    return _no_primary(engine, job, failed, consequences, first_time, now)


def _no_primary(engine: Engine, job: JobState, failed: list[RankState], consequences: list[RankState],
                first_time: float, now: float) -> Finding:
    """Everyone who failed blames a peer: the culprit is a device fault, a rank that ended cleanly too early, the
    rank that went silent, or one that never reported."""
    silent_cut = now - engine.settings.heartbeat_timeout_s
    peers = ",".join(str(c.rank) for c in consequences)
    early = [r for r in job.ranks.values() if r.exited_clean() and r.exit.time <= first_time]
    if early:
        r = min(early, key=lambda x: x.exit.time)
        finding = Finding(Kind.CRASH, RootCause.RANK_EXITED_EARLY, r.exit.time, 0.85, r.rank, r.who.host, None,
                          [Evidence("process.exit.code", 0, r.exit.time), Evidence("peer_failure_on_ranks", peers)],
                          f"rank {r.rank} ended cleanly (exit code 0) while its peers still needed it; ranks "
                          f"{peers} then failed in their next collective (uneven inputs: one rank ran out of data "
                          f"first?)", {"reason": "exited_early"}, symptom_time=first_time)
        return finding
    silent = [r for r in job.ranks.values() if r not in failed and r.exit is None and r.last_seen < silent_cut]
    missing = engine.missing_ranks(job)
    finding = Finding(Kind.CRASH, RootCause.UNKNOWN, first_time, 0.3, None, None, None,
                      [Evidence("peer_failure_on_ranks", peers)],
                      "ranks failed with communication errors; no first cause found", {},
                      explainable_by=[r.rank for r in failed + silent], symptom_time=first_time)
    if silent:
        r = min(silent, key=lambda x: x.last_seen)
        lost = _node_lost(engine, job, r, silent, now)
        if lost is not None:
            lost.evidence.append(Evidence("peer_failure_on_ranks", peers))
            return lost
        finding.cause, finding.confidence, finding.rank, finding.host = RootCause.RANK_PROCESS_DIED, 0.6, r.rank, \
            r.who.host
        finding.evidence.insert(0, Evidence("otel_gpu.progress.last_seen", round(r.last_seen, 3)))
        finding.summary = f"rank {r.rank} went away; the others failed in their next collective"
    elif missing:
        finding.cause, finding.confidence, finding.rank = RootCause.RANK_PROCESS_DIED, 0.6, missing[0]
        finding.summary = f"rank {missing[0]} went away; the others failed in their next collective"
    else:
        r = min(consequences, key=lambda x: x.exception.time if x.exception else now)
        if r.exception is not None:
            finding.evidence.insert(0, Evidence("exception.type", r.exception.type))
        finding.rank, finding.host = r.rank, r.who.host
    engine.explain(finding, job, throttle=False)
    return finding


def quiet_hosts(job: JobState, now: float, quiet_s: float = 0.0) -> list[str]:
    """Hosts none of whose ranks failed, exited or said anything in the last ``quiet_s``: a node that may be gone
    (its ranks' silence is only certain after the heartbeat timeout; see ``_node_lost``). With 0, every host whose
    ranks neither failed nor exited: a lost node's last records can arrive a second or two after its peers failed
    (the sidecar batches), so recency tells nothing that early."""
    by_host: dict[str, list[RankState]] = {}
    for r in job.ranks.values():
        if r.who.host is not None:
            by_host.setdefault(r.who.host, []).append(r)
    return [host for host, ranks in by_host.items()
            if all(not r.failed() and r.exit is None and r.last_seen < now - quiet_s for r in ranks)]


def _node_lost(engine: Engine, job: JobState, r: RankState, silent: list[RankState], now: float) -> Finding | None:
    """The silent rank's whole node went quiet (every rank of the host and its own device metrics, no exit record):
    ``node_lost`` on that host, the rule of ``_hang.decide_silent`` applied to a crash whose survivors failed first."""
    host = r.who.host
    if host is None:
        return None
    s = engine.settings
    on_host = [x for x in job.ranks.values() if x.who.host == host]
    host_seen = engine.devices.host_silent_since(host)
    if not (all(x in silent for x in on_host) and host_seen is not None and host_seen < now - s.heartbeat_timeout_s
            and host_seen <= r.last_seen + s.heartbeat_timeout_s):
        return None
    return Finding(Kind.CRASH, RootCause.NODE_LOST, max(r.last_seen, host_seen), 0.8, r.rank, host, None,
                   [Evidence(f"rank{r.rank}.last_heartbeat", round(r.last_seen, 3)),
                    Evidence(f"host.{host}.last_device_sample", round(host_seen, 3))],
                   f"node {host} went silent: its {len(on_host)} rank(s) and its own device metrics stopped together, "
                   f"with no exit reported; the ranks of the other nodes then failed in their next collective",
                   {"signal": "node_silent", "ranks": sorted(x.rank for x in on_host)})
