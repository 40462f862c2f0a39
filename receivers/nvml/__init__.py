"""``nvml`` receiver: GPU health from NVML (nvidia-ml-py), and XID errors from NVML's event set.

Per GPU (``gpu.index``, ``hw.id`` = UUID, ``gpu.pci.bus_id``, ``hw.model``, ``hw.vendor``, ``hw.driver_version``):
utilization, memory (used, and its bandwidth activity), temperatures, power
and energy, clocks and their maxima, clock-event (throttle) reasons as named flags, performance state, ECC
(volatile and aggregate), retired pages, row remapping, PCIe replays and throughput, NVLink per-link state and errors,
the processes on each GPU, XID counts and ``hw.status``. Names: :mod:`otel_gpu.schema.gpu`.

Example config::

    receivers:
      nvml:
        interval: 1s
        # backend: fake
        # scenario: tests/testdata/nvml_8gpu.yaml
    service:
      pipelines:
        metrics: {receivers: [nvml], exporters: [prometheus]}
        logs: {receivers: [nvml], exporters: [store]}      # XID records

Example (Python)::

    >>> from otel_gpu.receivers.nvml import FACTORY
    >>> FACTORY.type, sorted(s.value for s in FACTORY.signals)
    ('nvml', ['logs', 'metrics'])
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.pdata import Signal
from otel_gpu.receivers.nvml.config import NvmlReceiverConfig
from otel_gpu.receivers.nvml.receiver import LIBRARY_NOT_FOUND, NvmlReceiver

__all__ = ["FACTORY", "LIBRARY_NOT_FOUND", "NvmlReceiver", "NvmlReceiverConfig"]

FACTORY = ComponentFactory("nvml", "receiver", NvmlReceiverConfig, NvmlReceiver,
                           signals=(Signal.METRICS, Signal.LOGS),
                           description="GPU health from NVML; XID errors from the NVML event set.")
