"""The ``attribution`` processor: decodes what flows through the collector into observations for the engine
(``_decode``), runs the engine on a clock, and emits failure records (``_encode``) as a failure span, a failure event
(for the store and log backends) and a failures counter, each into the pipelines of that signal that follow it.

Batches pass through unchanged, except spans of a rank under an active slowdown or hang, which get the record's
``failure.*`` attributes (so that a Jaeger/Tempo query for ``failure.kind=slowdown`` finds the slow steps).
"""
from __future__ import annotations

import logging
import threading
import time

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otel_gpu.component import DEVICE_HEALTH, FAILURE_HISTORY, Processor
from otel_gpu.otlp_build import MetricsBuilder
from otel_gpu.pdata import Batch, Signal, attributes_dict
from otel_gpu.processors.attribution._decode import Decoder
from otel_gpu.processors.attribution._encode import SCOPE, failure_kvs, failure_logs, failure_spans, stuck_spans
from otel_gpu.processors.attribution._engine import Engine
from otel_gpu.failure import FailureRecord
from otel_gpu.schema import failure as F
from otel_gpu.schema import identity as I

__all__ = ["AttributionProcessor"]

_logger = logging.getLogger(__name__)


class AttributionProcessor(Processor):
    """Names the cause of crashes, hangs and slowdowns. See the package docstring for the configuration."""

    def __init__(self, config, host):
        super().__init__(config, host)
        self.engine = Engine(config)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when a crash incident opens: its decision falls due before a tick
        self._thread: threading.Thread | None = None
        self._records: list[FailureRecord] = []  # everything reported, newest last (bounded)
        self._tagging: dict[str, FailureRecord] = {}  # job -> the hang or slowdown its spans are tagged with
        self._clock = time.time
        self.decoder = Decoder(self.engine, config, host, lambda: self._clock())
        self._started_ns = time.time_ns()  # the start of the failures counter (a cumulative sum)

    # -- lifecycle -----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-gpu-attribution", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.tick()  # what was decided in the last moments still goes out

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._next_wait())
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the clock must keep running
                self.host.log_once("tick", logging.ERROR, "attribution tick failed (logged once)", exc_info=True)

    def _next_wait(self) -> float:
        """Until the next tick: the tick interval, or sooner when a crash decision falls due (a crash is named as
        soon as its settle time is over, not up to a tick interval later)."""
        with self._lock:
            due = self.engine.next_deadline()
        wait = self.config.tick_interval_s
        if due is not None:
            wait = min(wait, max(0.01, due - self._clock() + 0.005))
        return wait

    def tick(self, now: float | None = None) -> list[FailureRecord]:
        now = self._clock() if now is None else now
        with self._lock:
            records = self.engine.tick(now)
        for record in records:
            self._publish(record)
        return records

    @property
    def records(self) -> list[FailureRecord]:
        with self._lock:
            return list(self._records)

    # -- input ---------------------------------------------------------------------------------------------------------
    def process(self, batch: Batch) -> Batch | None:
        now = self._clock()
        with self._lock:
            if batch.signal is Signal.LOGS:
                self.decoder.logs(batch.message, now, batch)
            elif batch.signal is Signal.METRICS:
                self.decoder.metrics(batch.message, now, batch)
            else:
                if self.decoder.spans(batch.message, now) and self._tagging:
                    self._tag(batch)
            if self.engine.incident_opened:
                self.engine.incident_opened = False
                self._wake.set()
        return batch


    def _publish(self, record: FailureRecord) -> None:
        history = self.host.services.get(FAILURE_HISTORY)
        if history is not None and (record.version == 1 or record.previous_root_cause is not None):
            try:
                record.recurrence = int(history.recurrence(record.signature))
            except Exception:  # noqa: BLE001 - the store may be busy or gone; recurrence stays 0
                self.host.log_once("history", logging.WARNING, "failure history unavailable", exc_info=True)
        self._device_history(record)
        with self._lock:
            self._records.append(record)
            del self._records[:-1000]
            if record.withdrawn:
                current = self._tagging.get(record.job_id)
                if current is not None and current.failure_id == record.failure_id:
                    del self._tagging[record.job_id]
            elif record.kind is not F.Kind.CRASH:
                self._tagging[record.job_id] = record
            if len(self._tagging) > 1000:
                self._tagging.pop(next(iter(self._tagging)))
        _logger.warning("failure%s: %s %s (%s) job=%s culprit=%s: %s",
                        "" if record.version == 1 else f" revision {record.version}"
                        + (" (withdrawn)" if record.withdrawn else ""), record.kind.value.upper(),
                        record.root_cause.value, record.category.value, record.job_id,
                        record.culprit.rank, record.summary)
        if self.host.has_consumer(Signal.TRACES):
            self.host.emit(Batch.from_message(Signal.TRACES, failure_spans(record)))
            if record.details.get("waiting"):
                self.host.emit(Batch.from_message(Signal.TRACES, stuck_spans(record)))
        if self.host.has_consumer(Signal.LOGS):
            self.host.emit(Batch.from_message(Signal.LOGS, failure_logs(record)))
        if self.host.has_consumer(Signal.METRICS):
            self.host.emit(Batch.from_message(Signal.METRICS, self._failure_metrics()))

    def _device_history(self, record: FailureRecord) -> None:
        """Device health (issue 15): asks the health processor's shared service, when one runs, what it knows of the
        culprit's GPU and node; adds that history to the evidence, raises confidence in a hardware cause for a device
        already in watch/drain, and names a recurring culprit (third failure on the same device)."""
        health = self.host.services.get(DEVICE_HEALTH)
        if health is None:
            return
        try:
            ctx = health.failure_context(host=record.culprit.host, gpu=record.culprit.gpu, job_id=record.job_id,
                                         category=record.category.value, time_s=record.onset_time)
        except Exception:  # noqa: BLE001 - device history is a bonus, never a reason to lose the record
            self.host.log_once("device_health", logging.WARNING, "device health unavailable", exc_info=True)
            return
        if ctx.get("devices"):
            record.details["devices"] = list(ctx["devices"])
        record.evidence.extend(str(e) for e in ctx.get("evidence") or ())
        record.confidence = min(0.99, record.confidence + float(ctx.get("confidence_boost") or 0.0))
        if ctx.get("recurring"):
            record.details["recurring_culprit"] = ctx["recurring"]
            record.summary += f" (recurring culprit: {ctx['recurring']['device_id']}, failure " \
                              f"#{ctx['recurring']['failures']})"

    def _failure_metrics(self) -> ExportMetricsServiceRequest:
        counts: dict[tuple[str, str, str, str], int] = {}
        with self._lock:
            latest: dict[str, FailureRecord] = {}  # a failure counts once, as its latest revision says
            for r in self._records:
                latest[r.failure_id or str(id(r))] = r
            for r in latest.values():
                if r.withdrawn:
                    continue
                key = (r.job_id, r.kind.value, r.root_cause.value, r.category.value)
                counts[key] = counts.get(key, 0) + 1
        mb = MetricsBuilder(scope=SCOPE, start_time_ns=self._started_ns)
        for (job, kind, cause, category), n in counts.items():
            mb.record(F.FAILURES, n, {I.JOB_ID: job, F.KIND: kind, F.ROOT_CAUSE: cause,
                                      F.CATEGORY: category})
        return mb.build()

    def _tag(self, batch: Batch) -> None:
        """Adds failure.* attributes to the job's spans that end after the onset of its hang, or of its slowdown
        while that lasts (the engine re-arms when steps are fast again)."""
        request = batch.message
        targets = []
        for i, rs in enumerate(request.resource_spans):
            job = attributes_dict(rs.resource.attributes).get(I.JOB_ID)
            record = self._tagging.get(str(job)) if job is not None else None
            if record is None:
                continue
            if record.kind is F.Kind.SLOWDOWN:
                state = self.engine.jobs.get(record.job_id)
                if state is None or state.slowdown_active is None:
                    del self._tagging[record.job_id]
                    continue
            targets.append((i, record))
        if not targets:
            return
        request = batch.mutable()
        for i, record in targets:
            kvs = failure_kvs(record)
            onset_ns = int(record.onset_time * 1e9)
            for ss in request.resource_spans[i].scope_spans:
                for span in ss.spans:
                    if span.end_time_unix_nano >= onset_ns:
                        span.attributes.extend(kvs)

