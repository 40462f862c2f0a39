"""Parsing of ``NVRM: Xid`` kernel-log lines and PCI bus ids.

Example:
    >>> x = parse_line("6,1234,5678901234,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, "
    ...                "GPU has fallen off the bus.")
    >>> x.code, x.pci, x.pid, x.monotonic_us
    (79, '00000000:3B:00.0', 1234, 5678901234)
    >>> parse_line("Dec  3 13:33:35 n1 kernel: [ 12.5] NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', DBE").pid
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["XidLine", "parse_line", "pci_key", "pci_text"]

# re.ASCII: only 0-9 are digits (int() would also take e.g. Arabic-Indic digits).
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)(?:,\s*(.*))?", re.ASCII)
_PID = re.compile(r"pid=(\d+)", re.ASCII)
_KMSG = re.compile(r"^\d+,\d+,(\d+),[^;]*;", re.ASCII)
_INT32, _INT64 = 1 << 31, 1 << 63  # the kernel prints XID codes and pids as int; kmsg time is a u64 of microseconds


@dataclass(frozen=True)
class XidLine:
    code: int
    pci: str  # normalized: 00000000:3B:00.0
    pid: int | None
    message: str
    monotonic_us: int | None  # the /dev/kmsg timestamp (microseconds since boot), when the line is a kmsg record


def pci_key(bus_id: str) -> tuple[int, int, int, int]:
    """'00000000:3B:00.0', '0000:3b:00.0', '0000:3b:00' or '3b:00' -> (domain, bus, device, function)."""
    parts = bus_id.strip().split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    dev, _, fn = parts[2].partition(".")
    try:
        return int(parts[0], 16), int(parts[1], 16), int(dev, 16), int(fn or "0", 16)
    except ValueError:
        raise ValueError(f"not a PCI bus id: {bus_id!r}") from None


def pci_text(key: tuple[int, int, int, int]) -> str:
    """The NVML form of a bus id: 00000000:3B:00.0."""
    return f"{key[0]:08X}:{key[1]:02X}:{key[2]:02X}.{key[3]:X}"


def parse_line(line: str) -> XidLine | None:
    """An XID from one kernel-log line (a /dev/kmsg record or a syslog/dmesg line), or None."""
    m = _XID.search(line)
    if m is None:
        return None
    try:
        pci = pci_text(pci_key(m.group(1)))
    except ValueError:
        return None
    code = _bounded(m.group(2), _INT32)
    if code is None:  # not a code the driver can print; an int64 attribute could not even hold some of these
        return None
    rest = (m.group(3) or "").strip()
    pid_m, k = _PID.search(rest), _KMSG.match(line)
    return XidLine(code, pci, _bounded(pid_m.group(1), _INT32) if pid_m else None, rest,
                   _bounded(k.group(1), _INT64) if k else None)


def _bounded(digits: str, limit: int) -> int | None:
    """int(digits) when below ``limit``; None otherwise (length first: int() refuses over 4,300 digits)."""
    if len(digits) > 20:
        return None
    value = int(digits)
    return value if value < limit else None
