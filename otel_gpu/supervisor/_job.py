"""One job of many nodes: this node's link to the job's board on the aggregator (the ``verdict`` exporter's jobs API,
:mod:`otel_gpu.exporters.verdict.jobs`).

The supervisor of every node registers (member or spare), starts its part of the job for the board's current
generation (torchrun's command line rewritten for it: :mod:`otel_gpu.supervisor._torchrun`), watches the board while
the job runs, and after a failure proposes its decision; whichever node's proposal wins, every node carries out the
same one (docs/restart.md, "Many nodes").
"""
from __future__ import annotations

import os
import socket
from typing import Any

from otel_gpu.supervisor import _torchrun
from otel_gpu.supervisor._verdict import VerdictClient

__all__ = ["EXIT_EXCLUDED", "JobLink", "made_for"]

#: Exit status of ``otel-gpu run`` on a node the job's decision excluded (EX_TEMPFAIL: the job goes on elsewhere).
EXIT_EXCLUDED = 75


def made_for(state: dict[str, Any], generation: int) -> dict[str, Any] | None:
    """The decision the board holds for ``generation`` (None: none yet)."""
    decisions = state.get("decisions")
    for d in reversed(decisions if isinstance(decisions, list) else []):
        if isinstance(d, dict) and d.get("generation") == generation:
            return d
    return None


def rdzv_host_of(host: str | None) -> str:
    """The address other nodes reach this one at for torchrun's rendezvous: ``OTEL_GPU_RDZV_HOST``, else
    ``host`` (host.name as the instrumentation reports it), else the kernel's host name."""
    return os.environ.get("OTEL_GPU_RDZV_HOST", "").strip() or host or socket.gethostname()


class JobLink:
    """This node's view of the job's board: its role, the generation it runs, the command for that generation."""

    def __init__(self, client: VerdictClient, job_id: str, host: str, cmd: list[str]):
        self.client, self.job_id, self.host, self.cmd = client, job_id, host, list(cmd)
        low, high = _torchrun.nodes(cmd) or (1, 1)
        self.min_nodes, self.nnodes = low, high
        found = _torchrun.endpoint(cmd)
        self.rdzv_endpoint_host = found[0] if found else None
        self.rdzv_host = rdzv_host_of(host)
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
                                          self.rdzv_endpoint_host)
        generation = self.state.get("generation")
        self.generation = generation if isinstance(generation, int) else 0
        return str(self.state.get("role"))

    def refresh(self) -> dict[str, Any]:
        """The board's state now (raises VerdictUnavailable). A board that does not know the job (the aggregator
        restarted and lost it) is told again: this node's generation and role."""
        from otel_gpu.supervisor._verdict import VerdictUnavailable

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
                                          generation=self.generation, was=role)

    def made(self) -> dict[str, Any] | None:
        """The decision for the generation this node runs, if one was made (by any node); None also when the board
        does not answer."""
        from otel_gpu.supervisor._verdict import VerdictUnavailable

        try:
            return made_for(self.refresh(), self.generation)
        except VerdictUnavailable:
            return None

    def propose(self, proposal: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """(ours, the winning decision) for this node's generation. Raises VerdictUnavailable / Refused."""
        from otel_gpu.supervisor._verdict import Refused

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
