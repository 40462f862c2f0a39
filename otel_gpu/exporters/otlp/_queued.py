"""What both OTLP exporters share: a bounded queue drained by worker threads, and retry with backoff and jitter.

A transport subclass implements only :meth:`QueuedExporter._send_once` (one attempt) and the connection lifecycle.
"""
from __future__ import annotations

import abc
import collections
import logging
import random
import threading
import time
from dataclasses import dataclass

from otel_gpu.component import Exporter, ExportResult
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


class QueuedExporter(Exporter):
    """export() only enqueues; ``num_consumers`` threads send, retry, and count exported / dropped items."""

    def __init__(self, config, host):
        super().__init__(config, host)
        self._queue: collections.deque[Batch] = collections.deque()
        self._capacity = config.sending_queue.queue_size
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

    def _close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections."""

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._open()
        self._accepting = True
        if self.config.sending_queue.enabled:
            for i in range(self.config.sending_queue.num_consumers):
                worker = threading.Thread(target=self._work, name=f"{self._cid}-sender-{i}", daemon=True)
                worker.start()
                self._workers.append(worker)
        self.host.telemetry.queue(self._cid, 0, self._capacity)

    def export(self, batch: Batch) -> ExportResult:
        if not self._accepting:
            self.host.log_once("stopped", logging.WARNING, "%s: export after shutdown (or before start); batches "
                               "are dropped (logged once)", self._cid)
            return ExportResult.FAILURE
        if not self.config.sending_queue.enabled:
            return ExportResult.SUCCESS if self._deliver(batch, count=False) else ExportResult.FAILURE
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
        for batch in left:
            self.host.telemetry.dropped(self._cid, batch.signal, batch.item_count())
        if left:
            _logger.warning("%s: shutdown deadline reached; dropped %d queued batches", self._cid, len(left))
        for worker in self._workers:
            worker.join(max(0.05, deadline - time.monotonic()))
        self.host.telemetry.queue(self._cid, 0, self._capacity)
        self._close()

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
                self._deliver(batch, count=True)
            except Exception:  # noqa: BLE001 - a worker must survive anything
                self.host.log_once("worker", logging.ERROR, "%s: unexpected error sending a batch (logged once)",
                                   self._cid, exc_info=True)
                self.host.telemetry.dropped(self._cid, batch.signal, batch.item_count())
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def _deliver(self, batch: Batch, *, count: bool) -> bool:
        """Sends with retries. With ``count``, reports exported / dropped items itself."""
        retry = self.config.retry_on_failure
        body = batch.to_bytes()
        items = batch.item_count()
        started = time.monotonic()
        give_up_at = started + retry.max_elapsed_time_s if retry.max_elapsed_time_s > 0 else float("inf")
        interval = retry.initial_interval_s
        while True:
            attempt = self._send_once(batch.signal, body, self.config.timeout_s)
            if attempt.ok:
                if count:
                    self.host.telemetry.exported(self._cid, batch.signal, items - attempt.rejected)
                if attempt.rejected:
                    self.host.telemetry.dropped(self._cid, batch.signal, attempt.rejected)
                    self.host.log_once("partial", logging.WARNING, "%s: the backend rejected %d of %d %s items: %s "
                                       "(logged once)", self._cid, attempt.rejected, items, batch.signal.value,
                                       attempt.message)
                return True
            if not attempt.retryable or not retry.enabled or self._abort.is_set():
                why = "permanent error" if not attempt.retryable else (
                    "retry disabled" if not retry.enabled else "shutdown deadline reached")
                return self._give_up(batch, items, count, why, attempt.message)
            if attempt.delay_s is not None:
                delay = attempt.delay_s
            else:
                jitter = retry.randomization_factor * (2 * random.random() - 1)
                delay = interval * (1 + jitter)
                interval = min(interval * retry.multiplier, retry.max_interval_s)
            if time.monotonic() + delay > give_up_at:
                return self._give_up(batch, items, count, "retries exhausted", f"retried for "
                                     f"{time.monotonic() - started:.1f}s (max_elapsed_time_s "
                                     f"{retry.max_elapsed_time_s}): {attempt.message}")
            _logger.debug("%s: %s; retrying in %.2fs", self._cid, attempt.message, delay)
            if self._abort.wait(delay):
                return self._give_up(batch, items, count, "shutdown deadline reached", attempt.message)

    def _give_up(self, batch: Batch, items: int, count: bool, why: str, detail: str) -> bool:
        if count:
            self.host.telemetry.dropped(self._cid, batch.signal, items)
        self.host.log_once(("drop", why), logging.ERROR, "%s: dropping %s batch of %d items (%s: %s); further drops "
                           "for this reason are only counted", self._cid, batch.signal.value, items, why, detail)
        return False
