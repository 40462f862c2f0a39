"""Settings of the ``xid`` receiver."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from otel_gpu.collector import backends

__all__ = ["XidReceiverConfig"]


@dataclass
class XidReceiverConfig:
    """``receivers.xid`` settings.

    Attributes:
        path: kernel log to follow: ``/dev/kmsg`` records or a text file (kern.log, a journal export, a fake log);
            empty: ``/dev/kmsg`` when it is readable (root or CAP_SYSLOG), else the receiver says so once and idles.
        from_beginning: also report XIDs already in the log when the receiver starts (default: only new ones).
        backend: how PCI bus ids become GPUs: ``auto`` (NVML when the driver is there), ``nvml``, ``fake`` (with
            ``scenario``, the fake NVML) or ``none`` (only ``gpu_map``).
        scenario: the fake NVML scenario, with ``backend: fake``.
        gpu_map: PCI bus id -> GPU index, e.g. ``{"0000:3b:00": 2}``; wins over NVML.
        poll_interval_s: how often a plain file is checked for new lines.
        host_name: the host.name resource attribute; empty: this machine's host name.
    """

    path: str = ""
    from_beginning: bool = False
    backend: str = "auto"
    scenario: str = ""
    gpu_map: dict[str, int] = field(default_factory=dict)
    poll_interval_s: float = 0.2
    host_name: str = ""

    def validate(self) -> None:
        known = backends.names("nvml") + ["none"]
        if self.backend not in known:
            raise ValueError(f"backend must be one of {', '.join(known)} (got {self.backend!r})")
        if self.backend == "fake":
            if not self.scenario:
                raise ValueError("scenario: required with backend: fake (a fake NVML scenario file)")
            if not os.path.isfile(self.scenario):
                raise ValueError(f"scenario: no such file {self.scenario!r}")
        if not self.poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0 (got {self.poll_interval_s})")
        from otel_gpu.receivers.xid.parse import pci_key

        for key, index in self.gpu_map.items():
            try:
                pci_key(key)
            except ValueError:
                raise ValueError(f"gpu_map.{key}: not a PCI bus id (e.g. 0000:3b:00 or 00000000:3B:00.0)") from None
            if not isinstance(index, int) or index < 0:
                raise ValueError(f"gpu_map.{key} must be a GPU index >= 0 (got {index!r})")
