"""Typed records the detectors pass to each other and to the engine (the shape of PyTorch flight recorder's
``types.py``: small named records with what each field means, no behaviour beyond formatting).

- :class:`Evidence`: one observed fact (a metric, its value, when it began) that a decision rests on.
- :class:`Fault`: a hardware or network fault that passed the evidence rules (it *began* inside the cause's causal
  window, above the device's own baseline), with where it is and how strong it is.
- :class:`Finding`: what a detector concluded about one incident, before the engine gives it an id and a version;
  it keeps the ranks whose devices may still explain it when late evidence arrives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from otel_gpu.schema.failure import Action, Category, Kind, RootCause

__all__ = ["Evidence", "Fault", "Finding", "Window"]


@dataclass(frozen=True, slots=True)
class Evidence:
    """One signal that decided a verdict: ``signal=value @time`` in the record's ``evidence`` list."""

    signal: str  # e.g. "gpu.xid", "nic.mlx5_0/1.state", "exception.type"
    value: Any
    time: float | None = None  # when it happened or began (unix seconds); None when it has no time

    def __str__(self) -> str:
        text = f"{self.signal}={self.value}"
        return f"{text} @{self.time:.3f}" if self.time is not None else text


@dataclass(frozen=True, slots=True)
class Window:
    """A causal window around a symptom at ``t``: a fact that began in ``[t - before_s, t + after_s]`` may explain
    it; one that began earlier is baseline, one that began later is a consequence or unrelated."""

    before_s: float
    after_s: float

    def contains(self, began: float, symptom: float) -> bool:
        return symptom - self.before_s <= began <= symptom + self.after_s


@dataclass(slots=True)
class Fault:
    """A hardware or network fault that passed the evidence rules."""

    cause: RootCause
    onset: float  # when the fault began (the transition, the first XID of a burst, the first rise above background)
    evidence: list[Evidence]
    host: str
    gpu: str | None = None  # the GPU's UUID or NVML index, for GPU faults
    port: str | None = None  # "mlx5_0/1" or "eth0", for network faults
    strength: float = 0.9  # 0..1: a transition we saw or a pid-matched XID is strong; a rate rise less so
    hardware: bool = True  # counts as hardware/network evidence on its node (licenses exclude_node_and_restart)
    details: dict[str, Any] = field(default_factory=dict)  # e.g. {"xid": 79, "reason": "link_down"}
    category: Category | None = None  # overrides the taxonomy (an application XID is software, the node stays)
    action: Action | None = None
    why: str = ""  # a phrase for the summary: "its GPU fell off the bus (XID 79)"


@dataclass(slots=True)
class Finding:
    """A detector's verdict on one incident. The engine turns it into a versioned :class:`FailureRecord`."""

    kind: Kind
    cause: RootCause
    onset: float
    confidence: float
    rank: int | None
    host: str | None
    gpu: str | None
    evidence: list[Evidence]
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    category: Category | None = None
    action: Action | None = None
    #: Ranks whose GPUs and nodes may still explain the incident (hardware evidence can arrive late); empty when
    #: hardware cannot change the verdict (a user exception, an out-of-memory error).
    explainable_by: list[int] = field(default_factory=list)
    symptom_time: float | None = None  # the time causal windows are centred on (default: onset)
    fault: Fault | None = None  # the hardware or network fault the verdict rests on, if any
    #: The end of ``summary`` that says no fault was seen ("with no hardware signal"); the engine drops it when a
    #: fault (maybe a late one) explains the finding after all.
    no_fault_clause: str = ""
