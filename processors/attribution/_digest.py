"""Node digests on the aggregator (issue 20): decodes ``otel_gpu.node.digest`` records into per-node state, and keeps
the per-rank state the detectors read without a per-rank record.

A digest (``processors/compact/_digest.py``) says, for one node and one job, where each of its ranks is: ranks in
groups of identical progress, one shared :class:`Heartbeat` per group, and the steps that ended. Applying it costs a
few attribute writes per rank and one StepSeen per rank and step, instead of decoding a request per rank.

The hang and silence detectors walk every rank of a job. With digests they do so only when the node digests say it
can matter (:func:`quiet` is the gate, checked first on each tick): some node has a rank whose stall reaches the hang
timeout, or a rank (or a whole node: its digests stopped) not seen for the heartbeat timeout. This is the rule the
detectors start with (``decide_hang`` returns nothing unless a reporting rank is stalled past the timeout;
``decide_silent`` nothing unless a rank is silent past the heartbeat timeout), evaluated per node on what the digests
said. When it opens, the detectors run unchanged on the ranks, so a verdict names the same cause and culprit as with
every rank's own records. :meth:`DigestJob.behind` is the digest-level view of the wait-for graph: the nodes whose
ranks are behind the job's highest collective, and which ranks (what a drill-down reads first).

Rules:
- a rank counts as seen (``last_seen``) when a digest carries a heartbeat or a step of it that arrived at the sidecar
  since the previous digest (``fresh``), as it would with its own records;
- a node whose digests stop leaves its ranks' ``last_seen`` where it was: the silence detector names it (a lost node:
  ``node_lost`` when its device metrics stopped too);
- a late digest (older than the newest applied for that node) changes nothing;
- a job with ranks that no digest names (a node whose sidecar has digests off) is never gated.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from otel_gpu.processors.attribution import _hang, _slowdown
from otel_gpu.processors.attribution._observations import Heartbeat, Identity, Inflight, NodeStep
from otel_gpu.processors.attribution._state import JobState, RankState

if TYPE_CHECKING:
    from otel_gpu.processors.attribution._engine import Engine

__all__ = ["DigestJob", "NodeState", "observe_digest", "quiet", "sync"]

# The instrumentation says where an in-flight operation was seen; the engine needs only what it is (as processor.py).
_INFLIGHT_KINDS = {"collective": "collective", "wait": "collective", "flight_recorder": "collective",
                   "p2p": "collective", "data": "data", "checkpoint": "checkpoint"}
_MAX_NODES = 65536
_MAX_OPEN_STEPS = 256


@dataclass
class NodeState:
    """What the newest digest of one node said, and what the gate reads."""

    host: str
    sent: float = 0.0  # the sidecar's clock when it built the newest digest applied
    received: float = 0.0  # collector clock
    ranks: set[int] = field(default_factory=set)  # ranks of the job on this node, exited ones gone
    stall_t0: float = 0.0  # min over its ranks of last_seen - own stall: stalled past T at now iff now - it >= T
    seen_floor: float = 0.0  # min over its ranks of last_seen
    pg: dict[str, dict] = field(default_factory=dict)  # the digest's per-group summary
    last_step: int = -1  # the highest step its rows named
    counted: bool = False  # in DigestJob.at_step
    base: dict[str, Any] = field(default_factory=dict)  # job id and host of its digests' resource
    #: the newest digest's groups and collector time, not applied to the ranks yet (:func:`sync`)
    pending: tuple[list, float] | None = None


@dataclass
class DigestJob:
    """A job's node digests; reset with each incarnation."""

    restart_count: int = 0
    nodes: dict[str, NodeState] = field(default_factory=dict)
    rank_node: dict[int, str] = field(default_factory=dict)  # every rank a digest named -> its host
    identities: dict[int, Identity] = field(default_factory=dict)
    digests: int = 0
    steps: dict[int, NodeStep] = field(default_factory=dict)  # steps not closed yet, merged over the nodes' rows
    #: last_step -> nodes at it: how many nodes are past a step, without a walk over the nodes
    at_step: dict[int, int] = field(default_factory=dict)

    live: int = 0  # nodes counted in at_step: their ranks step (a node whose ranks all exited is not)
    #: nodes whose newest digest waits to be applied to their ranks (:func:`sync`), by host
    unsynced: dict[str, NodeState] = field(default_factory=dict)
    identity: Callable[[dict[str, Any]], Identity | None] | None = None  # the processor's identity builder
    said: dict[int, int] = field(default_factory=dict)  # rank -> a hash of what its node's digests said of it (who)

    def move(self, node: NodeState, step: int) -> None:
        """``node``'s rows reached ``step``."""
        self.uncount(node)
        node.last_step, node.counted = step, True
        self.at_step[step] = self.at_step.get(step, 0) + 1
        self.live += 1

    def uncount(self, node: NodeState) -> None:
        """``node`` no longer holds steps back (its ranks exited), or is about to be counted at a new step."""
        if not node.counted:
            return
        left = self.at_step.get(node.last_step, 0) - 1
        if left > 0:
            self.at_step[node.last_step] = left
        else:
            self.at_step.pop(node.last_step, None)
        node.counted = False
        self.live -= 1

    def past(self, step: int) -> int:
        """Counted nodes whose rows went beyond ``step``."""
        return sum(count for s, count in self.at_step.items() if s > step)

    def behind(self) -> dict[str, list[dict[str, Any]]]:
        """Per process group, the nodes behind the job's highest started collective: ``{pg: [{host, started,
        ranks}]}``, lowest first (``ranks``: the node's ranks behind, or all of them when the whole node is)."""
        top: dict[str, int] = {}
        for node in self.nodes.values():
            for pg, entry in node.pg.items():
                started = entry.get("started")
                if started:
                    top[pg] = max(top.get(pg, started[1]), started[1])
        out: dict[str, list[dict[str, Any]]] = {}
        for node in self.nodes.values():
            for pg, entry in node.pg.items():
                started = entry.get("started")
                if not started or pg not in top:
                    continue
                if started[1] < top[pg]:
                    ranks = sorted(node.ranks)
                elif started[0] < top[pg]:
                    ranks = list(entry.get("behind") or [])
                else:
                    continue
                out.setdefault(pg, []).append({"host": node.host, "started": started[0], "ranks": ranks})
        for rows in out.values():
            rows.sort(key=lambda r: (r["started"], r["host"]))
        return out


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError, OverflowError):
        return None


def _float(v: Any) -> float | None:
    try:
        return float(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


def _heartbeat(who: Identity, g: dict[str, Any]) -> Heartbeat:
    inflight = g.get("inflight")
    infl = None
    if isinstance(inflight, dict) and _float(inflight.get("since")) is not None:
        kind = str(inflight.get("kind"))
        infl = Inflight(kind=_INFLIGHT_KINDS.get(kind, kind), op=inflight.get("op"),
                        pg=None if inflight.get("pg") is None else str(inflight.get("pg")),
                        seq=_int(inflight.get("seq")), since=float(inflight["since"]),
                        bytes=_int(inflight.get("bytes")), p2p=bool(inflight.get("p2p")) or kind == "p2p")
    return Heartbeat(who, float(g.get("time") or 0.0), _int(g.get("step")), g.get("state"), infl,
                     _seq_map(g.get("last_seq")), _seq_map(g.get("last_started_seq")),
                     g.get("stack_top"), _float(g.get("stalled_s")), _int(g.get("steps_done")))


def _seq_map(v: Any) -> dict[str, int]:
    """``{pg: seq}`` as the detectors read it; the digest's own dict when it is one already (shared, read only)."""
    if not v:
        return {}
    if all(type(s) is int for s in v.values()):
        return v  # JSON object keys are strings
    return {str(k): int(s) for k, s in v.items()}


def observe_digest(engine: Engine, res: dict[str, Any], body: dict[str, Any], now: float,
                   identity: Callable[[dict[str, Any]], Identity | None]) -> None:
    """Applies one node digest (``body``, its resource's attributes ``res``) to the job's state. ``identity`` builds
    an :class:`Identity` from resource attributes (the processor's). Raises on a body of the wrong shape (the
    processor skips that record).

    The usual digest (every group fresh, the node's ranks as before, no new identity) is not applied to each rank
    at once: the node keeps it (``pending``) and :func:`sync` applies it when something reads the ranks (a rank's own
    record, a detector the gate let run, a verdict). What the gate reads is computed from the groups (each group's
    own stall), so that a healthy job costs a few operations per group and none per rank."""
    host = str(body.get("host") or res.get("host.name") or "")
    ranks = body.get("ranks") or []
    if not all(type(n) is int for n in ranks):
        ranks = [int(n) for n in ranks]
    who_map = body.get("who") or {}
    base = {k: res[k] for k in ("training.job.id", "host.name") if k in res}
    known = engine.jobs.get(res.get("training.job.id"))  # type: ignore[arg-type]
    # Identities first: a higher restart count is a new incarnation (the engine clears the job's ranks). The sidecar
    # says them again every refresh (for an aggregator that restarted): what it said before is not decoded again.
    said = known.digest.said if known is not None and isinstance(known.digest, DigestJob) \
        and known.digest.restart_count == known.restart_count else None
    fresh_ids: dict[int, Identity] = {}
    heard: dict[int, int] = {}
    for key, attrs in who_map.items():
        if isinstance(attrs, dict):
            try:
                h = hash((key, *attrs.items()))
            except TypeError:  # a value that is a list or an object: decoded each time
                h = None
            n = _int(key)
            if h is not None and n is not None:
                if said is not None and said.get(n) == h:
                    continue
                heard[n] = h
        who = identity({**base, **(attrs if isinstance(attrs, dict) else {}), "training.rank": int(key)})
        if who is not None:
            fresh_ids[who.rank] = who
    known = known if not fresh_ids else None
    if known is not None:  # the usual digest: a known job, no new identity (what engine._job would find)
        job = known
        job.last_activity = max(job.last_activity, now)
    else:
        probe = max(fresh_ids.values(), key=lambda w: w.restart_count, default=None)
        if probe is None:
            if not ranks:
                return
            probe = identity({**base, "training.rank": ranks[0]})
            if probe is None:
                return
        job = engine._job(probe, now)
    dj = job.digest
    if not isinstance(dj, DigestJob) or dj.restart_count != job.restart_count:
        dj = job.digest = DigestJob(job.restart_count)
    dj.identity = identity
    if fresh_ids and len(dj.identities) < engine.settings.max_ranks_per_job:  # bounded: who maps are input
        dj.identities.update(fresh_ids)
        dj.said.update((n, h) for n, h in heard.items() if n in fresh_ids)
    node = dj.nodes.get(host)
    sent = float(body.get("time") or 0.0)
    if node is None:
        if len(dj.nodes) >= _MAX_NODES:
            return
        node = dj.nodes[host] = NodeState(host)
    elif sent < node.sent:
        return  # a late digest: a newer one of this node was applied
    node.sent, node.received, node.base = sent, now, base
    dj.digests += 1
    node.pg = body.get("pg") or {}
    groups = body.get("groups") or []
    worst = None
    if not fresh_ids and ranks and not body.get("gone") and len(ranks) == len(node.ranks) \
            and node.ranks.issuperset(ranks):
        worst = _whole_fresh(node.ranks, groups)
    if worst is not None:
        # Every rank of the node is in a fresh group: seen now, stalled at most as long as its group says.
        node.pending = (groups, now)
        dj.unsynced[host] = node
        node.stall_t0, node.seen_floor = now - worst, now
    else:
        if node.pending is not None:
            _flush(engine, job, dj, node)
        # The groups' heartbeats, and on the way what the gate reads (_node_floor, without a second walk).
        stall_t0, seen, covered = _apply_groups(engine, job, dj, node, groups, now, fresh_ids)
        for n in body.get("gone") or []:
            node.ranks.discard(int(n))
        if not ranks and not node.ranks:
            dj.uncount(node)  # every rank of the node exited: the job's steps no longer wait for it
        if len(ranks) != len(node.ranks) or not node.ranks.issuperset(ranks):
            node.ranks.update(ranks)
            for n in ranks:
                dj.rank_node.setdefault(n, host)
                if n not in job.ranks:
                    _rank_state(engine, job, dj, node, n, now, fresh_ids)
        if covered == len(node.ranks):  # every rank of the node was in a group (a sidecar's digest names them all)
            node.stall_t0, node.seen_floor = stall_t0, seen
        else:
            _node_floor(job, node)
    rows = body.get("step_rows")
    if rows:
        _step_rows(engine, job, dj, node, rows, now)


def _whole_fresh(node_ranks: set[int], groups: list) -> float | None:
    """The longest own stall over ``groups`` when each is fresh and together they name every rank of the node (and
    no other); None otherwise (the digest is applied rank by rank)."""
    worst = 0.0
    named: set[int] = set()
    for g in groups:
        members = g.get("ranks")
        if not members or not g.get("fresh") or not node_ranks.issuperset(members):
            return None
        named.update(members)
        own = _group_stall(g)
        if own > worst:
            worst = own
    return worst if len(named) == len(node_ranks) else None


def _group_stall(g: dict[str, Any]) -> float:
    """:func:`_own_stall` of the heartbeat :func:`_heartbeat` would build from group ``g``, without building it."""
    inflight = g.get("inflight")
    since = _float(inflight.get("since")) if isinstance(inflight, dict) else None
    return _stall(_float(g.get("stalled_s")), float(g.get("time") or 0.0), since)


def _rank_state(engine: Engine, job: JobState, dj: DigestJob, node: NodeState, n: int, now: float,
                fresh_ids: dict[int, Identity]) -> RankState:
    """Rank ``n``'s state, made (or its identity renewed) from what the digests said of it."""
    r = job.ranks.get(n)
    who = fresh_ids.get(n)
    if r is None or who is not None:
        if who is None:
            who = dj.identities.get(n) or (dj.identity({**node.base, "training.rank": n})
                                           if dj.identity is not None else None)
            if who is None:
                raise ValueError(f"digest names rank {n!r} of no job")
            if who.restart_count != job.restart_count:
                who = Identity(who.job_id, who.rank, who.host, restart_count=job.restart_count)
        created = n not in job.ranks
        _, r = engine._rank(who, now, sync=False)
        if created:
            r.last_seen = now  # a digest named it: a record of it reached its sidecar, as one would here
        dj.rank_node[n] = node.host
    return r


def _apply_groups(engine: Engine, job: JobState, dj: DigestJob, node: NodeState, groups: list, now: float,
                  fresh_ids: dict[int, Identity]) -> tuple[float, float, int]:
    """Each group's heartbeat to its ranks (and a fresh group's ranks seen ``now``); returns (stall_t0, seen floor,
    ranks covered) over them, as the gate reads them."""
    job_ranks = job.ranks
    stall_t0 = seen = float("inf")
    covered = 0
    for g in groups:
        members = g.get("ranks") or ()
        if not members:
            continue
        hb = None
        own = 0.0
        fresh = bool(g.get("fresh"))
        for n in members:
            # the usual case: a rank known, no new identity
            r = job_ranks.get(n) if not fresh_ids or n not in fresh_ids else None
            if r is None:
                r = _rank_state(engine, job, dj, node, int(n), now, fresh_ids)
            if hb is None:
                hb = _heartbeat(r.who, g)
                own = _own_stall(hb)
            r.last_heartbeat = hb
            if fresh and now > r.last_seen:
                r.last_seen = now
            last = r.last_seen
            if last - own < stall_t0:
                stall_t0 = last - own
            if last < seen:
                seen = last
            covered += 1
    return stall_t0, seen, covered


def _flush(engine: Engine, job: JobState, dj: DigestJob, node: NodeState) -> None:
    """Applies ``node``'s pending digest to its ranks."""
    pending, node.pending = node.pending, None
    dj.unsynced.pop(node.host, None)
    if pending is None or dj.restart_count != job.restart_count:
        return
    groups, then = pending
    try:
        _apply_groups(engine, job, dj, node, groups, then, {})
    except (TypeError, ValueError, AttributeError, OverflowError, KeyError, IndexError):
        pass  # a group of the wrong shape (hostile input): its ranks keep what they had, as when it is skipped


def sync(engine: Engine, job: JobState) -> None:
    """Applies every node's pending digest to its ranks: called before anything reads the job's rank states."""
    dj = job.digest
    if not isinstance(dj, DigestJob) or not dj.unsynced:
        return
    for node in list(dj.unsynced.values()):
        _flush(engine, job, dj, node)


def _step_rows(engine: Engine, job: JobState, dj: DigestJob, node: NodeState, rows: list, now: float) -> None:
    """Merges a node's step rows into the job's steps, and closes those every node with ranks reported (or passed),
    as ``_slowdown.close_steps`` does per rank."""
    for row in rows:
        step = int(row[0])
        if step > node.last_step:
            dj.move(node, step)
        if step <= job.last_step_closed:
            continue
        ns = dj.steps.get(step)
        if ns is None:
            if len(dj.steps) >= _MAX_OPEN_STEPS:
                del dj.steps[min(dj.steps)]
            ns = dj.steps[step] = NodeStep(float(row[2]))
        ns.add(row)
    while dj.steps:
        step = min(dj.steps)
        ns = dj.steps[step]
        if ns.nodes < dj.live and dj.past(step) < dj.live:
            break
        del dj.steps[step]
        job.last_step_closed = step
        finding = _slowdown.evaluate(engine, job, step, ns.duration, ns, None)
        if finding is not None:
            engine._pending.append(engine._emit(job, finding, now))


def _own_stall(hb: Heartbeat) -> float:
    """How long the rank had made no progress when it sent ``hb``."""
    return _stall(hb.stalled_s, hb.time, hb.inflight.since if hb.inflight is not None else None)


def _stall(stalled_s: float | None, sent: float, inflight_since: float | None) -> float:
    """A rank's own stall when it reported at ``sent``: its watchdog's count, or its in-flight operation's age."""
    own = stalled_s if stalled_s is not None else 0.0
    if inflight_since is not None:
        own = max(own, sent - inflight_since)
    return own


def _node_floor(job: JobState, node: NodeState) -> None:
    stall_t0 = seen = float("inf")
    for n in node.ranks:
        r = job.ranks.get(n)
        if r is None:
            continue
        hb = r.last_heartbeat
        own = _own_stall(hb) if hb is not None else 0.0
        stall_t0 = min(stall_t0, r.last_seen - own)
        seen = min(seen, r.last_seen)
    node.stall_t0, node.seen_floor = stall_t0, seen


def quiet(engine: Engine, job: JobState, now: float) -> bool:
    """True when the node digests show that the hang and silence detectors have nothing to find on this tick: every
    rank of the job is named by a digest, none is stalled for the hang timeout and none is unseen for the heartbeat
    timeout. False (run the detectors) whenever that is not certain."""
    dj = job.digest
    if not isinstance(dj, DigestJob) or dj.restart_count != job.restart_count or len(job.ranks) != len(dj.rank_node):
        return False
    stuck_before = now - _hang.hang_timeout(engine, job)
    silent_cut = now - engine.settings.heartbeat_timeout_s
    for node in dj.nodes.values():
        if node.stall_t0 <= stuck_before or node.seen_floor < silent_cut:
            return False
    return True
