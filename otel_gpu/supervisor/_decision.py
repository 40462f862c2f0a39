"""The decision of ``otel-gpu run --restart`` after an incarnation ended: as printed, exported (event
``otel_gpu.restart.decision``) and kept in the store; shared by the one-node loop (supervisor.py) and the many-node
part (_job.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from otel_gpu.failure import printable

__all__ = ["RDZV_JOIN_TIMEOUT_S", "RESTARTING", "DecidedElsewhere", "Decision"]

#: Decisions after which the job starts again.
RESTARTING = ("restart", "exclude_and_restart")
#: What a blind restart (torchrun's own) costs on top when it lands on the broken node again: its rendezvous waits
#: for that node for torchrun's default join timeout.
RDZV_JOIN_TIMEOUT_S = 600.0


class DecidedElsewhere(Exception):
    """Another node's decision for this generation arrived while this one waited for a verdict."""

    def __init__(self, decision: dict[str, Any]):
        super().__init__("decided elsewhere")
        self.decision = decision


@dataclass
class Decision:
    """One decision, as printed, exported (event ``otel_gpu.restart.decision``) and kept in the store."""

    job_id: str
    incarnation: int
    restart_count: int
    time: float
    trigger: str  # exit | hang | crash_verdict | start (drained devices excluded before the first start)
    exit_status: int | None
    decision: str  # done | restart | exclude_and_restart | stop | give_up | report | exclude
    reason: str
    failure_id: str | None = None
    kind: str | None = None
    root_cause: str | None = None
    action: str | None = None
    culprit: dict | None = None
    backoff_s: float = 0.0
    restarts_in_window: int = 0
    excluded: str | None = None
    time_saved_s: float | None = None
    incarnation_start: float | None = None
    incarnation_end: float | None = None
    detection_latency_s: float | None = None
    hook: dict | None = field(default=None)
    #: Drained devices excluded before this restart (policy devices.exclude_drained): {device_id, host, gpu, since,
    #: evidence, hook}.
    drained: list | None = None
    #: Many nodes (docs/restart.md): the job-wide decision this node carried out: its generation, the nodes of the
    #: next one, the spares that joined, the hosts that left, which node proposed it, and this node.
    generation: int | None = None
    members: list | None = None
    joined: list | None = None
    exclude_hosts: list | None = None
    decided_by: str | None = None
    host: str | None = None
    #: Many nodes: the job's decision (restart, exclude_and_restart, stop, give_up, done) when this node's own part
    #: differs from it (``decision`` leave: this node was excluded).
    job_decision: str | None = None

    def line(self) -> str:
        """One line; whatever in it came from telemetry is escaped (:func:`otel_gpu.failure.printable`)."""
        cause = f"{self.kind}/{self.root_cause}" if self.root_cause else "no verdict"
        text = (f"incarnation {self.incarnation} ({self.trigger}, exit {self.exit_status}): {cause}"
                + (f", action {self.action}" if self.action else "") + f" -> {str(self.decision).upper()}: "
                f"{self.reason}")
        return "otel-gpu run: " + printable(text)
