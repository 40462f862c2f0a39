"""The ``memory_limiter`` processor: measures resident memory on a timer and publishes an admission check.

Example:
    >>> from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    >>> from otel_gpu.component import ADMISSION, ComponentHost
    >>> from otel_gpu.processors.memory_limiter import MemoryLimiterConfig, MemoryLimiterProcessor
    >>> cfg = MemoryLimiterConfig(limit_mib=1 << 20); cfg.validate()
    >>> host = ComponentHost("memory_limiter", PrometheusSelfTelemetry())
    >>> limiter = MemoryLimiterProcessor(cfg, host)
    >>> limiter.start(); host.services.get(ADMISSION)[0]() is None     # far below a 1 TiB limit: accept
    True
    >>> limiter.shutdown()
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading
import time
from pathlib import Path

from otel_gpu.component import ADMISSION, ComponentHost, Processor
from otel_gpu.pdata import Batch
from otel_gpu.processors.memory_limiter.config import MemoryLimiterConfig

__all__ = ["MemoryLimiterProcessor", "available_memory_bytes", "rss_bytes"]

_logger = logging.getLogger(__name__)
_MIB = 1024 * 1024
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """Resident set size of this process from ``/proc/self/statm``; None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):  # cgroup v1 writes a huge number for "no limit"
            return int(text)
    return None


def available_memory_bytes() -> int | None:
    """What ``limit_percentage`` is a percentage of: the cgroup's memory limit when set, else the machine's RAM."""
    limit = _cgroup_limit()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    return min(total, limit) if limit else total
    except (OSError, ValueError):
        pass
    return limit


def _malloc_trim():
    """glibc's malloc_trim (returns freed heap pages to the OS), or None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class MemoryLimiterProcessor(Processor):
    """Publishes :meth:`refusal` in ``host.services.get(ADMISSION)``; ``process`` passes batches through."""

    config: MemoryLimiterConfig

    def __init__(self, config: MemoryLimiterConfig, host: ComponentHost):
        super().__init__(config, host)
        if config.limit_mib:
            self.hard_limit = config.limit_mib * _MIB
            self.soft_limit = (config.limit_mib - config.spike_limit_mib) * _MIB
        else:
            total = available_memory_bytes() or 0
            self.hard_limit = total * config.limit_percentage // 100
            self.soft_limit = total * (config.limit_percentage - config.spike_limit_percentage) // 100
        self.usage = 0
        self.peak = 0
        self.limited = False
        self.refusals = 0  # requests refused since start (receivers count them in self-telemetry)
        self.gc_runs = 0
        self._last_gc = float("-inf")
        self._last_check = float("-inf")
        self._check_lock = threading.Lock()
        self._running = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trim = _malloc_trim()
        host.services.publish(ADMISSION, self.refusal)

    def refusal(self) -> float | None:
        """None when new data may be accepted; else the seconds a client should wait before retrying.

        When the timer thread's last measurement is older than ``check_interval_s`` (it can be starved of the GIL
        by the very request threads that fill memory), the asking thread measures itself: one read of
        /proc/self/statm, by one thread at a time."""
        if self._running and time.monotonic() - self._last_check > self.config.check_interval_s \
                and self._check_lock.acquire(blocking=False):
            try:
                self.check()
            finally:
                self._check_lock.release()
        if self.limited:
            self.refusals += 1
            return self.config.retry_after_s
        return None

    def check(self) -> None:
        """One measurement: sets ``limited``; above the hard limit, collects garbage and measures again."""
        self._last_check = time.monotonic()
        usage = rss_bytes()
        if usage is None:
            return
        if usage > self.soft_limit:
            # Python frees memory to its allocator, which keeps it: collect cycles and hand free pages back to the
            # OS, or RSS would stay above the limit long after the data is gone.
            interval = self.config.min_gc_interval_when_hard_limited_s if usage > self.hard_limit \
                else self.config.min_gc_interval_when_soft_limited_s
            now = time.monotonic()
            if now - self._last_gc >= interval:
                self._last_gc = now
                gc.collect()
                if self._trim is not None:
                    self._trim(0)
                self.gc_runs += 1
                usage = rss_bytes() or usage
        self.usage = usage
        self.peak = max(self.peak, usage)
        limited = usage > self.soft_limit
        if limited != self.limited:
            self.limited = limited
            if limited:
                _logger.warning("%s: memory %.0f MiB is above the soft limit %.0f MiB (hard %.0f MiB): refusing new "
                                "data until it falls", self.host.component_id, usage / _MIB, self.soft_limit / _MIB,
                                self.hard_limit / _MIB)
            else:
                _logger.info("%s: memory %.0f MiB is back under the soft limit %.0f MiB: accepting data again "
                             "(%d requests refused so far)", self.host.component_id, usage / _MIB,
                             self.soft_limit / _MIB, self.refusals)

    def _run(self) -> None:
        while not self._stop.wait(self.config.check_interval_s):
            try:
                with self._check_lock:
                    self.check()
            except Exception:  # noqa: BLE001 - a failed measurement must not stop the checks
                self.host.log_once("check", logging.ERROR, "%s: memory check failed (logged once)",
                                   self.host.component_id, exc_info=True)

    def start(self) -> None:
        if rss_bytes() is None:
            _logger.warning("%s: /proc/self/statm is not readable on this system: the memory limit is not enforced",
                            self.host.component_id)
            return
        if self.hard_limit <= 0:
            _logger.warning("%s: cannot tell the machine's memory: limit_percentage is not enforced; use limit_mib",
                            self.host.component_id)
            return
        self.check()
        _logger.info("%s: soft limit %.0f MiB, hard limit %.0f MiB, now %.0f MiB", self.host.component_id,
                     self.soft_limit / _MIB, self.hard_limit / _MIB, self.usage / _MIB)
        self._running = True
        self._thread = threading.Thread(target=self._run, name=f"{self.host.component_id}-check", daemon=True)
        self._thread.start()

    def process(self, batch: Batch) -> Batch | None:
        return batch

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.limited = False
