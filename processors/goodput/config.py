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
    #: Span and event times outside [receipt - past, receipt + future] are refused (a span) or replaced by the receipt
    #: time (a failure's onset and detection), and counted: one step span with a 1970 start set its job's wall time
    #: to 499,003 h and its ETTR to 0% for good.
    time_window_past_s: float = 86400.0
    time_window_future_s: float = 600.0

    def validate(self) -> None:
        if self.report_interval_s <= 0:
            raise ValueError(f"report_interval_s must be > 0 (got {self.report_interval_s})")
        if self.slowdown_ratio < 1.0:
            raise ValueError(f"slowdown_ratio must be >= 1 (got {self.slowdown_ratio})")
        if self.job_idle_s <= 0 or self.max_jobs <= 0:
            raise ValueError("job_idle_s and max_jobs must be > 0")
        for key in ("time_window_past_s", "time_window_future_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0 (got {getattr(self, key)}), e.g. 24h and 10m")
