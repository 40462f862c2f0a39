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
POISON_RECORDS = metric("otel_gpu.collector.poison_records", MetricType.COUNTER, "{record}",
                        "Records a store could not write (a value SQLite or JSON refuses), dropped alone: the rest "
                        "of their batch was written.", group=_G, attributes=(COMPONENT,))
OUT_OF_WINDOW = metric("otel_gpu.collector.out_of_window", MetricType.COUNTER, "{timestamp}",
                       "Timestamps outside the window a component accepts around receipt (time_window_past / "
                       "time_window_future), refused or replaced by the receipt time.", group=_G,
                       attributes=(COMPONENT,))
DEGRADED = metric("otel_gpu.collector.degraded", MetricType.GAUGE, "{state}",
                  "1 while a component runs degraded (a store that cannot open or write), else 0; the rest of the "
                  "collector goes on.", group=_G, attributes=(COMPONENT,))
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
