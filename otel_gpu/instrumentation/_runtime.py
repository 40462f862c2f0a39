"""The instrumentation's runtime: background export thread, watchdog thread, step tracking and crash hooks.

Nothing here runs on the training thread's hot path except ``on_optimizer_step`` (once per step). The export thread
drains the ring buffer of ``_hot``, reconciles Python-issued collectives with torch's flight recorder, turns both into
OTLP spans and sends them; the watchdog sends a heartbeat every ``heartbeat_s`` and the stacks of all threads when the
process makes no progress for longer than the (adaptive) threshold.
"""
from __future__ import annotations

import atexit
import bisect
import collections
import hashlib
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback

from otel_gpu import jobid
from otel_gpu.instrumentation import _export, _flight, _hot, _pbenc, _registry
from otel_gpu.instrumentation._hot import CKPT, COLL, DATA, NS, STEP, WAIT
from otel_gpu.instrumentation._identity import Identity, job_id_from_env
from otel_gpu.instrumentation.config import InstrumentationConfig, attribute_limits, signal_routes
from otel_gpu.schema import identity as ids
from otel_gpu.schema import training as tr

# Bucket bounds (seconds) of the collective-duration histogram: microsecond all-reduces to minute-long stalls.
_COLL_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_logger = logging.getLogger(__name__)

_RUNTIME: Runtime | None = None
_FORK_HOOKED = False
_MAX_SPANS_PER_REQUEST = 2000
_ASYNC_HOLD_NS = 10_000_000_000
_SCOPE_BYTES = _export.SCOPE.SerializeToString()


def current() -> Runtime | None:
    return _RUNTIME


def note_failed_collective(op, g, seq, exc) -> None:
    rt = _RUNTIME
    if rt is not None:
        rt.failed_collective = (op, g, seq, f"{type(exc).__name__}: {exc}"[:500])


def _record_end_ns(rec: tuple) -> int:
    kind = rec[0]
    return int(rec[5] if kind in (COLL, WAIT) else rec[3] if kind in (STEP, CKPT) else rec[2])


def _rand_id(n: int) -> bytes:
    return random.getrandbits(n * 8).to_bytes(n, "big")


def classify(exc: BaseException) -> str:
    """schema ExceptionHint value for an exception."""
    H = tr.ExceptionHint
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    torch = sys.modules.get("torch")
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None) if torch else None
    if (oom_type is not None and isinstance(exc, oom_type)) or "cuda out of memory" in low:
        return H.CUDA_OOM.value
    if isinstance(exc, KeyboardInterrupt):
        return H.KEYBOARD_INTERRUPT.value
    if any(s in low for s in ("connection closed by peer", "connection reset", "broken pipe", "econnreset",
                              "socket closed", "peer closed", "connection refused")):
        return H.PEER_FAILURE.value
    if "timed out" in low or "timeout" in low and ("gloo" in low or "nccl" in low or "watchdog" in low):
        return H.DIST_TIMEOUT.value
    if "nccl" in low:
        return H.NCCL_ERROR.value
    if "gloo" in low or type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistError"):
        return H.GLOO_ERROR.value
    if "cuda error" in low or "cudaerror" in low:
        return H.CUDA_ERROR.value
    return H.USER_CODE.value


def _frames(frame) -> list[dict]:
    out = [{"file": fs.filename, "line": fs.lineno, "function": fs.name}
           for fs in traceback.extract_stack(frame, limit=64)]
    return out


def _is_internal(path: str) -> bool:
    p = path.replace("\\", "/")
    return ("/torch/" in p or "/otel_gpu/instrumentation/" in p or p.endswith("/threading.py")
            or p.startswith("<otel_gpu"))


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
        self.fr = _flight.FlightRecorder()
        self.fr_enabled = False
        self.fr_inbox: list[dict] = []  # entries read by either thread, for the export thread
        self._fr_lock = threading.Lock()
        self._fr_last_poll = 0.0
        self._fr_last_poll_wall_ns = 0
        self._held_steps: list = []  # step spans waiting for the recorder read that covers their collectives
        self._fr_min_interval_s = cfg.export_interval_s
        self.fr_hold: list[dict] = []
        self.cpp_count: dict[str, int] = {}  # pg name -> collectives seen only in the flight recorder
        self._py_windows: dict[str, collections.deque] = {}  # pg name -> (t0, t1) of recent Python collectives
        self._res_version = -1
        self._resource_bytes: tuple = (None, b"")
        self._ids_cache: dict = {}
        self._resource = None
        self._pg_info: dict[int, tuple[object, str, int]] = {}  # id(pg) -> (pg, name, size)
        self._export_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._logs: collections.deque = collections.deque(maxlen=4096)
        self._pending_async: dict[tuple[int, int], list] = {}
        self._step_ends: collections.deque = collections.deque(maxlen=256)  # (n, t_end_ns)
        # Recent collective, data-wait and checkpoint intervals (kind, t0, t1, end_known), for the per-step
        # breakdown on the step span: what separates a straggler's compute from its peers' waiting.
        self._recent_iv: collections.deque = collections.deque(maxlen=8192)
        self._coll_hist: dict[str, list] = {}  # op -> [bucket counts, sum s, count]
        self._started_ns = time.time_ns()
        self._step_durs: collections.deque = collections.deque(maxlen=32)
        self._steps_done = 0
        self._step_t0 = time.time_ns()
        self._first_opt = None
        self.explicit_steps = False
        self.failed_collective = None
        self.counters = collections.Counter()
        self._last_progress_marker = None
        self._last_progress_ns = time.time_ns()
        # A rank of a multi-rank job (WORLD_SIZE > 1) is starting up until its process group exists: imports and the
        # rendezvous with peers that still start are not a stall (under load they outlast the hang timeout).
        self._in_pg_init = (os.environ.get("WORLD_SIZE") or "1").strip() not in ("", "0", "1")
        self._last_record_end_ns = 0
        self._stacks_sent_for = None
        self._exit_info: dict | None = None
        self._flushing: int | None = None  # thread id inside flush()
        self._deferred_signal: tuple | None = None
        self._saved_hooks: dict = {}
        self._pid = os.getpid()
        self._shut = False

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        global _RUNTIME
        _RUNTIME = self
        self.enable_flight_recorder()
        for name, target in (("otel-gpu-export", self._export_loop), ("otel-gpu-watchdog", self._watchdog_loop)):
            th = threading.Thread(target=target, name=name, daemon=True)
            th.start()
            self._threads.append(th)
        if self.cfg.crash_hooks:
            self._install_hooks()
        self._register()

    def enable_flight_recorder(self) -> None:
        """Sets TORCH_FR_BUFFER_SIZE for process groups created from now on (idempotent)."""
        if self.cfg.flight_recorder and not self.fr_enabled:
            self.fr_enabled = _flight.enable_env(self.cfg.flight_recorder_size)
            self._fr_min_interval_s = max(self.cfg.export_interval_s, _flight.buffer_size() / 256)

    def shutdown(self, timeout_s: float | None = None, reason: str = "shutdown") -> None:
        """Flushes (bounded) and stops the threads. Safe to call twice."""
        global _RUNTIME
        if self._shut:
            return
        self._shut = True
        timeout_s = self.cfg.flush_timeout_s if timeout_s is None else timeout_s
        self._stop.set()
        self._wake.set()
        self._uninstall_hooks()
        self.flush(timeout_s)
        for th in self._threads:
            th.join(timeout=0.5)
        self.client.close()
        if _RUNTIME is self:
            _RUNTIME = None

    def flush(self, timeout_s: float | None = None) -> bool:
        """Exports what is buffered now, from the calling thread, within ``timeout_s``."""
        timeout_s = self.cfg.flush_timeout_s if timeout_s is None else timeout_s
        if self._flushing == threading.get_ident():
            return False  # re-entered from a signal handler while this thread flushes: the outer flush finishes
        if not self._export_lock.acquire(timeout=timeout_s):
            return False
        self._flushing = threading.get_ident()
        ok = True
        try:
            self.client.reset_backoff()
            self._cycle(final=True)
            if self._steps_done and self._may_send_metrics():  # a rank that dies before its first heartbeat
                self.client.send_metrics(self._metrics_request())  # still reports its step time
        except Exception:  # noqa: BLE001
            _logger.debug("otel-gpu flush failed", exc_info=True)
            ok = False
        finally:
            self._flushing = None
            self._export_lock.release()
        deferred, self._deferred_signal = self._deferred_signal, None
        if deferred is not None:  # a signal arrived during the flush: act on it now that the data is out
            self._chain_signal(*deferred)
        return ok

    # ---------------------------------------------------------------- identity / registry
    def on_process_group_init(self) -> None:
        self._in_pg_init = True  # waiting in the rendezvous for peers that still start is not a stall

    def on_process_group_created(self) -> None:
        # Start-up (imports, rendezvous with ranks that are still starting) is not a stall: under load it can take
        # longer than the hang timeout, and a hang named then would take the incarnation's one terminal verdict.
        self._in_pg_init = False
        self._last_progress_ns = time.time_ns()
        NS["_dpg"] = None
        if not self._steps_done:
            self._step_t0 = time.time_ns()  # step 1 starts once the job is set up, not at import time
            self._last_progress_ns = max(self._last_progress_ns, self._step_t0)  # joining the group is progress
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
        except Exception:  # noqa: BLE001
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

    def _registry_event(self, event: dict) -> None:
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
        self._steps_done += 1
        if self._steps_done > 1:  # the first step carries warm-up (DDP set-up, lazy imports): not a baseline
            self._step_durs.append((t1 - t0) / 1e9)
        self._step_t0 = t1
        NS["_step"] = n + 1

    # ---------------------------------------------------------------- process groups
    def _pg(self, g) -> tuple[str, int]:
        info = self._pg_info.get(id(g))
        if info is None or info[0] is not g:
            name, size = "?", -1
            try:
                # never import torch from these threads: the main thread may be importing it right now
                c10d = sys.modules["torch.distributed.distributed_c10d"]
                name = str(c10d._get_process_group_name(g))
            except Exception:  # noqa: BLE001
                name = str(getattr(g, "group_name", "?"))
            try:
                size = int(g.size())
            except Exception:  # noqa: BLE001
                pass
            info = (g, name, size)
            self._pg_info[id(g)] = info
        return info[1], info[2]

    def _all_pgs(self) -> list:
        c10d = sys.modules.get("torch.distributed.distributed_c10d")  # not imported from a background thread
        try:
            return list(c10d._world.pg_map.keys()) if c10d is not None else []
        except Exception:  # noqa: BLE001
            return []

    def _cpp_ops_pending(self) -> bool:
        """True when torch counted ops on some group that neither the wrappers nor the recorder accounted for."""
        seq, p2p = NS["_seq"], NS["_p2p"]
        for g in self._all_pgs():
            try:
                torch_seq = g._get_sequence_number_for_group()
            except Exception:  # noqa: BLE001 - e.g. NCCL before its communicator exists
                continue
            name, _ = self._pg(g)
            if torch_seq > seq.get(g, 0) + p2p.get(g, 0) + self.cpp_count.get(name, 0):
                return True
        return False

    def poll_flight_recorder(self, force: bool = False, stalled: bool = False) -> None:
        """Reads new recorder entries when torch counted ops the wrappers did not issue. A read holds the GIL for
        ~15 us per buffered entry, so routine reads are spaced by the buffer size (1 s per 256 entries, at least
        export_interval_s); a stalled process (``stalled``) or the final flush (``force``) reads at once."""
        if not self.fr_enabled or self.fr.available is False:
            return
        now = time.monotonic()
        if not force and not stalled and now - self._fr_last_poll < self._fr_min_interval_s:
            return
        if not force and not self._cpp_ops_pending():
            return
        self._fr_last_poll = now
        self._fr_last_poll_wall_ns = time.time_ns()
        entries = self.fr.poll()
        if entries:
            with self._fr_lock:
                self.fr_inbox.extend(entries)
            self.counters["fr_polls"] += 1

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
            except Exception:  # noqa: BLE001 - never die silently, never crash the host
                _logger.warning("otel-gpu export cycle failed", exc_info=True)
            finally:
                self._export_lock.release()

    def _drain(self) -> list[tuple]:
        w, r = NS["_w"], NS["_r"]
        buf, mask = NS["_buf"], NS["_M"]
        out = []
        for i in range(r, w):
            rec = buf[i & mask]
            buf[i & mask] = None
            if rec is not None:
                out.append(rec)
        if out:
            self._last_record_end_ns = max(self._last_record_end_ns, _record_end_ns(out[-1]))
        NS["_r"] = w
        if len(NS["_pend"]) > 65536:  # Works awaited through futures never come back to Work.wait
            NS["_pend"].clear()
        return out

    def _trace_ids(self, step: int) -> tuple[bytes, bytes]:
        """Same trace for step n on every rank of the job; the step span's id is per rank."""
        key = (step, self.job_id, self.identity.rank)
        ids_ = self._ids_cache.get(key)
        if ids_ is None:
            tid = hashlib.sha256(f"{self.job_id}:{step}".encode()).digest()[:16]
            sid = hashlib.sha256(f"{self.job_id}:{self.identity.rank}:{self.identity.pid}:{step}".encode()
                                 ).digest()[:8]
            if len(self._ids_cache) > 1024:
                self._ids_cache.clear()
            ids_ = self._ids_cache[key] = (tid, sid)
        return ids_

    def _step_at(self, t_ns: int) -> int:
        for n, t_end in reversed(self._step_ends):
            if t_end < t_ns:
                return n + 1
        return self._step_ends[0][0] if self._step_ends else NS["_step"]

    def _cycle(self, final: bool) -> None:
        drain_ns = time.time_ns()
        records = self._drain()
        # Held step spans wait for a recorder read that covers them: read at most once per export interval then.
        catch_up = bool(self._held_steps) and time.monotonic() - self._fr_last_poll >= self.cfg.export_interval_s
        self.poll_flight_recorder(force=(final or catch_up) and self.fr_enabled)
        with self._fr_lock:
            fr_entries = self.fr_hold + self.fr_inbox
            self.fr_inbox = []
        self.fr_hold = []
        spans: list[tuple] = []  # (name, step, start, end, attrs, error)
        # Python collectives by pg name, for matching against the flight recorder
        py_by_pg: dict[str, list[list]] = {}
        for rec in records:
            kind = rec[0]
            if kind == COLL:
                _, op, g, s, t0, t1, nbytes, dtype, is_async, peer, step, err = rec
                name, size = self._pg(g)
                p2p = s is not None and s < 0
                seq = None if s is None else (-s if p2p else s + self.cpp_count.get(name, 0))
                attrs = {str(tr.COLL_OP): op, str(tr.COLL_PG): name, str(tr.COLL_PG_SIZE): size,
                         str(tr.COLL_SEQ): seq, str(tr.COLL_BYTES): nbytes,
                         str(tr.COLL_DTYPE): str(dtype).replace("torch.", "") if dtype is not None else None,
                         str(tr.COLL_ASYNC): bool(is_async), str(tr.COLL_PEER): peer,
                         str(tr.COLL_SOURCE): "python", str(tr.STEP): step}
                if p2p:
                    attrs[str(tr.COLL_P2P)] = True
                span = [str(tr.COLLECTIVE_SPAN), step, t0, t1, attrs, err]
                if not p2p and s is not None:
                    py_by_pg.setdefault(name, []).append([t0, t1, span])
                    win = self._py_windows.get(name)
                    if win is None:
                        win = self._py_windows[name] = collections.deque(maxlen=4096)
                    win.append((t0, t1))
                if is_async and err is None and s is not None:
                    self._pending_async[(id(g), s)] = [span, drain_ns]
                else:
                    spans.append(span)
                self.counters["collectives"] += 1
            elif kind == WAIT:
                _, op, g, s, t0, t1, issue_t0, step, err = rec
                name, _size = self._pg(g)
                pending = self._pending_async.pop((id(g), s), None)
                seq = -s if s < 0 else s + self.cpp_count.get(name, 0)
                if pending is not None:
                    pending[0][3] = t1
                    seq = pending[0][4][str(tr.COLL_SEQ)]
                    spans.append(pending[0])
                spans.append([str(tr.WAIT_SPAN), step, t0, t1,
                              {str(tr.COLL_OP): op, str(tr.COLL_PG): name, str(tr.COLL_SEQ): seq,
                               str(tr.STEP): step}, err])
            elif kind == STEP:
                _, n, t0, t1, err = rec
                self._step_ends.append((n, t1))
                spans.append([str(tr.STEP_SPAN), n, t0, t1, {str(tr.STEP): n}, err])
                self.counters["steps"] += 1
            elif kind == DATA:
                _, t0, t1, step, err = rec
                spans.append([str(tr.DATA_SPAN), step, t0, t1, {str(tr.STEP): step}, err])
            elif kind == CKPT:
                _, what, t0, t1, path, step, err = rec
                nbytes = None
                if isinstance(path, str) and os.path.isfile(path):
                    try:
                        nbytes = os.path.getsize(path)
                    except OSError:
                        pass
                spans.append([str(tr.CKPT_SAVE_SPAN if what == "save" else tr.CKPT_LOAD_SPAN), step, t0, t1,
                              {str(tr.STEP): step, str(tr.CHECKPOINT_PATH): path,
                               str(tr.CHECKPOINT_BYTES): nbytes}, err])
        # Flight recorder: entries that a Python call made get torch's seq onto the Python span; the others were
        # issued in C++ (DDP reducer, FSDP, functional collectives) and become spans of their own.
        cur = NS["_cur"]
        cur_pg = self._pg(cur[1])[0] if cur is not None and cur[1] is not None else None
        for e in fr_entries:
            if e.get("is_p2p"):
                continue
            pg = str((e.get("process_group") or [e.get("pg_id", "")])[0])
            created = int(e.get("time_created_ns") or 0)
            seq = int(e.get("collective_seq_id") or 0)
            match = None
            for item in py_by_pg.get(pg, ()):
                if item[0] <= created <= item[1] + 1000:
                    match = item
                    break
            if match is not None:
                py_by_pg[pg].remove(match)
                match[2][4][str(tr.COLL_SEQ)] = seq
                continue
            if created >= drain_ns or (cur_pg == pg and cur[3] <= created):
                if not final:
                    self.fr_hold.append(e)  # its Python call is still running: decide next cycle
                    continue
            if not self._is_own_pending(pg, created):
                self.cpp_count[pg] = self.cpp_count.get(pg, 0) + 1
                spans.append(self._fr_span(e, pg, seq, created))
                self.counters["fr_collectives"] += 1
        # async ops never awaited through Work.wait (futures): export at issue after a while
        for key, (span, since) in list(self._pending_async.items()):
            if final or drain_ns - since > _ASYNC_HOLD_NS:
                spans.append(span)
                del self._pending_async[key]
        spans = self._hold_steps(spans, final)
        if spans:
            self._add_step_breakdown(spans)
            if not final and self.client.is_down():
                self.counters["spans_dropped"] += len(spans)  # do not spend the GIL encoding what would be dropped
            else:
                self._send_spans(spans)
        self._send_queued_logs()

    def _observe_collective(self, op: str, seconds: float) -> None:
        entry = self._coll_hist.get(op)
        if entry is None:
            if len(self._coll_hist) >= 64:
                return
            entry = self._coll_hist[op] = [[0] * (len(_COLL_BOUNDS) + 1), 0.0, 0]
        entry[0][bisect.bisect_left(_COLL_BOUNDS, seconds)] += 1
        entry[1] += seconds
        entry[2] += 1

    def _hold_steps(self, spans: list, final: bool) -> list:
        """Keeps back step spans that end after the last flight-recorder read while this process has C++-issued
        collectives (DDP, FSDP), for at most 3 s: their collectives are read in a later cycle, and the step's
        breakdown needs them."""
        step_name = str(tr.STEP_SPAN)
        candidates = self._held_steps + [sp for sp in spans if sp[0] == step_name]
        if not candidates:
            return spans
        rest = [sp for sp in spans if sp[0] != step_name]
        self._held_steps = []
        if final or not self.counters["fr_collectives"]:
            return rest + candidates
        now_ns = time.time_ns()
        for sp in candidates:
            if sp[3] > self._fr_last_poll_wall_ns and now_ns - sp[3] < 3_000_000_000:
                self._held_steps.append(sp)
            else:
                rest.append(sp)
        return rest

    def _metrics_request(self):
        """Step duration (gauge), collective durations by op (cumulative histogram of the collectives whose end is
        known) and records dropped by the ring buffer: what the training dashboard plots, once per heartbeat."""
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.metrics.v1 import metrics_pb2

        now = time.time_ns()
        req = ExportMetricsServiceRequest()
        rm = req.resource_metrics.add()
        rm.resource.CopyFrom(self.resource())
        sm = rm.scope_metrics.add()
        sm.scope.name = "otel_gpu.instrumentation"
        if self._step_durs:
            m = sm.metrics.add(name=str(tr.STEP_DURATION), unit=tr.STEP_DURATION.unit,
                               description=tr.STEP_DURATION.description)
            m.gauge.data_points.add(time_unix_nano=now, as_double=float(self._step_durs[-1]))
        m = sm.metrics.add(name=str(tr.INSTR_DROPPED), unit=tr.INSTR_DROPPED.unit,
                           description=tr.INSTR_DROPPED.description)
        m.sum.is_monotonic = True
        m.sum.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
        m.sum.data_points.add(start_time_unix_nano=self._started_ns, time_unix_nano=now,
                              as_int=int(NS["_drops"]) + int(self.counters["spans_dropped"]))
        if self._coll_hist:
            m = sm.metrics.add(name=str(tr.COLLECTIVE_DURATION), unit=tr.COLLECTIVE_DURATION.unit,
                               description=tr.COLLECTIVE_DURATION.description)
            m.histogram.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
            for op, (counts, total, n) in self._coll_hist.items():
                p = m.histogram.data_points.add(start_time_unix_nano=self._started_ns, time_unix_nano=now, count=n,
                                                sum=total, explicit_bounds=_COLL_BOUNDS, bucket_counts=counts)
                kv = p.attributes.add(key=str(tr.COLL_OP))
                kv.value.string_value = op
        return req

    def _add_step_breakdown(self, spans: list) -> None:
        """Sets training.step.collective_time / data_time / checkpoint_time on the step spans of this cycle.

        Collective time is the union of the step's collective intervals. For collectives whose end the backend does
        not record (gloo's flight recorder: DDP's bucket all-reduces), the rank waits from the creation of the last
        of them in the step to the step's end: its backward finished computing when it handed over the last bucket,
        and the optimizer runs only once every bucket is reduced. A straggler hands its last bucket over late and so
        shows little collective time and much compute; its peers show the reverse.
        """
        coll, data, ckpt = str(tr.COLLECTIVE_SPAN), str(tr.DATA_SPAN), str(tr.CKPT_SAVE_SPAN)
        steps = []
        for span in spans:
            name = span[0]
            if name == coll:
                known = bool(span[4].get(str(tr.COLL_DURATION_KNOWN), True))
                self._recent_iv.append(("c", span[2], span[3], known))
                if known and span[3] >= span[2]:
                    self._observe_collective(str(span[4].get(str(tr.COLL_OP))), (span[3] - span[2]) / 1e9)
            elif name == data:
                self._recent_iv.append(("d", span[2], span[3], True))
            elif name == ckpt:
                self._recent_iv.append(("k", span[2], span[3], True))
            elif name == str(tr.STEP_SPAN):
                steps.append(span)
        for span in steps:
            t0, t1 = span[2], span[3]
            intervals, data_ns, ckpt_ns, last_unknown = [], 0, 0, None
            for kind, a, b, known in self._recent_iv:
                if not known:
                    if t0 <= a <= t1 and (last_unknown is None or a > last_unknown):
                        last_unknown = a
                    continue
                if b < t0 or a > t1:
                    continue
                lo, hi = max(a, t0), min(b, t1)
                if hi <= lo:
                    continue
                if kind == "c":
                    intervals.append((lo, hi))
                elif kind == "d":
                    data_ns += hi - lo
                else:
                    ckpt_ns += hi - lo
            if last_unknown is not None:
                intervals.append((last_unknown, t1))  # from the last bucket handed to the backend: waiting
            busy, end = 0, t0
            for lo, hi in sorted(intervals):
                if hi > end:
                    busy += hi - max(lo, end)
                    end = hi
            attrs = span[4]
            attrs[str(tr.STEP_COLLECTIVE_S)] = round(busy / 1e9, 6)
            attrs[str(tr.STEP_DATA_S)] = round(data_ns / 1e9, 6)
            attrs[str(tr.STEP_CHECKPOINT_S)] = round(ckpt_ns / 1e9, 6)
        horizon = max((sp[3] for sp in steps), default=0) - 60_000_000_000
        while self._recent_iv and self._recent_iv[0][2] < horizon:
            self._recent_iv.popleft()

    def _is_own_pending(self, pg: str, created: int) -> bool:
        """A Python op exported in an earlier cycle, or an async one awaiting its Work.wait, is also in the
        recorder: not a C++ op."""
        for t0, t1 in reversed(self._py_windows.get(pg, ())):
            if t0 <= created <= t1 + 1000:
                return True
            if t1 < created:
                break
        for span, _ in self._pending_async.values():
            a = span[4]
            if a[str(tr.COLL_PG)] == pg and span[2] <= created <= span[3] + 1000:
                return True
        return False

    def _fr_span(self, e: dict, pg: str, seq: int, created: int) -> list:
        nbytes, dtype = _flight.entry_bytes_dtype(e)
        end = int(e.get("time_discovered_completed_ns") or 0)
        if not end and e.get("duration_ms"):
            end = created + int(float(e["duration_ms"]) * 1e6)
        step = self._step_at(created)
        size = -1
        for info in self._pg_info.values():
            if info[1] == pg:
                size = info[2]
        attrs = {str(tr.COLL_OP): _flight.entry_op(e), str(tr.COLL_PG): pg, str(tr.COLL_PG_SIZE): size,
                 str(tr.COLL_SEQ): seq, str(tr.COLL_BYTES): nbytes, str(tr.COLL_DTYPE): dtype,
                 str(tr.COLL_SOURCE): "flight_recorder", str(tr.STEP): step,
                 str(tr.COLL_DURATION_KNOWN): bool(end)}
        return [str(tr.COLLECTIVE_SPAN), step, created, end or created, attrs, None]

    def _send_spans(self, spans: list) -> None:
        resource = self.resource()
        if self._resource_bytes[0] is not resource:
            self._resource_bytes = (resource, resource.SerializeToString())
        step_name = str(tr.STEP_SPAN)
        for i in range(0, len(spans), _MAX_SPANS_PER_REQUEST):
            encoded = []
            for name, step, t0, t1, attrs, err in spans[i:i + _MAX_SPANS_PER_REQUEST]:
                trace_id, step_span_id = self._trace_ids(step if step is not None else 0)
                if name == step_name:
                    encoded.append(_pbenc.span(name, trace_id, step_span_id, None, t0, t1, attrs, err))
                else:
                    encoded.append(_pbenc.span(name, trace_id, _rand_id(8), step_span_id, t0, t1, attrs, err))
            n = len(encoded)
            req = _pbenc.trace_request(self._resource_bytes[1], _SCOPE_BYTES, encoded)
            if self.client.send_traces(req):
                self.counters["spans_sent"] += n
            else:
                self.counters["spans_dropped"] += n

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

    # ---------------------------------------------------------------- watchdog
    def _watchdog_loop(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            try:
                self.heartbeat()
            except Exception:  # noqa: BLE001
                _logger.warning("otel-gpu heartbeat failed", exc_info=True)

    def stack_threshold_s(self) -> float:
        base = self.cfg.stack_after_s
        if self._step_durs:
            return max(base, min(3 * max(self._step_durs), 6 * base))
        return base

    def progress(self) -> tuple[dict, dict]:
        """(attributes, body) of one heartbeat."""
        now = time.time_ns()
        cur = NS["_cur"]
        marker = (NS["_w"], cur[3] if cur else None)  # Python-visible progress: records written, op changed
        if marker != self._last_progress_marker:
            self._last_progress_marker = marker
            # when the progress happened (not when we noticed): the newest record's end, or the in-flight start
            last = NS["_buf"][(NS["_w"] - 1) & NS["_M"]]
            t = _record_end_ns(last) if last is not None else self._last_record_end_ns
            if cur is not None:
                t = max(t or 0, cur[3])
            self._last_progress_ns = t or now
        if self._in_pg_init:
            self._last_progress_ns = now
        stalled_s = (now - self._last_progress_ns) / 1e9
        if stalled_s >= self.cfg.heartbeat_s and self.fr_enabled:
            self.poll_flight_recorder(stalled=True)  # a C++ collective may be what we are stuck in
        last_started: dict[str, int] = dict(self.fr.last_started)
        for g, s in list(NS["_seq"].items()):
            name, _ = self._pg(g)
            last_started[name] = max(last_started.get(name, 0), s + self.cpp_count.get(name, 0))
        inflight = None
        if cur is not None:
            op, g, s, t0, kind = cur
            inflight = {"kind": kind, "op": op, "since": t0 / 1e9}
            if g is not None:
                name, _ = self._pg(g)
                seq = -s if s < 0 else s + self.cpp_count.get(name, 0)
                latest = self.fr.latest.get(name)
                if s > 0 and latest is not None and int(latest.get("time_created_ns") or 0) >= t0:
                    seq = int(latest["collective_seq_id"])
                inflight.update(pg=name, seq=seq, p2p=s < 0)
                if s > 0:
                    last_started[name] = max(last_started.get(name, 0), seq)
        elif stalled_s >= self.cfg.heartbeat_s:
            # Not in a Python call: blocked in a collective that C++ issued (DDP's backward, FSDP)?
            newest = None
            for name, e in self.fr.latest.items():
                created = int(e.get("time_created_ns") or 0)
                done = self.fr.last_completed.get(name, 0) >= int(e.get("collective_seq_id") or 0)
                # issued after the last Python-visible progress (step end, data, collective) and not completed
                if not done and created >= self._last_progress_ns and (newest is None or created > newest[1]):
                    newest = (name, created, e)
            if newest is not None:
                name, created, e = newest
                inflight = {"kind": "flight_recorder", "op": _flight.entry_op(e), "pg": name,
                            "seq": int(e["collective_seq_id"]), "since": created / 1e9}
        if inflight is None and not self._steps_done and not NS["_w"]:
            # Starting up (imports, rendezvous, building the model and DDP) with nothing in flight and nothing
            # recorded yet: initialization, not a hang. On a busy node this took 7 s between init_process_group and
            # the first collective and read as a job-wide hang (the multi-node bed, tests/test_multihost.py). Once
            # a collective ran, a rank that stops in user code before its first step is stalled (its peers wait).
            stalled_s = 0.0
        last_seq = dict(last_started)
        if inflight is not None and inflight.get("pg") and not inflight.get("p2p"):
            last_seq[inflight["pg"]] = inflight["seq"] - 1
        for name, s in self.fr.last_completed.items():
            last_seq[name] = max(s, last_seq.get(name, 0)) if name != (inflight or {}).get("pg") else last_seq[name]
        state = "idle"
        if inflight is not None:
            state = {"collective": "collective", "wait": "collective", "flight_recorder": "collective",
                     "data": "data", "checkpoint": "checkpoint"}.get(inflight["kind"], "step")
        elif self._steps_done or NS["_w"]:
            state = "step"
        counters = {"steps": self._steps_done, "collectives": self.counters["collectives"],
                    "fr_collectives": self.counters["fr_collectives"], "dropped": NS["_drops"],
                    "fr_lost": self.fr.entries_lost, "spans_sent": self.counters["spans_sent"],
                    "spans_dropped": self.counters["spans_dropped"], "export_failures": self.client.failed,
                    "logs_dropped": self.counters["logs_dropped"], "export_buffered": self.client.buffer_requests,
                    "export_buffer_dropped": self.client.buffer_dropped}
        body = {"step": NS["_step"], "state": state, "inflight": inflight, "last_seq": last_seq,
                "last_started_seq": last_started, "counters": counters, "stalled_s": round(stalled_s, 3),
                "flight_recorder": bool(self.fr_enabled and self.fr.available is not False)}
        attrs = {str(tr.STEP): NS["_step"], str(tr.STATE): state}
        if inflight is not None:
            attrs.update({str(tr.COLL_OP): inflight.get("op"), str(tr.COLL_PG): inflight.get("pg"),
                          str(tr.COLL_SEQ): inflight.get("seq"), str(tr.INFLIGHT_SINCE): inflight["since"],
                          str(tr.INFLIGHT_FOR): round(now / 1e9 - inflight["since"], 3)})
        return attrs, body

    def is_training_process(self) -> bool:
        """Heartbeats come from ranks (or single-process training that steps), not from helper processes such as
        mp.spawn's parent or a torchrun-launched tool."""
        return self.identity.rank is not None or self._steps_done > 0

    def _may_send_metrics(self) -> bool:
        """Not before the job id is agreed (when the process group is created): a record now would start a stray
        job."""
        return not (self.identity_generated and (self.identity.world_size or 0) > 1
                    and time.monotonic() - self._started_mono < 120.0)

    def heartbeat(self) -> None:
        if not self.is_training_process() or not self._may_send_metrics():
            return
        attrs, body = self.progress()
        self.log(tr.PROGRESS_EVENT, attrs, body, now=True)
        try:
            self.client.send_metrics(self._metrics_request())
        except Exception:  # noqa: BLE001 - metrics are a convenience; heartbeats matter more
            _logger.debug("otel-gpu: metrics export failed", exc_info=True)
        stalled_s = body["stalled_s"]
        if stalled_s >= self.stack_threshold_s() and self._stacks_sent_for != self._last_progress_marker:
            self._stacks_sent_for = self._last_progress_marker
            self.send_stacks(body, stalled_s)

    def stacks(self) -> tuple[list[dict], str | None, str | None]:
        names = {t.ident: t.name for t in threading.enumerate()}
        main_id = threading.main_thread().ident
        me = threading.get_ident()
        threads, top, user_top = [], None, None
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            frames = _frames(frame)
            threads.append({"name": names.get(tid, str(tid)), "id": tid, "main": tid == main_id,
                            "frames": frames})
            if tid == main_id and frames:
                f = frames[-1]
                top = f"{f['file']}:{f['line']} {f['function']}"
                for f in reversed(frames):
                    if not _is_internal(f["file"]):
                        user_top = f"{f['file']}:{f['line']} {f['function']}"
                        break
        threads.sort(key=lambda t: not t["main"])
        return threads, top, user_top

    def send_stacks(self, progress_body: dict, stalled_s: float) -> None:
        threads, top, user_top = self.stacks()
        inflight = progress_body.get("inflight") or {}
        attrs = {str(tr.STEP): progress_body["step"], str(tr.COLL_OP): inflight.get("op"),
                 str(tr.COLL_SEQ): inflight.get("seq"), str(tr.INFLIGHT_FOR): round(stalled_s, 3)}
        body = {"threads": threads, "top": top, "user_top": user_top, "inflight": progress_body.get("inflight"),
                "state": progress_body.get("state"), "stalled_s": round(stalled_s, 3)}
        self.log(tr.STACKS_EVENT, attrs, body, severity=_export.WARN, now=True)
        self.counters["stacks_sent"] += 1

    # ---------------------------------------------------------------- crash hooks
    def _install_hooks(self) -> None:
        self._saved_hooks["excepthook"] = sys.excepthook
        self._saved_hooks["threading_excepthook"] = threading.excepthook
        sys.excepthook = self._excepthook
        threading.excepthook = self._threading_excepthook
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self._saved_hooks[sig] = signal.getsignal(sig)
                    signal.signal(sig, self._on_signal)
                except (ValueError, OSError):
                    pass
        atexit.register(self._atexit)
        global _FORK_HOOKED
        if not _FORK_HOOKED:
            _FORK_HOOKED = True
            os.register_at_fork(after_in_child=_after_fork_in_child)

    def _uninstall_hooks(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._saved_hooks.get("excepthook", sys.__excepthook__)
        if threading.excepthook == self._threading_excepthook:
            threading.excepthook = self._saved_hooks.get("threading_excepthook", threading.__excepthook__)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if sig in self._saved_hooks and signal.getsignal(sig) == self._on_signal:
                    try:
                        signal.signal(sig, self._saved_hooks[sig])
                    except (ValueError, OSError, TypeError):
                        pass
        atexit.unregister(self._atexit)

    def report_exception(self, exc_type, exc, tb, thread_name: str) -> None:
        try:
            hint = classify(exc)
            stack = "".join(traceback.format_exception(exc_type, exc, tb))[-16000:]
            failed = None
            if self.failed_collective is not None:
                op, g, s, msg = self.failed_collective
                name, _ = self._pg(g) if g is not None else ("?", -1)
                failed = {"op": op, "pg": name, "seq": -s if s < 0 else s + self.cpp_count.get(name, 0),
                          "error": msg}
            qual = f"{exc_type.__module__}.{exc_type.__qualname__}" if exc_type.__module__ != "builtins" \
                else exc_type.__qualname__
            attrs = {str(tr.EXC_TYPE): qual, str(tr.EXC_MESSAGE): str(exc)[:4000], str(tr.EXC_STACK): stack,
                     str(tr.EXC_HINT): hint, str(tr.THREAD_NAME): thread_name, str(tr.STEP): NS["_step"]}
            body = {"type": qual, "message": str(exc)[:4000], "hint": hint, "thread": thread_name,
                    "step": NS["_step"], "failed_collective": failed,
                    "frames": [{"file": f.filename, "line": f.lineno, "function": f.name}
                               for f in traceback.extract_tb(tb) if not _is_internal(f.filename)
                               or "/torch/" in f.filename][-32:]}
            self._registry_event({"kind": "exception", "type": qual, "hint": hint, "thread": thread_name})
            if thread_name == threading.main_thread().name:
                self._exit_info = {"how": "exception", "code": 1, "hint": hint, "type": qual}
            self.log(tr.EXCEPTION_EVENT, attrs, body, severity=_export.FATAL, now=True)
            self.flush()
        except Exception:  # noqa: BLE001
            _logger.debug("otel-gpu could not report an exception", exc_info=True)

    _otel_gpu = True

    def _excepthook(self, exc_type, exc, tb) -> None:
        if not self._shut and not issubclass(exc_type, SystemExit):
            self.report_exception(exc_type, exc, tb, threading.current_thread().name)
        prev = self._saved_hooks.get("excepthook") or sys.__excepthook__
        prev(exc_type, exc, tb)

    def _threading_excepthook(self, args) -> None:
        if not self._shut and args.exc_type is not None and not issubclass(args.exc_type, SystemExit):
            name = args.thread.name if args.thread is not None else "?"
            self.report_exception(args.exc_type, args.exc_value, args.exc_traceback, name)
        prev = self._saved_hooks.get("threading_excepthook") or threading.__excepthook__
        prev(args)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        try:
            self._exit_info = {"how": "signal", "signal": name, "code": -signum}
            self._registry_event({"kind": "signal", "signal": name})
            self.log(tr.SIGNAL_EVENT, {str(tr.EXIT_SIGNAL): name, str(tr.STEP): NS["_step"]},
                     {"signal": name, "step": NS["_step"]}, severity=_export.WARN, now=True)
            if self._flushing == threading.get_ident():
                # the signal interrupted a flush of this thread (e.g. after an exception): let it finish first
                self._deferred_signal = (signum, frame)
                return
            self.flush()
        except Exception:  # noqa: BLE001
            pass
        self._chain_signal(signum, frame)

    def _chain_signal(self, signum, frame) -> None:
        prev = self._saved_hooks.get(signum)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:  # SIG_DFL (or unknown): die of the same signal, as the program would have
            self.shutdown(timeout_s=1.0)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _atexit(self) -> None:
        if os.getpid() != self._pid:
            return
        info = self._exit_info or {"how": "atexit"}
        self._registry_event({"kind": "atexit", **info})
        if not self.is_training_process():
            self.shutdown()
            return
        attrs = {str(ids.JOB_ID): self.job_id, str(ids.RANK): self.identity.rank}
        if "code" in info:
            attrs[str(tr.EXIT_CODE)] = info["code"]
        if "signal" in info:
            attrs[str(tr.EXIT_SIGNAL)] = info["signal"]
        self.log(tr.EXIT_EVENT, attrs, {"source": "self", "step": NS["_step"], **info})
        try:
            _, body = self.progress()
            body["state"] = "exited"
            self.log(tr.PROGRESS_EVENT, {str(tr.STEP): NS["_step"], str(tr.STATE): "idle"}, body)
        except Exception:  # noqa: BLE001
            pass
        self.shutdown()


def _after_fork_in_child() -> None:
    """DataLoader workers and other forks: no threads came along, so do not record into a ring nobody drains."""
    global _RUNTIME
    NS["_on"] = False
    _RUNTIME = None
