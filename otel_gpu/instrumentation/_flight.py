"""Reads torch's flight recorder: the collectives that DDP's C++ reducer, FSDP and functional collectives issue
without passing through the Python functions.

The dump holds the GIL for about 15 us per buffered entry, so it is read only when torch's per-group op counter
(``ProcessGroup._get_sequence_number_for_group``, cheap) shows ops that the Python wrappers did not issue, and the
buffer is kept small (``TORCH_FR_BUFFER_SIZE``, 256 by default when the user set nothing).
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import threading

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
        if os.environ.get(var):
            return os.environ[var] != "0"
    if size <= 0:
        return False
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(size)
    # On NCCL, completion times (and CUDA-event durations) are filled in only with timing enabled.
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    return True


def buffer_size() -> int:
    """Entries torch keeps (the env var in force), 0 when unknown or off."""
    for var in ENV_VARS:
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
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
