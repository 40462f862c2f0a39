"""One job of many nodes: this node's link to the job's board on the aggregator (the ``verdict`` exporter's jobs API,
:mod:`otel_gpu.exporters.verdict.jobs`).

The supervisor of every node registers (member or spare), starts its part of the job for the board's current
generation (torchrun's command line rewritten for it: :mod:`otel_gpu.supervisor._torchrun`), watches the board while
the job runs, and after a failure proposes its decision; whichever node's proposal wins, every node carries out the
same one (docs/restart.md, "Many nodes").
"""
from __future__ import annotations

import collections
import os
import socket
import time
from typing import Any

from otel_gpu.failure import FailureRecord, format_failure
from otel_gpu.supervisor import _torchrun
from otel_gpu.supervisor._decision import RESTARTING, DecidedElsewhere, Decision
from otel_gpu.supervisor._hooks import HookRefused, hook_fields
from otel_gpu.supervisor._verdict import Refused, VerdictClient, VerdictUnavailable

__all__ = ["EXIT_EXCLUDED", "JobLink", "ManyNodes", "made_for"]

#: Exit status of ``otel-gpu run`` on a node the job's decision excluded (EX_TEMPFAIL: the job goes on elsewhere).
EXIT_EXCLUDED = 75


def made_for(state: dict[str, Any], generation: int) -> dict[str, Any] | None:
    """The decision the board holds for ``generation`` (None: none yet)."""
    decisions = state.get("decisions")
    for d in reversed(decisions if isinstance(decisions, list) else []):
        if isinstance(d, dict) and d.get("generation") == generation:
            return d
    return None


def backoff_left(made: dict[str, Any], now: float) -> float:
    """Seconds of the decision's backoff still to wait: every node starts the next generation at the same moment
    (the decision's time plus its backoff), however late it learned of the decision."""
    t, backoff = made.get("time"), made.get("backoff_s")
    if not isinstance(t, (int, float)) or not isinstance(backoff, (int, float)):
        return 0.0
    return max(0.0, min(float(t) + float(backoff) - now, 3600.0))


def rdzv_host_of() -> str:
    """The address other nodes reach this one at for torchrun's rendezvous: ``OTEL_GPU_RDZV_HOST``, else the
    kernel's host name: the name torchrun's agent recognises as its own when it decides whether to serve the
    rendezvous (``host.name`` may be a scheduler's node name that neither resolves nor matches)."""
    return os.environ.get("OTEL_GPU_RDZV_HOST", "").strip() or socket.gethostname()


def is_this_machine(host: str | None) -> bool:
    """True when ``host`` (a name or an address) is one of this machine's own non-loopback addresses: its agent
    serves torchrun's rendezvous. An address is this machine's when a socket can bind to it."""
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, addr in infos[:16]:
        ip = addr[0]
        if ip.startswith("127.") or ip == "::1":
            continue  # every machine is its own loopback
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((ip, 0))
            return True
        except OSError:
            continue
    return False


class JobLink:
    """This node's view of the job's board: its role, the generation it runs, the command for that generation."""

    def __init__(self, client: VerdictClient, job_id: str, host: str, cmd: list[str]):
        self.client, self.job_id, self.host, self.cmd = client, job_id, host, list(cmd)
        low, high = _torchrun.nodes(cmd) or (1, 1)
        self.min_nodes, self.nnodes = low, high
        found = _torchrun.endpoint(cmd)
        self.rdzv_endpoint_host = found[0] if found else None
        self.rdzv_host = rdzv_host_of()
        #: This node serves the rendezvous of generation 0 (the endpoint's host is one of its addresses).
        self.serves_rdzv = is_this_machine(self.rdzv_endpoint_host)
        self.generation = 0
        self.state: dict[str, Any] = {}

    @staticmethod
    def wanted(cmd: list[str]) -> bool:
        """A torchrun command of more than one node."""
        found = _torchrun.nodes(cmd)
        return found is not None and found[1] > 1

    # -- the board -----------------------------------------------------------------------------------------------
    def register(self) -> str:
        """Joins the board; this node's role (active, spare, excluded). Raises VerdictUnavailable / Refused."""
        self.state = self.client.register(self.job_id, self.host, self.rdzv_host, self.nnodes, self.min_nodes,
                                          self.rdzv_endpoint_host, serves_rdzv=self.serves_rdzv)
        generation = self.state.get("generation")
        self.generation = generation if isinstance(generation, int) else 0
        return str(self.state.get("role"))

    def refresh(self) -> dict[str, Any]:
        """The board's state now (raises VerdictUnavailable). A board that does not know the job (the aggregator
        restarted and lost it) is told again: this node's generation and role."""
        known = self.state
        try:
            state = self.client.job_state(self.job_id, self.host)
        except VerdictUnavailable as exc:
            if "HTTP 404" not in str(exc) or not known:
                raise
            self._register_again()
            return self.state
        if state.get("role") == "unknown" and known:  # another node told the board again first; now this one
            self._register_again()
        else:
            self.state = state
        return self.state

    def _register_again(self) -> None:
        role = self.state.get("role") if self.state.get("role") in ("active", "spare") else (
            "active" if self.host in self.members() else "spare")
        rdzv = self.state.get("rdzv_host")
        self.state = self.client.register(self.job_id, self.host, self.rdzv_host, self.nnodes, self.min_nodes,
                                          rdzv if isinstance(rdzv, str) else self.rdzv_endpoint_host,
                                          generation=self.generation, was=role,
                                          serves_rdzv=self.state.get("rdzv_owner") == self.host)

    def made(self) -> dict[str, Any] | None:
        """The decision for the generation this node runs, if one was made (by any node); None also when the board
        does not answer."""
        try:
            return made_for(self.refresh(), self.generation)
        except VerdictUnavailable:
            return None

    def propose(self, proposal: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """(ours, the winning decision) for this node's generation. Raises VerdictUnavailable / Refused."""
        try:
            answer = self.client.propose(self.job_id, self.generation, dict(proposal, by=self.host))
        except Refused as exc:
            if "unknown job" not in str(exc) or not self.state:
                raise
            self._register_again()  # the board forgot the job: tell it again, then propose
            answer = self.client.propose(self.job_id, self.generation, dict(proposal, by=self.host))
        state = answer.get("state")
        if isinstance(state, dict):
            self.state = state
        decision = answer.get("decision")
        if not isinstance(decision, dict):
            decision = made_for(self.state, self.generation)
        if not isinstance(decision, dict):
            raise ValueError("the board answered without a decision")
        return bool(answer.get("accepted")), decision

    # -- this node ----------------------------------------------------------------------------------------------
    def members(self) -> list[str]:
        members = self.state.get("members")
        return [m for m in members if isinstance(m, str)] if isinstance(members, list) else []

    def command(self) -> list[str]:
        """The command for this generation: the first as given; later ones with the rendezvous host the board chose
        (when the given one left the job) and, when the job runs with fewer nodes than torchrun's maximum or with an
        elastic range, ``--nnodes`` set to the member count (the rendezvous completes at once)."""
        if self.generation == 0:
            return list(self.cmd)
        rdzv = self.state.get("rdzv_host")
        members = len(self.members())
        nnodes = members if members and (members != self.nnodes or self.min_nodes != self.nnodes) else None
        return _torchrun.rewrite(self.cmd, rdzv if isinstance(rdzv, str) and rdzv != self.rdzv_endpoint_host
                                 else None, nnodes)


class ManyNodes:
    """The many-node part of :class:`otel_gpu.supervisor.Supervisor` (a mixin: it uses the supervisor's policy,
    client, output and one-node decision): register, wait as a spare, propose, and carry out the job's decision."""

    job: JobLink | None
    def _job_decide(self, launch, started: float, outcome: dict) -> Decision:
        """Many nodes: the job's decision for this generation (another node's, or this node's proposal if it wins),
        carried out here: restart as a member, leave as an excluded node, or stop."""
        job = self.job
        assert job is not None
        generation = job.generation
        made = outcome.get("job_decision") or job.made()
        proposal: Decision | None = None
        if made is None:
            try:
                proposal = self._make_decision(launch, generation, generation, started, outcome, act=False)
            except DecidedElsewhere as exc:
                made = exc.decision
        ours = False
        if made is None and proposal is not None:
            ours, made = self._propose(proposal, launch.status)
            if made is None:  # the board does not answer: this node stops alone; it never restarts on its own
                if proposal.decision in RESTARTING:
                    proposal.decision = "stop"
                    proposal.reason = ("the job's aggregator does not answer: a node cannot restart a job of many "
                                       "alone; stopping")
                proposal.exclude_hosts = None
                return proposal
        assert made is not None
        return self._carry_out(made, ours, proposal, launch, started, outcome)

    def _propose(self, proposal: Decision, status: int | None) -> tuple[bool, dict[str, Any] | None]:
        job = self.job
        assert job is not None
        body: dict[str, Any] = {
            "decision": proposal.decision, "failure_id": proposal.failure_id, "reason": proposal.reason,
            "exit_status": status, "backoff_s": proposal.backoff_s, "exclude_hosts": proposal.exclude_hosts or [],
            "allow_shrink": self.policy.nodes.allow_shrink}
        for attempt in range(2):
            try:
                return job.propose(body)
            except Refused as exc:
                if attempt:
                    self.say(f"the job's board refused this node's stop too ({exc})")
                    return False, None
                self.say(f"the job's board refused this node's proposal ({exc}); proposing to stop instead")
                body.update(decision="stop", exclude_hosts=[], reason=f"proposal refused: {exc}",
                            exit_status=status or 1)
                if body["failure_id"] is not None and "is not a failure" in str(exc):
                    body["failure_id"] = None
            except (VerdictUnavailable, ValueError) as exc:
                return self._propose_later(body, exc)
        return False, None

    def _propose_later(self, body: dict[str, Any], exc: Exception) -> tuple[bool, dict[str, Any] | None]:
        """The board did not answer: the other nodes decide with it, so ask again (and look for their decision)
        for ``verdict.wait`` before this node acts alone (it then stops; it never restarts alone)."""
        job = self.job
        assert job is not None
        self.say(f"cannot reach the job's board ({exc}); asking again for {self.policy.verdict.wait_s:.0f} s")
        deadline = time.monotonic() + self.policy.verdict.wait_s
        while time.monotonic() < deadline and self._stop_requested is None:
            time.sleep(1.0)
            try:
                return job.propose(body)
            except Refused:
                made = job.made()
                return (False, made) if made is not None else (False, None)
            except (VerdictUnavailable, ValueError):
                continue
        return False, None

    def _carry_out(self, made: dict[str, Any], ours: bool, proposal: Decision | None, launch, started: float,
                   outcome: dict) -> Decision:
        job = self.job
        assert job is not None
        kind = made.get("decision") if made.get("decision") in ("restart", "exclude_and_restart", "stop",
                                                                 "give_up", "done") else "stop"
        excluded = [h for h in made.get("exclude_hosts") or [] if isinstance(h, str)]
        members = [h for h in made.get("members") or [] if isinstance(h, str)]
        by = made.get("by") if isinstance(made.get("by"), str) else None
        d = proposal if (ours and proposal is not None) else Decision(
            job_id=self.job_id, incarnation=job.generation, restart_count=job.generation, time=time.time(),
            trigger="job_decision", exit_status=launch.status, decision=kind, reason="",
            incarnation_start=round(started, 3), incarnation_end=round(outcome["ended"], 3))
        d.decision, d.exit_status = kind, launch.status
        d.generation, d.decided_by, d.host = job.generation, by, self.local_host
        d.members, d.joined, d.exclude_hosts = members, list(made.get("joined") or []), excluded
        if not ours:
            for key in ("failure_id", "root_cause", "kind", "action"):
                if isinstance(made.get(key), str):
                    setattr(d, key, made[key])
            backoff = made.get("backoff_s")
            d.backoff_s = float(backoff) if isinstance(backoff, (int, float)) else 0.0
            d.reason = f"the job's decision, made by {by or '?'}: {made.get('reason') or kind}"
        if kind in ("stop", "give_up", "done") and ours and made.get("reason"):
            d.reason = str(made["reason"])
        d.excluded = ", ".join(f"host {h}" for h in excluded) or None
        record = outcome.get("record")
        d.job_decision = kind
        if self.local_host in excluded:
            self._hook_for(made, record, self.local_host, d)
            d.decision = "leave"
            d.reason = (f"this node ({self.local_host}) leaves the job: {made.get('root_cause') or 'excluded'} "
                        f"(the job's decision, made by {by or '?'}); "
                        + ("the job goes on without it" if kind in RESTARTING else f"the job stops: {d.reason}"))
        elif made.get("root_cause") == "node_lost" and by == self.local_host:
            for host in excluded:  # the lost node cannot run its own hook
                self._hook_for(made, record, host, d)
        if kind in ("stop", "give_up") and not outcome.get("printed"):
            record = record or self._record_of(made.get("failure_id"))
            if record is not None:
                self._emit(format_failure(record))
                outcome["printed"] = True
        if kind in RESTARTING and d.decision != "leave":
            if self.local_host not in members:
                d.decision = "leave"
                d.reason = f"this node ({self.local_host}) is not among the next nodes ({', '.join(members)})"
            else:
                now = time.time()
                d.restarts_in_window = self._sync_budget(now)
                job.generation = int(made.get("next_generation") or job.generation + 1)
                job.state.update(members=members, rdzv_host=made.get("rdzv_host"))
                d.backoff_s = round(min(backoff_left(made, now), d.backoff_s), 2)
        self._export_decision = ours
        return d

    def _record_of(self, failure_id: Any) -> FailureRecord | None:
        if not isinstance(failure_id, str):
            return None
        try:
            return next((r for r in self.client.failures(self.job_id) if r.failure_id == failure_id), None)
        except VerdictUnavailable:
            return None

    def _hook_for(self, made: dict[str, Any], record: FailureRecord | None, host: str, d: Decision) -> None:
        """Runs ``hooks.exclude`` for ``host`` (the culprit's fields when the verdict names that host)."""
        if not self.policy.hooks.exclude_argv:
            return
        record = record if record is not None and record.failure_id == made.get("failure_id") else \
            self._record_of(made.get("failure_id"))
        try:
            if record is not None and record.culprit.host == host:
                fields = self._hook_fields(record)
            else:
                fields = hook_fields("device_drain", host, None, None, self.job_id)
            d.hook = self._run_hook(fields)
        except HookRefused as exc:
            self.say(f"exclude hook not run for {host}: {exc}")

    def _sync_budget(self, now: float) -> int:
        """The job's restarts in the budget's window, from the board's decisions (the budget is the job's)."""
        job = self.job
        assert job is not None
        decisions = job.state.get("decisions")
        times = sorted(float(x["time"]) for x in decisions if isinstance(x, dict) and x.get("decision") in
                       RESTARTING and isinstance(x.get("time"), (int, float))) if isinstance(decisions,
                                                                                              list) else []
        self.restart_times = collections.deque(t for t in times if t >= now - self.policy.budget.window_s)
        return len(self.restart_times)

    def _wait_as_spare(self) -> int | None:
        """A spare waits (starting nothing: a waiting torchrun would restart the running job's rendezvous) until
        the job's decision names it a member; returns None to start, or the exit status when the job ended."""
        job = self.job
        assert job is not None
        self.say(f"spare node {self.local_host} for job {self.job_id} (members: {', '.join(job.members())}): "
                 "waiting until a decision of the job needs it")
        poll = self.policy.verdict.poll_interval_s
        while self._stop_requested is None:
            time.sleep(poll)
            try:
                state = job.refresh()
            except VerdictUnavailable:
                continue
            if self.local_host in job.members():
                generation = state.get("generation")
                job.generation = generation if isinstance(generation, int) else job.generation
                made = made_for(state, job.generation - 1) or {}
                self._sync_budget(time.time())
                wait = backoff_left(made, time.time())
                self.say(f"joining job {self.job_id} as a member of generation {job.generation} (in place of "
                         f"{', '.join(made.get('exclude_hosts') or []) or 'a node'}, decided by "
                         f"{made.get('by') or '?'})")
                time.sleep(wait)
                return None
            ended = state.get("ended")
            if ended:
                self.say(f"job {self.job_id} ended ({ended}) without needing this spare")
                return 0 if ended == "done" else 1
            if self.local_host in (state.get("excluded") or {}):
                self.say(f"this node ({self.local_host}) was excluded from job {self.job_id}")
                return EXIT_EXCLUDED
        return 128 + self._stop_requested

    def _join(self) -> int | None:
        """Many nodes: registers with the job's board; None to start, or the exit status (a spare whose job ended,
        an excluded node). Without a board (an older collector, or none) the job runs as on one node."""
        job = self.job
        assert job is not None
        try:
            role = job.register()
        except (VerdictUnavailable, Refused) as exc:
            self.say(f"the job's board at {self.client.url} cannot coordinate the {job.nnodes} nodes ({exc}): this "
                     "node acts alone and never restarts a job of many nodes by itself")
            self.job = None
            self._alone = True
            return None
        self.say(f"job {self.job_id}: this node ({self.local_host}) is {role} (generation {job.generation}; "
                 f"members {', '.join(job.members())})")
        if role == "spare":
            return self._wait_as_spare()
        if role == "excluded":
            self.say(f"this node ({self.local_host}) was excluded from job {self.job_id}: not starting")
            return EXIT_EXCLUDED
        return None
