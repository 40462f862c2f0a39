"""Settings of the goodput processor, with their defaults."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GoodputConfig"]


@dataclass
class GoodputConfig:
    #: How often the live metrics and the summary event (what the store keeps) are emitted.
    report_interval_s: float = 5.0
    #: A step slower than this many baseline (median) step times counts its excess as slowdown badput.
    slowdown_ratio: float = 1.2
    #: Jobs with no activity for this long are finalized (one last summary) and forgotten.
    job_idle_s: float = 600.0
    max_jobs: int = 1000

    def validate(self) -> None:
        if self.report_interval_s <= 0:
            raise ValueError(f"report_interval_s must be > 0 (got {self.report_interval_s})")
        if self.slowdown_ratio < 1.0:
            raise ValueError(f"slowdown_ratio must be >= 1 (got {self.slowdown_ratio})")
        if self.job_idle_s <= 0 or self.max_jobs <= 0:
            raise ValueError("job_idle_s and max_jobs must be > 0")
