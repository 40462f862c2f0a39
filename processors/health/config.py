"""Settings of the ``health`` processor, with their defaults (the scoring rules are in README.md).

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(HealthConfig, {"sample_interval": "5s", "clear_after": "2h"}, "processors.health")
    >>> cfg.sample_interval_s, cfg.clear_after_s, cfg.short_window_s
    (5.0, 7200.0, 900.0)
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HealthConfig"]


@dataclass
class HealthConfig:
    #: How often a node's counters are read from the batches that flow by (the receivers poll at 1 Hz; counters are
    #: cumulative, so the batches in between are passed on untouched and nothing is lost).
    sample_interval_s: float = 60.0
    #: NVLink counters (up to 18 links x 5 error types per GPU: most of a node's points) are read this often.
    nvlink_sample_interval_s: float = 300.0
    #: How often the rules are evaluated and the health metrics are emitted.
    evaluate_interval_s: float = 60.0
    #: Rates are counted over this window ...
    short_window_s: float = 900.0
    #: ... and compared with the device's own baseline, learned with this half-life while the device is quiet.
    baseline_half_life_s: float = 6 * 3600.0
    #: A new device's rates are not judged before it was watched this long (its baseline is learned meanwhile);
    #: flags (remap failure, uncorrectable ECC, hardware XIDs, link flaps) count from the start.
    warmup_s: float = 1800.0
    #: A rate rule holds when the window's count is >= factor x the baseline's expectation and >= the minimum count.
    watch_factor: float = 4.0
    drain_factor: float = 16.0
    watch_min_count: int = 20
    drain_min_count: int = 50
    #: NIC link flaps (link_downed increases) within an hour that make a port watch / drain.
    flaps_watch: int = 2
    flaps_drain: int = 4
    #: Fraction of samples in the window with a hardware clock-event (HW slowdown, HW thermal, power brake) for watch.
    throttle_watch_fraction: float = 0.2
    #: Failures a device was the culprit of within recurrence_window_s for watch / drain (3rd time: recurring).
    recurrence_watch: int = 2
    recurrence_drain: int = 3
    recurrence_window_s: float = 30 * 86400.0
    #: A device goes back to healthy only after no rule held for this long (drain and watch do not flicker).
    clear_after_s: float = 3600.0
    #: A drain-class fault (uncorrectable ECC, a drain-class XID) holds this long after it happened (NVIDIA: drain,
    #: reset, service), unless its counter shows the GPU was reset.
    fault_hold_s: float = 86400.0
    #: Devices tracked at most (bounded memory); the least recently seen is forgotten first.
    max_devices: int = 20_000

    def validate(self) -> None:
        for key in ("sample_interval_s", "nvlink_sample_interval_s", "evaluate_interval_s", "short_window_s",
                    "baseline_half_life_s", "watch_factor", "drain_factor", "recurrence_window_s"):
            value = getattr(self, key)
            if not value > 0:
                raise ValueError(f"{key} must be > 0 (got {value})")
        for key in ("warmup_s", "clear_after_s", "fault_hold_s"):
            value = getattr(self, key)
            if not value >= 0:
                raise ValueError(f"{key} must be >= 0 (got {value})")
        if self.short_window_s < 60:
            raise ValueError(f"short_window_s must be >= 60 (the rates are counted per minute; got "
                             f"{self.short_window_s})")
        if self.short_window_s > 3600:
            raise ValueError(f"short_window_s must be <= 3600 (got {self.short_window_s})")
        if self.drain_factor < self.watch_factor:
            raise ValueError(f"drain_factor must be >= watch_factor ({self.watch_factor}) (got {self.drain_factor})")
        if self.drain_min_count < self.watch_min_count:
            raise ValueError(f"drain_min_count must be >= watch_min_count ({self.watch_min_count}) "
                             f"(got {self.drain_min_count})")
        for key in ("watch_min_count", "flaps_watch", "recurrence_watch", "max_devices"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1 (got {getattr(self, key)})")
        if self.flaps_drain < self.flaps_watch:
            raise ValueError(f"flaps_drain must be >= flaps_watch ({self.flaps_watch}) (got {self.flaps_drain})")
        if self.recurrence_drain < self.recurrence_watch:
            raise ValueError(f"recurrence_drain must be >= recurrence_watch ({self.recurrence_watch}) "
                             f"(got {self.recurrence_drain})")
        if not 0 < self.throttle_watch_fraction <= 1:
            raise ValueError(f"throttle_watch_fraction must be within (0, 1] (got {self.throttle_watch_fraction})")
