"""What both OTLP exporters share: a bounded queue drained by worker threads, and retry with backoff and jitter.

A transport subclass implements only :meth:`QueuedExporter._send_once` (one attempt) and the connection lifecycle.
With ``sending_queue.persistent.path`` the queue is kept on disk (:mod:`._persistent`): a batch is committed before
``export()`` returns, deleted once the backend acknowledged it (or it was dropped for good), and replayed on start.
"""
from __future__ import annotations

import abc
import collections
import logging
import os
import random
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from otel_gpu.component import Exporter, ExportResult
from otel_gpu.exporters.otlp._persistent import DiskEntry, PersistentStore
from otel_gpu.pdata import Batch, Signal

__all__ = ["Attempt", "QueuedExporter"]

_logger = logging.getLogger(__name__)


@dataclass
class Attempt:
    """The result of one send."""

    ok: bool
    retryable: bool = False
    delay_s: float | None = None  # the server's requested delay (RetryInfo, Retry-After)
    message: str = ""
    rejected: int = 0  # items the server refused in a partial success


_SENT, _DROPPED, _ABORTED = "sent", "dropped", "aborted"  # outcomes of _deliver; aborted: shutdown mid-retry


class QueuedExporter(Exporter):
    """export() only enqueues; ``num_consumers`` threads send, retry, and count exported / dropped items."""

    def __init__(self, config, host):
        super().__init__(config, host)
        self._queue: collections.deque[Batch | DiskEntry] = collections.deque()
        self._capacity = config.sending_queue.queue_size
        self._store: PersistentStore | None = None
        self._max_bytes = int(config.sending_queue.persistent.max_size_mib * 1024 * 1024)
        self._cond = threading.Condition()
        self._in_flight = 0
        self._accepting = False
        self._stopping = False
        self._abort = threading.Event()  # set when the shutdown deadline passes: drop instead of retrying
        self._workers: list[threading.Thread] = []
        self._cid = host.component_id

    # -- transport hooks -----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _open(self) -> None:
        """Creates the channel / connection factory (called by start)."""

    @abc.abstractmethod
    def _send_once(self, signal: Signal, body: bytes, timeout_s: float) -> Attempt:
        """One attempt; never raises for network or server errors."""

    def _close(self) -> None:  # optional hook
        """Releases connections."""

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        persistent = self.config.sending_queue.persistent
        if persistent.path and self.config.sending_queue.enabled:
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", self._cid)
            self._store = PersistentStore(Path(os.path.expanduser(persistent.path)) / f"{name}.sqlite",
                                          persistent.sync)
            replay = self._store.entries()
            self._queue.extend(replay)
            if replay:
                _logger.info("%s: replaying %d batches (%d items, %.1f MiB) queued on disk by an earlier run",
                             self._cid, len(replay), sum(e.items for e in replay), self._store.total_bytes / 2**20)
        self._open()
        self._accepting = True
        if self.config.sending_queue.enabled:
            for i in range(self.config.sending_queue.num_consumers):
                worker = threading.Thread(target=self._work, name=f"{self._cid}-sender-{i}", daemon=True)
                worker.start()
                self._workers.append(worker)
        self.host.telemetry.queue(self._cid, len(self._queue), self._capacity)

    def export(self, batch: Batch) -> ExportResult:
        if not self._accepting:
            self.host.log_once("stopped", logging.WARNING, "%s: export after shutdown (or before start); batches "
                               "are dropped (logged once)", self._cid)
            return ExportResult.FAILURE
        if not self.config.sending_queue.enabled:
            sent = self._deliver(batch.signal, batch.to_bytes(), batch.item_count(), count=False) == _SENT
            return ExportResult.SUCCESS if sent else ExportResult.FAILURE
        if self._store is not None:
            return self._export_to_disk(batch)
        with self._cond:
            if len(self._queue) >= self._capacity:
                size = len(self._queue)
                full = True
            else:
                self._queue.append(batch)
                size = len(self._queue)
                full = False
                self._cond.notify()
        if full:
            # The runtime counts a FAILURE as dropped (otel_gpu.collector.runtime._ExporterStage).
            self.host.log_once("queue-full", logging.WARNING, "%s: sending queue full (%d batches); dropping "
                               "batches until it drains: is the backend down or too slow? (logged once)",
                               self._cid, self._capacity)
            return ExportResult.FAILURE
        self.host.telemetry.queue(self._cid, size, self._capacity)
        return ExportResult.QUEUED

    def _export_to_disk(self, batch: Batch) -> ExportResult:
        """Commits the batch to the store before returning; when full, evicts queued batches (``drop_oldest``) or
        refuses this one (``drop_newest``). Never waits for the senders."""
        body = batch.to_bytes()
        need = len(body)
        oldest_first = self.config.sending_queue.persistent.full_policy == "drop_oldest"
        evicted: list[DiskEntry] = []
        entry = None
        try:
            with self._cond:
                free_bytes = self._max_bytes - self._store.total_bytes
                free_slots = self._capacity - len(self._queue)
                n = 0
                if oldest_first and need <= self._max_bytes:
                    while (free_bytes < need or free_slots < 1) and n < len(self._queue):
                        free_bytes += self._queue[n].nbytes
                        free_slots += 1
                        n += 1
                if free_bytes >= need and free_slots >= 1:
                    evicted = [self._queue.popleft() for _ in range(n)]
                    self._store.delete([e.id for e in evicted])
                    entry = self._store.append(batch.signal, body, batch.item_count())
                    self._queue.append(entry)
                    self._cond.notify()
                size = len(self._queue)
        except (sqlite3.Error, OSError) as exc:
            self.host.log_once("disk", logging.ERROR, "%s: cannot write the sending queue to %s (%s); batches are "
                               "dropped and counted (logged once)", self._cid, self._store.file, exc)
            return ExportResult.FAILURE
        for old in evicted:
            self.host.telemetry.dropped(self._cid, old.signal, old.items)
        if evicted or entry is None:
            self.host.log_once("disk-full", logging.WARNING, "%s: persistent sending queue full (%d batches or %.1f "
                               "MiB): dropping the %s batches (full_policy) until it drains: is the backend down? "
                               "(logged once)", self._cid, self._capacity, self._max_bytes / 2**20,
                               "oldest" if oldest_first else "newest")
        self.host.telemetry.queue(self._cid, size, self._capacity)
        return ExportResult.QUEUED if entry is not None else ExportResult.FAILURE

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until every queued batch is delivered or given up on; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops taking batches, drains the queue until ``timeout_s``, then drops (and counts) what is left."""
        deadline = time.monotonic() + timeout_s
        self._accepting = False
        self.force_flush(max(0.0, deadline - time.monotonic() - 0.1))
        self._abort.set()
        with self._cond:
            self._stopping = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if self._store is not None:
            if left:
                _logger.warning("%s: shutdown deadline reached; %d queued batches stay on disk in %s for the next "
                                "start", self._cid, len(left), self._store.file)
        else:
            for batch in left:
                self.host.telemetry.dropped(self._cid, batch.signal, batch.item_count())
            if left:
                _logger.warning("%s: shutdown deadline reached; dropped %d queued batches", self._cid, len(left))
        for worker in self._workers:
            worker.join(max(0.05, deadline - time.monotonic()))
        self.host.telemetry.queue(self._cid, 0, self._capacity)
        self._close()
        if self._store is not None and not any(w.is_alive() for w in self._workers):
            self._store.close()  # a sender still on the wire keeps it (the process is ending anyway)

    # -- workers -------------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue.popleft()
                self._in_flight += 1
                size = len(self._queue)
            try:
                self.host.telemetry.queue(self._cid, size, self._capacity)
                if isinstance(batch, DiskEntry):
                    body = self._store.read(batch.id)
                    if body is not None:
                        if self._deliver(batch.signal, body, batch.items, count=True) != _ABORTED:
                            self._store.delete([batch.id])  # acknowledged, or dropped for good (and counted)
                else:
                    self._deliver(batch.signal, batch.to_bytes(), batch.item_count(), count=True)
            except Exception:  # noqa: BLE001 - a worker must survive anything
                self.host.log_once("worker", logging.ERROR, "%s: unexpected error sending a batch (logged once)",
                                   self._cid, exc_info=True)
                items = batch.items if isinstance(batch, DiskEntry) else batch.item_count()
                self.host.telemetry.dropped(self._cid, batch.signal, items)
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def _deliver(self, signal: Signal, body: bytes, items: int, *, count: bool) -> str:
        """Sends with retries; returns _SENT, _DROPPED or _ABORTED (shutdown deadline while retrying). With
        ``count``, reports exported / dropped items itself; with a persistent queue an aborted batch stays on disk
        and is not counted."""
        retry = self.config.retry_on_failure
        started = time.monotonic()
        give_up_at = started + retry.max_elapsed_time_s if retry.max_elapsed_time_s > 0 else float("inf")
        interval = retry.initial_interval_s
        while True:
            attempt = self._send_once(signal, body, self.config.timeout_s)
            if attempt.ok:
                if count:
                    self.host.telemetry.exported(self._cid, signal, items - attempt.rejected)
                if attempt.rejected:
                    self.host.telemetry.dropped(self._cid, signal, attempt.rejected)
                    self.host.log_once("partial", logging.WARNING, "%s: the backend rejected %d of %d %s items: %s "
                                       "(logged once)", self._cid, attempt.rejected, items, signal.value,
                                       attempt.message)
                return _SENT
            if not attempt.retryable or not retry.enabled or self._abort.is_set():
                why = "permanent error" if not attempt.retryable else (
                    "retry disabled" if not retry.enabled else "shutdown deadline reached")
                return self._give_up(signal, items, count, why, attempt.message)
            if attempt.delay_s is not None:
                delay = attempt.delay_s
            else:
                jitter = retry.randomization_factor * (2 * random.random() - 1)
                delay = interval * (1 + jitter)
                interval = min(interval * retry.multiplier, retry.max_interval_s)
            if time.monotonic() + delay > give_up_at:
                return self._give_up(signal, items, count, "retries exhausted", f"retried for "
                                     f"{time.monotonic() - started:.1f}s (max_elapsed_time "
                                     f"{retry.max_elapsed_time_s:g}s): {attempt.message}")
            _logger.debug("%s: %s; retrying in %.2fs", self._cid, attempt.message, delay)
            if self._abort.wait(delay):
                return self._give_up(signal, items, count, "shutdown deadline reached", attempt.message)

    def _give_up(self, signal: Signal, items: int, count: bool, why: str, detail: str) -> str:
        if why == "shutdown deadline reached" and self._store is not None:
            return _ABORTED  # stays on disk for the next start: neither exported nor dropped
        if count:
            self.host.telemetry.dropped(self._cid, signal, items)
        self.host.log_once(("drop", why), logging.ERROR, "%s: dropping %s batch of %d items (%s: %s); further drops "
                           "for this reason are only counted", self._cid, signal.value, items, why, detail)
        return _DROPPED
