"""A bounded on-disk store of export requests (SQLite, WAL), so that queued batches survive a collector restart.

One SQLite file per exporter (``<path>/<component id>.sqlite``), guarded by an exclusive ``flock`` on
``<file>.lock`` so that two collectors can never share it. A batch is inserted (and committed) before the
exporter's ``export()`` returns, deleted only once the backend acknowledged it (or it was dropped for good), and
every row still there when the store opens is handed back for replay, oldest first.

Durability (``sync``):

- ``normal`` (default): WAL with ``synchronous=NORMAL``. A committed batch survives the collector being killed
  (SIGKILL, OOM kill, crash): the WAL is in the kernel's page cache. An OS crash or power loss may lose the commits
  since the last checkpoint (never corrupts the file). Checkpoints (the only fsyncs) run once a second on a thread
  of their own, so ``export()`` never waits for one (about 30 us per batch here, against 140 us with SQLite's
  automatic checkpoints in the committing thread).
- ``full``: ``synchronous=FULL``: every commit is fsynced before ``export()`` returns; survives power loss; costs one
  fsync per batch (about 1-10 ms on SSDs).

Example:
    >>> import tempfile
    >>> from otel_gpu.pdata import Signal
    >>> store = PersistentStore(tempfile.mkdtemp() + "/otlp.sqlite")
    >>> entry = store.append(Signal.LOGS, b"", 0)
    >>> store.read(entry.id), store.total_bytes
    (b'', 0)
    >>> store.delete([entry.id]); store.close()
"""
from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from otel_gpu.pdata import Signal

__all__ = ["DiskEntry", "PersistentStore", "StoreLocked"]

_logger = logging.getLogger(__name__)


class StoreLocked(RuntimeError):
    """Another process holds the store."""


@dataclass(slots=True)
class DiskEntry:
    """A queued batch whose bytes stay on disk until a sender reads them."""

    id: int
    signal: Signal
    items: int
    nbytes: int


class PersistentStore:
    """Rows ``(id, signal, items, data)``; ``total_bytes`` is the sum of the stored request sizes. Thread-safe."""

    def __init__(self, file: str | os.PathLike, sync: str = "normal"):
        self.file = Path(file)
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(f"{self.file}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise StoreLocked(f"{self.file} is in use by another process (is a second collector running with the "
                              f"same sending_queue.persistent.path?)") from None
        self._mutex = threading.Lock()
        self._closed = threading.Event()
        try:
            try:
                self._open(sync)
            except sqlite3.DatabaseError as exc:
                # A damaged file must not keep the collector down: set it aside (for a post-mortem), start empty.
                aside = self.file.with_name(f"{self.file.name}.corrupt-{os.getpid()}")
                _logger.error("%s: unreadable (%s); moved to %s, starting with an empty queue", self.file, exc,
                              aside)
                for suffix in ("", "-wal", "-shm"):
                    src = Path(f"{self.file}{suffix}")
                    if src.exists():
                        src.rename(f"{aside}{suffix}")
                self._open(sync)
        except Exception:
            os.close(self._lock_fd)
            raise
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name=f"checkpoint-{self.file.name}",
                                              daemon=True)
        self._checkpointer.start()

    def _checkpoint_loop(self, interval_s: float = 1.0) -> None:
        try:
            db = sqlite3.connect(str(self.file), check_same_thread=False, isolation_level=None)
        except sqlite3.Error:
            _logger.warning("%s: no checkpoint connection; the WAL grows until close", self.file, exc_info=True)
            return
        try:
            while not self._closed.wait(interval_s):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error as exc:
                    _logger.debug("%s: checkpoint failed: %s", self.file, exc)
        finally:
            db.close()

    def _open(self, sync: str) -> None:
        db = sqlite3.connect(str(self.file), check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
            db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints (fsync) on our thread, not in export()
            db.execute("PRAGMA journal_size_limit=67108864")
            db.execute("CREATE TABLE IF NOT EXISTS queue (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                       "signal TEXT NOT NULL, items INTEGER NOT NULL, data BLOB NOT NULL)")
            self.total_bytes = int(db.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM queue").fetchone()[0])
        except BaseException:
            db.close()
            raise
        self._db = db

    def entries(self) -> list[DiskEntry]:
        """Every stored batch, oldest first (what to replay on start). Rows of an unknown signal are deleted."""
        out, bad = [], []
        with self._mutex:
            for rid, signal, items, nbytes in self._db.execute(
                    "SELECT id, signal, items, LENGTH(data) FROM queue ORDER BY id"):
                try:
                    out.append(DiskEntry(rid, Signal(signal), items, nbytes))
                except ValueError:
                    bad.append((rid, nbytes))
        if bad:
            _logger.warning("%s: deleting %d rows of an unknown signal", self.file, len(bad))
            self.delete([rid for rid, _ in bad])
        return out

    def append(self, signal: Signal, data: bytes, items: int) -> DiskEntry:
        """Stores one request; committed (and, with ``sync: full``, fsynced) when this returns."""
        with self._mutex:
            cur = self._db.execute("INSERT INTO queue (signal, items, data) VALUES (?, ?, ?)",
                                   (signal.value, items, data))
            self.total_bytes += len(data)
            return DiskEntry(int(cur.lastrowid), signal, items, len(data))

    def read(self, rid: int) -> bytes | None:
        with self._mutex:
            row = self._db.execute("SELECT data FROM queue WHERE id = ?", (rid,)).fetchone()
        return None if row is None else bytes(row[0])

    def delete(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._mutex:
            self._db.execute("BEGIN")
            try:
                for rid in ids:
                    row = self._db.execute("DELETE FROM queue WHERE id = ? RETURNING LENGTH(data)", (rid,)).fetchone()
                    if row is not None:
                        self.total_bytes -= int(row[0])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        self._closed.set()
        self._checkpointer.join(5)
        with self._mutex:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self._db.close()
        os.close(self._lock_fd)
