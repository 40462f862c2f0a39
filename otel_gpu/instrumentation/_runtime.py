"""The instrumentation's runtime: wires the parts of one instrumented process together and runs its two threads.

Nothing here runs on the training thread's hot path except ``on_optimizer_step`` (once per step). The parts, one job
each: ``_spans`` (ring records and flight-recorder entries to spans), ``_flight`` (reading torch's flight recorder),
``_export`` (the OTLP client), ``_metrics`` (the heartbeat's metrics), ``_watchdog`` (heartbeats, the stall decision,
stacks), ``_crash`` (excepthooks, signals, atexit). The export thread drains the ring every ``export_interval_s`` and
sends spans and queued logs; the watchdog thread sends a heartbeat every ``heartbeat_s``.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time

from otel_gpu.instrumentation import jobid
from otel_gpu.instrumentation import _export, _flight, _hot, _metrics, _pbenc, _registry
from otel_gpu.instrumentation._crash import CrashHooks, classify
from otel_gpu.instrumentation._hot import NS, STEP
from otel_gpu.instrumentation._identity import Identity, job_id_from_env
from otel_gpu.instrumentation._spans import SpanAssembler
from otel_gpu.instrumentation._watchdog import Watchdog
from otel_gpu.instrumentation.config import InstrumentationConfig, attribute_limits, env, signal_routes

__all__ = ["Runtime", "current", "classify"]

_logger = logging.getLogger(__name__)

_RUNTIME: Runtime | None = None
_FORK_HOOKED = False
_SCOPE_BYTES = _export.SCOPE.SerializeToString()


def current() -> Runtime | None:
    return _RUNTIME


class Runtime:
    """One per instrumented process (re-created on re-instrument)."""

    def __init__(self, cfg: InstrumentationConfig):
        self.cfg = cfg
        self.identity_generated = not cfg.job_id and jobid.resolve() is None  # agreed at the rendezvous
        self.job_id = job_id_from_env(cfg.job_id)
        self.identity = Identity(self.job_id, cfg.service_name, cfg.resource_attributes)
        self._started_mono = time.monotonic()
        self.client = _export.OtlpClient(cfg.endpoint, cfg.protocol, cfg.headers, cfg.export_timeout_s,
                                         routes=signal_routes(cfg))
        limits = attribute_limits()
        _pbenc.LIMITS, _export.LOG_LIMITS = limits["spans"], limits["logs"]
        self.counters: collections.Counter = collections.Counter()
        self.spans = SpanAssembler(self.counters)
        self.reads = _flight.Reads(cfg.export_interval_s, self.spans.pg, self.spans.cpp_count, self.counters)
        self.watchdog = Watchdog(self, starting=(env("WORLD_SIZE") or "1").strip() not in ("", "0", "1"))
        self.crash = CrashHooks(self)
        self._res_version = -1
        self._resource_bytes: tuple = (None, b"")
        self._resource = None
        self._export_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._logs: collections.deque = collections.deque(maxlen=4096)
        self._started_ns = time.time_ns()
        self.step_durs: collections.deque = collections.deque(maxlen=32)
        self.steps_done = 0
        self._step_t0 = time.time_ns()
        self._first_opt = None
        self.explicit_steps = False
        self._flushing: int | None = None  # thread id inside flush()
        self._shut = False
        NS.pop("_failed", None)  # a failed collective of an earlier runtime is not this one's

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        global _RUNTIME, _FORK_HOOKED
        _RUNTIME = self
        self.enable_flight_recorder()
        for name, target in (("otel-gpu-export", self._export_loop),
                             ("otel-gpu-watchdog", lambda: self.watchdog.loop(self._stop))):
            th = threading.Thread(target=target, name=name, daemon=True)
            th.start()
            self._threads.append(th)
        if self.cfg.crash_hooks:
            self.crash.install()
            if not _FORK_HOOKED:
                _FORK_HOOKED = True
                os.register_at_fork(after_in_child=_after_fork_in_child)
        self._register()

    def enable_flight_recorder(self) -> None:
        """Sets TORCH_FR_BUFFER_SIZE for process groups created from now on (idempotent)."""
        if self.cfg.flight_recorder:
            self.reads.enable(self.cfg.flight_recorder_size)

    def is_shut(self) -> bool:
        return self._shut

    def shutdown(self, timeout_s: float | None = None, reason: str = "shutdown") -> None:
        """Flushes (bounded) and stops the threads. Safe to call twice."""
        global _RUNTIME
        if self._shut:
            return
        self._shut = True
        timeout_s = self.cfg.flush_timeout_s if timeout_s is None else timeout_s
        self._stop.set()
        self._wake.set()
        self.crash.uninstall()
        self.flush(timeout_s)
        for th in self._threads:
            th.join(timeout=0.5)
        self.client.close()
        if _RUNTIME is self:
            _RUNTIME = None

    def flushing_here(self) -> bool:
        """This thread is inside flush() (a signal handler interrupted it)."""
        return self._flushing == threading.get_ident()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Exports what is buffered now, from the calling thread, within ``timeout_s``."""
        timeout_s = self.cfg.flush_timeout_s if timeout_s is None else timeout_s
        if self.flushing_here():
            return False  # re-entered from a signal handler while this thread flushes: the outer flush finishes
        if not self._export_lock.acquire(timeout=timeout_s):
            return False
        self._flushing = threading.get_ident()
        ok = True
        try:
            self.client.reset_backoff()
            self._cycle(final=True)
            if self.steps_done and self.may_send_metrics():  # a rank that dies before its first heartbeat
                self.send_metrics()  # still reports its step time
        except Exception:
            _logger.debug("otel-gpu flush failed", exc_info=True)
            ok = False
        finally:
            self._flushing = None
            self._export_lock.release()
        self.crash.after_flush()
        return ok

    # ---------------------------------------------------------------- identity / registry
    def on_process_group_init(self) -> None:
        self.watchdog.clock.starting = True  # waiting in the rendezvous for peers that still start is not a stall

    def on_process_group_created(self) -> None:
        # Start-up (imports, rendezvous with ranks that are still starting) is not a stall: under load it can take
        # longer than the hang timeout, and a hang named then would take the incarnation's one terminal verdict.
        NS["_dpg"] = None
        if not self.steps_done:
            self._step_t0 = time.time_ns()  # step 1 starts once the job is set up, not at import time
        self.watchdog.clock.group_created(time.time_ns(), None if self.steps_done else self._step_t0)
        self.identity.refresh_from_dist()
        self._agree_job_id()
        self._register()
        self._wake.set()

    def _agree_job_id(self) -> None:
        """When no launcher gave a job id, every rank generated its own: adopt rank 0's through the c10d store."""
        if not self.identity_generated:
            return
        try:
            import datetime

            from torch.distributed import distributed_c10d as c10d

            store = c10d._get_default_store()
            key = "otel_gpu/job_id"
            if self.identity.rank == 0:
                store.set(key, self.job_id)
            else:
                store.wait([key], datetime.timedelta(seconds=5))
                self.job_id = store.get(key).decode()
            self.identity.job_id = self.job_id
            self.identity.version += 1
            self.identity_generated = False
        except Exception:
            _logger.warning("otel-gpu: could not agree on a job id through the store", exc_info=True)

    def _register(self) -> None:
        folder = self.cfg.registry_dir
        if folder and os.path.isdir(folder):
            role = "rank" if self.identity.rank is not None else "python"
            _registry.write_proc(folder, {"pid": os.getpid(), "ppid": os.getppid(), "role": role,
                                          "rank": self.identity.rank, "local_rank": self.identity.local_rank,
                                          "world_size": self.identity.world_size, "host": self.identity.host,
                                          # the launcher adopts this id; a provisional one is not worth adopting
                                          "job_id": None if self.identity_generated else self.identity.job_id,
                                          "argv": sys.argv[:8]})

    def registry_event(self, event: dict) -> None:
        folder = self.cfg.registry_dir
        if folder and os.path.isdir(folder):
            _registry.append_event(folder, {"rank": self.identity.rank, **event})

    def resource(self):
        if self.identity.gpu_index is None:
            self.identity.refresh_gpu()  # CUDA often starts after the process group (model.cuda()); bumps version
        if self._res_version != self.identity.version or self._resource is None:
            self._resource = _export.make_resource(self.identity.attributes())
            self._res_version = self.identity.version
        return self._resource

    def is_training_process(self) -> bool:
        """Heartbeats come from ranks (or single-process training that steps), not from helper processes such as
        mp.spawn's parent or a torchrun-launched tool."""
        return self.identity.rank is not None or self.steps_done > 0

    def may_send_metrics(self) -> bool:
        """Not before the job id is agreed (when the process group is created): a record now would start a stray
        job."""
        return not (self.identity_generated and (self.identity.world_size or 0) > 1
                    and time.monotonic() - self._started_mono < 120.0)

    # ---------------------------------------------------------------- steps
    def on_optimizer_step(self, optimizer, _args, _kwargs) -> None:
        if not NS["_on"] or self.explicit_steps:
            return
        if self._first_opt is None:
            self._first_opt = id(optimizer)
        elif id(optimizer) != self._first_opt:
            return  # several optimizers: the first one seen marks the step
        self.end_step(NS["_step"], self._step_t0, time.time_ns(), None)

    def end_step(self, n: int, t0: int, t1: int, error: str | None) -> None:
        _hot.push((STEP, n, t0, t1, error))
        self.steps_done += 1
        if self.steps_done > 1:  # the first step carries warm-up (DDP set-up, lazy imports): not a baseline
            self.step_durs.append((t1 - t0) / 1e9)
        self._step_t0 = t1
        NS["_step"] = n + 1

    # ---------------------------------------------------------------- watchdog and crash hooks (their modules)
    def progress(self) -> tuple[dict, dict]:
        """(attributes, body) of one heartbeat."""
        return self.watchdog.progress()

    def report_exception(self, exc_type, exc, tb, thread_name: str) -> None:
        self.crash.report_exception(exc_type, exc, tb, thread_name)

    # ---------------------------------------------------------------- export
    def _export_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.cfg.export_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            if not self._export_lock.acquire(timeout=0.1):
                continue
            try:
                self._cycle(final=False)
            except Exception:  # never die silently, never crash the host
                _logger.warning("otel-gpu export cycle failed", exc_info=True)
            finally:
                self._export_lock.release()

    def _cycle(self, final: bool) -> None:
        spans, reads = self.spans, self.reads
        drain_ns = time.time_ns()
        records = spans.drain()
        # Held step spans wait for a recorder read that covers them: read at most once per export interval then.
        catch_up = bool(spans.held_steps) and time.monotonic() - reads.last_read >= self.cfg.export_interval_s
        reads.poll(force=(final or catch_up) and reads.enabled)
        fr_entries = spans.fr_hold + reads.take()
        spans.fr_hold = []
        out = spans.assemble(records, fr_entries, drain_ns, final, NS["_cur"])
        out = spans.hold_steps(out, final, reads.last_read_wall_ns)
        if out:
            spans.add_step_breakdown(out)
            if not final and self.client.is_down():
                self.counters["spans_dropped"] += len(out)  # do not spend the GIL encoding what would be dropped
            else:
                self._send_spans(out)
        self._send_queued_logs()

    def _send_spans(self, spans: list) -> None:
        resource = self.resource()
        if self._resource_bytes[0] is not resource:
            self._resource_bytes = (resource, resource.SerializeToString())
        for req, n in self.spans.requests(spans, self._resource_bytes[1], _SCOPE_BYTES, self.job_id,
                                          self.identity.rank, self.identity.pid):
            if self.client.send_traces(req):
                self.counters["spans_sent"] += n
            else:
                self.counters["spans_dropped"] += n

    def send_metrics(self) -> None:
        self.client.send_metrics(self._metrics_request())

    def _metrics_request(self):
        return _metrics.metrics_request(self.resource(), self.step_durs[-1] if self.step_durs else None,
                                        self._started_ns, NS["_drops"] + self.counters["spans_dropped"],
                                        self.spans.coll_hist)

    # ---------------------------------------------------------------- logs
    def log(self, event, attrs: dict, body: dict, severity: int = _export.INFO, now: bool = False) -> None:
        rec = (str(event), time.time_ns(), attrs, body, severity)
        if now:
            self._send_logs([rec])
        else:
            self._logs.append(rec)
            self._wake.set()

    def _send_logs(self, records: list) -> bool:
        ok = self.client.send_logs(_export.logs_request(self.resource(), records))
        self.counters["logs_sent" if ok else "logs_dropped"] += len(records)
        return ok

    def _send_queued_logs(self) -> None:
        batch = []
        while self._logs:
            batch.append(self._logs.popleft())
        if batch:
            self._send_logs(batch)


def _after_fork_in_child() -> None:
    """DataLoader workers and other forks: no threads came along, so do not record into a ring nobody drains."""
    global _RUNTIME
    NS["_on"] = False
    _RUNTIME = None
