"""``compact`` processor: a node sidecar forwards only what its job's aggregator needs, with the job named on every
resource (the routing key for sharding jobs over aggregators; see docs/scale.md).

Kept by default: ``otel_gpu.progress`` / ``stacks`` / ``exception`` / ``signal`` / ``process.exit`` and ``gpu.xid``
events; ``otel_gpu.step``, data-wait and checkpoint spans; the GPU and NIC metrics attribution uses (XID, ECC, row
remap, NVLink, PCIe replay, clock events, process-to-GPU, NIC errors and link state) and the step duration. Dropped:
per-collective spans and everything else; send the full traces to the backend through a pipeline without it::

    processors:
      compact: {job_id: "${env:OTEL_GPU_JOB_ID:-}"}   # empty: learned from the training processes on the node
    service:
      pipelines:
        traces/backend:    {receivers: [otlp], exporters: [otlp/backend]}
        traces/aggregator: {receivers: [otlp], processors: [compact], exporters: [otlp/aggregator]}
        metrics:           {receivers: [otlp, nvml, nic], processors: [compact], exporters: [otlp/aggregator]}
        logs:              {receivers: [otlp, nvml, xid], processors: [compact], exporters: [otlp/aggregator]}

Example:
    >>> from otel_gpu.processors.compact import FACTORY
    >>> FACTORY.type, FACTORY.kind
    ('compact', 'processor')
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.processors.compact.config import CompactConfig
from otel_gpu.processors.compact.processor import CompactProcessor

__all__ = ["CompactConfig", "CompactProcessor", "FACTORY"]

FACTORY = ComponentFactory("compact", "processor", CompactConfig, CompactProcessor,
                           description="Sidecar -> aggregator: keep heartbeats, step records and failure evidence; "
                                       "name the job on every resource.")
