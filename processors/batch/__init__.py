"""``batch`` processor: groups what arrives into fewer, larger requests, as the OpenTelemetry Collector's.

A request is passed on once ``send_batch_size`` items (spans, metric data points, log records) wait, or ``timeout``
after the first of them arrived; ``send_batch_max_size`` (0: no limit) caps an outgoing request, splitting larger
ones::

    processors:
      batch: {send_batch_size: 8192, timeout: 200ms, send_batch_max_size: 0}
    service:
      pipelines:
        traces: {receivers: [otlp], processors: [memory_limiter, batch], exporters: [otlp]}
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.processors.batch.config import BatchConfig
from otel_gpu.processors.batch.processor import BatchProcessor, split

__all__ = ["FACTORY", "BatchConfig", "BatchProcessor", "split"]

FACTORY = ComponentFactory("batch", "processor", BatchConfig, BatchProcessor,
                           description="Groups items into larger requests (size or timeout), splits oversized ones.")
