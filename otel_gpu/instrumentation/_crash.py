"""Crash hooks: ``sys.excepthook``, ``threading.excepthook``, SIGTERM/SIGINT (chained; SIG_DFL re-raised after a
bounded flush) and atexit. Each reports what ended the process (``otel_gpu.exception``, ``otel_gpu.signal``,
``otel_gpu.process.exit``) and flushes before the previous hook runs.

Example:
    >>> classify(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"))
    'peer_failure'
    >>> classify(ValueError("bad batch"))
    'user_code'
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import traceback

from otel_gpu.instrumentation import _export
from otel_gpu.instrumentation._hot import NS
from otel_gpu.instrumentation._watchdog import is_internal
from otel_gpu.schema import identity as ids
from otel_gpu.schema import training as tr

_logger = logging.getLogger(__name__)


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


class CrashHooks:
    """The hooks of one runtime (``rt``: its logs, flush, shutdown, registry and progress). ``exit_info`` is what
    the atexit record says ended the process."""

    _otel_gpu = True

    def __init__(self, rt):
        self.rt = rt
        self.exit_info: dict | None = None
        self.deferred_signal: tuple | None = None  # a signal that arrived while this thread flushed
        self._saved: dict = {}
        self._pid = os.getpid()

    def install(self) -> None:
        self._saved["excepthook"] = sys.excepthook
        self._saved["threading_excepthook"] = threading.excepthook
        sys.excepthook = self._excepthook
        threading.excepthook = self._threading_excepthook
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self._saved[sig] = signal.getsignal(sig)
                    signal.signal(sig, self._on_signal)
                except (ValueError, OSError):
                    pass
        atexit.register(self._atexit)

    def uninstall(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._saved.get("excepthook", sys.__excepthook__)
        if threading.excepthook == self._threading_excepthook:
            threading.excepthook = self._saved.get("threading_excepthook", threading.__excepthook__)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if sig in self._saved and signal.getsignal(sig) == self._on_signal:
                    try:
                        signal.signal(sig, self._saved[sig])
                    except (ValueError, OSError, TypeError):
                        pass
        atexit.unregister(self._atexit)

    def failed_collective(self) -> dict | None:
        """The collective that failed last (``_hot``'s slot), with torch's seq, or None."""
        slot = NS.get("_failed")
        if slot is None:
            return None
        op, g, s, msg = slot
        spans = self.rt.spans
        name, _ = spans.pg(g) if g is not None else ("?", -1)
        return {"op": op, "pg": name, "seq": -s if s < 0 else s + spans.cpp_count.get(name, 0), "error": msg}

    def report_exception(self, exc_type, exc, tb, thread_name: str) -> None:
        rt = self.rt
        try:
            hint = classify(exc)
            stack = "".join(traceback.format_exception(exc_type, exc, tb))[-16000:]
            failed = self.failed_collective()
            qual = f"{exc_type.__module__}.{exc_type.__qualname__}" if exc_type.__module__ != "builtins" \
                else exc_type.__qualname__
            attrs = {str(tr.EXC_TYPE): qual, str(tr.EXC_MESSAGE): str(exc)[:4000], str(tr.EXC_STACK): stack,
                     str(tr.EXC_HINT): hint, str(tr.THREAD_NAME): thread_name, str(tr.STEP): NS["_step"]}
            body = {"type": qual, "message": str(exc)[:4000], "hint": hint, "thread": thread_name,
                    "step": NS["_step"], "failed_collective": failed,
                    "frames": [{"file": f.filename, "line": f.lineno, "function": f.name}
                               for f in traceback.extract_tb(tb) if not is_internal(f.filename)
                               or "/torch/" in f.filename][-32:]}
            rt.registry_event({"kind": "exception", "type": qual, "hint": hint, "thread": thread_name})
            if thread_name == threading.main_thread().name:
                self.exit_info = {"how": "exception", "code": 1, "hint": hint, "type": qual}
            rt.log(tr.EXCEPTION_EVENT, attrs, body, severity=_export.FATAL, now=True)
            rt.flush()
        except Exception:
            _logger.debug("otel-gpu could not report an exception", exc_info=True)

    def _excepthook(self, exc_type, exc, tb) -> None:
        if not self.rt.is_shut() and not issubclass(exc_type, SystemExit):
            self.report_exception(exc_type, exc, tb, threading.current_thread().name)
        prev = self._saved.get("excepthook") or sys.__excepthook__
        prev(exc_type, exc, tb)

    def _threading_excepthook(self, args) -> None:
        if not self.rt.is_shut() and args.exc_type is not None and not issubclass(args.exc_type, SystemExit):
            name = args.thread.name if args.thread is not None else "?"
            self.report_exception(args.exc_type, args.exc_value, args.exc_traceback, name)
        prev = self._saved.get("threading_excepthook") or threading.__excepthook__
        prev(args)

    def _on_signal(self, signum, frame) -> None:
        rt = self.rt
        name = signal.Signals(signum).name
        try:
            self.exit_info = {"how": "signal", "signal": name, "code": -signum}
            rt.registry_event({"kind": "signal", "signal": name})
            rt.log(tr.SIGNAL_EVENT, {str(tr.EXIT_SIGNAL): name, str(tr.STEP): NS["_step"]},
                   {"signal": name, "step": NS["_step"]}, severity=_export.WARN, now=True)
            if rt.flushing_here():
                # the signal interrupted a flush of this thread (e.g. after an exception): let it finish first
                self.deferred_signal = (signum, frame)
                return
            rt.flush()
        except Exception:  # noqa: BLE001
            pass
        self.chain_signal(signum, frame)

    def after_flush(self) -> None:
        """A signal that arrived during a flush: act on it now that the data is out."""
        deferred, self.deferred_signal = self.deferred_signal, None
        if deferred is not None:
            self.chain_signal(*deferred)

    def chain_signal(self, signum, frame) -> None:
        prev = self._saved.get(signum)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:  # SIG_DFL (or unknown): die of the same signal, as the program would have
            self.rt.shutdown(timeout_s=1.0)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _atexit(self) -> None:
        rt = self.rt
        if os.getpid() != self._pid:
            return
        info = self.exit_info or {"how": "atexit"}
        rt.registry_event({"kind": "atexit", **info})
        if not rt.is_training_process():
            rt.shutdown()
            return
        attrs = {str(ids.JOB_ID): rt.job_id, str(ids.RANK): rt.identity.rank}
        if "code" in info:
            attrs[str(tr.EXIT_CODE)] = info["code"]
        if "signal" in info:
            attrs[str(tr.EXIT_SIGNAL)] = info["signal"]
        rt.log(tr.EXIT_EVENT, attrs, {"source": "self", "step": NS["_step"], **info})
        try:
            _, body = rt.progress()
            body["state"] = "exited"
            rt.log(tr.PROGRESS_EVENT, {str(tr.STEP): NS["_step"], str(tr.STATE): "idle"}, body)
        except Exception:  # noqa: BLE001
            pass
        rt.shutdown()
