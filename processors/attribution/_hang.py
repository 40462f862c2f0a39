"""Hang detector: a wait-for graph across all process groups.

Every rank in a collective (``pg``, ``seq``) waits for the members of that group that have not started ``seq`` yet,
that exited, or that went silent. From the ranks stuck longer than the hang timeout, the graph is followed to its
end: the culprit is a rank that waits for nobody (asleep or busy in user code, loading data, saving a checkpoint,
exited, vanished, never reported), not the first waiter found. With subgroups [0,1] and [2,3] and rank 3 asleep
before its subgroup all_reduce, ranks 0 and 1 wait in the world group for 2 and 3, rank 2 waits in its subgroup for
3: the end of every chain is rank 3.

What the end of the chain is doing decides the cause:
- exited with code 0: ``rank_exited_early`` (uneven inputs: it ran out of data while its peers wait);
- in a checkpoint (a checkpoint span, ``torch.save``, ``torch.distributed.checkpoint`` on its stack): busy, not a
  hang, until ``checkpoint_timeout_s``; then ``checkpoint_stall``;
- waiting for data: ``dataloader_stall``;
- before its first step (importing, reading its data set, building its model): starting, not hung, until
  ``startup_timeout_s``;
- anywhere else (asleep, a lock, a loop): ``rank_not_in_collective``; user code on top of its stack makes it the
  user's to fix. The decision waits up to ``stack_grace_s`` for a fresh stack, then goes out without one;
- never reported: ``rank_not_in_collective`` with what is known.
When no chain ends outside the waiters (everyone is in the same collective), different operations or sizes at the
same sequence number are a ``collective_mismatch``; else a hardware or network fault that began in its window on
the waiters' devices, else ``unknown``.

A rank silent while the others report is handled by :func:`decide_silent` (a crash: its process is gone, or its whole
node is: ``node_lost``); when every rank is silent at once the collector lost telemetry (a restart): no verdict.

A rank that its launcher saw frozen (``otel-gpu run`` reads the state of live ranks: T or D for 2 s) is a hang,
``rank_frozen``, wherever the graph meets it (the end of a chain, one of everyone waiting in the same collective, a
silent rank), with its state and kernel wait channel as evidence: stopped (state T: SIGSTOP, a debugger, a
scheduler's suspend) is named so, not blamed on hardware; uninterruptible sleep inside the NVIDIA driver (its wait
channel or kernel stack in the ``nvidia`` modules) is the GPU's: category hardware, ``exclude_node_and_restart``;
uninterruptible sleep elsewhere (a dead file system) is investigated. An XID on the frozen rank's GPU in its window
names the XID instead (``gpu_xid``, ``gpu_fell_off_bus``, ...).
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from otel_gpu.processors.attribution._state import JobState, RankState
from otel_gpu.processors.attribution._types import Evidence, Finding
from otel_gpu.schema.failure import Action, Category, Kind, RootCause

if TYPE_CHECKING:
    from otel_gpu.processors.attribution._engine import Engine

__all__ = ["decide_hang", "decide_silent", "frozen_finding", "hang_timeout", "stalled_for", "progress_marker"]

_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", "/otel_gpu/instrumentation/")
_CHECKPOINT_MARKERS = ("/torch/serialization.py", "/torch/distributed/checkpoint/", "safetensors")
_WORLD_PG = "0"


def hang_timeout(engine: Engine, job: JobState) -> float:
    s = engine.settings
    recent = [d for _, d in list(job.step_done)[-20:]]
    if recent:
        return max(s.hang_timeout_s, s.hang_step_factor * statistics.median(recent))
    return s.hang_timeout_s


def stalled_for(r: RankState, now: float) -> float:
    """How long the rank has made no progress: its watchdog's own count (stalled_s) or the age of its in-flight
    operation, plus the time since that heartbeat arrived."""
    hb = r.last_heartbeat
    if hb is None:
        return 0.0
    own = hb.stalled_s if hb.stalled_s is not None else 0.0
    if hb.inflight is not None:
        own = max(own, hb.time - hb.inflight.since)
    return own + max(0.0, now - r.last_seen)


def progress_marker(r: RankState) -> tuple:
    """Changes whenever the rank makes progress (a step, a new collective started)."""
    hb = r.last_heartbeat
    if hb is None:
        return (None,)
    return (hb.step, sum(hb.last_started_seq.values()), sum(hb.last_seq.values()), len(r.steps) and r.steps[-1].step)


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


def _is_blocking_stdlib(frame: dict) -> bool:
    """A standard-library call the user's code blocks in (a queue's get, a lock, a socket): the user's wait. A
    library's ``wait`` (torch's futures, a collective's work) is not: that rank is stuck inside the library."""
    file = str(frame.get("file", ""))
    stdlib = file.startswith("<frozen ") or ("/lib/python3" in file and "-packages/" not in file)
    return stdlib and str(frame.get("function")) in {"sleep", "acquire", "wait", "join", "get", "select", "poll",
                                                     "recv", "read", "_wait_for_tstate_lock"}


def stack_top(r: RankState) -> str | None:
    if r.stacks is not None:
        return _fmt_frame(_user_frame(r.stacks.frames)) or r.stacks.top
    hb = r.last_heartbeat
    return hb.stack_top if hb else None


def category_by_stack(r: RankState) -> tuple[Category, Action]:
    """User code at the top of the culprit's stack: the user must fix it. Otherwise (inside a library, or no stack)
    it is a software fault that a restart usually clears."""
    frames = r.stacks.frames if r.stacks else []
    if frames:
        innermost = frames[-1]
        user = _user_frame(frames)
        if user is not None and (user is innermost or _is_blocking_stdlib(innermost)):
            return Category.USER, Action.USER_FIX
        return Category.SOFTWARE, Action.AUTO_RESTART
    hb = r.last_heartbeat
    if hb and hb.stack_top and not any(m in hb.stack_top for m in _LIBRARY_MARKERS):
        return Category.USER, Action.USER_FIX
    return Category.SOFTWARE, Action.AUTO_RESTART


def _in_checkpoint(r: RankState) -> bool:
    hb = r.last_heartbeat
    if hb is not None and (hb.state == "checkpoint" or (hb.inflight is not None and hb.inflight.kind == "checkpoint")):
        return True
    frames = r.stacks.frames if r.stacks is not None else []
    return any(any(m in str(f.get("file", "")) for m in _CHECKPOINT_MARKERS) for f in frames)


def _coll(r: RankState):
    """The collective the rank is in (pg, seq, op, bytes), or None."""
    hb = r.last_heartbeat
    i = hb.inflight if hb is not None else None
    if i is None or i.kind != "collective" or i.pg is None or i.seq is None or r.exit is not None:
        return None
    return i


def decide_hang(engine: Engine, job: JobState, now: float) -> Finding | None:
    s = engine.settings
    timeout = hang_timeout(engine, job)
    silent_cut = now - s.heartbeat_timeout_s
    live = [r for r in job.ranks.values() if r.exit is None and r.last_heartbeat is not None]
    if not live or all(r.last_seen < silent_cut for r in live):
        return None  # nothing reports: a telemetry gap (collector restart), not a verdict on silence alone
    if not any(r.last_seen >= silent_cut and stalled_for(r, now) >= timeout for r in live):
        return None  # nobody is stuck long enough (the usual tick: no graph to build)
    # Where each rank is in each process group: the highest collective it started (heartbeat counters, or the one
    # in flight). A rank reporting an older collective of a group as in flight has finished it (gloo's flight
    # recorder never marks completion): its peers could not have started the next one otherwise.
    started: dict[str, dict[int, int]] = {}
    for r in job.ranks.values():
        hb = r.last_heartbeat
        if hb is None:
            continue
        for pg, seq in hb.last_started_seq.items():
            row = started.setdefault(pg, {})
            row[r.rank] = max(row.get(r.rank, 0), seq)
        i = hb.inflight
        if i is not None and i.kind == "collective" and i.seq is not None and i.pg is not None and not i.p2p:
            row = started.setdefault(i.pg, {})
            row[r.rank] = max(row.get(r.rank, 0), i.seq)
    world = set(range(job.world_size)) if job.world_size else set(job.ranks)

    def members(pg: str) -> set[int]:
        return world | set(started.get(pg, {})) if pg == _WORLD_PG else set(started.get(pg, {}))

    def gone(n: int) -> bool:
        r = job.ranks.get(n)
        return r is None or r.exit is not None or r.last_seen < silent_cut

    # Performance (aggregator scale): the ranks waiting at the same (pg, seq) share one set of blockers, computed
    # once, so that a 16k-rank hang costs O(ranks) per tick, not O(ranks^2).
    blockers: dict[tuple[str, int], frozenset[int]] = {}
    waits_at: dict[int, tuple[str, int]] = {}
    for r in live:
        i = _coll(r)
        if i is None or i.p2p:
            continue
        key = (i.pg, i.seq)
        if key not in blockers:
            row = started.get(i.pg, {})
            blockers[key] = frozenset(q for q in members(i.pg) if row.get(q, 0) < i.seq or gone(q))
        waits_at[r.rank] = key
    roots = [r for r in live if r.rank in waits_at and r.last_seen >= silent_cut and stalled_for(r, now) >= timeout]
    if not roots:
        return _lone_stall(engine, job, live, timeout, now)
    onset_rank = max(roots, key=lambda r: stalled_for(r, now))
    onset = now - stalled_for(onset_rank, now)
    # Follow every chain from the stuck ranks to its end: one search from all of them, group by group.
    root_keys: dict[tuple[str, int], int] = {}
    for r in roots:
        root_keys[waits_at[r.rank]] = root_keys.get(waits_at[r.rank], 0) + 1
    key_weight = dict(root_keys)  # how many stuck ranks wait, directly or through a chain, at each (pg, seq)
    todo, seen_keys, ends = list(root_keys), set(root_keys), set()
    while todo:
        key = todo.pop()
        for q in blockers[key]:
            qkey = waits_at.get(q)
            if qkey is not None and not gone(q):
                key_weight[qkey] = key_weight.get(qkey, 0) + key_weight[key]
                if qkey not in seen_keys:
                    seen_keys.add(qkey)
                    todo.append(qkey)
            else:
                ends.add(q)
    reach: dict[int, int] = {}
    for key in seen_keys:
        for q in blockers[key]:
            if q in ends:
                reach[q] = reach.get(q, 0) + key_weight.get(key, 0)
    ops = [_coll(r).op for r in roots]
    op = max(set(ops), key=ops.count) if ops else None
    first = _coll(onset_rank)
    pg, seq = first.pg, first.seq
    # Who waits: the stuck ranks and every rank that reports from the same collective as one of them, however
    # recently it came in (a rank that was a second slower to reach it waits for the same ranks all the same).
    rooted = {r.rank for r in roots}
    stuck = sorted(roots + [r for r in live if r.rank not in rooted and waits_at.get(r.rank) in root_keys
                            and r.last_seen >= silent_cut], key=lambda x: x.rank)
    base_ev = [Evidence("stuck_ranks", ",".join(str(r.rank) for r in stuck)),
               Evidence("collective", f"{op or '?'} pg={pg} seq={seq}", onset),
               Evidence("hang_timeout_s", round(timeout, 1))]
    waiting = [{"rank": r.rank, "host": r.who.host, "since": round(now - stalled_for(r, now), 3),
                "op": _coll(r).op, "pg": _coll(r).pg, "seq": _coll(r).seq} for r in stuck[:64]]
    if reach:
        def behind(n: int) -> int:
            return min((row.get(n, 0) for row in started.values() if n in row), default=-1)
        ends = sorted(reach, key=lambda n: (-reach[n], behind(n), n))
        return _chain_end(engine, job, ends, stuck, onset, timeout, now, op, pg, seq, base_ev, waiting)
    if len(roots) < len(live):
        return None  # some ranks still progress and nobody is waited for: not a job-wide hang (yet)
    if any(r.last_seen < now - s.heartbeat_timeout_s / 2 for r in roots):
        return None  # one of them stopped reporting: gone or frozen (decide_silent names it)
    return _all_waiting(engine, job, roots, onset, now, op, pg, seq, base_ev, waiting)


def _chain_end(engine: Engine, job: JobState, ends: list[int], roots: list[RankState], onset: float,
               timeout: float, now: float, op, pg, seq, base_ev: list[Evidence], waiting: list[dict]) -> Finding | None:
    s = engine.settings
    n = ends[0]
    culprit = job.ranks.get(n)
    what = f"{op or 'collective'} seq {seq}" if seq is not None else (op or "a collective")
    others = [x for x in ends[1:]]
    tail = f"; ranks {others} are behind too" if others else ""
    details = {"op": op, "pg": pg, "seq": seq, "waiting": waiting}
    waiters = [r.rank for r in roots]
    confidence = 0.9 if not others else 0.7
    if culprit is None:
        finding = Finding(Kind.HANG, RootCause.RANK_NOT_IN_COLLECTIVE, onset, 0.6, n, None, None, list(base_ev),
                          f"rank {n} never reported; the others wait in {what}{tail}", details,
                          explainable_by=waiters)
        engine.explain(finding, job, throttle=False)
        return finding
    ev = list(base_ev)
    hb = culprit.last_heartbeat
    if hb is not None:
        ev.append(Evidence(f"rank{n}.last_started_seq", hb.last_started_seq.get(pg, 0), hb.time))
    if culprit.exit is not None:
        if culprit.exited_clean():
            ev.append(Evidence("process.exit.code", 0, culprit.exit.time))
            return Finding(Kind.HANG, RootCause.RANK_EXITED_EARLY, onset, 0.9, n, culprit.who.host, None, ev,
                           f"rank {n} ended cleanly (exit code 0) while {len(roots)} rank(s) wait for it in {what} "
                           f"(uneven inputs: it ran out of data first?){tail}",
                           dict(details, reason="exited_early"))
        return None  # it crashed: the crash detector names it
    if culprit.frozen is not None:
        return frozen_finding(engine, job, culprit, roots, min(onset, culprit.frozen.time), ev, details)
    if culprit.last_seen < now - s.heartbeat_timeout_s / 2:
        return None  # it stopped reporting: gone or frozen, a crash or a lost node (decide_silent)
    starting = hb is not None and (not any(hb.last_started_seq.values()) or (
        hb.steps_done == 0 and not job.step_done))
    if starting and now - onset < s.startup_timeout_s:
        return None  # before its first step: still importing, loading its data, building its model
    if _in_checkpoint(culprit):
        busy_for = now - onset
        if busy_for < s.checkpoint_timeout_s:
            return None  # a long checkpoint on one rank: busy, not hung (yet)
        ev.append(Evidence("training.state", "checkpoint", onset))
        finding = Finding(Kind.HANG, RootCause.CHECKPOINT_STALL, onset, 0.8, n, culprit.who.host, None, ev,
                          f"rank {n} has been saving a checkpoint for {busy_for:.0f} s while {len(roots)} rank(s) "
                          f"wait in {what}{tail}", dict(details, reason="checkpoint", stack_top=stack_top(culprit)),
                          explainable_by=[n])
        engine.explain(finding, job, throttle=False)
        return finding
    fresh = culprit.stacks is not None and culprit.stacks.time >= onset
    grace_over = now >= onset + timeout + s.stack_grace_s
    if not fresh and not grace_over:
        return None  # its watchdog sends the stack soon: where it is decides user vs software
    where = stack_top(culprit) if fresh or (culprit.stacks is None and hb is not None) else None
    if where:
        ev.append(Evidence(f"rank{n}.stack", where))
    state = hb.state if hb else None
    if hb is not None and hb.inflight is not None and hb.inflight.kind != "collective":
        state = hb.inflight.kind
    category = action = None
    if state == "data":
        cause = RootCause.DATALOADER_STALL
    else:
        cause = RootCause.RANK_NOT_IN_COLLECTIVE
        if fresh:
            category, action = category_by_stack(culprit)
        elif where and not any(m in where for m in _LIBRARY_MARKERS):
            category, action = Category.USER, Action.USER_FIX
        else:
            category, action = Category.SOFTWARE, Action.INVESTIGATE
            confidence = min(confidence, 0.7)
    summary = (f"rank {n} never reached {what} (pg {pg}); {len(roots)} rank(s) wait for it"
               + (f"; it is at {where}" if where else "; no stack from it yet")
               + tail)
    # A rank asleep or looping in user code is not explained by hardware; one stuck inside a library may be.
    explainable = [] if category is Category.USER else [n] + [r.rank for r in roots]
    finding = Finding(Kind.HANG, cause, onset, confidence, n, culprit.who.host, None, ev, summary,
                      dict(details, stack_top=where, reason=state), category=category, action=action,
                      explainable_by=explainable)
    engine.explain(finding, job, throttle=False)
    return finding


def _all_waiting(engine: Engine, job: JobState, roots: list[RankState], onset: float, now: float, op, pg, seq,
                 base_ev: list[Evidence], waiting: list[dict]) -> Finding:
    """Every rank is in the same collective and it does not complete: different calls, a rank frozen inside it (the
    GPU driver), or a device or link."""
    details = {"op": op, "pg": pg, "seq": seq, "waiting": waiting}
    frozen = sorted((r for r in roots if r.frozen is not None), key=lambda r: (r.frozen.frozen != "gpu_driver",
                                                                               r.frozen.time, r.rank))
    if frozen:
        r = frozen[0]
        return frozen_finding(engine, job, r, [x for x in roots if x is not r], min(onset, r.frozen.time),
                              list(base_ev), details)
    by_sig: dict[tuple, list[int]] = {}
    for r in roots:
        i = _coll(r)
        by_sig.setdefault((i.op, i.bytes), []).append(r.rank)
    what = f"{op or 'collective'} seq {seq}" if seq is not None else (op or "a collective")
    if len(by_sig) > 1:
        for ranks in by_sig.values():
            ranks.sort()
        minority = min(by_sig.values(), key=lambda rs: (len(rs), rs))
        odd = job.ranks[minority[0]]
        ev = base_ev + [Evidence(f"ranks{','.join(map(str, ranks))}", f"{sig[0]} bytes={sig[1]}")
                        for sig, ranks in sorted(by_sig.items(), key=lambda kv: kv[1])]
        return Finding(Kind.HANG, RootCause.COLLECTIVE_MISMATCH, onset, 0.85, odd.rank, odd.who.host, None, ev,
                       f"ranks called different collectives at seq {seq} (pg {pg}): " + "; ".join(
                           f"ranks {ranks}: {sig[0]}" + (f" ({sig[1]} bytes)" if sig[1] else "")
                           for sig, ranks in by_sig.items()),
                       dict(details, op="/".join(sorted(str(x[0]) for x in by_sig))))
    finding = Finding(Kind.HANG, RootCause.UNKNOWN, onset, 0.4, None, None, None, list(base_ev),
                      f"every rank waits in {what} and no hardware or network fault was seen", details,
                      explainable_by=[r.rank for r in roots],
                      no_fault_clause=" and no hardware or network fault was seen")
    engine.explain(finding, job, throttle=False)
    return finding


def _lone_stall(engine: Engine, job: JobState, live: list[RankState], timeout: float, now: float) -> Finding | None:
    """No rank waits in a collective, but some are stuck in data loading or a checkpoint (one rank, or every rank at
    the same place)."""
    s = engine.settings
    for r in sorted(live, key=lambda x: x.rank):
        hb = r.last_heartbeat
        i = hb.inflight
        if i is None or i.kind not in ("data", "checkpoint"):
            continue
        stalled = stalled_for(r, now)
        limit = s.checkpoint_timeout_s if i.kind == "checkpoint" else timeout
        if stalled < limit or r.last_seen < now - s.heartbeat_timeout_s:
            continue
        cause = RootCause.CHECKPOINT_STALL if i.kind == "checkpoint" else RootCause.DATALOADER_STALL
        onset = now - stalled
        finding = Finding(Kind.HANG, cause, onset, 0.8, r.rank, r.who.host, None,
                          [Evidence("training.state", i.kind, i.since),
                           Evidence("training.inflight.duration", round(stalled, 1))],
                          f"rank {r.rank} has been in {i.kind} for {stalled:.0f} s",
                          {"reason": i.kind, "stack_top": stack_top(r)}, explainable_by=[r.rank])
        engine.explain(finding, job, throttle=False)
        return finding
    return None


def decide_silent(engine: Engine, job: JobState, now: float) -> Finding | None:
    """A rank whose heartbeats stopped while its peers still report and wait for it: its process died without anyone
    telling us (no launcher), or it is frozen; when every rank of its host and the host's own device metrics went
    silent together, the node is gone (``node_lost``). When every rank is silent, the collector lost telemetry: no
    verdict."""
    s = engine.settings
    if len(job.ranks) < 2:
        return None
    silent_cut = now - s.heartbeat_timeout_s
    silent = [r for r in job.ranks.values() if r.last_heartbeat is not None and r.exit is None
              and r.last_seen < silent_cut]
    alive = [r for r in job.ranks.values() if r.last_seen >= silent_cut and r.exit is None]
    if not silent or not alive:
        return None
    # Peers that are stuck (not merely inside a collective at the moment of their heartbeat): a node agent that
    # restarts makes its ranks silent for a while, but their peers keep stepping.
    stuck_for = min(s.heartbeat_timeout_s, s.hang_timeout_s)
    waiting = [r for r in alive if r.last_heartbeat and r.last_heartbeat.inflight is not None
               and r.last_heartbeat.inflight.kind == "collective" and stalled_for(r, now) >= stuck_for]
    if not waiting:
        return None
    r = min(silent, key=lambda x: x.last_seen)
    host = r.who.host
    ev = [Evidence(f"rank{r.rank}.last_heartbeat", round(r.last_seen, 3)),
          Evidence("waiting_ranks", ",".join(str(w.rank) for w in waiting))]
    if host is not None:
        on_host = [x for x in job.ranks.values() if x.who.host == host]
        host_seen = engine.devices.host_silent_since(host)
        if all(x in silent for x in on_host) and host_seen is not None and host_seen < silent_cut \
                and host_seen <= r.last_seen + s.heartbeat_timeout_s:
            ev.append(Evidence(f"host.{host}.last_device_sample", round(host_seen, 3)))
            return Finding(Kind.CRASH, RootCause.NODE_LOST, max(r.last_seen, host_seen), 0.8, r.rank, host, None, ev,
                           f"node {host} went silent: its {len(on_host)} rank(s) and its own device metrics stopped "
                           f"together {now - r.last_seen:.0f} s ago, with no exit reported, while ranks wait for it",
                           {"signal": "node_silent", "ranks": sorted(x.rank for x in on_host)})
    if r.frozen is not None:
        details = {"waiting": [{"rank": w.rank, "host": w.who.host, "since": round(now - stalled_for(w, now), 3)}
                               for w in sorted(waiting, key=lambda x: x.rank)[:64]]}
        return frozen_finding(engine, job, r, waiting, min(r.last_seen, r.frozen.time), ev, details)
    finding = Finding(Kind.CRASH, RootCause.RANK_PROCESS_DIED, r.last_seen, 0.7, r.rank, host, None, ev,
                      f"rank {r.rank} stopped sending heartbeats {now - r.last_seen:.0f} s ago while its peers wait "
                      f"for it: its process is gone", {"signal": "silent"}, explainable_by=[r.rank],
                      symptom_time=r.last_seen)
    engine.explain(finding, job, throttle=False)
    return finding


_FROZEN_WORDS = {"stopped": "is stopped (state {state}: SIGSTOP, a debugger or a scheduler's suspend; SIGCONT resumes "
                            "it)",
                 "gpu_driver": "is stuck inside the NVIDIA driver (state {state}, uninterruptible: the GPU stopped "
                               "answering; restarting on this node will not help)",
                 "uninterruptible": "is stuck in the kernel (state {state}, uninterruptible sleep: a file system or "
                                    "device that does not answer)"}


def frozen_finding(engine: Engine, job: JobState, r: RankState, waiters: list[RankState], onset: float,
                   ev: list[Evidence], details: dict) -> Finding:
    """``rank_frozen``: ``r``'s process exists but does not run (its launcher saw it in state T or D), while
    ``waiters`` wait for it. Stopped is nobody's hardware; uninterruptible sleep inside the GPU driver is."""
    fz = r.frozen
    ev = [Evidence("process.state", fz.state, fz.time)] + ([Evidence("process.wchan", fz.wchan)] if fz.wchan else []) \
        + list(ev)
    frame = next((line for line in fz.stack.splitlines() if "[nvidia" in line), None) if fz.stack else None
    if frame:
        ev.insert(2, Evidence("process.kernel_stack", frame))
    words = _FROZEN_WORDS.get(fz.frozen or "", "does not run (state {state})").format(state=fz.state)
    where = f" in {fz.wchan}" if fz.wchan else ""
    summary = f"rank {r.rank} {words}{where}; {len(waiters)} rank(s) wait for it"
    details = dict(details, reason=fz.frozen, state=fz.state, wchan=fz.wchan or None)
    details.pop("stack_top", None)
    if fz.frozen == "gpu_driver":
        finding = Finding(Kind.HANG, RootCause.RANK_FROZEN, onset, 0.85, r.rank, r.who.host, None, ev, summary,
                          details, category=Category.HARDWARE, action=Action.EXCLUDE_NODE_AND_RESTART,
                          explainable_by=[r.rank])
    elif fz.frozen == "stopped":
        finding = Finding(Kind.HANG, RootCause.RANK_FROZEN, onset, 0.9, r.rank, r.who.host, None, ev, summary,
                          details, category=Category.INFRASTRUCTURE, action=Action.INVESTIGATE)
    else:
        finding = Finding(Kind.HANG, RootCause.RANK_FROZEN, onset, 0.75, r.rank, r.who.host, None, ev, summary,
                          details, category=Category.INFRASTRUCTURE, action=Action.INVESTIGATE,
                          explainable_by=[r.rank])
    engine.explain(finding, job, throttle=False)
    return finding
