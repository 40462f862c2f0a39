"""``attribution`` processor: names why a training job crashed, hung or slowed down.

It reads what the collector already receives (progress heartbeats, stacks, exceptions and exits from the training
processes; step, data and checkpoint spans; GPU, XID and NIC health from the receivers) and emits one failure record per
incident: a ``otel_gpu.failure`` span, an ``otel_gpu.failure`` event (what the store keeps) and the
``otel_gpu.failures`` counter. Put it in the traces, metrics and logs pipelines so that it sees everything::

    processors:
      attribution: {hang_timeout: 15s}
    service:
      pipelines:
        traces:  {receivers: [otlp], processors: [attribution], exporters: [store]}
        metrics: {receivers: [otlp, nvml, nic], processors: [attribution], exporters: [prometheus]}
        logs:    {receivers: [otlp, xid], processors: [attribution], exporters: [store]}
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.processors.attribution.config import AttributionConfig
from otel_gpu.processors.attribution.processor import AttributionProcessor

__all__ = ["AttributionConfig", "AttributionProcessor", "FACTORY"]

FACTORY = ComponentFactory("attribution", "processor", AttributionConfig, AttributionProcessor,
                           description="Failure attribution: crash, hang, slowdown with root cause and culprit.")
