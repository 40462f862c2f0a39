"""The hot path: wrappers generated from the real signatures, writing tuples into a preallocated ring buffer.

Every wrapper runs in one shared globals namespace (``NS``) so that the state it touches (the ring, the per-group
counters, the in-flight slot) is a plain global load/store: no attribute lookups, no dict allocation, one clock read
before and one after the call. The background thread reads ``NS`` to drain the ring; the watchdog reads ``NS["_cur"]``.

Record layouts (first item is the kind):
    COLL  (0, op, group, seq, t0_ns, t1_ns, nbytes, dtype, async, peer, step, error)   seq < 0: point-to-point
    WAIT  (1, op, group, seq, t0_ns, t1_ns, issue_t0_ns, step, error)
    STEP  (2, n, t0_ns, t1_ns, error)
    DATA  (3, t0_ns, t1_ns, step, error)
    CKPT  (4, "save" | "load", t0_ns, t1_ns, path, step, error)
"""
from __future__ import annotations

import inspect
import logging
import time

_logger = logging.getLogger(__name__)

COLL, WAIT, STEP, DATA, CKPT = 0, 1, 2, 3, 4

#: the wrappers' globals
NS: dict = {}


def reset(ring_size: int) -> None:
    """(Re)creates the hot-path state; ``ring_size`` is rounded up to a power of two."""
    size = 1
    while size < ring_size:
        size <<= 1
    NS.update(
        _on=False,
        _buf=[None] * size,
        _N=size,
        _M=size - 1,
        _w=0,
        _r=0,
        _drops=0,
        _seq={},  # group -> collectives issued from Python
        _p2p={},  # group -> point-to-point ops issued from Python
        _pend={},  # id(Work) -> (op, group, seq, issue_t0)
        _cur=None,  # (op, group, seq, t0_ns, kind) of the in-flight operation, or None
        _in=False,  # inside a wrapped collective: torch's own nested calls (send -> isend) are not counted twice
        _step=1,
        _dpg=None,
        _ns=time.time_ns,
        _id=id,
    )
    # _failed: (op, group, seq, error text) of the collective that failed last, set by _fail only (a key the
    # wrappers never touch: their globals keep the layout they were tuned with)
    NS.pop("_failed", None)


reset(16)


def push(record: tuple) -> None:
    """Appends a record from non-generated code (steps, data, checkpoints, failures)."""
    i = NS["_w"]
    if i - NS["_r"] < NS["_N"]:
        NS["_buf"][i & NS["_M"]] = record
        NS["_w"] = i + 1
    else:
        NS["_drops"] += 1


def _get_dpg():
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group()
    NS["_dpg"] = pg
    return pg


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _fail(op, g, s, t0, exc, nbytes=None, dtype=None, async_op=False, peer=None):
    NS["_cur"] = None
    push((COLL, op, g, s, t0, time.time_ns(), nbytes, dtype, async_op, peer, NS["_step"], _error_text(exc)))
    NS["_failed"] = (op, g, s, f"{type(exc).__name__}: {exc}"[:500])  # what the crash hooks report as failed


def _lbytes(tensors) -> int:
    try:
        return sum(t.nbytes for t in tensors)
    except Exception:  # noqa: BLE001
        return 0


NS.update(_get_dpg=_get_dpg, _fail=_fail, _lbytes=_lbytes)


def _params(sig: inspect.Signature, prefix: str):
    """Parameter list text and call text, defaults bound in ``NS`` under ``prefix``."""
    params, call, env = [], [], {}
    kwonly_started = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            call.append(f"*{p.name}")
            kwonly_started = True
            continue
        if p.kind is p.VAR_KEYWORD:
            params.append(f"**{p.name}")
            call.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not kwonly_started:
            params.append("*")
            kwonly_started = True
        text = p.name
        if p.default is not p.empty:
            key = f"{prefix}_d_{p.name}"
            env[key] = p.default
            text += f"={key}"
        params.append(text)
        call.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
    return ", ".join(params), ", ".join(call), env


def make_collective(orig, op: str, *, nbytes: str | None, dtype: str | None, group: str = "group",
                    async_arg: str | None = "async_op", always_async: bool = False, peer: str | None = None,
                    p2p: bool = False):
    """Builds the wrapper of one torch.distributed function from its signature and the expressions (over its
    parameters) that give the payload bytes, dtype, group, async flag and peer."""
    sig = inspect.signature(orig)
    prefix = f"_{op}"
    params, call, env = _params(sig, prefix)
    names = set(sig.parameters)
    for required in (group,) + ((async_arg,) if async_arg else ()):
        if required not in names:
            raise TypeError(f"{op}: parameter {required!r} not in {sig}")
    counter = "_p2p" if p2p else "_seq"
    is_async = "True" if always_async else (async_arg if async_arg else "False")
    seq_expr = "-s" if p2p else "s"
    src = f"""
def {op}({params}):
    global _w, _cur, _drops, _in
    if not _on or _in:
        return {prefix}_orig({call})
    g = {group}
    if g is None:
        g = _dpg
        if g is None:
            g = _get_dpg()
    s = {counter}.get(g, 0) + 1
    {counter}[g] = s
    t0 = _ns()
    _cur = ({op!r}, g, {seq_expr}, t0, "collective")
    _in = True
    try:
        r = {prefix}_orig({call})
    except BaseException as e:
        _in = False
        _fail({op!r}, g, {seq_expr}, t0, e, None, None, {is_async}, {peer or 'None'})
        raise
    t1 = _ns()
    _cur = None
    _in = False
    if {is_async} and r is not None:
        _pend[_id(r)] = ({op!r}, g, {seq_expr}, t0)
    i = _w
    if i - _r < _N:
        _buf[i & _M] = (0, {op!r}, g, {seq_expr}, t0, t1, {nbytes or 'None'}, {dtype or 'None'}, {is_async}, \
{peer or 'None'}, _step, None)
        _w = i + 1
    else:
        _drops += 1
    return r
"""
    NS.update(env)
    NS[f"{prefix}_orig"] = orig
    code = compile(src, f"<otel_gpu wrapper {op}>", "exec")
    exec(code, NS)  # noqa: S102 - generated from the wrapped function's own signature
    fn = NS.pop(op)
    fn.__wrapped__ = orig
    fn.__doc__ = getattr(orig, "__doc__", None)
    fn.__qualname__ = getattr(orig, "__qualname__", op)
    fn.__module__ = getattr(orig, "__module__", None)
    fn._otel_gpu_wrapper = True
    return fn


_WAIT_SRC = """
def wait(self, *args, **kwargs):
    global _w, _cur, _drops
    if not _on:
        return _wait_orig(self, *args, **kwargs)
    p = _pend.pop(_id(self), None)
    if p is None:
        return _wait_orig(self, *args, **kwargs)
    t0 = _ns()
    _cur = (p[0], p[1], p[2], t0, "wait")
    try:
        r = _wait_orig(self, *args, **kwargs)
    except BaseException as e:
        _cur = None
        _fail(p[0], p[1], p[2], p[3], e, None, None, True, None)
        raise
    t1 = _ns()
    _cur = None
    i = _w
    if i - _r < _N:
        _buf[i & _M] = (1, p[0], p[1], p[2], t0, t1, p[3], _step, None)
        _w = i + 1
    else:
        _drops += 1
    return r
"""


def make_wait(orig):
    """Wrapper of ``Work.wait``: times the wait of an async op issued through a wrapped function."""
    NS["_wait_orig"] = orig
    exec(compile(_WAIT_SRC, "<otel_gpu wrapper Work.wait>", "exec"), NS)  # noqa: S102
    fn = NS.pop("wait")
    fn.__wrapped__ = orig
    fn._otel_gpu_wrapper = True
    return fn
