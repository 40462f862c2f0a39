"""The ``store`` exporter: failure records, goodput summaries and job sightings into SQLite, off the pipeline thread."""
from __future__ import annotations

import collections
import json
import logging
import queue
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from otel_gpu.component import ComponentHost, Exporter, ExportResult, IdentityCache
from otel_gpu.exporters.store import db
from otel_gpu.exporters.store import devices as device_store
from otel_gpu.exporters.store.config import StoreExporterConfig
from otel_gpu.pdata import Batch, Signal, body_object, event_name, log_records, to_python
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
_JOB, _HOST, _RANK, _WORLD = (str(identity.JOB_ID), str(identity.HOST_NAME), str(identity.RANK),
                              str(identity.WORLD_SIZE))
_IDENTITY_KEYS = frozenset((_JOB, _HOST, _RANK, _WORLD))
_MAX_BATCH = 500  # records per transaction
_KNOWN_MAX = 1_000_000  # (job, rank) / (job, host) pairs remembered as written
_IDENTITY_CACHE = 4096  # distinct resources remembered (a node has a few ranks and devices)


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


class _JobSeen:
    __slots__ = ("first", "last", "ranks", "hosts", "world_size")

    def __init__(self, now: float):
        self.first = self.last = now
        self.ranks: set[int] = set()
        self.hosts: set[str] = set()
        self.world_size: int | None = None


class FailureHistory:
    """``host.services["failure_history"]``: how often a failure signature was recorded, for the attribution processor.

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

    ``export()`` never blocks: events go to a bounded queue (full: dropped and counted), job sightings are merged
    in memory and written every ``flush_interval_s``. Only resources are walked for traces and metrics.
    """

    def __init__(self, config: StoreExporterConfig, host: ComponentHost):
        super().__init__(config, host)
        self.path = Path(config.path)
        self.history = FailureHistory(self.path)
        if "failure_history" in host.services:
            _logger.warning("more than one store exporter: failure_history now reads %s", self.path)
        host.services["failure_history"] = self.history
        self.devices = device_store.DeviceHistory(self.path, db.open_reader)  # device history (health processor)
        host.services["device_history"] = self.devices
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
        self.written = 0  # records committed (tests, report)

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
            self.host.log_once("queue_full", logging.WARNING, "store %s: queue full (%d records); new records are "
                               "dropped and counted (logged once)", cid, self.config.queue_size)
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
        try:
            self._conn = db.open_writer(self.path)
        except (OSError, sqlite3.Error, db.StoreTooNew) as exc:
            raise RuntimeError(f"store cannot open {db.db_path(self.path)}: {exc}; check exporters."
                               f"{self.host.component_id}.path") from None
        self.devices.load(self._conn)
        self._retention()
        self._thread = threading.Thread(target=self._run, name=f"otel-gpu-store-{self.host.component_id}",
                                        daemon=True)
        self._thread.start()
        _logger.info("store exporter %s writing %s", self.host.component_id, db.db_path(self.path))

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
        self.history.remove_pending([s for s in lost if s])
        if lost:
            self.host.telemetry.dropped(self.host.component_id, Signal.LOGS, len(lost))

    # -- writer thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        cfg = self.config
        next_jobs = time.monotonic() + cfg.flush_interval_s
        next_retention = time.monotonic() + cfg.retention_interval_s
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
            markers = [i for i in items if isinstance(i, threading.Event)]
            stop = any(i is self._stop for i in items)
            now = time.monotonic()
            flush_jobs = bool(markers) or stop or now >= next_jobs
            try:
                self._write(records, flush_jobs)
            except Exception:  # noqa: BLE001 - the writer must outlive a bad record or a full disk
                self.host.log_once("write", logging.ERROR, "store %s: write failed; %d records dropped "
                                   "(logged once)", self.host.component_id, len(records), exc_info=True)
                self.history.remove_pending([r[3] for r in records if r[3]])
                self.devices.remove_pending([r[1] for r in records if r[0] == _FAILURE])
                self.host.telemetry.dropped(self.host.component_id, Signal.LOGS, len(records))
            if flush_jobs:
                next_jobs = now + cfg.flush_interval_s
            if now >= next_retention:
                next_retention = now + cfg.retention_interval_s
                try:
                    self._retention()
                except sqlite3.Error:
                    self.host.log_once("retention", logging.ERROR, "store: retention failed (logged once)",
                                       exc_info=True)
            self.host.telemetry.queue(self.host.component_id, self._queue.qsize(), cfg.queue_size)
            for marker in markers:
                marker.set()

    def _write(self, records: list[tuple[str, dict[str, Any], float, str]], flush_jobs: bool) -> None:
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
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            for name, body, received, _pending in records:
                if name == _FAILURE:
                    self._insert_failure(conn, body, received)
                    device_store.link_failure(conn, body, received, self.devices.ids(body))
                elif name == _DEVICE:
                    device_store.insert_state(conn, body, received)
                elif name == _RESTART:
                    conn.execute("INSERT INTO restarts (job_id, time, received_time, record) VALUES (?, ?, ?, ?)",
                                 (str(body.get("job_id") or ""), _num(body.get("time")), received,
                                  json.dumps(body, sort_keys=True)))
                else:
                    self._insert_goodput(conn, body, received)
            self._write_jobs(conn, jobs)
        except BaseException:
            conn.execute("ROLLBACK")
            with self._jobs_lock:  # sightings are merged back, not lost
                for job, seen in jobs.items():
                    self._merge_job(job, seen)
            raise
        with self.history.commit_lock, self.devices.commit_lock:
            conn.execute("COMMIT")
            self.history.remove_pending([r[3] for r in records if r[3]])
            self.devices.remove_pending([r[1] for r in records if r[0] == _FAILURE])
        self.written += len(records)
        if records:
            self.host.telemetry.exported(self.host.component_id, Signal.LOGS, len(records))

    def _merge_job(self, job: str, seen: _JobSeen) -> None:
        cur = self._jobs.get(job)
        if cur is None:
            self._jobs[job] = seen
            return
        cur.first, cur.last = min(cur.first, seen.first), max(cur.last, seen.last)
        cur.ranks |= seen.ranks
        cur.hosts |= seen.hosts
        cur.world_size = cur.world_size if cur.world_size is not None else seen.world_size

    @staticmethod
    def _insert_failure(conn: sqlite3.Connection, body: dict[str, Any], received: float) -> None:
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
               _num(body.get("detected_time")), received, text, failure_id, version, status)
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
        conn.execute("INSERT INTO goodput_history (job_id, received_time, summary) VALUES (?, ?, ?)",
                     (job, received, text))

    def _write_jobs(self, conn: sqlite3.Connection, jobs: dict[str, _JobSeen]) -> None:
        for job, seen in jobs.items():
            conn.execute("INSERT INTO jobs (job_id, first_seen, last_seen, world_size) VALUES (?, ?, ?, ?) "
                         "ON CONFLICT(job_id) DO UPDATE SET first_seen = min(first_seen, excluded.first_seen), "
                         "last_seen = max(last_seen, excluded.last_seen), "
                         "world_size = coalesce(excluded.world_size, world_size)",
                         (job, seen.first, seen.last, seen.world_size))
            new_ranks = [(job, r) for r in seen.ranks if (job, r) not in self._known_ranks]
            new_hosts = [(job, h) for h in seen.hosts if (job, h) not in self._known_hosts]
            if new_ranks:
                conn.executemany("INSERT OR IGNORE INTO job_ranks (job_id, rank) VALUES (?, ?)", new_ranks)
            if new_hosts:
                conn.executemany("INSERT OR IGNORE INTO job_hosts (job_id, host) VALUES (?, ?)", new_hosts)
            if len(self._known_ranks) > _KNOWN_MAX or len(self._known_hosts) > _KNOWN_MAX:
                self._known_ranks.clear()
                self._known_hosts.clear()
            self._known_ranks.update(new_ranks)
            self._known_hosts.update(new_hosts)

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
                conn.execute("ROLLBACK")
                raise
