"""``prometheus`` exporter: serves the latest OTLP metrics, and the collector's self-telemetry, for Prometheus.

OTLP metrics become Prometheus series by the reference translation that Prometheus and the OpenTelemetry Collector
share (``hw.power`` in W -> ``hw_power_watts``; monotonic sums -> ``*_total`` counters; ``_ratio`` only for gauges in
unit ``1``; explicit-bucket histograms -> histograms; see :mod:`otel_gpu.schema.prom`). Data point attributes become
labels; resources become ``job``/``instance`` labels and a ``target_info`` series, and the promoted resource
attributes (job id, host, rank, GPU) stay labels of every series (``resource_to_telemetry_conversion`` is off by
default, as in the Collector). Series not updated for ``metric_expiration`` disappear.
``/metrics`` answers in the Prometheus text format, or OpenMetrics when the scraper asks for it; ``/health`` answers
``{"status": "ok"}``.

Example config::

    exporters:
      prometheus:
        endpoint: 127.0.0.1:9464
        namespace: ""                 # optional prefix, e.g. "training"
        metric_expiration: 5m
        resource_to_telemetry_conversion: false   # the default; true copies every resource attribute
        promote_resource_attributes: [training.job.id, host.name, training.rank, gpu.index]   # the default
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
