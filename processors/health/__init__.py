"""``health`` processor: finds the GPUs, NIC ports and nodes that are about to fail, before the next job loses time.

It reads the GPU and NIC counters the ``nvml``, ``nic`` and ``xid`` receivers produce (and the failures the store
keeps), and marks each device ``healthy``, ``watch`` or ``drain`` by transparent rules (README.md), with the evidence
and since when. Put it in the metrics and logs pipelines, after the receivers::

    processors:
      health: {sample_interval: 1m}
    service:
      pipelines:
        metrics: {receivers: [nvml, nic], processors: [health], exporters: [prometheus]}
        logs:    {receivers: [xid, otlp], processors: [attribution, health], exporters: [store]}

Example:
    >>> from otel_gpu.processors.health import FACTORY
    >>> FACTORY.type, FACTORY.kind
    ('health', 'processor')
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.pdata import Signal
from otel_gpu.processors.health.config import HealthConfig
from otel_gpu.processors.health.processor import DeviceHealthService, HealthProcessor

__all__ = ["DeviceHealthService", "FACTORY", "HealthConfig", "HealthProcessor"]

FACTORY = ComponentFactory("health", "processor", HealthConfig, HealthProcessor,
                           signals=(Signal.METRICS, Signal.LOGS),
                           description="Device health trends: healthy / watch / drain per GPU, NIC port and node.")
