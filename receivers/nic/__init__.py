"""``nic`` receiver: InfiniBand port counters, state and rate, vendor ``hw_counters``, and Ethernet/RoCE interface
statistics, read from sysfs; counters become rates, with resets and wraps handled.

Names: :mod:`otel_gpu.schema.nic`. Each counter is exported as a monotonic sum (restarting, with a new start time,
when the kernel counter resets) and as a per-second rate (absent for the interval of a reset).

Example config::

    receivers:
      nic:
        interval: 1s
        # sysfs_root: /tmp/fake-sys     # a fake tree (FakeSysfs writes one)
    service:
      pipelines:
        metrics: {receivers: [nic], exporters: [prometheus]}

Example (Python)::

    >>> from otel_gpu.receivers.nic import FACTORY
    >>> FACTORY.type
    'nic'
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.pdata import Signal
from otel_gpu.receivers.nic.config import NicReceiverConfig
from otel_gpu.receivers.nic.receiver import CounterTracker, NicReceiver

__all__ = ["FACTORY", "CounterTracker", "NicReceiver", "NicReceiverConfig"]

FACTORY = ComponentFactory("nic", "receiver", NicReceiverConfig, NicReceiver, signals=(Signal.METRICS,),
                           description="InfiniBand and Ethernet health from sysfs.")
