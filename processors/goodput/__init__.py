"""``goodput`` processor: ETTR (productive step time / wall time) and badput buckets per job, live and for the report.

Buckets (docs/design.md section 4): startup, data_loading, checkpoint_save, checkpoint_restore, hang, wasted_progress (steps
since the last checkpoint when a failure struck), restart_gap, slowdown (step time above the baseline), other::

    processors:
      attribution: {}
      goodput: {report_interval: 5s}
    service:
      pipelines:
        traces: {receivers: [otlp], processors: [attribution, goodput], exporters: [store]}
        logs:   {receivers: [otlp], processors: [attribution, goodput], exporters: [store]}
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.processors.goodput.config import GoodputConfig
from otel_gpu.processors.goodput.processor import GoodputProcessor

__all__ = ["FACTORY", "GoodputConfig", "GoodputProcessor"]

FACTORY = ComponentFactory("goodput", "processor", GoodputConfig, GoodputProcessor,
                           description="Goodput (ETTR) and badput buckets per job.")
