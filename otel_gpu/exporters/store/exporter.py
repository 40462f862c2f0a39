"""The ``store`` exporter: failure records, goodput summaries and job sightings into SQLite, off the pipeline thread.

Faults stay in the store (issue 21): a store that cannot open (full disk, corrupt file, another collector holding its
lock) or write leaves the exporter *degraded*, never the collector stopped: it says so (an error naming the file and
the fix, ``COMPONENT_STATUS`` for the health check, the ``otel_gpu.collector.degraded`` gauge), drops and
counts what it cannot write, and tries again every ``reopen_interval``. A record SQLite refuses drops alone.
"""
from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from otel_gpu.component import (COMPONENT_STATUS, DEVICE_HISTORY, FAILURE_HISTORY, ComponentHost, ExportResult, Exporter,
                                IdentityCache)
from otel_gpu.exporters.store import db
from otel_gpu.exporters.store import devices as device_store
from otel_gpu.exporters.store.config import StoreExporterConfig
from otel_gpu.pdata import Batch, Signal, body_object, event_name, log_records, to_python
from otel_gpu.schema import collector as collector_schema
from otel_gpu.schema import failure as failure_schema
from otel_gpu.schema import health as health_schema
from otel_gpu.schema import identity
from otel_gpu.schema import training as training_schema

__all__ = ["FailureHistory", "StoreExporter"]

_logger = logging.getLogger(__name__)

_FAILURE = failure_schema.FAILURE_EVENT.name
_GOODPUT = failure_schema.GOODPUT_EVENT.name
_DEVICE = health_schema.STATE_CHANGE_EVENT.name
_RESTART = training_schema.RESTART_EVENT.name
_EVENTS = (_FAILURE, _GOODPUT, _DEVICE, _RESTART)
_JOB, _HOST, _RANK, _WORLD = (identity.JOB_ID, identity.HOST_NAME, identity.RANK,
                              identity.WORLD_SIZE)
_IDENTITY_KEYS = frozenset((_JOB, _HOST, _RANK, _WORLD))
_MAX_BATCH = 500  # records per transaction
_KNOWN_MAX = 1_000_000  # (job, rank) / (job, host) pairs remembered as written
_IDENTITY_CACHE = 65536  # distinct resources remembered: a node digest and its devices per node (16,384 nodes:
# 32,768), or one per rank process; at 4,096 a 131,072-rank job missed on every request
LOCK_FILE = db.DB_FILE + ".lock"  # beside the file: one writing collector per store (flock; readers never take it)
_LOG_EVERY_S = 60.0  # a repeating fault (a poison record, a full disk) is logged at most this often per kind
_SQLITE_MAGIC = b"SQLite format 3\x00"


def _int(value: Any) -> int | None:
    try:
        out = None if value is None else int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        return None
    return out if out is None or -(1 << 63) <= out < 1 << 63 else None  # SQLite integers are 64-bit


def _text(value: Any) -> str | None:
    """A column value from a body field of any JSON type: a list or object would fail the whole transaction."""
    return value if value is None or isinstance(value, str) else json.dumps(value, sort_keys=True)


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def store_fault(exc: BaseException) -> bool:
    """True when ``exc`` is the store's own fault (a full disk, an I/O error, a corrupt or locked file), which every
    record would hit; False for one record's (a lone surrogate, an integer SQLite cannot hold, a value JSON refuses),
    which only that record should pay for."""
    if isinstance(exc, OSError):
        return True
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(
        exc, (sqlite3.IntegrityError, sqlite3.DataError, sqlite3.ProgrammingError, sqlite3.InterfaceError))


class StoreBusy(RuntimeError):
    """Another process (a second collector) holds the store's lock file."""


class _RateLog:
    """Logs a repeating problem at most once per ``every_s`` per key, with how many were not logged since: a poison
    record per minute shows up every minute, not once forever and not 10,000 times."""

    def __init__(self, logger: logging.Logger, every_s: float = _LOG_EVERY_S):
        self._logger, self._every_s = logger, every_s
        self._last: dict[Any, tuple[float, int]] = {}

    def __call__(self, key: Any, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        now = time.monotonic()
        last, quiet = self._last.get(key, (None, 0))
        if last is not None and now - last < self._every_s:
            self._last[key] = (last, quiet + 1)
            return
        self._last[key] = (now, 0)
        if quiet:
            msg += f" ({quiet} more like it in the last {self._every_s:g} s)"
        self._logger.log(level, msg, *args, **kwargs)


class _Ticket:
    """Put behind a batch's records: set once they are committed (``ok``) or given up on."""

    __slots__ = ("event", "ok")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.ok = False

    def done(self, ok: bool) -> None:
        self.ok = ok
        self.event.set()


class _JobSeen:
    __slots__ = ("first", "last", "ranks", "hosts", "world_size")

    def __init__(self, now: float):
        self.first = self.last = now
        self.ranks: set[int] = set()
        self.hosts: set[str] = set()
        self.world_size: int | None = None


class FailureHistory:
    """``host.services.get(FAILURE_HISTORY)``: how often a failure signature was recorded, for the attribution processor.

    Counts what the store holds plus what is queued for it, so that two failures moments apart see each other.
    Thread-safe; reads through its own connection.
    """

    def __init__(self, folder: str | Path):
        self._folder = folder
        self._conn: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()  # held by readers and by the writer around commit + un-pending
        self._pending_lock = threading.Lock()
        self._pending: collections.Counter[str] = collections.Counter()
        self._pending_total = 0
        self._log_once_done = False

    # -- writer side ---------------------------------------------------------------------------------------------
    def add_pending(self, signature: str) -> None:
        with self._pending_lock:
            self._pending[signature] += 1
            self._pending_total += 1

    def remove_pending(self, signatures: list[str]) -> None:
        with self._pending_lock:
            for sig in signatures:
                left = self._pending[sig] - 1
                if left > 0:
                    self._pending[sig] = left
                else:
                    del self._pending[sig]
                self._pending_total -= 1

    @property
    def commit_lock(self) -> threading.Lock:
        return self._read_lock

    # -- reader side ---------------------------------------------------------------------------------------------
    def _connection(self) -> sqlite3.Connection | None:
        if self._conn is None:
            try:
                self._conn = db.open_reader(self._folder)
            except (db.StoreMissing, sqlite3.Error):
                return None
        return self._conn

    def _count(self, signature: str | None) -> int:
        with self._read_lock:
            stored = 0
            try:
                conn = self._connection()
                if conn is not None:
                    stored = db.failure_count(conn, signature)
            except sqlite3.Error as exc:
                if not self._log_once_done:
                    self._log_once_done = True
                    _logger.warning("failure history: cannot read the store (%s); counting queued records only "
                                    "(logged once)", exc)
            with self._pending_lock:
                pending = self._pending_total if signature is None else self._pending.get(signature, 0)
        return stored + pending

    def recurrence(self, signature: str) -> int:
        """How many failure records with ``signature`` the store holds (across jobs)."""
        return self._count(signature)

    def record_count(self) -> int:
        """How many failure records the store holds."""
        return self._count(None)

    def close(self) -> None:
        with self._read_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class StoreExporter(Exporter):
    """Writes failures, goodput and job sightings to ``<path>/otel-gpu.db`` from its own thread.

    Events go to a bounded queue (full: dropped and counted) and ``export()`` waits up to ``durable_timeout_s`` for
    their commit, so that what the receiver answers 200 for survives a SIGKILL; job sightings are merged in memory and
    written every ``flush_interval_s``. Only resources are walked for traces and metrics (which never wait).
    """

    def __init__(self, config: StoreExporterConfig, host: ComponentHost):
        super().__init__(config, host)
        self.path = Path(config.path)
        self.history = FailureHistory(self.path)
        if FAILURE_HISTORY in host.services:
            _logger.warning("more than one store exporter: failure_history now reads %s", self.path)
        host.services.publish(FAILURE_HISTORY, self.history)
        self.devices = device_store.DeviceHistory(self.path, db.open_reader)  # device history (health processor)
        host.services.publish(DEVICE_HISTORY, self.devices)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self._jobs_lock = threading.Lock()
        self._jobs: dict[str, _JobSeen] = {}
        #: (job, host, rank, world) per resource, keyed by a hash of its attributes, LRU-bounded (a flood of distinct
        #: hostile resources costs at most _IDENTITY_CACHE small entries).
        self._identities = IdentityCache(_IDENTITY_CACHE)
        self._known_ranks: set[tuple[str, int]] = set()
        self._known_hosts: set[tuple[str, str]] = set()
        self._thread: threading.Thread | None = None
        self._stop = object()
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self.written = 0  # records committed (tests, report)
        self.poisoned = 0  # records SQLite or JSON refused, dropped alone (their batch was written)
        self.out_of_window = 0  # record times outside the window, indexed as the receipt time instead
        self.degraded: str | None = None  # why the store cannot write now, or None
        self._rate_log = _RateLog(_logger)
        host.services.publish(COMPONENT_STATUS, lambda: (f"exporters.{host.component_id}", self.degraded))

    # -- pipeline side -------------------------------------------------------------------------------------------
    def export(self, batch: Batch) -> ExportResult:
        message = batch.message
        if batch.signal is Signal.TRACES:
            self._see_resources(message.resource_spans)
            return ExportResult.SUCCESS
        if batch.signal is Signal.METRICS:
            self._see_resources(message.resource_metrics)
            return ExportResult.SUCCESS
        self._see_resources(message.resource_logs)
        ignored = queued = dropped = 0
        now = time.time()
        ticket = None
        for _, _, record in log_records(message):
            name = event_name(record)
            if name not in _EVENTS:
                ignored += 1
                continue
            body = body_object(record)
            if body is None:
                self.host.log_once(("body", name), logging.WARNING, "store: a %s event without a JSON object "
                                   "body was ignored (logged once)", name)
                ignored += 1
                continue
            if self._enqueue(name, body, now):
                queued += 1
            else:
                dropped += 1
        cid = self.host.component_id
        if ignored:
            self.host.telemetry.exported(cid, Signal.LOGS, ignored)
        if dropped:
            self.host.telemetry.dropped(cid, Signal.LOGS, dropped)
            self._rate_log("queue_full", logging.WARNING, "store %s: queue full (%d records); new records are "
                           "dropped and counted", cid, self.config.queue_size)
        if queued and self.config.durable_timeout_s > 0 and self.degraded is None and self._thread is not None:
            # Durable before the answer: the receiver answers when this returns. The writer commits what waits in
            # one transaction, so concurrent senders share a commit (group commit).
            ticket = _Ticket()
            try:
                self._queue.put(ticket, timeout=self.config.durable_timeout_s)
            except queue.Full:
                ticket = None
            if ticket is not None and not ticket.event.wait(self.config.durable_timeout_s):
                self._rate_log("slow_commit", logging.WARNING, "store %s: records not committed within "
                               "durable_timeout %.1f s; answered before they are durable", cid,
                               self.config.durable_timeout_s)
        return ExportResult.QUEUED

    def _enqueue(self, name: str, body: dict[str, Any], now: float) -> bool:
        # The 4th item is the signature counted as pending for recurrence until committed: a revision or a
        # withdrawal of a failure already counted is no new failure.
        signature = str(body.get("signature") or "") if name == _FAILURE else ""
        if signature and ((_int(body.get("version")) or 1) > 1 or db.is_withdrawn(body)):
            signature = ""
        if signature:
            self.history.add_pending(signature)
        if name == _FAILURE:
            self.devices.add_pending(body)
        elif name == _DEVICE:
            self.devices.learn(body)
        try:
            self._queue.put_nowait((name, body, now, signature))
        except queue.Full:
            if signature:
                self.history.remove_pending([signature])
            if name == _FAILURE:
                self.devices.remove_pending([body])
            return False
        return True

    def _identity(self, resource: Any) -> tuple[str, str | None, int | None, int | None] | None:
        """(job, host, rank, world size) of a resource, cached by a hash of it (senders repeat the same few)."""
        key = self._identities.key(resource)
        cached = self._identities.get(key, False)
        if cached is not False:
            return cached
        found: dict[str, Any] = {}
        for kv in resource.attributes:
            if kv.key in _IDENTITY_KEYS:
                found[kv.key] = to_python(kv.value, json_safe=True)
        out = None
        if found.get(_JOB):
            out = (str(found[_JOB]), str(found[_HOST]) if found.get(_HOST) else None, _int(found.get(_RANK)),
                   _int(found.get(_WORLD)))
        self._identities.put(key, out)
        return out

    def _see_resources(self, resources: Any) -> None:
        seen = [ident for ident in map(self._identity, (r.resource for r in resources)) if ident is not None]
        if not seen:
            return
        now = time.time()
        with self._jobs_lock:
            for job, host, rank, world in seen:
                entry = self._jobs.get(job)
                if entry is None:
                    entry = self._jobs[job] = _JobSeen(now)
                entry.last = now
                if rank is not None:
                    entry.ranks.add(rank)
                if host:
                    entry.hosts.add(host)
                if world is not None:
                    entry.world_size = world

    def _see_job(self, job: str, now: float) -> None:
        with self._jobs_lock:
            seen = self._jobs.get(job)
            if seen is None:
                self._jobs[job] = _JobSeen(now)
            else:
                seen.last = now

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        # Never raises: a store that cannot open degrades the store alone, and the writer tries again (issue 21: a
        # full disk or a corrupt file stopped every receiver and exporter from starting).
        self._open()
        self._thread = threading.Thread(target=self._run, name=f"otel-gpu-store-{self.host.component_id}",
                                        daemon=True)
        self._thread.start()

    def _open(self) -> bool:
        """Takes the lock, opens (creates, migrates) the file and runs retention; on failure: degraded, False."""
        file = db.db_path(self.path)
        try:
            self._take_lock()
            conn = db.open_writer(self.path)
        except StoreBusy as exc:
            self._degrade(str(exc))
            return False
        except db.StoreTooNew as exc:
            self._degrade(str(exc))
            return False
        except (OSError, sqlite3.Error) as exc:
            self._degrade(f"store cannot open {file}: {exc}; {self._fix(exc)}")
            return False
        self._conn = conn
        try:
            self.devices.load(conn)
            self._retention()
        except sqlite3.Error as exc:  # a corrupt page can still open; it is reported, the writer goes on
            self._degrade(f"store {file} opened but cannot be read or cleaned: {exc}; {self._fix(exc)}")
            return True
        self._recovered()
        _logger.info("store exporter %s writing %s", self.host.component_id, file)
        return True

    def _fix(self, exc: BaseException) -> str:
        file, key = db.db_path(self.path), f"exporters.{self.host.component_id}.path"
        text = str(exc).lower()
        if isinstance(exc, OSError) and exc.errno in (28, 122) or "full" in text:  # ENOSPC, EDQUOT
            return f"free space on the disk of {file.parent} or set {key} to a folder with room"
        if "not a database" in text or "malformed" in text or "corrupt" in text:
            return (f"stop the collector, move {file} (with its -wal and -shm files) aside to keep it, and start "
                    f"again (a new store is created; `sqlite3 {file} .recover` may save the old records)")
        if "readonly" in text or "read-only" in text or isinstance(exc, PermissionError):
            return f"make {file.parent} writable by the collector or set {key}"
        return f"check {key} (a writable folder)"

    def _take_lock(self) -> None:
        """flock on ``<path>/otel-gpu.db.lock`` (held until shutdown, released by the kernel on any exit, SIGKILL
        too); the holder's pid is written in it for the next one's message."""
        if self._lock_fd is not None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        lock_path = self.path / LOCK_FILE
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "pid unknown"
            raise StoreBusy(f"store {db.db_path(self.path)} is in use by another collector ({who}, holding "
                            f"{lock_path}); give each collector its own exporters.{self.host.component_id}.path "
                            f"(`otel-gpu report` reads it without the lock)") from None
        except OSError:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # a full disk: the lock holds, only the pid in the message is missing
            pass
        self._lock_fd = fd

    def _degrade(self, reason: str) -> None:
        first = self.degraded is None
        self.degraded = reason
        _set_degraded_gauge(self.host, self.host.component_id, 1.0)
        if first:
            _logger.error("store %s degraded, the rest of the collector goes on: %s (records for the store are "
                          "dropped and counted; tried again every %s s)", self.host.component_id, reason,
                          f"{self.config.reopen_interval_s:g}")
        else:
            self._rate_log(("degraded", reason), logging.ERROR, "store %s still degraded: %s",
                           self.host.component_id, reason)

    def _recovered(self) -> None:
        self._fault = None
        if self.degraded is None:
            return
        self.degraded = None
        _set_degraded_gauge(self.host, self.host.component_id, 0.0)
        _logger.warning("store %s writes %s again", self.host.component_id, db.db_path(self.path))

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        if self._thread is None or not self._thread.is_alive():
            return False
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            deadline = time.monotonic() + timeout_s
            try:
                self._queue.put(self._stop, timeout=max(0.1, timeout_s / 2))
            except queue.Full:
                _logger.warning("store %s: queue still full at shutdown; unwritten records are lost",
                                self.host.component_id)
                self._drain_queue()
                try:
                    self._queue.put(self._stop, timeout=1.0)
                except queue.Full:
                    pass
            thread.join(max(0.1, deadline - time.monotonic()))
            if thread.is_alive():
                _logger.warning("store %s: writer did not finish within %.1f s", self.host.component_id, timeout_s)
                return
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        self.history.close()
        self.devices.close()

    def _drain_queue(self) -> None:
        lost = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                lost.append(item[3])
                if item[0] == _FAILURE:
                    self.devices.remove_pending([item[1]])
            elif isinstance(item, _Ticket):
                item.done(False)
            elif isinstance(item, threading.Event):
                item.set()
        self.history.remove_pending([s for s in lost if s])
        if lost:
            self.host.telemetry.dropped(self.host.component_id, Signal.LOGS, len(lost))

    # -- writer thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        cfg = self.config
        now = time.monotonic()
        next_jobs = now + cfg.flush_interval_s
        next_retention = now + cfg.retention_interval_s
        next_open = now + cfg.reopen_interval_s
        next_check = now + cfg.check_interval_s if cfg.check_interval_s > 0 else float("inf")
        stop = False
        while not stop:
            items: list[Any] = []
            try:
                items.append(self._queue.get(timeout=max(0.01, next_jobs - time.monotonic())))
                while len(items) < _MAX_BATCH:
                    items.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            records = [i for i in items if isinstance(i, tuple)]
            tickets = [i for i in items if isinstance(i, _Ticket)]
            markers = [i for i in items if isinstance(i, threading.Event)]
            stop = any(i is self._stop for i in items)
            now = time.monotonic()
            flush_jobs = bool(markers) or stop or now >= next_jobs
            if self._conn is None and now >= next_open:  # the disk was freed, the other collector left, ...
                next_open = now + cfg.reopen_interval_s
                self._open()
            ok = False
            if self._conn is None:
                self._drop(records, "the store is not open")
            else:
                try:
                    ok = True
                    if self._write(records, flush_jobs) and self._fault == "write":
                        self._recovered()
                except Exception as exc:  # noqa: BLE001 - the writer must outlive a bad record or a full disk
                    ok = False
                    self._drop(records, f"{type(exc).__name__}: {exc}")
                    if store_fault(exc):
                        self._fault = "write"
                        self._degrade(f"store cannot write {db.db_path(self.path)}: {exc}; {self._fix(exc)}")
                    else:  # not SQLite's refusal of one record, nor the store's fault: a bug
                        self._rate_log("write", logging.ERROR, "store %s: write failed; %d records dropped",
                                       self.host.component_id, len(records), exc_info=True)
            if flush_jobs:
                next_jobs = now + cfg.flush_interval_s
                if self._conn is not None:
                    self._check_header()
            if self._conn is not None and now >= next_check:
                next_check = now + cfg.check_interval_s
                self._check_integrity()
            if now >= next_retention and self._conn is not None:
                next_retention = now + cfg.retention_interval_s
                try:
                    self._retention()
                except sqlite3.Error as exc:
                    self._rate_log("retention", logging.ERROR, "store %s: retention failed on %s: %s; %s",
                                   self.host.component_id, db.db_path(self.path), exc, self._fix(exc))
            self.host.telemetry.queue(self.host.component_id, self._queue.qsize(), cfg.queue_size)
            for ticket in tickets:
                ticket.done(ok)
            for marker in markers:
                marker.set()

    _fault: str | None = None  # what degraded a store that is open: "write" (cleared by a write), "check"

    def _drop(self, records: list[tuple[str, dict[str, Any], float, str]], why: str) -> None:
        if not records:
            return
        self.history.remove_pending([r[3] for r in records if r[3]])
        self.devices.remove_pending([r[1] for r in records if r[0] == _FAILURE])
        self.host.telemetry.dropped(self.host.component_id, Signal.LOGS, len(records))
        self._rate_log("dropped", logging.ERROR, "store %s: %d records dropped, not written to %s (%s)",
                       self.host.component_id, len(records), db.db_path(self.path), why)

    def _check_header(self) -> None:
        """The file still starts as an SQLite file: bytes overwritten while running were silent (issue 21), since
        the writer's own page cache hides them until a checkpoint or a reader trips on them."""
        try:
            with open(db.db_path(self.path), "rb") as f:
                head = f.read(len(_SQLITE_MAGIC))
        except OSError as exc:
            head, why = b"", f"cannot read it ({exc})"
        else:
            why = f"its header is {head[:16]!r}, not SQLite's"
        if head == _SQLITE_MAGIC:
            return
        # Confirmed by SQLite itself before it is called corrupt: while page 1 is in the WAL, SQLite reads it from
        # there and the next checkpoint writes it back whole.
        self._check_integrity(why)

    def _check_integrity(self, header: str | None = None) -> None:
        """``PRAGMA quick_check`` through a fresh read-only connection (the writer's page cache would hide pages
        changed on disk); clears a degraded state this check raised once the file checks out again. ``header``:
        what the header check found, said with the verdict."""
        file = db.db_path(self.path)
        try:
            conn = sqlite3.connect(f"{file.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
            try:
                rows = [r[0] for r in conn.execute("PRAGMA quick_check(3)")]
            finally:
                conn.close()
        except sqlite3.Error as exc:
            rows = [str(exc)]
        if rows == ["ok"]:
            if header is not None:
                self._rate_log("header", logging.WARNING, "store %s: %s on disk, but SQLite reads %s whole (its "
                               "newest pages are in the WAL)", self.host.component_id, header, file)
            elif self._fault == "check":
                self._recovered()
            return
        self._corrupt("; ".join(filter(None, (header, "quick_check: " + "; ".join(rows)[:300]))))

    def _corrupt(self, why: str) -> None:
        file = db.db_path(self.path)
        self._fault = "check"
        self._degrade(f"store {file} is corrupt ({why}); records are still written where SQLite can, readers may "
                      f"fail. Fix: {self._fix(sqlite3.DatabaseError('malformed'))}")

    def _write(self, records: list[tuple[str, dict[str, Any], float, str]], flush_jobs: bool) -> bool:
        """Writes ``records`` and (if ``flush_jobs``) the job sightings in one transaction; True if it wrote any.

        If one record fails (a value SQLite or JSON refuses), the batch is written again one record at a time
        (a savepoint each), so that only that record drops (issue 21: a lone surrogate lost its 500 neighbours)."""
        conn = self._conn
        assert conn is not None
        for name, body, received, _ in records:
            job = body.get("job_id")
            if job:
                self._see_job(str(job), received)
        jobs: dict[str, _JobSeen] = {}
        if flush_jobs:
            with self._jobs_lock:
                jobs, self._jobs = self._jobs, {}
        if not records and not jobs:
            return False
        try:
            try:
                written, poisoned, known = self._transaction(conn, records, jobs, alone=False)
            except Exception as exc:  # sorted below: the store's fault is raised again
                if store_fault(exc):
                    raise
                written, poisoned, known = self._transaction(conn, records, jobs, alone=True)
        except BaseException:
            with self._jobs_lock:  # sightings are merged back, not lost
                for job, seen in jobs.items():
                    self._merge_job(job, seen)
            raise
        self._known_ranks.update(known[0])
        self._known_hosts.update(known[1])
        if len(self._known_ranks) > _KNOWN_MAX or len(self._known_hosts) > _KNOWN_MAX:
            self._known_ranks.clear()
            self._known_hosts.clear()
        self.written += len(written)
        cid = self.host.component_id
        if written:
            self.host.telemetry.exported(cid, Signal.LOGS, len(written))
        if poisoned:
            self.poisoned += len(poisoned)
            self.host.telemetry.dropped(cid, Signal.LOGS, len(poisoned))
            _count(self.host, "poison", cid, len(poisoned))
            for (name, body, _, _), exc in poisoned:
                self._rate_log("poison", logging.ERROR, "store %s: dropped one %s record that SQLite or JSON refuses "
                               "(%s: %s; job %s); the rest of its batch was written", cid, name,
                               type(exc).__name__, str(exc)[:200], ascii(body.get("job_id"))[:80])
        return True

    def _transaction(self, conn: sqlite3.Connection, records: list[tuple[str, dict[str, Any], float, str]],
                     jobs: dict[str, _JobSeen], alone: bool) -> tuple[list, list, tuple[list, list]]:
        """One transaction; ``alone``: each record (and job) in its own savepoint, a refused one rolled back and
        returned in ``poisoned`` instead of failing the rest. Returns (written, poisoned, (new ranks, new hosts))."""
        written: list[tuple[str, dict[str, Any], float, str]] = []
        poisoned: list[tuple[tuple[str, dict[str, Any], float, str], BaseException]] = []
        conn.execute("BEGIN IMMEDIATE")
        try:
            for record in records:
                if alone:
                    conn.execute("SAVEPOINT record")
                try:
                    self._insert(conn, record)
                except Exception as exc:  # sorted: the store's fault fails all, a record's only it
                    if not alone or store_fault(exc):
                        raise
                    conn.execute("ROLLBACK TO record")
                    conn.execute("RELEASE record")
                    poisoned.append((record, exc))
                    continue
                if alone:
                    conn.execute("RELEASE record")
                written.append(record)
            known = self._write_jobs(conn, jobs, alone)
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        with self.history.commit_lock, self.devices.commit_lock:
            try:
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            self.history.remove_pending([r[3] for r in records if r[3]])
            self.devices.remove_pending([r[1] for r in records if r[0] == _FAILURE])
        return written, poisoned, known

    def _insert(self, conn: sqlite3.Connection, record: tuple[str, dict[str, Any], float, str]) -> None:
        name, body, received, _pending = record
        if name == _FAILURE:
            self._insert_failure(conn, body, received)
            device_store.link_failure(conn, body, received, self.devices.ids(body))
        elif name == _DEVICE:
            device_store.insert_state(conn, body, received)
        elif name == _RESTART:
            conn.execute("INSERT INTO restarts (job_id, time, received_time, record) VALUES (?, ?, ?, ?)",
                         (str(body.get("job_id") or ""), self._when(body.get("time"), received), received,
                          json.dumps(body, sort_keys=True)))
        else:
            self._insert_goodput(conn, body, received)

    def _when(self, value: Any, received: float) -> float | None:
        """A record's time as indexed: as given inside [received - past, received + future]; else the receipt time,
        counted (the record's JSON keeps what was sent)."""
        t = _num(value)
        if t is None:
            return None
        cfg = self.config
        if received - cfg.time_window_past_s <= t <= received + cfg.time_window_future_s:
            return t
        self.out_of_window += 1
        _count(self.host, "out_of_window", self.host.component_id, 1)
        return received

    def _merge_job(self, job: str, seen: _JobSeen) -> None:
        cur = self._jobs.get(job)
        if cur is None:
            self._jobs[job] = seen
            return
        cur.first, cur.last = min(cur.first, seen.first), max(cur.last, seen.last)
        cur.ranks |= seen.ranks
        cur.hosts |= seen.hosts
        cur.world_size = cur.world_size if cur.world_size is not None else seen.world_size

    def _insert_failure(self, conn: sqlite3.Connection, body: dict[str, Any], received: float) -> None:
        """One row per failure: a record with a ``failure_id`` replaces an older version of the same failure (never
        a newer one: versions may arrive out of order after a replay), and every version lands in
        ``failure_versions`` once (a redelivered version is ignored)."""
        failure_id = None if body.get("failure_id") in (None, "") else str(body["failure_id"])
        version = _int(body.get("version"))
        version = 1 if version is None else version
        status = db.WITHDRAWN if db.is_withdrawn(body) else _text(body.get("status"))
        text = json.dumps(body, sort_keys=True)
        signature = str(body.get("signature") or "")
        row = (_text(body.get("kind")), _text(body.get("root_cause")),
               None if body.get("job_id") is None else str(body["job_id"]), signature or None,
               self._when(body.get("detected_time"), received), received, text, failure_id, version, status)
        if failure_id is None:
            conn.execute("INSERT INTO failures (kind, root_cause, job_id, signature, detected_time, received_time, "
                         "record, failure_id, version, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            return
        conn.execute("INSERT OR IGNORE INTO failure_versions (failure_id, version, received_time, record) "
                     "VALUES (?, ?, ?, ?)", (failure_id, version, received, text))
        conn.execute(
            "INSERT INTO failures (kind, root_cause, job_id, signature, detected_time, received_time, record, "
            "failure_id, version, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(failure_id) DO UPDATE SET kind = excluded.kind, root_cause = excluded.root_cause, "
            "job_id = excluded.job_id, signature = excluded.signature, detected_time = excluded.detected_time, "
            "received_time = excluded.received_time, record = excluded.record, version = excluded.version, "
            "status = excluded.status WHERE excluded.version >= coalesce(failures.version, 0)", row)

    @staticmethod
    def _insert_goodput(conn: sqlite3.Connection, body: dict[str, Any], received: float) -> None:
        job = str(body.get("job_id") or "")
        text = json.dumps(body, sort_keys=True)
        conn.execute("INSERT INTO goodput (job_id, updated_time, summary) VALUES (?, ?, ?) ON CONFLICT(job_id) "
                     "DO UPDATE SET updated_time = excluded.updated_time, summary = excluded.summary",
                     (job, received, text))
        # The timeline is cumulative: the latest summary's is the whole picture, and a copy in each of the ~17,000
        # rows a day of a job leaves in the history would be ~10 KB each.
        history = {k: v for k, v in body.items() if k != "timeline"}
        conn.execute("INSERT INTO goodput_history (job_id, received_time, summary) VALUES (?, ?, ?)",
                     (job, received, json.dumps(history, sort_keys=True) if "timeline" in body else text))

    def _write_jobs(self, conn: sqlite3.Connection, jobs: dict[str, _JobSeen],
                    alone: bool = False) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
        """Upserts job sightings; returns the (job, rank) and (job, host) pairs written, remembered once committed.
        ``alone``: a job SQLite refuses (an id from a record body with a lone surrogate) drops alone."""
        all_ranks: list[tuple[str, int]] = []
        all_hosts: list[tuple[str, str]] = []
        for job, seen in jobs.items():
            new_ranks = [(job, r) for r in seen.ranks if (job, r) not in self._known_ranks]
            new_hosts = [(job, h) for h in seen.hosts if (job, h) not in self._known_hosts]
            if alone:
                conn.execute("SAVEPOINT job")
            try:
                conn.execute("INSERT INTO jobs (job_id, first_seen, last_seen, world_size) VALUES (?, ?, ?, ?) "
                             "ON CONFLICT(job_id) DO UPDATE SET first_seen = min(first_seen, excluded.first_seen), "
                             "last_seen = max(last_seen, excluded.last_seen), "
                             "world_size = coalesce(excluded.world_size, world_size)",
                             (job, seen.first, seen.last, seen.world_size))
                if new_ranks:
                    conn.executemany("INSERT OR IGNORE INTO job_ranks (job_id, rank) VALUES (?, ?)", new_ranks)
                if new_hosts:
                    conn.executemany("INSERT OR IGNORE INTO job_hosts (job_id, host) VALUES (?, ?)", new_hosts)
            except Exception as exc:
                if not alone or store_fault(exc):
                    raise
                conn.execute("ROLLBACK TO job")
                conn.execute("RELEASE job")
                self.poisoned += 1
                _count(self.host, "poison", self.host.component_id, 1)
                self._rate_log("poison_job", logging.ERROR, "store %s: dropped the sighting of a job whose id "
                               "SQLite refuses (%s: %s)", self.host.component_id, type(exc).__name__,
                               str(exc)[:200])
                continue
            if alone:
                conn.execute("RELEASE job")
            all_ranks += new_ranks
            all_hosts += new_hosts
        return all_ranks, all_hosts

    def _retention(self) -> None:
        conn = self._conn
        assert conn is not None
        cfg = self.config
        cutoff = time.time() - cfg.max_age_days * 86400.0
        with self.history.commit_lock:  # recurrence counts never see a half-applied retention
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("DELETE FROM failures WHERE received_time < ?", (cutoff,))
                conn.execute("DELETE FROM failures WHERE id <= (SELECT id FROM failures ORDER BY id DESC "
                             "LIMIT 1 OFFSET ?)", (cfg.max_failures,))
                conn.execute("DELETE FROM failure_versions WHERE received_time < ? OR failure_id NOT IN "
                             "(SELECT failure_id FROM failures WHERE failure_id IS NOT NULL)", (cutoff,))
                conn.execute("DELETE FROM goodput_history WHERE received_time < ?", (cutoff,))
                conn.execute("DELETE FROM goodput_history WHERE id <= (SELECT id FROM goodput_history "
                             "ORDER BY id DESC LIMIT 1 OFFSET ?)", (cfg.max_goodput_history,))
                conn.execute("DELETE FROM goodput WHERE updated_time < ?", (cutoff,))
                device_store.retention(conn, cutoff)
                conn.execute("DELETE FROM restarts WHERE received_time < ?", (cutoff,))
                if conn.execute("DELETE FROM jobs WHERE last_seen < ?", (cutoff,)).rowcount:
                    conn.execute("DELETE FROM job_ranks WHERE job_id NOT IN (SELECT job_id FROM jobs)")
                    conn.execute("DELETE FROM job_hosts WHERE job_id NOT IN (SELECT job_id FROM jobs)")
                    self._known_ranks.clear()
                    self._known_hosts.clear()
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise


def _count(host: ComponentHost, what: str, component: str, n: int) -> None:
    """Self-telemetry beyond the SelfTelemetry protocol's five calls, where the host's telemetry offers it."""
    metric = {"poison": collector_schema.POISON_RECORDS, "out_of_window": collector_schema.OUT_OF_WINDOW}[what]
    count = getattr(host.telemetry, "count", None)
    if count is not None:
        count(metric, component, n)


def _set_degraded_gauge(host: ComponentHost, component: str, value: float) -> None:
    gauge = getattr(host.telemetry, "gauge", None)
    if gauge is not None:
        gauge(collector_schema.DEGRADED, component, value)
