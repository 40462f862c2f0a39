"""What ``otel-gpu run`` reads from and changes in a torchrun command line for a job of many nodes: ``--nnodes``
and the rendezvous endpoint (its host moves when the node that served it is excluded).

Example:
    >>> cmd = ["torchrun", "--nnodes", "1:2", "--rdzv-endpoint=node0:29400", "--rdzv-id", "j", "train.py", "--nnodes",
    ...        "9"]
    >>> nodes(cmd), endpoint(cmd)
    ((1, 2), ('node0', 29400))
    >>> rewrite(cmd, rdzv_host="node2", nnodes=1)[:4]
    ['torchrun', '--nnodes', '1', '--rdzv-endpoint=node2:29400']
    >>> nodes(["python", "train.py", "--nnodes", "4"]) is None  # not torchrun: its own arguments are the script's
    True
    >>> nodes(["torchrun", "--no-python", "--nnodes", "2", "--rdzv-endpoint", "h:1", "./train.sh"])  # a flag: no value
    (2, 2)
"""
from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["endpoint", "nodes", "rewrite"]

_ENDPOINT = ("--rdzv-endpoint", "--rdzv_endpoint")
_NNODES = ("--nnodes",)
#: torchrun's options that take no value (the others take one: ``--opt VALUE`` or ``--opt=VALUE``).
_FLAGS = frozenset(("--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--module",
                    "--virtual-local-rank", "--virtual_local_rank", "-h", "--help"))


def _options(cmd: Sequence[str]) -> range | None:
    """Indices of torchrun's own options in ``cmd`` (up to the script or ``-m``); None when ``cmd`` is not torchrun."""
    for i, arg in enumerate(cmd):
        base = os.path.basename(arg)
        if base == "torchrun":
            start = i + 1
            break
        if arg == "torch.distributed.run" and i >= 1 and cmd[i - 1] == "-m":
            start = i + 1
            break
    else:
        return None
    end = start
    while end < len(cmd):
        arg = cmd[end]
        if arg == "-m" or arg == "--" or not arg.startswith("-"):
            break
        end += 1 if "=" in arg or arg in _FLAGS else 2
    return range(start, min(end, len(cmd)))


def _find(cmd: Sequence[str], names: tuple[str, ...]) -> tuple[int, str] | None:
    span = _options(cmd)
    if span is None:
        return None
    i = span.start
    while i < span.stop:
        arg = cmd[i]
        name, eq, value = arg.partition("=")
        if name in names:
            if eq:
                return i, value
            if i + 1 < len(cmd):
                return i + 1, cmd[i + 1]
            return None
        i += 1 if eq or arg in _FLAGS else 2
    return None


def nodes(cmd: Sequence[str]) -> tuple[int, int] | None:
    """torchrun's ``--nnodes`` as (min, max); None when ``cmd`` is not torchrun or says nothing readable."""
    found = _find(cmd, _NNODES)
    if found is None:
        return (1, 1) if _options(cmd) is not None else None
    low, _, high = found[1].partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        return None
    return (lo, hi) if 1 <= lo <= hi else None


def endpoint(cmd: Sequence[str]) -> tuple[str, int | None] | None:
    """torchrun's rendezvous endpoint as (host, port or None)."""
    found = _find(cmd, _ENDPOINT)
    if found is None:
        return None
    host, sep, port = found[1].rpartition(":")
    if not sep:
        return found[1], None
    return host.strip("[]"), int(port) if port.isdigit() else None


def rewrite(cmd: Sequence[str], rdzv_host: str | None = None, nnodes: int | None = None) -> list[str]:
    """``cmd`` with the rendezvous endpoint's host set to ``rdzv_host`` (its port kept) and ``--nnodes`` set to
    ``nnodes`` (a fixed size: the rendezvous then completes as soon as every member is there)."""
    out = list(cmd)
    if rdzv_host is not None:
        found = _find(out, _ENDPOINT)
        if found is not None:
            i, value = found
            _, sep, port = value.rpartition(":")
            host = f"[{rdzv_host}]" if ":" in rdzv_host else rdzv_host
            new = f"{host}:{port}" if sep and port.isdigit() else host
            out[i] = f"{out[i].partition('=')[0]}={new}" if out[i].startswith("--") else new
    if nnodes is not None:
        found = _find(out, _NNODES)
        if found is not None:
            i, _ = found
            out[i] = f"--nnodes={nnodes}" if out[i].startswith("--") else str(nnodes)
    return out
