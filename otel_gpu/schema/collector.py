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
UNTRUSTED = metric("otel_gpu.collector.untrusted", MetricType.COUNTER, "{record}",
                   "Records that act (failure, device state, restart decision, goodput) a receiver got from a sender "
                   "that did not authenticate as a trusted forwarder: dropped before any processor or exporter.",
                   group=_G, attributes=_ATTRS)
TRUNCATED = metric("otel_gpu.collector.truncated", MetricType.COUNTER, "{attribute}",
                   "Attributes a receiver cut from a request: dropped past the per-resource/per-item count limit, "
                   "or a value shortened to the byte limit.", group=_G, attributes=_ATTRS)
SERIES_REFUSED = metric("otel_gpu.collector.series_refused", MetricType.COUNTER, "{point}",
                        "Data points a Prometheus exporter did not serve because they would have made a new series "
                        "past its max_series bound.", group=_G, attributes=_ATTRS)
