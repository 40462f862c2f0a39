"""What the kernel knows about a process that ``otel-gpu run`` launched, whoever its parent is: how it ended (the
exit status a zombie keeps until it is reaped) and whether a live one runs (its state and wait channel).

Example:
    >>> import os
    >>> read_stat(os.getpid()).state in ("R", "S")
    True
    >>> frozen_how("T", "do_signal_stop", ""), frozen_how("D", "os_wait_uninterruptible", ""), frozen_how("S", "", "")
    ('stopped', 'gpu_driver', None)

Rules (each a Linux fact, checked on kernel 6.18 here):
- ``/proc/PID/stat`` field 3 is the state: R running, S sleeping, D uninterruptible sleep, T stopped (SIGSTOP,
  SIGTSTP), t stopped by a tracer, Z zombie (ended, not reaped), X dead. Field 52 (``exit_code``, Linux >= 3.5) is the
  exit status in ``waitpid`` form, readable by the process's owner or root while it is a zombie: the exact code or
  signal of a rank whose parent (Lightning, ``mp.spawn``, a shell, ``srun``) has not reaped it yet.
- ``prctl(PR_SET_CHILD_SUBREAPER)`` makes a launcher the parent of its orphaned descendants: a rank whose own parent
  died first (Lightning's rank 0, a killed torchrun agent) is reaped by ``otel-gpu run``, with its exact status.
- A process that stays in T or D is frozen: it exists but does not run. ``/proc/PID/wchan`` names the kernel function
  it waits in (``do_signal_stop`` for SIGSTOP), ``/proc/PID/stack`` (root only) its kernel stack with module tags
  (``[nvidia]``). D inside the NVIDIA driver (a wait channel or stack frame of the ``nvidia``/``nvidia_uvm`` modules,
  whose symbols are ``nv_*``, ``_nv*``, ``os_*`` of its OS layer, ``uvm_*``) is a GPU that stopped answering.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

__all__ = ["ProcStat", "read_stat", "wchan", "kernel_stack", "frozen_how", "in_gpu_driver", "become_subreaper",
           "reap_orphans", "children", "FROZEN_STATES", "FrozenRanks"]

FROZEN_STATES = frozenset("DTt")
_PR_SET_CHILD_SUBREAPER = 36
# Symbols of the NVIDIA kernel modules a process waits in when the GPU stops answering: nvidia.ko's OS layer
# (os_acquire_mutex, os_wait_uninterruptible, ...), its RM entry points (_nv000123rm) and nv_* helpers, the UVM
# driver (uvm_*), nvidia-modeset (nvkms*). Not "nv" alone: nvme_* is a disk driver.
_GPU_WCHAN_PREFIXES = ("nv_", "_nv", "nvidia", "nvkms", "uvm_", "os_acquire", "os_wait", "os_delay")
_GPU_MODULE_TAGS = ("[nvidia]", "[nvidia_uvm]", "[nvidia_modeset]", "[nvidia_drm]")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    exit_status: int | None  # waitpid-form status, only meaningful while state is Z


def read_stat(pid: int) -> ProcStat | None:
    """The process's state, parent and (a zombie's) exit status; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
        fields = raw.rsplit(b")", 1)[1].split()
        state = fields[0].decode()
        ppid = int(fields[1])
        status = int(fields[49]) if len(fields) > 49 and state == "Z" else None
        return ProcStat(pid, state, ppid, status)
    except (OSError, IndexError, ValueError):
        return None


def _read_text(path: str, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode(errors="replace").strip()
    except OSError:
        return ""


def wchan(pid: int) -> str:
    """The kernel function the process sleeps in ("" when running, unknown or unreadable; "0" reads as "")."""
    text = _read_text(f"/proc/{pid}/wchan", 256)
    return "" if text == "0" else text


def kernel_stack(pid: int, max_frames: int = 12) -> str:
    """The process's kernel stack, innermost first, one ``function+off/len [module]`` per line ("" unless root)."""
    lines = []
    for line in _read_text(f"/proc/{pid}/stack", 8192).splitlines()[:max_frames]:
        lines.append(line.split("] ", 1)[-1].strip())
    return "\n".join(lines)


def in_gpu_driver(wchan_name: str, stack: str) -> bool:
    """The wait channel or a kernel stack frame is in the NVIDIA driver."""
    if wchan_name and wchan_name.startswith(_GPU_WCHAN_PREFIXES):
        return True
    return any(tag in stack for tag in _GPU_MODULE_TAGS)


def frozen_how(state: str, wchan_name: str, stack: str) -> str | None:
    """How a process in ``state`` is frozen: ``stopped`` (T, t), ``gpu_driver`` (D in the NVIDIA driver),
    ``uninterruptible`` (D elsewhere); None when it runs or sleeps interruptibly."""
    if state in ("T", "t"):
        return "stopped"
    if state == "D":
        return "gpu_driver" if in_gpu_driver(wchan_name, stack) else "uninterruptible"
    return None


def become_subreaper() -> bool:
    """Makes this process the reaper of its orphaned descendants (Linux); False where it cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int | None = None) -> list[int]:
    """The live children of ``pid`` (default: this process), from every thread's ``/proc/PID/task/TID/children``."""
    pid = os.getpid() if pid is None else pid
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        out += [int(x) for x in _read_text(f"/proc/{pid}/task/{tid}/children", 65536).split() if x.isdigit()]
    return out


def reap_orphans(keep: int | None) -> list[tuple[int, int]]:
    """Reaps ended children other than ``keep`` (the launched command, which ``subprocess`` reaps): orphans that a
    subreaper inherited. Returns (pid, waitpid status) of each. Stops at ``keep``: ``waitid`` shows one child at a
    time, and the command's own status is not ours to take."""
    out: list[tuple[int, int]] = []
    for _ in range(256):
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            break
        except OSError:
            break
        if info is None or info.si_pid == 0 or info.si_pid == keep:
            break
        try:
            pid, status = os.waitpid(info.si_pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if pid:
            out.append((pid, status))
    return out


class FrozenRanks:
    """Watches the state of live ranks and says when one froze (state T or D for ``frozen_after_s``) and when a
    frozen one runs again. One report per transition: ``{pid, rank, state, how, wchan, stack, since, resumed}``.

    A rank's main thread (the thread-group leader whose state ``/proc/PID/stat`` shows) is what trains: stopped by
    SIGSTOP every thread stops (its heartbeats too); stuck in the GPU driver only the main thread is, and its
    watchdog still reports while the rank makes no progress.
    """

    def __init__(self, frozen_after_s: float = 2.0, interval_s: float = 0.5):
        self.frozen_after_s = frozen_after_s
        self.interval_s = interval_s
        self._since: dict[int, float] = {}  # pid -> when first seen frozen (wall clock)
        self._reported: dict[int, dict] = {}
        self._last = 0.0

    def check(self, procs: dict[int, dict], now: float) -> list[dict]:
        if self._last <= now < self._last + self.interval_s:
            return []
        self._last = now
        out = []
        for pid, info in procs.items():
            if info.get("rank") is None:
                continue
            st = read_stat(pid)
            if st is None or st.state in ("Z", "X"):
                self._since.pop(pid, None)
                self._reported.pop(pid, None)
                continue
            if st.state in FROZEN_STATES:
                since = self._since.setdefault(pid, now)
                if pid not in self._reported and now - since >= self.frozen_after_s:
                    name, stack = wchan(pid), kernel_stack(pid)
                    rep = {"pid": pid, "rank": info.get("rank"), "state": st.state, "wchan": name, "stack": stack,
                           "how": frozen_how(st.state, name, stack), "since": since, "resumed": False}
                    self._reported[pid] = rep
                    out.append(rep)
            else:
                self._since.pop(pid, None)
                old = self._reported.pop(pid, None)
                if old is not None:
                    out.append({**old, "state": st.state, "wchan": wchan(pid), "stack": "", "how": None,
                                "resumed": True, "since": now})
        return out
