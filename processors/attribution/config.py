"""Settings of the attribution processor, with their defaults."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttributionConfig"]


@dataclass
class AttributionConfig:
    #: An operation in flight this long is a hang (raised to hang_step_factor x the median step time when steps are
    #: slow). PyTorch's own watchdog waits 10 minutes (NCCL) or 30 (other backends).
    hang_timeout_s: float = 15.0
    hang_step_factor: float = 5.0
    #: A rank silent this long while its peers wait is treated as gone.
    heartbeat_timeout_s: float = 8.0
    #: After the first sign of a crash, wait this long for the other ranks' reports before naming the first cause.
    crash_settle_s: float = 0.5
    #: A step slower than max(ratio x baseline, baseline + min_excess, baseline + 6 MAD) is slow; 3 of 4 make a
    #: slowdown.
    slowdown_ratio: float = 1.5
    slowdown_min_excess_s: float = 0.05
    slowdown_warmup_steps: int = 5
    checkpoint_stall_s: float = 10.0
    #: A rank saving a checkpoint (a checkpoint span, torch.save or torch.distributed.checkpoint on its stack) while
    #: its peers wait for it is busy, not hung, until this long; then it is a checkpoint_stall hang.
    checkpoint_timeout_s: float = 600.0
    #: How long a hang verdict waits for the culprit's stack (where it is decides user vs software) before it goes
    #: out without one.
    stack_grace_s: float = 3.0
    #: Peers waiting in their first collectives for a rank that has not started any yet (still importing, loading its
    #: data set, building its model) make a hang only after this long.
    startup_timeout_s: float = 120.0
    #: Slow steps among the last slowdown_confirm + 1 that declare a slowdown.
    slowdown_confirm: int = 3
    tick_interval_s: float = 0.5
    #: host.name for hardware metrics that carry none (a single-node collector).
    default_host: str = ""
    #: Bounds of the state kept: a job silent this long is forgotten; at most max_jobs jobs and max_ranks_per_job
    #: ranks per job are tracked (the oldest job is evicted first; ranks past the bound are ignored).
    job_idle_evict_s: float = 3600.0
    max_jobs: int = 1000
    max_ranks_per_job: int = 262144  # a 131,072-rank job (issue 20) fits, twice over

    def validate(self) -> None:
        for key in ("hang_timeout_s", "heartbeat_timeout_s", "tick_interval_s", "checkpoint_stall_s",
                    "checkpoint_timeout_s", "startup_timeout_s", "job_idle_evict_s", "slowdown_confirm",
                    "max_jobs", "max_ranks_per_job"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0 (got {getattr(self, key)})")
        if self.crash_settle_s < 0 or self.crash_settle_s > 2.5:
            raise ValueError(f"crash_settle_s must be within 0..2.5 so a crash is named within 3 s "
                             f"(got {self.crash_settle_s})")
        if self.stack_grace_s < 0:
            raise ValueError(f"stack_grace_s must be >= 0 (got {self.stack_grace_s})")
        if self.slowdown_ratio <= 1.0:
            raise ValueError(f"slowdown_ratio must be > 1 (got {self.slowdown_ratio})")
        if self.slowdown_warmup_steps < 0:
            raise ValueError(f"slowdown_warmup_steps must be >= 0 (got {self.slowdown_warmup_steps})")
