"""Auto-instrumentation of PyTorch training: steps, every collective (DDP/FSDP included through torch's flight
recorder), data-loader waits, checkpoints, an in-flight watchdog and crash hooks, exported over OTLP.

Example::

    import otel_gpu
    otel_gpu.instrument(heartbeat_s=2.0)
    for n, batch in enumerate(loader):
        loss = model(batch).sum(); loss.backward(); opt.step()   # steps come from the optimizer hook
    with otel_gpu.checkpoint("ckpt.pt"):
        torch.save(model.state_dict(), "ckpt.pt")

The same from outside the program: ``opentelemetry-instrument python train.py`` (entry point
``opentelemetry_instrumentor: otel_gpu``), ``otel-gpu run -- torchrun ... train.py`` or ``import otel_gpu.auto``.
See README.md in this folder for the settings and what is seen on which torch version.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import fields

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_gpu.instrumentation import _hot
from otel_gpu.instrumentation._hot import CKPT, DATA, NS
from otel_gpu.instrumentation.config import InstrumentationConfig, signal_routes, unsupported_settings

_logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _log_once(key: str, level: int, msg: str, *args) -> None:
    """Once per process: a re-instrument (or a second rank thread) does not repeat what the first one said."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        _logger.log(level, msg, *args)

__all__ = ["TorchDistributedInstrumentor", "InstrumentationConfig", "instrument", "uninstrument", "step",
           "checkpoint", "flush", "is_instrumented", "COLLECTIVES"]

#: torch.distributed functions wrapped, with the expressions (over each function's own parameters) that the
#: generated wrapper evaluates for payload bytes, dtype, async flag and peer. One table for wrap and unwrap.
COLLECTIVES: dict[str, dict] = {
    "all_reduce": dict(nbytes="tensor.nbytes", dtype="tensor.dtype"),
    "all_gather": dict(nbytes="tensor.nbytes", dtype="tensor.dtype"),
    "all_gather_into_tensor": dict(nbytes="input_tensor.nbytes", dtype="input_tensor.dtype"),
    "reduce_scatter": dict(nbytes="_lbytes(input_list)", dtype="output.dtype"),
    "reduce_scatter_tensor": dict(nbytes="input.nbytes", dtype="input.dtype"),
    "broadcast": dict(nbytes="tensor.nbytes", dtype="tensor.dtype", peer="src"),
    "reduce": dict(nbytes="tensor.nbytes", dtype="tensor.dtype", peer="dst"),
    "all_to_all": dict(nbytes="_lbytes(input_tensor_list)", dtype=None),
    "all_to_all_single": dict(nbytes="input.nbytes", dtype="input.dtype"),
    "barrier": dict(nbytes=None, dtype=None),
    "gather": dict(nbytes="tensor.nbytes", dtype="tensor.dtype", peer="dst"),
    "scatter": dict(nbytes="tensor.nbytes", dtype="tensor.dtype", peer="src"),
    "send": dict(nbytes="tensor.nbytes", dtype="tensor.dtype", peer="dst", async_arg=None, p2p=True),
    "recv": dict(nbytes="tensor.nbytes", dtype="tensor.dtype", peer="src", async_arg=None, p2p=True),
    "isend": dict(nbytes="tensor.nbytes", dtype="tensor.dtype", peer="dst", async_arg=None, always_async=True,
                  p2p=True),
    "irecv": dict(nbytes="tensor.nbytes", dtype="tensor.dtype", peer="src", async_arg=None, always_async=True,
                  p2p=True),
}

# Options that opentelemetry-instrument passes to every instrumentor; we export on our own path.
_OTEL_KWARGS = {"tracer_provider", "meter_provider", "logger_provider", "event_logger_provider",
                "skip_dep_check", "raise_exception_on_conflict"}


def _time_ns() -> int:
    return time.time_ns()


# ---------------------------------------------------------------------------------------------- other wrappers
def _wrap_batch_isend_irecv(orig):
    """Timing only: the isend/irecv inside are counted by their own wrappers (when P2POp was built with them)."""

    @functools.wraps(orig)
    def batch_isend_irecv(p2p_op_list):
        if not NS["_on"]:
            return orig(p2p_op_list)
        t0 = _time_ns()
        g = getattr(p2p_op_list[0], "group", None) if p2p_op_list else None
        if g is None:
            g = NS["_dpg"] or _hot._get_dpg()
        NS["_cur"] = ("batch_isend_irecv", g, None, t0, "collective")
        try:
            works = orig(p2p_op_list)
        except BaseException as exc:
            _hot._fail("batch_isend_irecv", g, None, t0, exc)
            raise
        NS["_cur"] = None
        _hot.push((0, "batch_isend_irecv", g, None, t0, _time_ns(), None, None, True, None, NS["_step"], None))
        return works

    return batch_isend_irecv


def _wrap_init_process_group(orig):
    @functools.wraps(orig)
    def init_process_group(*args, **kwargs):
        from otel_gpu.instrumentation import _runtime

        rt = _runtime.current()
        if rt is not None:
            rt.on_process_group_init()
        result = orig(*args, **kwargs)  # if it raises, the process is failing anyway: no stall to report
        rt = _runtime.current()
        if rt is not None:
            try:
                rt.on_process_group_created()
            except Exception:  # noqa: BLE001
                _logger.debug("otel-gpu: identity refresh failed", exc_info=True)
        return result

    return init_process_group


def _wrap_destroy_process_group(orig):
    @functools.wraps(orig)
    def destroy_process_group(group=None):
        try:
            if group is None:
                for key in ("_seq", "_p2p"):
                    NS[key].clear()
                NS["_pend"].clear()
                from otel_gpu.instrumentation import _runtime

                rt = _runtime.current()
                if rt is not None:
                    rt.flush(1.0)
                    rt.cpp_count.clear()
            else:
                for key in ("_seq", "_p2p"):
                    NS[key].pop(group, None)
        except Exception:  # noqa: BLE001
            pass
        NS["_dpg"] = None
        return orig(group)

    return destroy_process_group


def _wrap_dataloader_next(orig):
    @functools.wraps(orig)
    def __next__(self):
        if not NS["_on"]:
            return orig(self)
        t0 = _time_ns()
        NS["_cur"] = (None, None, 0, t0, "data")
        try:
            item = orig(self)
        except StopIteration:
            NS["_cur"] = None
            raise
        except BaseException as exc:
            NS["_cur"] = None
            _hot.push((DATA, t0, _time_ns(), NS["_step"], _hot._error_text(exc)))
            raise
        NS["_cur"] = None
        _hot.push((DATA, t0, _time_ns(), NS["_step"], None))
        return item

    return __next__


def _wrap_mp_spawn_entry(orig):
    """torch.multiprocessing.spawn catches a rank's exception (sys.excepthook never sees it): report it first."""

    @functools.wraps(orig)
    def _wrap(fn, i, args, *rest, **kwargs):
        def reporting(*a, **k):
            try:
                return fn(*a, **k)
            except KeyboardInterrupt:
                raise
            except Exception:
                from otel_gpu.instrumentation import _runtime

                rt = _runtime.current()
                if rt is not None:
                    et, ev, tb = sys.exc_info()
                    rt.report_exception(et, ev, tb, threading.current_thread().name)
                raise

        return orig(reporting, i, args, *rest, **kwargs)

    return _wrap


_ckpt_depth = threading.local()


def _path_of(value) -> str | None:
    if isinstance(value, str):
        return value
    fspath = getattr(value, "__fspath__", None)
    if fspath is not None:
        try:
            return str(fspath())
        except Exception:  # noqa: BLE001
            return None
    return None


def _wrap_checkpoint(what: str, path_arg: int | None, path_kw: str):
    def factory(orig):
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not NS["_on"] or getattr(_ckpt_depth, "n", 0):
                return orig(*args, **kwargs)
            raw = kwargs.get(path_kw)
            if raw is None and path_arg is not None and len(args) > path_arg:
                raw = args[path_arg]
            with _checkpoint_span(what, _path_of(raw)):
                return orig(*args, **kwargs)

        return wrapper

    return factory


@contextlib.contextmanager
def _checkpoint_span(what: str, path: str | None) -> Iterator[None]:
    if not NS["_on"] or getattr(_ckpt_depth, "n", 0):
        yield
        return
    _ckpt_depth.n = 1
    t0 = _time_ns()
    prev = NS["_cur"]
    NS["_cur"] = (None, None, 0, t0, "checkpoint")
    err = None
    try:
        yield
    except BaseException as exc:
        err = _hot._error_text(exc)
        raise
    finally:
        _ckpt_depth.n = 0
        NS["_cur"] = prev
        _hot.push((CKPT, what, t0, _time_ns(), path, NS["_step"], err))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once, right after the module named ``name`` has been imported."""

    def __init__(self, name: str, callback):
        self.name = name
        self.callback = callback

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callback = spec.loader, self.callback
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            try:
                callback(module)
            except Exception:  # noqa: BLE001
                _logger.debug("otel-gpu: post-import hook for %s failed", name, exc_info=True)

        loader.exec_module = exec_module
        return spec


# ---------------------------------------------------------------------------------------------- instrumentor
class TorchDistributedInstrumentor(BaseInstrumentor):
    """Wraps torch.distributed (one table for wrap and unwrap), hooks optimizer steps, data loading and checkpoints,
    and runs the export and watchdog threads. ``instrument(**options)`` takes the fields of InstrumentationConfig."""

    _patches: list[tuple[object, str, object, object]] = []
    _runtime = None
    _step_hook = None
    _dcp_hook = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("torch >= 2.2",)

    def _targets(self):
        """(owner, attribute, wrapper factory) for everything patched."""
        import torch
        import torch.distributed as dist

        out = []
        if dist.is_available():
            from torch.distributed import distributed_c10d as c10d

            for name, spec in COLLECTIVES.items():
                if hasattr(c10d, name):
                    out.append((c10d, name, lambda orig, n=name, s=spec: _hot.make_collective(orig, n, **s)))
            out.append((c10d, "batch_isend_irecv", _wrap_batch_isend_irecv))
            out.append((c10d, "init_process_group", _wrap_init_process_group))
            out.append((c10d, "destroy_process_group", _wrap_destroy_process_group))
            out.append((c10d.Work, "wait", _hot.make_wait))
            dcp = sys.modules.get("torch.distributed.checkpoint")  # importing it costs ~1 s: only when used
            if dcp is not None:
                out.extend(self._dcp_targets(dcp))
        try:
            import torch.multiprocessing.spawn  # noqa: F401 - the package's spawn() function shadows the module

            mp_spawn = sys.modules["torch.multiprocessing.spawn"]
            if hasattr(mp_spawn, "_wrap"):
                out.append((mp_spawn, "_wrap", _wrap_mp_spawn_entry))
        except Exception:  # noqa: BLE001
            pass
        import torch.utils.data.dataloader as dl

        out.append((dl._BaseDataLoaderIter, "__next__", _wrap_dataloader_next))
        out.append((torch, "save", _wrap_checkpoint("save", 1, "f")))
        out.append((torch, "load", _wrap_checkpoint("load", 0, "f")))
        return out

    @staticmethod
    def _dcp_targets(dcp):
        return [(dcp, "save", _wrap_checkpoint("save", None, "checkpoint_id")),
                (dcp, "load", _wrap_checkpoint("load", None, "checkpoint_id"))]

    def _patch(self, targets) -> None:
        try:
            import torch.distributed as dist_pkg
        except Exception:  # noqa: BLE001
            dist_pkg = None
        for owner, name, factory in targets:
            orig = getattr(owner, name, None)
            if orig is None or getattr(orig, "_otel_gpu_wrapper", False):
                continue
            try:
                wrapper = factory(orig)
            except Exception as exc:  # noqa: BLE001 - an unexpected signature: leave that one alone
                _logger.warning("otel-gpu: not instrumenting %s.%s (%s)", getattr(owner, "__name__", owner), name,
                                exc)
                continue
            wrapper._otel_gpu_wrapper = True
            setattr(owner, name, wrapper)
            self._patches.append((owner, name, orig, wrapper))
            # torch.distributed re-exports the c10d functions: patch the alias too
            if dist_pkg is not None and owner is not dist_pkg and getattr(dist_pkg, name, None) is orig:
                setattr(dist_pkg, name, wrapper)
                self._patches.append((dist_pkg, name, orig, wrapper))
            if name in ("save", "load") and getattr(owner, "__name__", "") == "torch":
                import torch.serialization as ser

                if getattr(ser, name, None) is orig:
                    setattr(ser, name, wrapper)
                    self._patches.append((ser, name, orig, wrapper))

    def _on_dcp_import(self, module) -> None:
        if NS["_on"]:
            self._patch(self._dcp_targets(module))

    def _instrument(self, **kwargs) -> None:
        from otel_gpu.instrumentation import _runtime

        options = {k: v for k, v in kwargs.items() if k not in _OTEL_KWARGS}
        cfg = InstrumentationConfig.from_env(**options)
        if cfg.sdk_disabled:
            _log_once("disabled", logging.INFO, "otel-gpu: OTEL_SDK_DISABLED=true: instrumentation is off in this "
                      "process (nothing is wrapped or exported)")
            return
        for var, value, instead in unsupported_settings():
            _log_once(var, logging.WARNING, "otel-gpu: %s=%s has no effect on otel-gpu's export path: %s", var,
                      value, instead)
        for signal, route in signal_routes(cfg).items():
            if signal == "logs" and not route.otlp:
                _log_once("logs-off", logging.WARNING, "otel-gpu: OTEL_LOGS_EXPORTER has no otlp: heartbeats, stacks "
                          "and exceptions are not sent, so hangs and crashes cannot be attributed")
        _hot.reset(cfg.ring_size)
        rt = _runtime.Runtime(cfg)
        rt.enable_flight_recorder()  # TORCH_FR_BUFFER_SIZE, before any process group is created from now on
        type(self)._patches = []
        self._patch(self._targets())  # imports torch here, in the calling thread, before our threads start
        rt.start()
        if "torch.distributed.checkpoint" not in sys.modules:
            type(self)._dcp_hook = _AfterImport("torch.distributed.checkpoint", self._on_dcp_import)
            sys.meta_path.insert(0, type(self)._dcp_hook)
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            type(self)._step_hook = register_optimizer_step_post_hook(rt.on_optimizer_step)
        except Exception:  # noqa: BLE001
            _logger.info("otel-gpu: no global optimizer step hook in this torch; use otel_gpu.step()")
        type(self)._runtime = rt
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rt.on_process_group_created()
        except Exception:  # noqa: BLE001
            pass
        NS["_on"] = True

    def _uninstrument(self, **kwargs) -> None:
        NS["_on"] = False
        if type(self)._dcp_hook is not None:
            try:
                sys.meta_path.remove(type(self)._dcp_hook)
            except ValueError:
                pass
            type(self)._dcp_hook = None
        for owner, name, orig, wrapper in reversed(type(self)._patches):
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, orig)
            else:
                _logger.info("otel-gpu: %s was re-wrapped by someone else; leaving it (it passes through now)",
                             name)
        type(self)._patches = []
        if type(self)._step_hook is not None:
            type(self)._step_hook.remove()
            type(self)._step_hook = None
        rt, type(self)._runtime = type(self)._runtime, None
        if rt is not None:
            rt.shutdown()


def instrument(**options) -> TorchDistributedInstrumentor:
    """Instruments this process (idempotent). Options: the fields of InstrumentationConfig."""
    unknown = set(options) - {f.name for f in fields(InstrumentationConfig)}
    if unknown:
        raise ValueError(f"unknown instrumentation option(s): {', '.join(sorted(unknown))}")
    inst = TorchDistributedInstrumentor()
    if not inst.is_instrumented_by_opentelemetry:
        inst.instrument(skip_dep_check=True, **options)
    return inst


def uninstrument() -> None:
    inst = TorchDistributedInstrumentor()
    if inst.is_instrumented_by_opentelemetry:
        inst.uninstrument()


def is_instrumented() -> bool:
    return bool(NS.get("_on"))


def flush(timeout_s: float | None = None) -> bool:
    """Exports what is buffered now (bounded); False when not instrumented or it timed out."""
    from otel_gpu.instrumentation import _runtime

    rt = _runtime.current()
    return rt.flush(timeout_s) if rt is not None else False


@contextlib.contextmanager
def step(n: int | None = None) -> Iterator[int]:
    """Marks one training step. Once used, the optimizer hook stops marking steps (explicit wins)."""
    from otel_gpu.instrumentation import _runtime

    rt = _runtime.current()
    if rt is None or not NS["_on"]:
        yield n if n is not None else 0
        return
    rt.explicit_steps = True
    n = NS["_step"] if n is None else int(n)
    NS["_step"] = n
    t0 = _time_ns()
    err = None
    try:
        yield n
    except BaseException as exc:
        err = _hot._error_text(exc)
        raise
    finally:
        rt.end_step(n, t0, _time_ns(), err)


def checkpoint(path: str | None = None):
    """Marks the blocking part of a checkpoint save (``with otel_gpu.checkpoint("ckpt.pt"): ...``)."""
    return _checkpoint_span("save", path)
