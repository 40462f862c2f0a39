"""Settings of the ``nvml`` receiver."""
from __future__ import annotations

import os
from dataclasses import dataclass

from otel_gpu.collector import backends

__all__ = ["NvmlReceiverConfig", "BACKENDS"]

#: The built-in backends; others registered in :mod:`otel_gpu.collector.backends` are accepted too.
BACKENDS = ("auto", "nvml", "fake")


@dataclass
class NvmlReceiverConfig:
    """``receivers.nvml`` settings.

    Attributes:
        backend: ``auto`` (real NVML through nvidia-ml-py; without a driver the receiver says so once and stays idle),
            ``nvml`` (the same, named explicitly), ``fake`` (the fake NVML driven by ``scenario``) or another name
            registered in :mod:`otel_gpu.collector.backends`.
        scenario: YAML/JSON scenario file of the fake backend (required with ``backend: fake``).
        interval_s: seconds between polls.
        nvlink_interval_s: seconds between reads of NVLink state and error counters (up to 18 links x 6 calls per
            GPU: the most expensive part of a poll); 0 disables NVLink.
        devices: NVML indices to watch; empty: all.
        xid_events: watch XID errors through the NVML event set (a background thread).
        processes: report the processes on each GPU (pid -> GPU).
        pcie_throughput: read PCIe throughput (NVML samples it for ~20 ms per call, per direction).
        host_name: the host.name resource attribute; empty: this machine's host name.
    """

    backend: str = "auto"
    scenario: str = ""
    interval_s: float = 1.0
    nvlink_interval_s: float = 10.0
    devices: list[int] | None = None
    xid_events: bool = True
    processes: bool = True
    pcie_throughput: bool = True
    host_name: str = ""

    def validate(self) -> None:
        known = backends.names("nvml")
        if self.backend not in known:
            raise ValueError(f"backend must be one of {', '.join(known)} (got {self.backend!r})")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0 (got {self.interval_s})")
        if self.nvlink_interval_s < 0:
            raise ValueError(f"nvlink_interval_s must be >= 0 (0 disables NVLink) (got {self.nvlink_interval_s})")
        if self.backend == "fake":
            if not self.scenario:
                raise ValueError("scenario: required with backend: fake (a YAML or JSON scenario file; see "
                                 "otel_gpu/testing/fake_nvml.py)")
            if not os.path.isfile(self.scenario):
                raise ValueError(f"scenario: no such file {self.scenario!r}")
        elif self.scenario:
            raise ValueError(f"scenario: only used with backend: fake (backend is {self.backend!r})")
        for i, d in enumerate(self.devices or []):
            if d < 0:
                raise ValueError(f"devices[{i}] must be an NVML index >= 0 (got {d})")
