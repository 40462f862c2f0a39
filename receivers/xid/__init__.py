"""``xid`` receiver: XID errors from the kernel log (``NVRM: Xid (PCI:0000:3b:00): 79, ...``), as ``gpu.xid`` log
records identical in shape to the nvml receiver's (``gpu.xid.source`` says ``kmsg``), with the PCI bus id mapped to
the GPU (index, UUID, name) through NVML when it is available, or through ``gpu_map``.

It catches XIDs NVML's event set does not deliver (e.g. when the collector is not allowed to register for events)
and keeps the pid and the driver's message text.

Example config::

    receivers:
      xid: {}                                  # /dev/kmsg (needs root or CAP_SYSLOG)
      # xid: {path: /var/log/kern.log, gpu_map: {"0000:3b:00": 2}, backend: none}
    service:
      pipelines:
        logs: {receivers: [xid], exporters: [store]}

Example (Python)::

    >>> from otel_gpu.receivers.xid import FACTORY, parse_line
    >>> FACTORY.type, parse_line("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.").code
    ('xid', 79)
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.pdata import Signal
from otel_gpu.receivers.xid.config import XidReceiverConfig
from otel_gpu.receivers.xid.parse import XidLine, parse_line
from otel_gpu.receivers.xid.receiver import XidReceiver

__all__ = ["FACTORY", "XidLine", "XidReceiver", "XidReceiverConfig", "parse_line"]

FACTORY = ComponentFactory("xid", "receiver", XidReceiverConfig, XidReceiver, signals=(Signal.LOGS,),
                           description="XID errors from the kernel log.")
