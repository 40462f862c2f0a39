"""The failure record of docs/design.md section 3, its taxonomy defaults, and its stable signature."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from otel_gpu.schema.failure import Action, Category, Kind, RootCause

__all__ = ["Culprit", "FailureRecord", "TAXONOMY", "evidence"]

# root_cause -> (category, action, auto_remediable). Category "software or user (by stack)" is decided by the engine.
TAXONOMY: dict[RootCause, tuple[Category, Action, bool]] = {
    RootCause.GPU_XID: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.GPU_FELL_OFF_BUS: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.GPU_ECC_UNCORRECTABLE: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.GPU_THERMAL_THROTTLE: (Category.HARDWARE, Action.INVESTIGATE, False),
    RootCause.GPU_POWER_THROTTLE: (Category.HARDWARE, Action.INVESTIGATE, False),
    RootCause.GPU_HW_SLOWDOWN: (Category.HARDWARE, Action.INVESTIGATE, False),
    RootCause.NVLINK_ERROR: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.PCIE_ERROR: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.NIC_LINK_DOWN: (Category.INFRASTRUCTURE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.NIC_ERRORS: (Category.INFRASTRUCTURE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.RANK_NOT_IN_COLLECTIVE: (Category.USER, Action.USER_FIX, False),
    RootCause.COLLECTIVE_MISMATCH: (Category.USER, Action.USER_FIX, False),
    RootCause.RANK_PROCESS_DIED: (Category.INFRASTRUCTURE, Action.AUTO_RESTART, True),
    RootCause.CUDA_OOM: (Category.USER, Action.USER_FIX, False),
    RootCause.PYTHON_EXCEPTION: (Category.USER, Action.USER_FIX, False),
    RootCause.STRAGGLER_COMPUTE: (Category.SOFTWARE, Action.INVESTIGATE, False),
    RootCause.DATALOADER_STALL: (Category.SOFTWARE, Action.INVESTIGATE, False),
    RootCause.CHECKPOINT_STALL: (Category.SOFTWARE, Action.INVESTIGATE, False),
    RootCause.RANK_EXITED_EARLY: (Category.USER, Action.USER_FIX, False),
    RootCause.NODE_LOST: (Category.INFRASTRUCTURE, Action.EXCLUDE_NODE_AND_RESTART, True),
    # stopped (SIGSTOP, a debugger) or in uninterruptible sleep outside the GPU driver; D inside the NVIDIA driver
    # is hardware (the finding says so: category hardware, exclude_node_and_restart)
    RootCause.RANK_FROZEN: (Category.INFRASTRUCTURE, Action.INVESTIGATE, False),
    RootCause.UNKNOWN: (Category.SOFTWARE, Action.INVESTIGATE, False),
}


def evidence(signal: str, value: Any, at: float | None = None) -> str:
    """One line of evidence: ``signal=value @time`` (time in unix seconds, 3 decimals)."""
    text = f"{signal}={value}"
    return f"{text} @{at:.3f}" if at is not None else text


@dataclass
class Culprit:
    rank: int | None = None
    host: str | None = None
    gpu: str | None = None


@dataclass
class FailureRecord:
    kind: Kind
    root_cause: RootCause
    job_id: str
    onset_time: float
    detected_time: float
    confidence: float
    culprit: Culprit = field(default_factory=Culprit)
    evidence: list[str] = field(default_factory=list)
    category: Category | None = None
    action: Action | None = None
    auto_remediable: bool | None = None
    summary: str = ""  # one sentence for people, e.g. "rank 2 never reached all_reduce seq 41"
    details: dict[str, Any] = field(default_factory=dict)  # e.g. xid code, op, seq, stack top
    signature: str = ""
    recurrence: int = 0
    #: Stable id of this failure; a revision (late hardware evidence, a hang that resumed) keeps it and bumps
    #: ``version``. ``withdrawn``: the revision says it was no failure after all (the ranks progressed again).
    failure_id: str = ""
    version: int = 1
    withdrawn: bool = False
    previous_root_cause: str | None = None  # on a revision that changed the root cause: the one it replaces

    def __post_init__(self) -> None:
        category, action, auto = TAXONOMY[self.root_cause]
        self.category = self.category or category
        self.action = self.action or action
        if self.auto_remediable is None:
            self.auto_remediable = auto
        if not self.signature:
            self.signature = self.compute_signature()

    def compute_signature(self) -> str:
        """Same cause, same fingerprint, across jobs and runs: kind, cause and its stable details (XID code, the op
        a hang stopped in, the stack top of the culprit, the exception type), never times, ranks or job ids."""
        stable = {k: self.details[k] for k in ("xid", "op", "exception_type", "stack_top", "signal", "reason")
                  if self.details.get(k) is not None}
        text = json.dumps([self.kind.value, self.root_cause.value, stable], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("kind", "root_cause", "category", "action"):
            out[key] = getattr(self, key).value
        out["onset_time"] = round(self.onset_time, 3)
        out["detected_time"] = round(self.detected_time, 3)
        out["confidence"] = round(self.confidence, 2)
        if self.previous_root_cause is None:
            del out["previous_root_cause"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)
