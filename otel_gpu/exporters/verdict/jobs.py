"""The job board of the ``verdict`` exporter: one decision per failure for a job of many nodes (docs/restart.md,
"Many nodes").

Every node of a job runs ``otel-gpu run --restart auto --verdict-url http://AGGREGATOR:4319 -- torchrun ...``. Each
node's supervisor *registers* here (its host, the address others reach it at, torchrun's ``--nnodes``): the first
``nnodes`` hosts are the job's members, later ones wait as spares. When the job fails, every supervisor that notices
*proposes* a decision for the current generation; the first valid proposal wins (compare-and-set on the generation),
the board applies it to the membership (excluded hosts leave, spares join, the generation goes up) and every other
proposal for that generation gets the winner back. So the job decides once per failure, whichever node noticed first,
and each node carries out its own part of the same decision.

A proposal is checked against what the collector itself knows before it wins: a host may be excluded only when a
failure of the job that this collector holds (a verdict: made by its own attribution or a trusted forwarder) names it
as the culprit, or when one of its devices is drained; a restart or stop must name a failure of the job or come from
a node whose own job ended (its exit status). A sender that may post here (the token, or loopback without one)
still cannot exclude a host that no verdict blames.

Example:
    >>> board = JobBoard(max_jobs=10)
    >>> [board.register("j", h, h, nnodes=2)["role"] for h in ("n0", "n1", "n2")]
    ['active', 'active', 'spare']
    >>> failure = {"failure_id": "f1", "culprit": {"host": "n1"}, "root_cause": "nic_link_down"}
    >>> out = board.propose("j", 0, {"decision": "exclude_and_restart", "exclude_hosts": ["n1"],
    ...                              "failure_id": "f1", "by": "n0"}, failures={"f1": failure})
    >>> out["accepted"], out["decision"]["members"], out["decision"]["joined"], out["state"]["generation"]
    (True, ['n0', 'n2'], ['n2'], 1)
    >>> board.propose("j", 0, {"decision": "restart", "by": "n2", "exit_status": 1})["accepted"]  # too late
    False
"""
from __future__ import annotations

import collections
import copy
import re
import threading
import time
from typing import Any, Callable

__all__ = ["DECISIONS", "JobBoard", "Refused"]

#: What a proposal may decide (otel_gpu.supervisor.Decision.decision).
DECISIONS = ("restart", "exclude_and_restart", "stop", "give_up", "done")
_RESTARTING = ("restart", "exclude_and_restart")
_HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})$")
#: A spare that has not asked for the job's state for this long is not picked to replace a node (it may be gone).
SPARE_FRESH_S = 15.0
MAX_NODES = 4096
MAX_DECISIONS = 500
_TEXT_MAX = 2000


class Refused(ValueError):
    """A registration or proposal that is not taken; the message says which field and why (HTTP 400/409)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _host(value: Any, key: str) -> str:
    if not isinstance(value, str) or not _HOST.match(value):
        raise Refused(f"{key} must be a host name or address (letters, digits, '-', '.'; got {str(value)[:80]!r})")
    return value


def _text(value: Any) -> str | None:
    return value[:_TEXT_MAX] if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) > 1e12:
        return None
    return float(value)


class _Job:
    __slots__ = ("job_id", "nnodes", "min_nodes", "generation", "members", "spares", "excluded", "nodes",
                 "decisions", "rdzv_host", "rdzv_owner", "ended", "updated")

    def __init__(self, job_id: str, nnodes: int, min_nodes: int, rdzv_host: str | None):
        self.job_id = job_id
        self.nnodes, self.min_nodes = nnodes, min_nodes
        self.generation = 0
        self.members: list[str] = []
        self.spares: list[str] = []
        self.excluded: dict[str, str] = {}  # host -> why
        self.nodes: dict[str, dict[str, Any]] = {}  # host -> {rdzv_host, registered, seen}
        self.decisions: list[dict[str, Any]] = []
        self.rdzv_host = rdzv_host  # the rendezvous endpoint's host for the current generation
        self.rdzv_owner: str | None = None  # the node whose agent serves it (it said so: the address is its own)
        self.ended: str | None = None  # the decision that ended the job
        self.updated = time.time()

    def state(self, host: str | None = None) -> dict[str, Any]:
        out = {"job_id": self.job_id, "generation": self.generation, "nnodes": self.nnodes,
               "min_nodes": self.min_nodes, "members": list(self.members), "spares": list(self.spares),
               "excluded": dict(self.excluded), "rdzv_host": self.rdzv_host, "rdzv_owner": self.rdzv_owner,
               "ended": self.ended,
               "decisions": copy.deepcopy(self.decisions)}
        if host is not None:
            out["role"] = self.role(host)
        return out

    def role(self, host: str) -> str:
        if host in self.excluded:
            return "excluded"
        if host in self.members:
            return "active"
        if host in self.spares:
            return "spare"
        return "unknown"


class JobBoard:
    """Membership and decisions per job, in memory (bounded: ``max_jobs``, :data:`MAX_NODES` per job,
    :data:`MAX_DECISIONS` per job). Thread-safe; no I/O."""

    def __init__(self, max_jobs: int = 1000):
        self.max_jobs = max_jobs
        self._jobs: collections.OrderedDict[str, _Job] = collections.OrderedDict()
        self._lock = threading.Lock()

    # -- nodes ---------------------------------------------------------------------------------------------------
    def register(self, job_id: str, host: str, rdzv_host: str, nnodes: int, min_nodes: int | None = None,
                 rdzv_endpoint_host: str | None = None, generation: int | None = None,
                 was: str | None = None, serves_rdzv: bool = False) -> dict[str, Any]:
        """Adds ``host`` to the job (idempotent): a member while the first generation still has room, else a spare.
        Returns the job's state with this host's ``role`` (active, spare, excluded).

        After the aggregator restarted the board is empty while the job runs on: a node registering again says the
        ``generation`` it runs and the role it ``was`` (active, spare); a board that has decided nothing yet takes
        the highest generation it hears and gives each node its old role (members up to ``nnodes``)."""
        _host(host, "host")
        _host(rdzv_host, "rdzv_host")
        if rdzv_endpoint_host is not None:
            _host(rdzv_endpoint_host, "rdzv_endpoint_host")
        if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)
                                       or not 0 <= generation <= 1_000_000):
            raise Refused(f"generation must be an integer >= 0 (got {generation!r})")
        if was not in (None, "active", "spare"):
            raise Refused(f"was must be active or spare (got {str(was)[:20]!r})")
        if isinstance(nnodes, bool) or not isinstance(nnodes, int) or not 1 <= nnodes <= MAX_NODES:
            raise Refused(f"nnodes must be an integer 1..{MAX_NODES} (got {nnodes!r})")
        low = nnodes if min_nodes is None else min_nodes
        if isinstance(low, bool) or not isinstance(low, int) or not 1 <= low <= nnodes:
            raise Refused(f"min_nodes must be an integer 1..nnodes (got {min_nodes!r})")
        now = time.time()
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                if len(self._jobs) >= self.max_jobs:
                    self._jobs.popitem(last=False)
                job = self._jobs[job_id] = _Job(job_id, nnodes, low, rdzv_endpoint_host)
            self._jobs.move_to_end(job_id)
            if (nnodes, low) != (job.nnodes, job.min_nodes):
                raise Refused(f"nnodes {low}:{nnodes} differs from the job's {job.min_nodes}:{job.nnodes} (every "
                              "node must run the same torchrun command)", 409)
            if generation and not job.decisions and generation > job.generation:
                job.generation = generation  # a board that lost its memory learns where the job is
                if rdzv_endpoint_host is not None:
                    job.rdzv_host = rdzv_endpoint_host
            if host not in job.nodes:
                if len(job.nodes) >= MAX_NODES:
                    raise Refused(f"the job already has {MAX_NODES} nodes", 409)
                job.nodes[host] = {"rdzv_host": rdzv_host, "registered": now}
                if host not in job.excluded:
                    room = not job.decisions and len(job.members) < job.nnodes
                    member = room and (was == "active" or (was is None and job.generation == 0))
                    (job.members if member else job.spares).append(host)
            elif was == "active" and host in job.spares and not job.decisions and len(job.members) < job.nnodes:
                job.spares.remove(host)  # it ran as a member before the board forgot: it still does
                job.members.append(host)
            if serves_rdzv and job.rdzv_owner is None:
                job.rdzv_owner = host
            job.nodes[host]["seen"] = now
            job.updated = now
            return job.state(host)

    def state(self, job_id: str, host: str | None = None) -> dict[str, Any] | None:
        """The job's state (None: unknown job); asking as ``host`` marks it alive (a spare that asks can be picked)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            if host is not None and host in job.nodes:
                job.nodes[host]["seen"] = time.time()
            return job.state(host)

    # -- decisions -----------------------------------------------------------------------------------------------
    def propose(self, job_id: str, generation: int, proposal: dict[str, Any],
                failures: dict[str, dict[str, Any]] | None = None,
                drained_hosts: Callable[[], set[str]] | None = None) -> dict[str, Any]:
        """The first valid proposal for ``generation`` wins; later ones get the winner. ``failures``: the job's
        failures this collector holds, by failure_id; ``drained_hosts``: hosts with a drained device. Returns
        ``{accepted, decision, state}``. Raises Refused for a proposal that does not validate."""
        if isinstance(generation, bool) or not isinstance(generation, int):
            raise Refused(f"generation must be an integer (got {generation!r})")
        if not isinstance(proposal, dict):
            raise Refused("decision must be a JSON object")
        kind = proposal.get("decision")
        if kind not in DECISIONS:
            raise Refused(f"decision must be one of {', '.join(DECISIONS)} (got {str(kind)[:40]!r})")
        by = _host(proposal.get("by"), "by")
        exclude = proposal.get("exclude_hosts") or []
        if not isinstance(exclude, list) or len(exclude) > MAX_NODES:
            raise Refused("exclude_hosts must be a list of hosts")
        exclude = [_host(h, "exclude_hosts[]") for h in exclude]
        failures = failures or {}
        now = time.time()
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise Refused(f"unknown job {job_id[:80]!r}: register its nodes first", 404)
            if by not in job.nodes:
                raise Refused(f"{by!r} is not a node of job {job_id[:80]!r}", 409)
            job.nodes[by]["seen"] = now
            made = self._made(job, generation)
            if made is not None or generation != job.generation or job.ended:
                return {"accepted": False, "decision": copy.deepcopy(made), "state": job.state(by)}
            failure_id = proposal.get("failure_id")
            failure = failures.get(failure_id) if isinstance(failure_id, str) else None
            if failure_id is not None and failure is None:
                raise Refused(f"failure {str(failure_id)[:80]!r} is not a failure of job {job_id[:80]!r} that this "
                              "collector holds", 409)
            if kind != "done" and failure is None and _number(proposal.get("exit_status")) in (None, 0.0):
                raise Refused(f"a {kind} decision names a failure of the job (failure_id) or the proposing node's "
                              "non-zero exit_status", 409)
            if exclude and kind != "exclude_and_restart" and kind not in ("stop", "give_up"):
                raise Refused("exclude_hosts needs decision exclude_and_restart (or stop/give_up)")
            culprit = ((failure or {}).get("culprit") or {}).get("host")
            drained = drained_hosts() if drained_hosts is not None else set()
            for host in exclude:
                if host not in job.nodes:
                    raise Refused(f"{host!r} is not a node of job {job_id[:80]!r}", 409)
                if host != culprit and host not in drained:
                    raise Refused(f"no failure this collector holds blames {host!r} (culprit "
                                  f"{str(culprit)[:80]!r}) and none of its devices is drained: not excluded", 409)
            decision = self._apply(job, generation, kind, exclude, proposal, failure, now, drained)
            return {"accepted": True, "decision": copy.deepcopy(decision), "state": job.state(by)}

    @staticmethod
    def _made(job: _Job, generation: int) -> dict[str, Any] | None:
        for d in reversed(job.decisions):
            if d["generation"] == generation:
                return d
        return None

    def _apply(self, job: _Job, generation: int, kind: str, exclude: list[str], proposal: dict[str, Any],
               failure: dict[str, Any] | None, now: float,
               drained: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
        reason = _text(proposal.get("reason")) or ""
        for host in exclude:
            job.excluded[host] = (f"{failure.get('root_cause')}" if failure and
                                  (failure.get("culprit") or {}).get("host") == host else "device_drain")
        members = [m for m in job.members if m not in job.excluded]
        joined: list[str] = []
        spares = [s for s in job.spares if s not in job.excluded]
        if kind in _RESTARTING:
            # A spare that has gone quiet may be gone; one with a drained device would bring the fault back.
            fresh = [s for s in spares if now - job.nodes[s].get("seen", 0.0) <= SPARE_FRESH_S and s not in drained]
            while len(members) < job.nnodes and fresh:
                host = fresh.pop(0)
                spares.remove(host)
                members.append(host)
                joined.append(host)
            if len(members) < job.nnodes:
                allow_shrink = proposal.get("allow_shrink") is True
                if not members or len(members) < job.min_nodes or not allow_shrink:
                    need = (f"torchrun --nnodes {job.min_nodes}:{job.nnodes} and policy nodes.allow_shrink"
                            if job.min_nodes < job.nnodes else f"--nnodes {job.nnodes}")
                    kind = "stop"
                    reason = (f"no spare node to take the place of {', '.join(exclude) or 'the lost node'}: "
                              f"{len(members)} of {job.nnodes} nodes left ({need} would let it go on smaller); "
                              "not restarting" + (f" [{reason}]" if reason else ""))
        new_rdzv, owner = job.rdzv_host, job.rdzv_owner
        if kind in _RESTARTING and members:
            gone = {h for h in job.excluded} | {job.nodes[h]["rdzv_host"] for h in job.excluded if h in job.nodes}
            if new_rdzv is None or new_rdzv in gone or owner in job.excluded:
                owner = members[0]  # the rendezvous host itself left (by name, address or its own word)
                new_rdzv = job.nodes[owner]["rdzv_host"]
        decision = {
            "job_id": job.job_id, "generation": generation, "decision": kind, "by": proposal["by"], "time": now,
            "reason": reason, "failure_id": proposal.get("failure_id") if failure else None,
            "exclude_hosts": list(exclude), "hook_host": None,
            "members": members if kind in _RESTARTING else list(job.members), "joined": joined,
            "rdzv_host": new_rdzv, "exit_status": _number(proposal.get("exit_status")),
            "backoff_s": max(0.0, min(3600.0, _number(proposal.get("backoff_s")) or 0.0)),
            "next_generation": generation + 1 if kind in _RESTARTING else None,
        }
        if exclude:
            # The culprit's own node runs the exclude hook; a node that is gone (node_lost) cannot: the proposer does.
            lost = failure is not None and failure.get("root_cause") == "node_lost"
            decision["hook_host"] = proposal["by"] if lost else exclude[0]
        for key in ("root_cause", "kind", "action"):
            if failure and isinstance(failure.get(key), str):
                decision[key] = failure[key][:80]
        if kind in _RESTARTING:
            job.generation = generation + 1
            job.members, job.spares, job.rdzv_host, job.rdzv_owner = members, spares, new_rdzv, owner
        else:
            job.ended = kind
            job.spares = spares
        job.decisions.append(decision)
        del job.decisions[:-MAX_DECISIONS]
        job.updated = now
        return decision
