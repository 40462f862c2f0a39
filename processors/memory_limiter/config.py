"""Settings of the ``memory_limiter`` processor (the OpenTelemetry Collector's names, durations in seconds).

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(MemoryLimiterConfig, {"limit_mib": 400}, "processors.memory_limiter")
    >>> cfg.limit_mib, cfg.spike_limit_mib
    (400, 80)
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryLimiterConfig"]


@dataclass
class MemoryLimiterConfig:
    """Hard limit ``limit_mib`` (or ``limit_percentage`` of the memory available: the cgroup's limit, else RAM);
    soft limit = hard - spike. Above the soft limit receivers refuse new data; above the hard limit a gc runs."""

    check_interval_s: float = 1.0
    limit_mib: int = 0
    spike_limit_mib: int = 0  # 0: 20% of limit_mib
    limit_percentage: int = 0
    spike_limit_percentage: int = 0  # 0: 20% of limit_percentage
    retry_after_s: float = 1.0  # the retry hint given to refused clients (gRPC RetryInfo, HTTP Retry-After)
    min_gc_interval_when_soft_limited_s: float = 10.0  # gc (and malloc_trim) at most this often above the soft limit
    min_gc_interval_when_hard_limited_s: float = 0.0  # ... and above the hard limit (0: at every check)

    def validate(self) -> None:
        if self.check_interval_s <= 0:
            raise ValueError(f"check_interval_s must be > 0 (got {self.check_interval_s})")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be > 0 (got {self.retry_after_s})")
        for key in ("min_gc_interval_when_soft_limited_s", "min_gc_interval_when_hard_limited_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0 (got {getattr(self, key)})")
        if self.limit_mib and self.limit_percentage:
            raise ValueError("limit_mib: set limit_mib or limit_percentage, not both")
        if self.limit_mib:
            if self.limit_mib < 0:
                raise ValueError(f"limit_mib must be > 0 (got {self.limit_mib})")
            if self.spike_limit_percentage:
                raise ValueError("spike_limit_percentage: goes with limit_percentage; use spike_limit_mib")
            if self.spike_limit_mib == 0:
                self.spike_limit_mib = self.limit_mib // 5
            if not 0 <= self.spike_limit_mib < self.limit_mib:
                raise ValueError(f"spike_limit_mib must be >= 0 and < limit_mib ({self.limit_mib}) "
                                 f"(got {self.spike_limit_mib})")
        elif self.limit_percentage:
            if not 0 < self.limit_percentage <= 100:
                raise ValueError(f"limit_percentage must be within 1..100 (got {self.limit_percentage})")
            if self.spike_limit_mib:
                raise ValueError("spike_limit_mib: goes with limit_mib; use spike_limit_percentage")
            if self.spike_limit_percentage == 0:
                self.spike_limit_percentage = max(1, self.limit_percentage // 5)
            if not 0 <= self.spike_limit_percentage < self.limit_percentage:
                raise ValueError(f"spike_limit_percentage must be >= 0 and < limit_percentage "
                                 f"({self.limit_percentage}) (got {self.spike_limit_percentage})")
        else:
            raise ValueError("limit_mib: set limit_mib (e.g. 400) or limit_percentage (e.g. 80)")
