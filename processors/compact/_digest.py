"""Node digests (issue 20): one ``otel_gpu.node.digest`` log record per job per node per interval, instead of every
rank's heartbeats and step spans.

The sidecar knows its node's ranks. Per job it keeps each rank's newest heartbeat, the step spans of steps not yet
complete on the node, each rank's baselines and its identity; :meth:`NodeDigests.bodies` turns them into one record
whose JSON body says, per process group, the lowest and highest completed, started and in-flight collective sequence
numbers and which ranks are behind the node's highest; the ranks in *groups* of identical progress (step, state,
in-flight operation, last sequence numbers: a healthy node is one or two groups); one *step row* per step its ranks
completed (below) and a min/median/max summary of step times; the rank stalled longest; what changed since the last
digest; the identities of ranks that are new (and all of them every ``refresh_s``, so that an aggregator that
restarted learns them again). A group is ``fresh`` when a heartbeat or a step span of its ranks arrived since the last
digest: the aggregator counts a rank as seen only then, as it would its own record.

Step rows (digest v2): the slowdown detector compares each rank's compute and data time with the rank's own usual
(``processors/attribution/_slowdown.py``). Those baselines live here, where a node's few ranks are: each rank's median
compute and data seconds over its last 32 healthy steps, after the node's first ``slowdown_warmup_steps``; a step is
healthy when the node's step time is within the job detector's own slow limit of the node's usual (the ranks of a
synchronous job wait for each other, so the node's step time is the job's). A step's row goes out once every rank of
the node reported it (or a later one), or after three intervals with those that did: ``[step, ranks, start, end,
duration, data_s, checkpoint_s, data_growth_min, collective_floor_min, top]``. start, end, data_s and checkpoint_s are
the lowest rank's (what goodput counts); duration is the longest of the node's ranks; data_growth_min the least growth
of a rank's data time over its baseline; collective_floor_min the least of each rank's collective seconds plus its
compute and data baselines (None while a rank has no baseline); top the two ranks whose compute or data time grew
most, ``[[rank, compute_growth, data_growth], ...]``. The aggregator does per node and step what it did per rank and
step (at 131,072 ranks that per-rank work was most of its CPU).

What a rank sends on its own (exceptions, signals, exits, checkpoint spans) is still forwarded as it is; its stacks
too, unless it waits in a collective (the detectors read the stacks of the rank everyone waits for, never of a
waiter: at 131,072 ranks a hang would otherwise send 131,071 stacks the aggregator does not read).

Example:
    >>> d = NodeDigests("node-1", clock=lambda: 100.0)
    >>> who = {"training.job.id": "j", "training.rank": 3, "host.name": "node-1"}
    >>> d.heartbeat(who, {"step": 7, "state": "step", "last_seq": {"0": 56}, "last_started_seq": {"0": 56}}, 99.5)
    True
    >>> body = d.bodies(100.0)[0][1]
    >>> body["ranks"], body["pg"]["0"]["started"], body["groups"][0]["fresh"]
    ([3], [56, 56], True)
    >>> d.step(who, 7, 98.0, 99.0, 0.25, 0.05, None)
    True
    >>> d.bodies(101.0)[0][1]["step_rows"]  # rank 3 completed step 7; no baseline yet: no growth, no floor
    [[7, 1, 98.0, 99.0, 1.0, 0.05, None, 0.0, None, [[3, 0.0, 0.0]]]]
"""
from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

from otel_gpu.processors.attribution import AttributionConfig
from otel_gpu.schema import identity as I

__all__ = ["NodeDigests", "DIGEST_VERSION", "IDENTITY_KEYS", "RANKS_PER_INTERVAL"]

DIGEST_VERSION = 2
_JOB, _RANK, _HOST = I.JOB_ID, I.RANK, I.HOST_NAME
#: Resource attributes of a rank that the aggregator's Identity holds (sent when new, and every refresh_s).
IDENTITY_KEYS = (I.LOCAL_RANK, I.PROCESS_PID, I.GPU_INDEX, I.GPU_UUID, I.WORLD_SIZE,
                 I.RESTART_COUNT, I.NET_INTERFACES, I.PROCESS_CREATION_TIME)
_COLLECTIVE_KINDS = frozenset(("collective", "wait", "flight_recorder"))
_MAX_RANKS = 4096  # ranks per job on one node (8 is usual); more is hostile input
_MAX_JOBS = 64
#: A job's digests go one more interval apart for each this many ranks (NodeDigests.intervals_for).
RANKS_PER_INTERVAL = 65536
_MAX_OPEN_STEPS = 64  # steps of a job waiting for the node's other ranks (a few, usually)
_ROW_AFTER = 3  # intervals a step waits for the node's other ranks before its row goes out with those that reported
_BASELINE = 32  # healthy steps per rank baseline
_TOP = 2  # ranks per row whose own time grew most
_SLOW = AttributionConfig()  # the job detector's slow-step rule and warm-up, applied to the node's own step times


class _Rank:
    __slots__ = ("rank", "who", "who_sent", "hb", "hb_key", "fresh", "sent_key", "last_step", "compute_base",
                 "data_base")

    def __init__(self, rank: int, who: dict[str, Any]):
        self.rank = rank
        self.who = who  # identity attributes (IDENTITY_KEYS present on its resource)
        self.who_sent = -1e18  # when its identity last went out in a digest
        self.hb: dict[str, Any] | None = None  # the newest heartbeat's fields the detectors read
        self.hb_key = ""  # those fields without the ones that differ from rank to rank (time, stall), as text
        self.fresh = False  # a heartbeat or a step arrived since the last digest
        self.sent_key = ""  # hb_key in the last digest ("changed")
        self.last_step: int | None = None  # the highest step it completed
        self.compute_base: deque[float] = deque(maxlen=_BASELINE)  # healthy steps' compute seconds
        self.data_base: deque[float] = deque(maxlen=_BASELINE)


class _Job:
    __slots__ = ("ranks", "gone", "last_refresh", "open_steps", "closed", "durations", "rows_done", "step_s",
                 "world", "last_sent", "restart_count")

    def __init__(self) -> None:
        self.ranks: dict[int, _Rank] = {}
        self.gone: list[int] = []  # ranks that exited since the last digest
        self.last_refresh: float | None = None  # when every identity last went out (new ones go at once)
        #: step -> (when its first span came, {rank: (start, end, collective_s, data_s, checkpoint_s)})
        self.open_steps: dict[int, tuple[float, dict[int, tuple]]] = {}
        self.closed = -1  # the highest step whose row went out (later spans of it are late)
        self.durations: deque[float] = deque(maxlen=30)  # the node's healthy step times (its usual)
        self.rows_done = 0  # rows built (the first slowdown_warmup_steps teach no baseline)
        self.step_s: list[float] = []  # step durations seen since the last digest
        self.world: int | None = None  # the job's world size, as its ranks say
        self.last_sent: float | None = None  # when its last digest went
        #: the latest incarnation its ranks on this node said they are (training.restart_count), None: not said
        self.restart_count: int | None = None


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None and v != "" and not isinstance(v, bool) else None
    except (TypeError, ValueError, OverflowError):
        return None


def _num(v: Any) -> float | None:
    try:
        return float(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def _seqs(v: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    if isinstance(v, dict):
        for k, s in v.items():
            n = _int(s)
            if n is not None:
                out[str(k)] = n
    return out


class NodeDigests:
    """What the sidecar holds between digests, per job and rank of its node. Not thread-safe: the compact processor
    calls it under its lock."""

    def __init__(self, host: str, clock: Callable[[], float], refresh_s: float = 30.0, interval_s: float = 1.0):
        self.host = host
        self.clock = clock
        self.refresh_s = refresh_s
        self.interval_s = interval_s
        self.jobs: dict[str, _Job] = {}
        #: heartbeats and step spans folded into digests, stacks held back (waiters'), digests built
        self.stats = {"heartbeats": 0, "steps": 0, "stacks_held": 0, "digests": 0}

    # -- what the ranks send -----------------------------------------------------------------------------------
    def _rank(self, res: dict[str, Any]) -> tuple[_Job, _Rank] | None:
        job_id, rank_no = res.get(_JOB), _int(res.get(_RANK))
        if not isinstance(job_id, str) or not job_id or rank_no is None:
            return None
        job = self.jobs.get(job_id)
        if job is None:
            if len(self.jobs) >= _MAX_JOBS:
                return None
            job = self.jobs[job_id] = _Job()
        who = {k: res[k] for k in IDENTITY_KEYS if k in res}
        host = res.get(_HOST)
        if isinstance(host, str) and host:
            who[_HOST] = host
        world = _int(who.get(I.WORLD_SIZE))
        if world is not None and world != job.world:
            job.world = world
        restarts = _int(who.get(I.RESTART_COUNT))
        if restarts is not None and (job.restart_count is None or restarts > job.restart_count):
            if job.restart_count is not None:
                # A new incarnation on this node (its ranks came back after their exits were seen, or still look
                # like the old ones): it redoes steps from its checkpoint, and they count anew.
                job.open_steps.clear()
                job.closed = -1
            job.restart_count = restarts
        r = job.ranks.get(rank_no)
        if r is None:
            if len(job.ranks) >= _MAX_RANKS:
                return None
            r = job.ranks[rank_no] = _Rank(rank_no, who)
            if rank_no in job.gone:
                job.gone.remove(rank_no)
        elif r.who != who:
            if _int(who.get(I.RESTART_COUNT)) != _int(r.who.get(I.RESTART_COUNT)) \
                    or who.get(I.PROCESS_PID) != r.who.get(I.PROCESS_PID):
                # a new process of this rank: what the old one said is history (a new incarnation's steps are
                # reset for the whole job above)
                r.hb, r.hb_key, r.last_step = None, "", None
            r.who, r.who_sent = who, -1e18
        return job, r

    def heartbeat(self, res: dict[str, Any], body: dict[str, Any], t: float) -> bool:
        """A rank's ``otel_gpu.progress`` body; True when it is folded into the digest (not forwarded)."""
        found = self._rank(res)
        if found is None:
            return False
        _, r = found
        if r.hb is not None and t < r.hb.get("time", 0.0):
            return True  # an older heartbeat that arrived late: the newer one stands
        inflight = body.get("inflight")
        infl = None
        if isinstance(inflight, dict) and _num(inflight.get("since")) is not None:
            infl = {k: inflight.get(k) for k in ("kind", "op", "pg", "seq", "bytes", "p2p") if inflight.get(k)
                    is not None}
            infl["since"] = _num(inflight.get("since"))
        counters = body.get("counters")
        hb = {"step": _int(body.get("step")), "state": body.get("state") if isinstance(body.get("state"), str)
              else None, "inflight": infl, "last_seq": _seqs(body.get("last_seq")),
              "last_started_seq": _seqs(body.get("last_started_seq")),
              "stack_top": body.get("stack_top") or body.get("user_top") or None,
              "steps_done": _int(counters.get("steps")) if isinstance(counters, dict) else None}
        # What tells ranks apart for the detectors; when an operation began and how long a rank stalled are kept as
        # the group's oldest and longest (its ranks entered the same collective within moments).
        same = dict(hb, inflight=None if infl is None else {k: v for k, v in infl.items() if k != "since"})
        key = json.dumps(same, sort_keys=True, default=str)
        hb["time"] = t
        hb["stalled_s"] = _num(body.get("stalled_s"))
        r.hb, r.hb_key, r.fresh = hb, key, True
        self.stats["heartbeats"] += 1
        return True

    def step(self, res: dict[str, Any], step: int, start: float, end: float, collective_s: float | None,
             data_s: float | None, checkpoint_s: float | None) -> bool:
        found = self._rank(res)
        if found is None:
            return False
        job, r = found
        r.fresh = True
        if r.last_step is None or step > r.last_step:
            r.last_step = step
        self.stats["steps"] += 1
        if step <= job.closed:
            return True  # its row went out without it (late): only a sign of life
        opened = job.open_steps.get(step)
        if opened is None:
            if len(job.open_steps) >= _MAX_OPEN_STEPS:
                del job.open_steps[min(job.open_steps)]
            opened = job.open_steps[step] = (self.clock(), {})
        opened[1][r.rank] = (start, end, collective_s, data_s, checkpoint_s)
        if len(job.step_s) < 4096:
            job.step_s.append(end - start)
        return True

    def stacks_held(self, res: dict[str, Any], body: dict[str, Any]) -> bool:
        """True when the stacks come from a rank waiting in a collective (held back, counted in the digest)."""
        inflight = body.get("inflight")
        if not isinstance(inflight, dict) or str(inflight.get("kind")) not in _COLLECTIVE_KINDS \
                or inflight.get("p2p") or inflight.get("seq") is None:
            return False
        if self._rank(res) is None:
            return False
        self.stats["stacks_held"] += 1
        return True

    def exited(self, res: dict[str, Any], record_attrs: dict[str, Any]) -> None:
        """A rank's exit (from the rank, or its launcher naming it): it leaves the digest."""
        job_id = record_attrs.get(_JOB) or res.get(_JOB)
        rank_no = _int(record_attrs.get(_RANK, res.get(_RANK)))
        job = self.jobs.get(job_id) if isinstance(job_id, str) else None
        if job is None or rank_no is None or rank_no not in job.ranks:
            return
        del job.ranks[rank_no]
        job.gone.append(rank_no)

    # -- step rows -----------------------------------------------------------------------------------------------
    def _rows(self, job: _Job, now: float) -> list[list]:
        """Rows of the steps every rank of the node completed (or whose wait ran out), lowest step first."""
        rows = []
        for step in sorted(job.open_steps):
            since, spans = job.open_steps[step]
            done = all(r.last_step is not None and r.last_step >= step for r in job.ranks.values())
            if not (done or len(spans) >= len(job.ranks) or now - since >= _ROW_AFTER * self.interval_s):
                break
            del job.open_steps[step]
            job.closed = max(job.closed, step)
            rows.append(self._row(job, step, spans))
        return rows

    def _row(self, job: _Job, step: int, spans: dict[int, tuple]) -> list:
        first = spans[min(spans)]
        duration = max(end - start for start, end, *_ in spans.values())
        top: list[tuple[float, int, float, float]] = []
        data_min: float | None = None
        floor: float | None = float("inf")
        learned: list[tuple[_Rank, float | None, float | None]] = []
        for n, (start, end, coll, data, ckpt) in spans.items():
            r = job.ranks.get(n)
            compute = None if coll is None else max(0.0, end - start - coll - (data or 0.0) - (ckpt or 0.0))
            c_base = statistics.median(r.compute_base) if r is not None and r.compute_base else None
            d_base = statistics.median(r.data_base) if r is not None and r.data_base else None
            dc = compute - c_base if compute is not None and c_base is not None else 0.0
            dd = data - d_base if data is not None and d_base is not None else 0.0
            top.append((max(dc, dd), n, dc, dd))
            data_min = dd if data_min is None else min(data_min, dd)
            if floor is not None:
                floor = None if coll is None or c_base is None else min(floor, coll + c_base + (d_base or 0.0))
            if r is not None:
                learned.append((r, compute, data))
        top.sort(key=lambda t: (-t[0], t[1]))
        # The node's own step time against its usual, with the job detector's rule: a slow step teaches nothing.
        job.rows_done += 1
        if job.rows_done > _SLOW.slowdown_warmup_steps:
            healthy = True
            if len(job.durations) >= 5:
                base = statistics.median(job.durations)
                mad = statistics.median(abs(d - base) for d in job.durations)
                healthy = duration <= max(base * _SLOW.slowdown_ratio, base + _SLOW.slowdown_min_excess_s,
                                          base + 6 * 1.4826 * mad)
            if healthy:
                job.durations.append(duration)
                for r, compute, data in learned:
                    if compute is not None:
                        r.compute_base.append(compute)
                    if data is not None:
                        r.data_base.append(data)
        return [step, len(spans), first[0], first[1], _round(duration), first[3], first[4], _round(data_min),
                _round(floor), [[n, _round(dc), _round(dd)] for _, n, dc, dd in top[:_TOP]]]

    # -- the digest ----------------------------------------------------------------------------------------------
    @staticmethod
    def intervals_for(world_size: int | None) -> int:
        """How many intervals apart a job's digests go: one up to RANKS_PER_INTERVAL ranks, one more for each
        RANKS_PER_INTERVAL beyond (a 131,072-rank job: every 2 s). The aggregator's cost is per digest, and a job
        that large steps in seconds and hangs for minutes before its watchdog acts: a digest every second per node
        is more than it needs (docs/scale.md). A rank's exception, exit or stop signal never waits."""
        if not world_size or world_size <= RANKS_PER_INTERVAL:
            return 1
        return -(-world_size // RANKS_PER_INTERVAL)

    def restart_count(self, job_id: str) -> int | None:
        """The incarnation a job's digests speak for (its resource's ``training.restart_count``): the latest its
        ranks on this node said. A restarted job's step rows are its new incarnation's (the old one's open steps
        were dropped when its ranks came back), and its aggregator's goodput counts them there."""
        job = self.jobs.get(job_id)
        return None if job is None else job.restart_count

    def bodies(self, now: float) -> list[tuple[str, dict[str, Any]]]:
        """(job id, digest body) per job with ranks on this node whose digest is due; resets what is per
        interval."""
        out = []
        for job_id, job in list(self.jobs.items()):
            if not job.ranks and not job.gone:
                del self.jobs[job_id]
                continue
            every = self.intervals_for(job.world) * self.interval_s
            if job.last_sent is not None and now - job.last_sent < every - 0.5 * self.interval_s:
                continue  # a large job: not due yet (the timer's jitter aside)
            job.last_sent = now
            out.append((job_id, self._body(job, now)))
            job.gone = []
        self.stats["digests"] += len(out)
        return out

    def _body(self, job: _Job, now: float) -> dict[str, Any]:
        if job.last_refresh is None:
            job.last_refresh = now
        refresh = now - job.last_refresh >= self.refresh_s
        if refresh:
            job.last_refresh = now
        who: dict[str, dict] = {}
        groups: dict[tuple, dict] = {}
        pgs: dict[str, dict[str, list]] = {}
        changed: list[int] = []
        stalled: tuple[float, int] | None = None
        for n in sorted(job.ranks):
            r = job.ranks[n]
            if refresh or r.who_sent < 0:
                who[str(n)] = r.who
                r.who_sent = now
            hb = r.hb
            if hb is None:
                continue
            if r.hb_key != r.sent_key:
                changed.append(n)
                r.sent_key = r.hb_key
            g = groups.get((r.fresh, r.hb_key))
            if g is None:
                g = groups[(r.fresh, r.hb_key)] = {"ranks": [], "fresh": r.fresh, **hb}
                if hb["inflight"] is not None:
                    g["inflight"] = dict(hb["inflight"])
            else:
                g["time"] = max(g["time"], hb["time"])
                if hb["stalled_s"] is not None:
                    g["stalled_s"] = max(g["stalled_s"] or 0.0, hb["stalled_s"])
                if hb["inflight"] is not None:
                    g["inflight"]["since"] = min(g["inflight"]["since"], hb["inflight"]["since"])
            g["ranks"].append(n)
            r.fresh = False
            own = max(hb["stalled_s"] or 0.0, hb["time"] - hb["inflight"]["since"] if hb["inflight"] else 0.0)
            if stalled is None or own > stalled[0]:
                stalled = (own, n)
            for key, row in (("completed", hb["last_seq"]), ("started", hb["last_started_seq"])):
                for pg, seq in row.items():
                    pgs.setdefault(pg, {}).setdefault(key, []).append((seq, n))
            i = hb["inflight"]
            if i is not None and i.get("pg") is not None and _int(i.get("seq")) is not None:
                pgs.setdefault(str(i["pg"]), {}).setdefault("inflight", []).append((_int(i["seq"]), n))
        pg_out = {}
        for pg, rows in pgs.items():
            entry: dict[str, Any] = {}
            for key in ("completed", "started", "inflight"):
                vals = rows.get(key)
                entry[key] = [min(v for v, _ in vals), max(v for v, _ in vals)] if vals else None
            started = rows.get("started", [])
            top = max((v for v, _ in started), default=None)
            entry["behind"] = sorted(n for v, n in started if v < top) if top is not None else []
            pg_out[pg] = entry
        durations = sorted(job.step_s)
        job.step_s = []
        host = next((r.who[_HOST] for r in job.ranks.values() if _HOST in r.who), self.host)
        return {"v": DIGEST_VERSION, "host": host, "time": now, "interval_s": self.interval_s,
                "ranks": sorted(job.ranks), "who": who, "groups": list(groups.values()), "pg": pg_out,
                "step_rows": self._rows(job, now),
                "step_s": [round(durations[0], 6), round(statistics.median(durations), 6),
                           round(durations[-1], 6)] if durations else None,
                "stalled": None if stalled is None else {"rank": stalled[1], "s": round(stalled[0], 3)},
                "changed": changed, "gone": sorted(job.gone)}
