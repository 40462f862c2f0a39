"""A per-job registry folder shared by ``otel-gpu run`` and the processes it starts.

Each instrumented process writes ``proc-<pid>.json`` (pid, parent, rank, argv) at start and appends lines to
``events-<pid>.jsonl`` (exception, signal, atexit); every process that reaps a child appends the child's status to
``wait-<pid>.jsonl``. The launcher reads it all once the command ends, to tell which rank ended how, including ranks
that vanished without a word (SIGKILL, ``os._exit``). Writes are small single ``write`` calls with O_APPEND.
"""
from __future__ import annotations

import json
import os
import time

PROC = "proc-{pid}.json"
EVENTS = "events-{pid}.jsonl"
WAITS = "wait-{pid}.jsonl"


def _append(path: str, obj: dict) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def write_proc(folder: str, info: dict) -> None:
    pid = info.get("pid", os.getpid())
    tmp = os.path.join(folder, f".proc-{pid}.tmp")
    try:
        with open(tmp, "w") as fh:
            json.dump({"t": time.time(), **info}, fh, default=str)
        os.replace(tmp, os.path.join(folder, PROC.format(pid=pid)))
    except OSError:
        pass


def append_event(folder: str, event: dict) -> None:
    _append(os.path.join(folder, EVENTS.format(pid=os.getpid())), {"t": time.time(), "pid": os.getpid(), **event})


def append_wait(folder: str, child_pid: int, status: int) -> None:
    rec = {"t": time.time(), "parent": os.getpid(), "pid": child_pid, "status": status}
    if os.WIFEXITED(status):
        rec["code"] = os.WEXITSTATUS(status)
    elif os.WIFSIGNALED(status):
        rec["signal"] = os.WTERMSIG(status)
    _append(os.path.join(folder, WAITS.format(pid=os.getpid())), rec)


def read(folder: str) -> tuple[dict[int, dict], dict[int, list[dict]], dict[int, dict]]:
    """(processes by pid, events by pid, last wait status by child pid)."""
    procs: dict[int, dict] = {}
    events: dict[int, list[dict]] = {}
    waits: dict[int, dict] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return procs, events, waits
    for name in names:
        path = os.path.join(folder, name)
        try:
            if name.startswith("proc-") and name.endswith(".json"):
                with open(path) as fh:
                    info = json.load(fh)
                procs[int(info["pid"])] = info
            elif name.startswith(("events-", "wait-")) and name.endswith(".jsonl"):
                with open(path) as fh:
                    for line in fh:
                        try:
                            rec = json.loads(line)
                        except ValueError:
                            continue
                        if name.startswith("events-"):
                            events.setdefault(int(rec["pid"]), []).append(rec)
                        else:
                            waits[int(rec["pid"])] = rec
        except (OSError, ValueError, KeyError):
            continue
    return procs, events, waits
