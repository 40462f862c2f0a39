"""Device history in the store: devices by stable identity, their health state changes, and the failures each was
the culprit of, across jobs and collector restarts.

Tables (store schema version 2): ``devices`` (one row per device id: identity, last state, since, score, evidence),
``device_events`` (every state change), ``device_failures`` (device id x failure, with job, time and cause). A failure
is linked to its culprit's devices: ``details.devices`` when the attribution processor put them there (it asks the
health processor), else its culprit host (``node:<host>``) and GPU (``gpu:<uuid>``; a GPU index is resolved to its
UUID through the devices the health processor announced on that host).

Queries for readers (``otel-gpu report``, the restart policy's verdict): :func:`device_states`,
:func:`culprit_counts`, :func:`device_events`.

Example:
    >>> import tempfile
    >>> from contextlib import closing
    >>> from otel_gpu.exporters.store import db
    >>> folder = tempfile.mkdtemp()
    >>> with closing(db.open_writer(folder)) as conn:
    ...     ok = insert_state(conn, {"device_id": "gpu:GPU-1", "kind": "gpu", "host": "n1", "uuid": "GPU-1",
    ...                         "gpu_index": 0, "state": "drain", "since": 100.0, "time": 100.0, "score": 90,
    ...                         "evidence": ["row remap failure"], "rules": ["row_remap_failure"]}, 100.0)
    ...     [(d["device_id"], d["state"]) for d in device_states(conn)]
    [('gpu:GPU-1', 'drain')]
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from otel_gpu.schema.failure import NOT_THE_DEVICE, counts_against_device

__all__ = ["MIGRATION", "DeviceHistory", "culprit_counts", "device_events", "device_states", "failure_device_ids",
           "failure_key", "insert_state", "link_failure", "retention"]

#: The step that adds the device-history tables (appended to db._MIGRATIONS).
MIGRATION: tuple[str, ...] = (
    """CREATE TABLE devices (
           device_id TEXT PRIMARY KEY, kind TEXT NOT NULL, host TEXT, uuid TEXT, serial TEXT, gpu_index INTEGER,
           pci_bus_id TEXT, port TEXT, guid TEXT, state TEXT NOT NULL, score REAL, since REAL, first_seen REAL,
           updated_time REAL NOT NULL, rules TEXT, evidence TEXT)""",
    "CREATE INDEX devices_host ON devices(host, gpu_index)",
    "CREATE INDEX devices_state ON devices(state)",
    """CREATE TABLE device_events (
           id INTEGER PRIMARY KEY AUTOINCREMENT, device_id TEXT NOT NULL, time REAL NOT NULL, state TEXT,
           previous TEXT, score REAL, body TEXT NOT NULL)""",
    "CREATE INDEX device_events_device ON device_events(device_id, time)",
    """CREATE TABLE device_failures (
           device_id TEXT NOT NULL, failure_key TEXT NOT NULL, job_id TEXT, time REAL, root_cause TEXT,
           category TEXT, PRIMARY KEY (device_id, failure_key)) WITHOUT ROWID""",
    "CREATE INDEX device_failures_time ON device_failures(time)",
)

_STATES = ("healthy", "watch", "drain")


def _has_tables(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='devices'").fetchone() is not None


def _num(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if out == out else None  # NaN


def _int(value: Any) -> int | None:
    try:
        out = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if -(1 << 63) <= out < 1 << 63 else None


def _text(value: Any) -> str | None:
    return None if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _list(value: Any) -> list[str]:
    if isinstance(value, list):
        return [v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str) for v in value[:50]]
    return [] if value in (None, "") else [value if isinstance(value, str) else json.dumps(value, sort_keys=True,
                                                                                           default=str)]


# -- writer side ---------------------------------------------------------------------------------------------------
def insert_state(conn: sqlite3.Connection, body: dict[str, Any], received: float) -> bool:
    """Keeps one ``otel_gpu.device.state_change`` event: the event row and the device's latest state. Returns False
    (and keeps nothing) for a body without a device id, kind or a known state."""
    did, kind, state = body.get("device_id"), body.get("kind"), body.get("state")
    if not isinstance(did, str) or not did or not isinstance(kind, str) or state not in _STATES:
        return False
    t = _num(body.get("time")) or received
    since = _num(body.get("since")) or t
    conn.execute("INSERT INTO device_events (device_id, time, state, previous, score, body) VALUES (?, ?, ?, ?, ?, ?)",
                 (did, t, state, _text(body.get("previous")), _num(body.get("score")),
                  json.dumps(body, sort_keys=True)))
    conn.execute(
        """INSERT INTO devices (device_id, kind, host, uuid, serial, gpu_index, pci_bus_id, port, guid, state, score,
                                since, first_seen, updated_time, rules, evidence)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
           ON CONFLICT(device_id) DO UPDATE SET
               kind = excluded.kind, host = coalesce(excluded.host, host), uuid = coalesce(excluded.uuid, uuid),
               serial = coalesce(excluded.serial, serial), gpu_index = coalesce(excluded.gpu_index, gpu_index),
               pci_bus_id = coalesce(excluded.pci_bus_id, pci_bus_id), port = coalesce(excluded.port, port),
               guid = coalesce(excluded.guid, guid), state = excluded.state, score = excluded.score,
               since = excluded.since, first_seen = min(first_seen, excluded.first_seen),
               updated_time = excluded.updated_time, rules = excluded.rules, evidence = excluded.evidence""",
        (did, kind, _text(body.get("host")), _text(body.get("uuid")), _text(body.get("serial")),
         _int(body.get("gpu_index")), _text(body.get("pci_bus_id")), _text(body.get("port")), _text(body.get("guid")),
         state, _num(body.get("score")), since, _num(body.get("first_seen")) or t, received,
         json.dumps(_list(body.get("rules"))), json.dumps(_list(body.get("evidence")))))
    return True


def failure_key(record: dict[str, Any]) -> str:
    """Stable id of a failure: its ``failure_id`` (revisions keep it), else job, kind, signature and onset."""
    if record.get("failure_id"):
        return str(record["failure_id"])
    return "|".join(str(record.get(k) or "") for k in ("job_id", "kind", "signature", "onset_time"))


def failure_device_ids(record: dict[str, Any], resolve_gpu: Any = None) -> list[str]:
    """The device ids a failure record names as culprit (see the module docstring)."""
    details = record.get("details")
    if isinstance(details, dict) and isinstance(details.get("devices"), list):
        ids = [str(d) for d in details["devices"] if isinstance(d, str) and ":" in d]
        if ids:
            return ids[:8]
    culprit = record.get("culprit")
    if not isinstance(culprit, dict):
        return []
    host = culprit.get("host")
    host = str(host) if host not in (None, "") else None
    gpu = culprit.get("gpu")
    ids = []
    if gpu not in (None, ""):
        gpu = str(gpu)
        if gpu.isdigit():
            uuid = resolve_gpu(host, int(gpu)) if resolve_gpu is not None and host else None
            if uuid:
                ids.append(f"gpu:{uuid}")
        else:
            ids.append(f"gpu:{gpu}")
    if host:
        ids.append(f"node:{host}")
    return ids


def _withdrawn(record: dict[str, Any]) -> bool:
    return record.get("status") == "withdrawn" or record.get("withdrawn") is True


def link_failure(conn: sqlite3.Connection, record: dict[str, Any], received: float, ids: Iterable[str]) -> None:
    """Links a stored failure to its devices (a revision of the same failure replaces its links; a withdrawn verdict,
    e.g. a hang whose ranks resumed, removes them)."""
    key = failure_key(record)
    conn.execute("DELETE FROM device_failures WHERE failure_key = ?", (key,))  # a revision may name other devices
    if _withdrawn(record):
        return
    t = _num(record.get("onset_time")) or _num(record.get("detected_time")) or received
    for did in ids:
        conn.execute("INSERT OR REPLACE INTO device_failures (device_id, failure_key, job_id, time, root_cause, "
                     "category) VALUES (?, ?, ?, ?, ?, ?)",
                     (did, key, _text(record.get("job_id")), t, _text(record.get("root_cause")),
                      _text(record.get("category"))))


def retention(conn: sqlite3.Connection, cutoff: float) -> None:
    """Deletes device events and failure links older than ``cutoff`` and devices not updated since (inside the
    caller's transaction)."""
    if not _has_tables(conn):
        return
    conn.execute("DELETE FROM device_events WHERE time < ?", (cutoff,))
    conn.execute("DELETE FROM device_failures WHERE time < ?", (cutoff,))
    conn.execute("DELETE FROM devices WHERE updated_time < ? AND state = 'healthy'", (cutoff,))


# -- readers -------------------------------------------------------------------------------------------------------
def culprit_counts(conn: sqlite3.Connection, window_s: float | None = None, *, now: float | None = None,
                   device_ids: Iterable[str] | None = None,
                   keys: set[tuple[str, str]] | None = None) -> dict[str, dict[str, Any]]:
    """Per device id: ``{"failures": n, "jobs": [job ids, oldest first], "first": t, "last": t, "causes": [...]}``
    for the failures it was the culprit of that count against a device (:func:`counts_against_device`), within
    ``window_s`` before ``now`` when given. ``keys`` (optional) collects the (device id, failure key) pairs
    counted."""
    if not _has_tables(conn):
        return {}
    sql = "SELECT device_id, failure_key, job_id, time, root_cause FROM device_failures"
    where = [f"(category IS NULL OR category NOT IN ({','.join('?' * len(NOT_THE_DEVICE))}))"]
    args: list[Any] = list(NOT_THE_DEVICE)
    if window_s is not None:
        where.append("time >= ?")
        args.append((time.time() if now is None else now) - window_s)
    if device_ids is not None:
        ids = list(device_ids)
        if not ids:
            return {}
        where.append(f"device_id IN ({','.join('?' * len(ids))})")
        args.extend(ids)
    sql += " WHERE " + " AND ".join(where) + " ORDER BY time"
    out: dict[str, dict[str, Any]] = {}
    for did, _key, job, t, cause in conn.execute(sql, args):
        info = out.get(did)
        if info is None:
            info = out[did] = {"failures": 0, "jobs": [], "first": t, "last": t, "causes": []}
        if keys is not None:
            keys.add((did, _key))
        info["failures"] += 1
        if job is not None and job not in info["jobs"]:
            info["jobs"].append(job)
        if cause and cause not in info["causes"]:
            info["causes"].append(cause)
        info["last"] = t
    return out


def device_states(conn: sqlite3.Connection, states: Iterable[str] | None = None, *, host: str | None = None,
                  window_s: float | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """Devices with their latest health state, most severe and highest score first: ``{device_id, kind, host,
    uuid, serial, gpu_index, pci_bus_id, port, guid, state, score, since, updated_time, rules, evidence,
    failures: {failures, jobs, first, last, causes} | None}``. ``states`` filters (e.g. ``("drain",)``);
    ``window_s`` limits the failures counted to that many seconds before ``now``.

    This is the verdict a restart policy reads: a node in ``drain`` should not be in the next attempt.
    """
    if not _has_tables(conn):
        return []
    sql = ("SELECT device_id, kind, host, uuid, serial, gpu_index, pci_bus_id, port, guid, state, score, since, "
           "first_seen, updated_time, rules, evidence FROM devices")
    where, args = [], []
    if states is not None:
        wanted = [s for s in states]
        if not wanted:
            return []
        where.append(f"state IN ({','.join('?' * len(wanted))})")
        args.extend(wanted)
    if host is not None:
        where.append("host = ?")
        args.append(host)
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += (" ORDER BY CASE state WHEN 'drain' THEN 0 WHEN 'watch' THEN 1 ELSE 2 END, score DESC, since, "
            "device_id")
    rows = conn.execute(sql, args).fetchall()
    counts = culprit_counts(conn, window_s, now=now, device_ids=[r[0] for r in rows]) if rows else {}
    out = []
    keys = ("device_id", "kind", "host", "uuid", "serial", "gpu_index", "pci_bus_id", "port", "guid", "state", "score",
            "since", "first_seen", "updated_time")
    for row in rows:
        item = dict(zip(keys, row[:14]))
        item["rules"] = json.loads(row[14] or "[]")
        item["evidence"] = json.loads(row[15] or "[]")
        item["failures"] = counts.get(row[0])
        out.append(item)
    return out


def device_events(conn: sqlite3.Connection, device_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """State changes, newest first (the whole event body)."""
    if not _has_tables(conn):
        return []
    sql, args = "SELECT body FROM device_events", []
    if device_id is not None:
        sql += " WHERE device_id = ?"
        args.append(device_id)
    sql += " ORDER BY time DESC, id DESC LIMIT ?"
    args.append(limit)
    return [json.loads(r[0]) for r in conn.execute(sql, args)]


# -- the service -----------------------------------------------------------------------------------------------------
class DeviceHistory:
    """``host.services.get(DEVICE_HISTORY)``: device states and per-device recurrence from the store, counting the
    failures still queued for it, so that two failures moments apart see each other. Thread-safe."""

    def __init__(self, folder: str | Path, opener: Any):
        self._folder = folder
        self._open = opener  # db.open_reader (passed in: this module does not import db)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: dict[str, tuple[list[str], str | None, float, str | None]] = {}  # failure key -> ...
        self._gpus: dict[tuple[str, int], str] = {}  # (host, index) -> uuid

    # -- writer side
    def learn(self, body: dict[str, Any]) -> None:
        """Remembers a GPU's (host, index) -> UUID from a state-change event (to resolve culprits given by index)."""
        host, index, uuid = body.get("host"), _int(body.get("gpu_index")), body.get("uuid")
        if host and index is not None and isinstance(uuid, str) and uuid:
            if len(self._gpus) > 100_000:
                self._gpus.clear()
            self._gpus[(str(host), index)] = uuid

    def load(self, conn: sqlite3.Connection) -> None:
        if _has_tables(conn):
            for host, index, uuid in conn.execute("SELECT host, gpu_index, uuid FROM devices WHERE kind = 'gpu' "
                                                  "AND gpu_index IS NOT NULL AND uuid IS NOT NULL"):
                self._gpus[(host, index)] = uuid

    def resolve_gpu(self, host: str | None, index: int) -> str | None:
        return self._gpus.get((host, index)) if host else None

    def ids(self, record: dict[str, Any]) -> list[str]:
        return failure_device_ids(record, self.resolve_gpu)

    def add_pending(self, record: dict[str, Any]) -> None:
        ids = self.ids(record)
        if _withdrawn(record) or not counts_against_device(_text(record.get("category"))):
            with self._pending_lock:  # a revision may have changed what an earlier one said
                self._pending.pop(failure_key(record), None)
        elif ids:
            t = _num(record.get("onset_time")) or _num(record.get("detected_time")) or time.time()
            with self._pending_lock:
                self._pending[failure_key(record)] = (ids, _text(record.get("job_id")), t,
                                                      _text(record.get("root_cause")))

    @property
    def commit_lock(self) -> threading.Lock:
        """Held by readers, and by the writer around COMMIT + :meth:`remove_pending`."""
        return self._lock

    def remove_pending(self, records: Iterable[dict[str, Any]]) -> None:
        with self._pending_lock:
            for record in records:
                self._pending.pop(failure_key(record), None)

    # -- readers
    def _connection(self) -> sqlite3.Connection | None:
        if self._conn is None:
            try:
                self._conn = self._open(self._folder)
            except (FileNotFoundError, sqlite3.Error):
                return None
        return self._conn

    def device_states(self, states: Iterable[str] | None = None) -> list[dict[str, Any]]:
        with self._lock:
            conn = self._connection()
            return device_states(conn, states) if conn is not None else []

    def culprit_counts(self, window_s: float | None = None, *, now: float | None = None,
                       device_ids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        ids = None if device_ids is None else list(device_ids)
        with self._lock:
            conn = self._connection()
            stored: set[tuple[str, str]] = set()
            out = culprit_counts(conn, window_s, now=now, device_ids=ids, keys=stored) if conn is not None else {}
            with self._pending_lock:
                pending = list(self._pending.items())
        cutoff = None if window_s is None else (time.time() if now is None else now) - window_s
        for key, (pids, job, t, cause) in pending:
            if cutoff is not None and t < cutoff:
                continue
            for did in pids:
                if (ids is not None and did not in ids) or (did, key) in stored:  # a revision of a stored one
                    continue
                info = out.setdefault(did, {"failures": 0, "jobs": [], "first": t, "last": t, "causes": []})
                info["failures"] += 1
                if job is not None and job not in info["jobs"]:
                    info["jobs"].append(job)
                if cause and cause not in info["causes"]:
                    info["causes"].append(cause)
                info["first"], info["last"] = min(info["first"], t), max(info["last"], t)
        return out

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
