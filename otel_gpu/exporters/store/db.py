"""The embedded store's SQLite file: schema, migrations and the queries ``otel-gpu report`` runs.

One file, ``<path>/otel-gpu.db``, in WAL mode so that readers (the report, the failure-history service) never wait
for the writer. The ``schema_version`` table records the layout; :func:`open_writer` migrates an older file forward
and refuses a newer one.

Example:
    >>> import tempfile
    >>> from contextlib import closing
    >>> folder = tempfile.mkdtemp()
    >>> open_writer(folder).close()
    >>> with closing(open_reader(folder)) as conn:
    ...     failures(conn), jobs(conn)
    ([], [])
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_gpu.failure import FailureRecord, Revision, UnreadableRecord, from_json

from otel_gpu.exporters.store import devices as _devices
from otel_gpu.exporters.store.devices import culprit_counts, device_events, device_states

__all__ = ["DB_FILE", "SCHEMA_VERSION", "StoreMissing", "StoreTooNew", "db_path", "open_writer", "open_reader",
           "failures", "failure_versions", "goodput", "latest_goodput", "jobs", "failure_count", "is_withdrawn",
           "WITHDRAWN", "device_states", "device_events", "culprit_counts", "restarts", "read_failures",
           "StoredFailure", "Unreadable", "FailureRows", "Records"]

DB_FILE = "otel-gpu.db"
SCHEMA_VERSION = 4

# Each entry migrates from version i to i + 1 (index 0: empty file -> 1). Append; never edit a shipped step.
_MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE failures (
               id INTEGER PRIMARY KEY AUTOINCREMENT,
               kind TEXT, root_cause TEXT, job_id TEXT, signature TEXT,
               detected_time REAL, received_time REAL NOT NULL,
               record TEXT NOT NULL)""",
        "CREATE INDEX failures_kind ON failures(kind)",
        "CREATE INDEX failures_root_cause ON failures(root_cause)",
        "CREATE INDEX failures_job ON failures(job_id)",
        "CREATE INDEX failures_signature ON failures(signature)",
        "CREATE INDEX failures_detected ON failures(detected_time)",
        """CREATE TABLE goodput (
               job_id TEXT PRIMARY KEY, updated_time REAL NOT NULL, summary TEXT NOT NULL)""",
        """CREATE TABLE goodput_history (
               id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, received_time REAL NOT NULL,
               summary TEXT NOT NULL)""",
        "CREATE INDEX goodput_history_job ON goodput_history(job_id, id)",
        """CREATE TABLE jobs (
               job_id TEXT PRIMARY KEY, first_seen REAL NOT NULL, last_seen REAL NOT NULL, world_size INTEGER)""",
        "CREATE TABLE job_ranks (job_id TEXT NOT NULL, rank INTEGER NOT NULL, PRIMARY KEY (job_id, rank)) "
        "WITHOUT ROWID",
        "CREATE TABLE job_hosts (job_id TEXT NOT NULL, host TEXT NOT NULL, PRIMARY KEY (job_id, host)) WITHOUT ROWID",
    ),
    # 1 -> 2: verdicts that change. `failures` holds the latest version of each failure_id (older records without
    # an id stay one row each); `failure_versions` keeps every version ever received, once per (failure_id, version).
    (
        "ALTER TABLE failures ADD COLUMN failure_id TEXT",
        "ALTER TABLE failures ADD COLUMN version INTEGER",
        "ALTER TABLE failures ADD COLUMN status TEXT",
        "CREATE UNIQUE INDEX failures_failure_id ON failures(failure_id)",
        """CREATE TABLE failure_versions (
               id INTEGER PRIMARY KEY AUTOINCREMENT, failure_id TEXT NOT NULL, version INTEGER NOT NULL,
               received_time REAL NOT NULL, record TEXT NOT NULL, UNIQUE (failure_id, version))""",
    ),
    _devices.MIGRATION,  # 2 -> 3: device history (devices, device_events, device_failures)
    (  # 3 -> 4: decisions of otel-gpu run --restart (one row per decision; a job's incarnations on one timeline)
        """CREATE TABLE restarts (
               id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, time REAL, received_time REAL NOT NULL,
               record TEXT NOT NULL)""",
        "CREATE INDEX restarts_job ON restarts(job_id, time)",
    ),
]
assert len(_MIGRATIONS) == SCHEMA_VERSION

# Indexes that change no layout (an older otel-gpu reads the file as before), created if missing at every open.
# device_failures_key: each stored failure first deletes its old device links by failure_key, which was a full scan
# of the table (5,000 links: 0.25 ms a record, the store's writer capped at ~2,000 failures/s and falling).
_INDEXES: tuple[str, ...] = (
    "CREATE INDEX IF NOT EXISTS device_failures_key ON device_failures(failure_key)",
)


class StoreMissing(FileNotFoundError):
    """No store at the given folder."""


class StoreTooNew(RuntimeError):
    """The file was written by a newer otel-gpu (a higher schema version)."""


def db_path(folder: str | Path) -> Path:
    return Path(folder) / DB_FILE


def _version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='schema_version'").fetchone()
    if row is None:
        return 0
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def open_writer(folder: str | Path) -> sqlite3.Connection:
    """Creates the folder and file if needed, migrates to :data:`SCHEMA_VERSION`; for the writer thread.

    Raises:
        StoreTooNew: the file has a higher schema version than this otel-gpu knows.
    """
    Path(folder).mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db_path(folder), timeout=10.0, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints, never corrupt
        conn.execute("BEGIN IMMEDIATE")
        version = _version(conn)
        if version > SCHEMA_VERSION:
            raise StoreTooNew(f"{db_path(folder)} has store schema version {version}, newer than this otel-gpu "
                              f"understands ({SCHEMA_VERSION}); upgrade otel-gpu or use another store path")
        if version == 0:
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        for step in _MIGRATIONS[version:]:
            for statement in step:
                conn.execute(statement)
        if version < SCHEMA_VERSION:
            conn.execute("DELETE FROM schema_version")
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        for statement in _INDEXES:
            conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()
        raise
    return conn


def open_reader(folder: str | Path) -> sqlite3.Connection:
    """A read-only connection (works while a collector writes: WAL readers never block the writer).

    Raises:
        StoreMissing: no store file in ``folder``.
        StoreTooNew: the file has a higher schema version than this otel-gpu knows.
    """
    path = db_path(folder)
    if not path.is_file():
        raise StoreMissing(f"no otel-gpu store at {Path(folder)} (expected {path}); run `otel-gpu collector` with a "
                           "store exporter, or pass --store DIR")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0, check_same_thread=False)
    try:
        version = _version(conn)
    except sqlite3.DatabaseError:
        conn.close()
        raise
    if version > SCHEMA_VERSION:
        conn.close()
        raise StoreTooNew(f"{path} has store schema version {version}, newer than this otel-gpu understands "
                          f"({SCHEMA_VERSION}); upgrade otel-gpu")
    return conn


def _has_tables(conn: sqlite3.Connection) -> bool:
    return _version(conn) >= 1


WITHDRAWN = "withdrawn"


def is_withdrawn(record: dict[str, Any]) -> bool:
    """A verdict taken back (a hang whose ranks resumed): ``status: withdrawn`` or ``withdrawn: true``."""
    return record.get("status") == WITHDRAWN or record.get("withdrawn") is True


@dataclass
class StoredFailure:
    """One failure row, read typed: ``record`` checked by :func:`otel_gpu.failure.from_json`; ``raw`` the JSON as
    stored (every key, extra ones too: what ``otel-gpu report --format json`` prints)."""

    row_id: int
    record: FailureRecord
    raw: dict[str, Any]
    #: With ``history``: every version received, oldest first (``record`` None for a version that does not read).
    versions: list[Revision] = field(default_factory=list)
    raw_versions: list[dict[str, Any]] | None = None  # as stored; None: not asked for, or no failure_id


@dataclass
class Unreadable:
    """A stored record that does not read as a failure record: left out, and said so."""

    row_id: int
    name: str  # its failure_id when it has one, else "#<row id>"
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"row_id": self.row_id, "id": self.name, "reason": self.reason}


class FailureRows(list):
    """``list[StoredFailure]``; ``unreadable``: the rows left out, each with why."""

    def __init__(self, rows=(), unreadable=()):
        super().__init__(rows)
        self.unreadable: list[Unreadable] = list(unreadable)


class Records(list):
    """``list[dict]`` of the records that read; ``unreadable``: the rows left out, each with why."""

    def __init__(self, rows=(), unreadable=()):
        super().__init__(rows)
        self.unreadable: list[Unreadable] = list(unreadable)


def _loads(text: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnreadableRecord("record", f"not JSON ({type(exc).__name__})") from None


def read_failures(conn: sqlite3.Connection, job_id: str | None = None, limit: int | None = None, *,
                  history: bool = False, withdrawn: bool = True) -> FailureRows:
    """Failure records, newest first (by detection time), the latest version of each failure, read typed. A row
    that does not read (:class:`otel_gpu.failure.UnreadableRecord`) is left out and listed in ``unreadable``.

    Args:
        history: fill ``versions`` of each record that has a ``failure_id``: every version received, oldest first.
        withdrawn: include withdrawn verdicts (marked by their record's ``status``).
    """
    layout = _version(conn)
    if layout < 1:
        return FailureRows()
    sql = ("SELECT id, record, failure_id FROM failures" if layout >= 2
           else "SELECT id, record, NULL FROM failures")
    where: list[str] = []
    args: list[Any] = []
    if job_id is not None:
        where.append("job_id = ?")
        args.append(job_id)
    if not withdrawn and layout >= 2:
        where.append("coalesce(status, '') != ?")
        args.append(WITHDRAWN)
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY coalesce(detected_time, received_time) DESC, id DESC"
    if limit is not None and limit >= 0:
        sql += " LIMIT ?"
        args.append(limit)
    out = FailureRows()
    for row_id, text, failure_id in conn.execute(sql, args).fetchall():
        name = failure_id if isinstance(failure_id, str) and failure_id else f"#{row_id}"
        try:
            raw = _loads(text)
            record = from_json(raw)
        except UnreadableRecord as exc:
            out.unreadable.append(Unreadable(row_id, name, str(exc)))
            continue
        stored = StoredFailure(row_id, record, raw)
        if history and failure_id is not None:
            stored.raw_versions = failure_versions(conn, failure_id)
            stored.versions = [_revision(v) for v in stored.raw_versions]
        out.append(stored)
    return out


def _revision(version: dict[str, Any]) -> Revision:
    number = version.get("version")
    received = version.get("received_time")
    try:
        return Revision(number, received, from_json(version.get("record")))
    except UnreadableRecord as exc:
        return Revision(number, received, None, str(exc))


def failures(conn: sqlite3.Connection, job_id: str | None = None, limit: int | None = None, *,
             history: bool = False, withdrawn: bool = True) -> Records:
    """The records of :func:`read_failures` as their stored JSON (every key, extra ones too), newest first; those
    that do not read are left out and listed in ``unreadable``.

    Args:
        history: add ``versions`` to each record that has a ``failure_id``: every version received, oldest
            first, each ``{"version", "received_time", "record"}``.
        withdrawn: include withdrawn verdicts (marked by their record's ``status``).
    """
    rows = read_failures(conn, job_id, limit, history=history, withdrawn=withdrawn)
    out = Records(unreadable=rows.unreadable)
    for row in rows:
        record = dict(row.raw)
        if row.raw_versions is not None:
            record["versions"] = row.raw_versions
        out.append(record)
    return out


def failure_versions(conn: sqlite3.Connection, failure_id: str) -> list[dict[str, Any]]:
    """Every version of one failure the store received, oldest first: ``{"version", "received_time", "record"}``
    (``record`` None for one that is not JSON)."""
    if _version(conn) < 2:
        return []
    rows = conn.execute("SELECT version, received_time, record FROM failure_versions WHERE failure_id = ? "
                        "ORDER BY version, id", (failure_id,))
    out = []
    for v, t, r in rows:
        try:
            record = _loads(r)
        except UnreadableRecord:
            record = None
        out.append({"version": v, "received_time": t, "record": record})
    return out


def failure_count(conn: sqlite3.Connection, signature: str | None = None) -> int:
    """Failures recorded (one per failure_id, whatever its revisions), withdrawn verdicts not counted."""
    if not _has_tables(conn):
        return 0
    live = " coalesce(status, '') != 'withdrawn'" if _version(conn) >= 2 else " 1"
    if signature is None:
        return conn.execute("SELECT count(*) FROM failures WHERE" + live).fetchone()[0]
    return conn.execute("SELECT count(*) FROM failures WHERE signature = ? AND" + live, (signature,)).fetchone()[0]


def goodput(conn: sqlite3.Connection, job_id: str) -> dict[str, Any] | None:
    """The latest goodput summary of a job, or None."""
    if not _has_tables(conn):
        return None
    row = conn.execute("SELECT summary FROM goodput WHERE job_id = ?", (job_id,)).fetchone()
    return json.loads(row[0]) if row else None


def latest_goodput(conn: sqlite3.Connection) -> dict[str, Any] | None:
    """The most recently updated job's goodput summary, or None."""
    if not _has_tables(conn):
        return None
    row = conn.execute("SELECT summary FROM goodput ORDER BY updated_time DESC LIMIT 1").fetchone()
    return json.loads(row[0]) if row else None


def goodput_history(conn: sqlite3.Connection, job_id: str, limit: int = 100) -> list[dict[str, Any]]:
    """Past goodput summaries of a job, newest first."""
    if not _has_tables(conn):
        return []
    rows = conn.execute("SELECT summary FROM goodput_history WHERE job_id = ? ORDER BY id DESC LIMIT ?",
                        (job_id, limit))
    return [json.loads(r[0]) for r in rows]


def restarts(conn: sqlite3.Connection, job_id: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
    """Decisions of ``otel-gpu run --restart`` (oldest first): the incarnations of each job on one timeline."""
    if _version(conn) < 4:
        return []
    sql, args = "SELECT record FROM restarts", []
    if job_id is not None:
        sql += " WHERE job_id = ?"
        args.append(job_id)
    sql += " ORDER BY coalesce(time, received_time), id LIMIT ?"
    args.append(limit)
    return [json.loads(row[0]) for row in conn.execute(sql, args)]


def jobs(conn: sqlite3.Connection, job_id: str | None = None) -> list[dict[str, Any]]:
    """Jobs seen, most recently active first: {job_id, first_seen, last_seen, ranks, hosts, world_size, goodput}."""
    if not _has_tables(conn):
        return []
    sql = """SELECT j.job_id, j.first_seen, j.last_seen, j.world_size,
                    (SELECT count(*) FROM job_ranks r WHERE r.job_id = j.job_id),
                    (SELECT count(*) FROM job_hosts h WHERE h.job_id = j.job_id),
                    g.summary
             FROM jobs j LEFT JOIN goodput g ON g.job_id = j.job_id"""
    args: tuple[Any, ...] = ()
    if job_id is not None:
        sql += " WHERE j.job_id = ?"
        args = (job_id,)
    sql += " ORDER BY j.last_seen DESC"
    return [{"job_id": jid, "first_seen": first, "last_seen": last, "ranks": ranks, "hosts": hosts,
             "world_size": world, "goodput": json.loads(summary) if summary else None}
            for jid, first, last, world, ranks, hosts, summary in conn.execute(sql, args)]
