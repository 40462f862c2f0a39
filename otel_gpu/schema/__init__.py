"""The unified schema: every span name, attribute key, metric name and event otel-gpu emits, in one place.

Example:
    >>> from otel_gpu import schema
    >>> str(schema.failure.KIND)
    'failure.kind'
    >>> schema.REGISTRY.metrics["otel_gpu.failures"].prometheus_name
    'otel_gpu_failures_total'

``python -m otel_gpu.schema > docs/schema.md`` regenerates the reference; a test keeps them equal.
This package imports nothing else of otel-gpu, so every other part may import it.
"""
from __future__ import annotations

from otel_gpu.schema import collector, failure, gpu, health, identity, nic, training
from otel_gpu.schema._model import REGISTRY, Attr, EventDef, Metric, MetricType, SpanDef

__all__ = ["REGISTRY", "Attr", "EventDef", "Metric", "MetricType", "SpanDef", "collector", "failure", "gpu",
           "health", "identity", "nic", "training", "render_markdown"]


def render_markdown() -> str:
    """The text of docs/schema.md."""
    from otel_gpu.schema._docs import render

    return render(REGISTRY)
