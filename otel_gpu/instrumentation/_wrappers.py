"""The wrappers: what replaces torch.distributed's functions, ``Work.wait``, the data loader's ``__next__``,
``torch.save``/``load`` and DCP's save/load, and the table of targets that drives both wrap and unwrap.

The collectives' wrappers are generated from each function's own signature (``_hot.make_collective``); the others
here are plain closures. Each checks that instrumentation is on first and records into ``_hot``'s ring. The ones
that talk to the runtime (process-group start-up, mp.spawn's rank entry) find it through ``_runtime.current()``.

Example:
    >>> sorted(COLLECTIVES)[:3]
    ['all_gather', 'all_gather_into_tensor', 'all_reduce']
    >>> _path_of("ckpt.pt"), _path_of(3)
    ('ckpt.pt', None)
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
from collections.abc import Iterator

from otel_gpu.instrumentation import _hot
from otel_gpu.instrumentation._hot import CKPT, DATA, NS

_logger = logging.getLogger(__name__)

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
            except Exception:
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
                    rt.spans.cpp_count.clear()
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
            with checkpoint_span(what, _path_of(raw)):
                return orig(*args, **kwargs)

        return wrapper

    return factory


@contextlib.contextmanager
def checkpoint_span(what: str, path: str | None) -> Iterator[None]:
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


class AfterImport(importlib.abc.MetaPathFinder):
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
            except Exception:
                _logger.debug("otel-gpu: post-import hook for %s failed", name, exc_info=True)

        loader.exec_module = exec_module
        return spec


def targets() -> list[tuple[object, str, object]]:
    """(owner, attribute, wrapper factory) for everything patched: the one table for wrap and unwrap."""
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
            out.extend(dcp_targets(dcp))
    try:
        import torch.multiprocessing.spawn  # the package's spawn() function shadows the module

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


def dcp_targets(dcp) -> list[tuple[object, str, object]]:
    """torch.distributed.checkpoint's save and load (patched once it is imported: importing it costs ~1 s)."""
    return [(dcp, "save", _wrap_checkpoint("save", None, "checkpoint_id")),
            (dcp, "load", _wrap_checkpoint("load", None, "checkpoint_id"))]
