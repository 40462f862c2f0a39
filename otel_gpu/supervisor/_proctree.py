"""Stopping a whole job: the command, everything below it, and processes that left its session (torchrun starts
each rank in a session of its own, so a process-group kill misses them)."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from collections.abc import Iterable

__all__ = ["become_subreaper", "descendants", "stop_tree"]

_logger = logging.getLogger(__name__)
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of the job (a rank whose torchrun agent died) become our children instead of init's, so that they
    stay findable and stoppable. Linux only; False elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _ppids() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                rest = fh.read().rsplit(")", 1)[1].split()
            if rest[0] not in ("Z", "X"):
                out[int(name)] = int(rest[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(roots: Iterable[int]) -> set[int]:
    """Live processes below ``roots`` (and the live roots themselves)."""
    ppids = _ppids()
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    found = {r for r in roots if r in ppids}
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    me = os.getpid()
    for pid in pids:
        if pid == me:
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap_orphans(pids: Iterable[int], keep: int | None) -> None:
    """Orphans we adopted as subreaper must be reaped by us (the launched command is reaped by its Popen)."""
    for pid in pids:
        if pid == keep:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def stop_tree(root: int, extra: Iterable[int] = (), grace_s: float = 10.0) -> dict[str, int]:
    """SIGTERM to ``root``, its descendants and ``extra`` (the job's registered processes), SIGKILL to whatever is
    left after ``grace_s``. Returns how many got each signal."""
    extra = set(extra)
    targets = descendants({root} | extra)
    _signal_all(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = targets
    while time.monotonic() < deadline:
        time.sleep(0.1)
        _reap_orphans(left, root)
        left = descendants(targets | extra)  # children started meanwhile count too
        if not left:
            break
    killed = descendants(targets | extra)
    if killed:
        _logger.info("stopping the job: %d processes ignored SIGTERM for %.0f s; SIGKILL", len(killed), grace_s)
        _signal_all(killed, signal.SIGKILL)
        time.sleep(0.1)
        _reap_orphans(killed, root)
    return {"sigterm": len(targets), "sigkill": len(killed)}
