"""The collector's own telemetry: what each component received, refused, exported and dropped."""
from __future__ import annotations

from otel_gpu.schema._model import MetricType, metric
from otel_gpu.schema.identity import COMPONENT, SIGNAL

_G = "Collector self-telemetry"
_ATTRS = (COMPONENT, SIGNAL)

RECEIVED = metric("otel_gpu.collector.received", MetricType.COUNTER, "{item}",
                  "Spans, data points or log records accepted by a receiver.", group=_G, attributes=_ATTRS)
REFUSED = metric("otel_gpu.collector.refused", MetricType.COUNTER, "{item}",
                 "Items (or requests, when they could not be parsed) a receiver refused.", group=_G,
                 attributes=_ATTRS)
EXPORTED = metric("otel_gpu.collector.exported", MetricType.COUNTER, "{item}",
                  "Items an exporter delivered.", group=_G, attributes=_ATTRS)
DROPPED = metric("otel_gpu.collector.dropped", MetricType.COUNTER, "{item}",
                 "Items an exporter or processor gave up on (queue full, retries exhausted, permanent error).",
                 group=_G, attributes=_ATTRS)
QUEUE_SIZE = metric("otel_gpu.collector.queue.size", MetricType.GAUGE, "{batch}",
                    "Batches waiting in an exporter's queue.", group=_G, attributes=(COMPONENT,))
QUEUE_CAPACITY = metric("otel_gpu.collector.queue.capacity", MetricType.GAUGE, "{batch}",
                        "Capacity of an exporter's queue.", group=_G, attributes=(COMPONENT,))
