"""Settings of the ``store`` exporter.

Example:
    >>> from otel_gpu.config import build
    >>> build(StoreExporterConfig, {"path": "/var/lib/otel-gpu", "max_age_days": 30}, "exporters.store").max_failures
    100000
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StoreExporterConfig"]


@dataclass
class StoreExporterConfig:
    """Where the store lives and how much it keeps."""

    path: str = "./otel-gpu-data"
    queue_size: int = 10_000  # records waiting for the writer thread; beyond it new ones are dropped and counted
    max_failures: int = 100_000  # newest failure records kept
    max_age_days: float = 90.0  # failures, goodput and jobs older than this are deleted
    max_goodput_history: int = 100_000  # past goodput summaries kept (the latest per job is always kept)
    flush_interval_s: float = 1.0  # how often job sightings are written
    retention_interval_s: float = 60.0  # how often retention runs
    # Records that act (failures, device states, restart decisions, goodput) are committed before export() returns,
    # i.e. before the OTLP answer: a SIGKILL right after a 200 lost 700 of them. 0: do not wait (queue only).
    durable_timeout_s: float = 2.0
    reopen_interval_s: float = 30.0  # a store that cannot open (full disk, locked, corrupt) is tried again this often
    check_interval_s: float = 600.0  # how often the file's integrity is checked (PRAGMA quick_check); 0: never
    # Times in a record outside [receipt - past, receipt + future] are not indexed as given (the indexed time is
    # the receipt time) and are counted: a 1970 or 2100 detection time would sort a record out of sight or on top.
    time_window_past_s: float = 86400.0
    time_window_future_s: float = 600.0

    def validate(self) -> None:
        if not self.path:
            raise ValueError("path must not be empty (e.g. ./otel-gpu-data)")
        for key in ("queue_size", "max_failures", "max_goodput_history"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1 (got {getattr(self, key)})")
        for key in ("max_age_days", "flush_interval_s", "retention_interval_s", "reopen_interval_s",
                    "time_window_past_s", "time_window_future_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0 (got {getattr(self, key)})")
        for key in ("durable_timeout_s", "check_interval_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0 (got {getattr(self, key)}; 0 turns it off)")
