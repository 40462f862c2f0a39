"""A fake kernel log for the xid receiver: appends ``/dev/kmsg``-style records (or syslog lines) to a file.

Example:
    >>> import os, tempfile
    >>> log = FakeKernelLog(os.path.join(tempfile.mkdtemp(), "kmsg"))
    >>> log.xid("0000:3b:00", 79, pid=4242).split(";", 1)[1]
    'NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.'
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

__all__ = ["FakeKernelLog"]

_TEXT = {79: "GPU has fallen off the bus.", 48: "An uncorrectable double bit error (DBE) has been detected on GPU "
         "in the framebuffer at partition 0, subpartition 0.", 13: "Graphics SM Warp Exception on (GPC 0, TPC 0)",
         31: "Ch 00000008, intr 10000000. MMU Fault", 74: "NVLink: fatal error detected on link 4",
         94: "Contained: SM (0x1). RST: No, D-RST: No", 95: "Uncontained: FBHUB. RST: Yes, D-RST: No"}


class FakeKernelLog:
    """Appends kernel-log records to ``path``; point ``receivers.xid.path`` at it."""

    def __init__(self, path: str | os.PathLike, *, syslog: bool = False):
        self.path = Path(path)
        self.syslog = syslog
        self._seq = 0
        self._lock = threading.Lock()
        self.path.touch()

    def line(self, message: str, level: int = 6) -> str:
        """Appends one record with ``message``; returns the line written (without the newline)."""
        with self._lock:
            self._seq += 1
            if self.syslog:
                text = f"{time.strftime('%b %d %H:%M:%S')} node kernel: [{time.monotonic():12.6f}] {message}"
            else:
                text = f"{level},{self._seq},{int(time.monotonic() * 1e6)},-;{message}"
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
            return text

    def xid(self, pci: str, code: int, *, pid: int | None = None, name: str = "python",
            text: str | None = None) -> str:
        """Appends ``NVRM: Xid (PCI:<pci>): <code>, pid=<pid>, name=<name>, <text>``."""
        who = f"pid={pid}, name={name}" if pid is not None else "pid='<unknown>', name=<unknown>"
        return self.line(f"NVRM: Xid (PCI:{pci}): {code}, {who}, {text or _TEXT.get(code, 'Xid error')}", level=4)

    def rotate(self) -> None:
        """Moves the log aside and starts an empty one (logrotate's create mode)."""
        with self._lock:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self.path.touch()
