"""Reads torch's flight recorder: the collectives that DDP's C++ reducer, FSDP and functional collectives issue
without passing through the Python functions.

The dump holds the GIL for about 15 us per buffered entry, so it is read only when torch's per-group op counter
(``ProcessGroup._get_sequence_number_for_group``, cheap) shows ops that the Python wrappers did not issue, and the
buffer is kept small (``TORCH_FR_BUFFER_SIZE``, 256 by default when the user set nothing).
"""
from __future__ import annotations

import json
import logging
import pickle
import sys
import threading
import time

from otel_gpu.instrumentation._hot import NS
from otel_gpu.instrumentation.config import env, set_env

_logger = logging.getLogger(__name__)

_DTYPE = {"Float": ("float32", 4), "Double": ("float64", 8), "Half": ("float16", 2), "BFloat16": ("bfloat16", 2),
          "Long": ("int64", 8), "Int": ("int32", 4), "Short": ("int16", 2), "Char": ("int8", 1),
          "Byte": ("uint8", 1), "Bool": ("bool", 1), "Float8_e4m3fn": ("float8_e4m3fn", 1),
          "Float8_e5m2": ("float8_e5m2", 1), "ComplexFloat": ("complex64", 8)}

ENV_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enable_env(size: int) -> bool:
    """Turns the recorder on for process groups created from now on, unless the user configured it. Returns
    whether it is (or already was) on."""
    for var in ENV_VARS:
        value = env(var)
        if value:
            return value != "0"
    if size <= 0:
        return False
    set_env("TORCH_FR_BUFFER_SIZE", str(size))
    # On NCCL, completion times (and CUDA-event durations) are filled in only with timing enabled.
    set_env("TORCH_NCCL_ENABLE_TIMING", "1", only_if_unset=True)
    return True


def buffer_size() -> int:
    """Entries torch keeps (the env var in force), 0 when unknown or off."""
    for var in ENV_VARS:
        try:
            return int(env(var) or "")
        except ValueError:
            continue
    return 0


def entry_op(entry: dict) -> str:
    name = entry.get("profiling_name") or ""
    return name.split(":", 1)[1] if ":" in name else name


def entry_bytes_dtype(entry: dict) -> tuple[int | None, str | None]:
    total, dtype = 0, None
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    for shape, dt in zip(sizes, dtypes):
        name, width = _DTYPE.get(dt, (str(dt).lower(), 0))
        dtype = dtype or name
        n = 1
        for d in shape:
            n *= int(d)
        total += n * width
    return (total if dtypes else None), dtype


class FlightRecorder:
    """Incremental reader. ``poll()`` returns entries newer than the previous poll and keeps per-group state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_record_id = -1
        self.available: bool | None = None
        self.polls = 0
        self.entries_seen = 0
        self.entries_lost = 0  # overwritten in torch's ring before we read them
        self.last_started: dict[str, int] = {}  # pg name -> highest collective_seq_id seen
        self.last_completed: dict[str, int] = {}  # pg name -> highest completed (NCCL only)
        self.latest: dict[str, dict] = {}  # pg name -> latest entry
        self._dump = None

    def _dumper(self):
        if self._dump is None:
            c10d = getattr(sys.modules.get("torch._C"), "_distributed_c10d", None)
            # torch >= 2.7 names first; before that the recorder was NCCL-only under _dump_nccl_trace*
            fn = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
            if fn is not None:
                self._dump = lambda: pickle.loads(fn(includeCollectives=True, includeStackTraces=False))
            else:
                fn = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
                if fn is not None:
                    self._dump = lambda: json.loads(fn(includeCollectives=True))
        return self._dump

    def poll(self) -> list[dict]:
        """New entries in record order; [] when the recorder is missing, off or failing (logged once)."""
        with self._lock:
            dump = self._dumper()
            if dump is None:
                self.available = False
                return []
            try:
                data = dump()
            except Exception as exc:  # noqa: BLE001 - private API
                if self.available is not False:
                    _logger.info("otel-gpu: torch flight recorder not readable (%s): C++-issued collectives "
                                 "(DDP, FSDP) will not be seen", exc)
                self.available = False
                return []
            self.available = True
            self.polls += 1
            entries = [e for e in (data.get("entries") or []) if e.get("record_id", -1) > self._last_record_id]
            entries.sort(key=lambda e: e.get("record_id", 0))
            if entries:
                first = entries[0]["record_id"]
                if self._last_record_id >= 0 and first > self._last_record_id + 1:
                    self.entries_lost += first - self._last_record_id - 1
                self._last_record_id = entries[-1]["record_id"]
                self.entries_seen += len(entries)
            for e in entries:
                pg = str((e.get("process_group") or [e.get("pg_id", "")])[0])
                seq = int(e.get("collective_seq_id") or 0)
                if e.get("is_p2p"):
                    continue
                if seq > self.last_started.get(pg, 0):
                    self.last_started[pg] = seq
                    self.latest[pg] = e
                if e.get("state") == "completed" or e.get("time_discovered_completed_ns"):
                    self.last_completed[pg] = max(self.last_completed.get(pg, 0), seq)
            return entries


class Reads:
    """When the recorder is read, and what was read, for the export thread.

    A read holds the GIL for ~15 us per buffered entry, so it happens only when torch counted ops on some group that
    neither the wrappers nor earlier reads accounted for, and routine reads are spaced by the buffer size (1 s per 256
    entries, at least ``export_interval_s``); a stalled process or the final flush reads at once. ``pg`` names a
    process group; ``cpp_count`` (pg name -> ops seen only in the recorder) is the span assembler's.
    """

    def __init__(self, export_interval_s: float, pg, cpp_count: dict[str, int], counters) -> None:
        self.fr = FlightRecorder()
        self.enabled = False
        self.inbox: list[dict] = []  # entries read by either thread, for the export thread
        self.lock = threading.Lock()
        self.last_read = 0.0  # monotonic
        self.last_read_wall_ns = 0
        self._export_interval_s = export_interval_s
        self._min_interval_s = export_interval_s
        self._pg = pg
        self._cpp_count = cpp_count
        self._counters = counters

    def enable(self, size: int) -> None:
        """Sets TORCH_FR_BUFFER_SIZE for process groups created from now on (idempotent)."""
        if not self.enabled:
            self.enabled = enable_env(size)
            self._min_interval_s = max(self._export_interval_s, buffer_size() / 256)

    def _all_pgs(self) -> list:
        c10d = sys.modules.get("torch.distributed.distributed_c10d")  # not imported from a background thread
        try:
            return list(c10d._world.pg_map.keys()) if c10d is not None else []
        except Exception:  # noqa: BLE001
            return []

    def cpp_ops_pending(self) -> bool:
        """True when torch counted ops on some group that neither the wrappers nor the recorder accounted for."""
        seq, p2p = NS["_seq"], NS["_p2p"]
        for g in self._all_pgs():
            try:
                torch_seq = g._get_sequence_number_for_group()
            except Exception:  # noqa: BLE001 - e.g. NCCL before its communicator exists
                continue
            name, _ = self._pg(g)
            if torch_seq > seq.get(g, 0) + p2p.get(g, 0) + self._cpp_count.get(name, 0):
                return True
        return False

    def poll(self, force: bool = False, stalled: bool = False) -> None:
        """Reads new recorder entries into ``inbox`` when due (see the class)."""
        if not self.enabled or self.fr.available is False:
            return
        now = time.monotonic()
        if not force and not stalled and now - self.last_read < self._min_interval_s:
            return
        if not force and not self.cpp_ops_pending():
            return
        self.last_read = now
        self.last_read_wall_ns = time.time_ns()
        entries = self.fr.poll()
        if entries:
            with self.lock:
                self.inbox.extend(entries)
            self._counters["fr_polls"] += 1

    def take(self) -> list[dict]:
        """The entries read since the last take."""
        with self.lock:
            out, self.inbox = self.inbox, []
        return out
