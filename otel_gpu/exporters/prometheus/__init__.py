"""``prometheus`` exporter: serves the latest OTLP metrics, and the collector's self-telemetry, for Prometheus.

OTLP metrics become Prometheus series by OpenTelemetry's compatibility rules (``hw.gpu.power`` in W ->
``hw_gpu_power_watts``; monotonic sums -> ``*_total`` counters; explicit-bucket histograms -> histograms). Data point
and resource attributes become labels. Series not updated for ``metric_expiration`` disappear.
``/metrics`` answers in the Prometheus text format, or OpenMetrics when the scraper asks for it; ``/health`` answers
``{"status": "ok"}``.

Example config::

    exporters:
      prometheus:
        endpoint: 127.0.0.1:9464
        namespace: ""                 # optional prefix, e.g. "training"
        metric_expiration: 5m
        resource_to_telemetry_conversion: true
        const_labels: {cluster: a}

Example (in Python)::

    from otel_gpu.collector.config import load_text
    from otel_gpu.collector.runtime import Collector
    c = Collector(load_text('''
    receivers: {otlp: {protocols: {grpc: {endpoint: 127.0.0.1:0}}}}
    exporters: {prometheus: {endpoint: 127.0.0.1:0}}
    service: {pipelines: {metrics: {receivers: [otlp], exporters: [prometheus]}}}
    '''))
    c.start(); print(c.component("exporter", "prometheus").url + "/metrics"); c.shutdown()
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.exporters.prometheus.config import PrometheusExporterConfig
from otel_gpu.exporters.prometheus.exporter import PrometheusExporter
from otel_gpu.pdata import Signal

__all__ = ["FACTORY", "PrometheusExporter", "PrometheusExporterConfig"]

FACTORY = ComponentFactory("prometheus", "exporter", PrometheusExporterConfig, PrometheusExporter,
                           signals=(Signal.METRICS,),
                           description="Serves metrics (and self-telemetry) on /metrics for Prometheus to scrape.")
