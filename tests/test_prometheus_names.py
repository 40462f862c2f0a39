"""OTLP metric -> Prometheus name, against the reference translation that Prometheus and the OpenTelemetry Collector
share.

The expected names are those of prometheus/otlptranslator (metric_namer.go and unit_namer.go; its table test
metric_namer_test.go, cases with UTF8Allowed=false and WithMetricSuffixes=true, which is what the Collector's
prometheus exporter does by default and what Prometheus' OTLP ingestion does with its default translation strategy
UnderscoreEscapingWithSuffixes). The rules came from the Collector's pkg/translator/prometheus/normalize_name.go
(BuildCompliantName with addMetricSuffixes). The second table applies the same rules to otel-gpu's own metrics, so
that the names on /metrics, in the dashboards and in docs/schema.md are the ones a stock Collector would expose.
"""
from __future__ import annotations

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

from otel_gpu import schema
from otel_gpu.exporters.prometheus._convert import MetricState
from otel_gpu.schema.prom import prometheus_name, unit_suffix

G, C, U, H = "gauge", "counter", "updowncounter", "histogram"

# (name, unit, type, Prometheus name, unit name): cases of otlptranslator's metric_namer_test.go.
REFERENCE = [
    ("requests", "", C, "requests_total", ""),
    ("cpu_usage", "1", G, "cpu_usage_ratio", ""),
    ("items", "1", C, "items_total", ""),
    ("response_time", "ms", G, "response_time_milliseconds", "milliseconds"),
    ("memory_usage", "By", G, "memory_usage_bytes", "bytes"),
    ("requests", "1/s", G, "requests_per_second", "per_second"),
    ("throughput", "By/s", G, "throughput_bytes_per_second", "bytes_per_second"),
    ("custom_metric", "custom_unit", G, "custom_metric_custom_unit", "custom_unit"),
    ("custom_metric", "{custom}", G, "custom_metric", ""),
    ("custom_metric", "By/{custom}", G, "custom_metric_bytes", "bytes"),
    ("requests_total", "", C, "requests_total", ""),
    ("cpu_usage_ratio", "1", G, "cpu_usage_ratio", ""),
    ("response_time_seconds", "s", G, "response_time_seconds", "seconds"),
    ("metric__with__multiple__underscores", "unit__multiple__underscores", G,
     "metric_with_multiple_underscores_unit_multiple_underscores", "unit_multiple_underscores"),
    ("custom_metric", "unit@with#special/chars", G, "custom_metric_unit_with_special_per_chars",
     "unit_with_special_per_chars"),
    ("request_duration", "s", H, "request_duration_seconds", "seconds"),
    ("active_connections", "", U, "active_connections", ""),
    ("uptime", "d", G, "uptime_days", "days"),
    ("duration", "h", G, "duration_hours", "hours"),
    ("timeout", "min", G, "timeout_minutes", "minutes"),
    ("latency", "us", G, "latency_microseconds", "microseconds"),
    ("precision_time", "ns", G, "precision_time_nanoseconds", "nanoseconds"),
    ("cache_size", "KiBy", G, "cache_size_kibibytes", "kibibytes"),
    ("memory", "MiBy", G, "memory_mebibytes", "mebibytes"),
    ("storage", "GiBy", G, "storage_gibibytes", "gibibytes"),
    ("transfer", "KBy", G, "transfer_kilobytes", "kilobytes"),
    ("download", "MBy", G, "download_megabytes", "megabytes"),
    ("backup", "GBy", G, "backup_gigabytes", "gigabytes"),
    ("archive", "TBy", G, "archive_terabytes", "terabytes"),
    ("distance", "m", G, "distance_meters", "meters"),
    ("voltage", "V", G, "voltage_volts", "volts"),
    ("current", "A", G, "current_amperes", "amperes"),
    ("energy", "J", G, "energy_joules", "joules"),
    ("power", "W", G, "power_watts", "watts"),
    ("weight", "g", G, "weight_grams", "grams"),
    ("temperature", "Cel", G, "temperature_celsius", "celsius"),
    ("frequency", "Hz", G, "frequency_hertz", "hertz"),
    ("cpu_usage", "%", G, "cpu_usage_percent", "percent"),
    ("requests", "1/m", G, "requests_per_minute", "per_minute"),
    ("events", "1/h", G, "events_per_hour", "per_hour"),
    ("transactions", "1/d", G, "transactions_per_day", "per_day"),
    ("reports", "1/w", G, "reports_per_week", "per_week"),
    ("invoices", "1/mo", G, "invoices_per_month", "per_month"),
    ("renewals", "1/y", G, "renewals_per_year", "per_year"),
    ("custom", "1/custom_unit", G, "custom_per_custom_unit", "per_custom_unit"),
    ("metric", "By/", G, "metric_bytes", "bytes"),
    ("metric", " By / s ", G, "metric_bytes_per_second", "bytes_per_second"),
    ("metric", "/", G, "metric", ""),
    ("http.request.duration", "ms", H, "http_request_duration_milliseconds", "milliseconds"),
    ("http.requests", "1", C, "http_requests_total", ""),
    ("metric@with#special$chars", "", G, "metric_with_special_chars", ""),
    ("123metric", "", G, "_123metric", ""),
]


@pytest.mark.parametrize("name,unit,kind,want,want_unit", REFERENCE)
def test_reference_table(name, unit, kind, want, want_unit):
    assert prometheus_name(name, unit, kind) == want
    assert unit_suffix(unit) == want_unit


# otel-gpu's metrics by the same rules (these are what the issue found wrong before: hw.status got _ratio, a
# {packet}/s rate lost _per_second, MHz became megahertz).
OURS = [
    ("hw.status", "1", U, "hw_status"),
    ("hw.network.up", "1", U, "hw_network_up"),
    ("hw.gpu.utilization", "1", G, "hw_gpu_utilization_ratio"),
    ("hw.gpu.memory.utilization", "1", G, "hw_gpu_memory_utilization_ratio"),
    ("hw.gpu.memory.usage", "By", U, "hw_gpu_memory_usage_bytes"),
    ("hw.temperature", "Cel", G, "hw_temperature_celsius"),
    ("hw.power", "W", G, "hw_power_watts"),
    ("hw.energy", "J", C, "hw_energy_joules_total"),
    ("hw.errors", "{error}", C, "hw_errors_total"),
    ("hw.network.io", "By", C, "hw_network_io_bytes_total"),
    ("hw.network.packets", "{packet}", C, "hw_network_packets_total"),
    ("hw.network.bandwidth.limit", "By/s", U, "hw_network_bandwidth_limit_bytes_per_second"),
    ("gpu.clock.frequency", "MHz", G, "gpu_clock_frequency_MHz"),
    ("gpu.pcie.throughput", "By/s", G, "gpu_pcie_throughput_bytes_per_second"),
    ("otel_gpu.nic.io.rate", "By/s", G, "otel_gpu_nic_io_rate_bytes_per_second"),
    ("otel_gpu.nic.packets.rate", "{packet}/s", G, "otel_gpu_nic_packets_rate_per_second"),
    ("otel_gpu.nic.errors.rate", "{error}/s", G, "otel_gpu_nic_errors_rate_per_second"),
    ("otel_gpu.collective.duration", "s", H, "otel_gpu_collective_duration_seconds"),
    ("otel_gpu.step.duration", "s", G, "otel_gpu_step_duration_seconds"),
    ("otel_gpu.failures", "{failure}", C, "otel_gpu_failures_total"),
    ("otel_gpu.collector.received", "{item}", C, "otel_gpu_collector_received_total"),
    ("a.total.count", "", C, "a_count_total"),
    ("fan.speed_ratio", "1", G, "fan_speed_ratio"),
]


@pytest.mark.parametrize("name,unit,kind,want", OURS)
def test_otel_gpu_names(name, unit, kind, want):
    assert prometheus_name(name, unit, kind) == want


def test_every_schema_metric_uses_the_rules():
    for metric in schema.REGISTRY.metrics.values():
        assert metric.prometheus_name == prometheus_name(metric.name, metric.unit, metric.type.value)
        assert "megahertz" not in metric.prometheus_name
        if metric.unit == "1" and metric.type is not schema.MetricType.GAUGE:
            assert not metric.prometheus_name.endswith("_ratio"), metric.name


def _request(metric: m.Metric) -> ExportMetricsServiceRequest:
    rm = m.ResourceMetrics()
    rm.scope_metrics.add().metrics.append(metric)
    return ExportMetricsServiceRequest(resource_metrics=[rm])


@pytest.mark.parametrize("name,unit,kind,want", [row for row in OURS if row[2] != H])
def test_the_exporter_exposes_these_names(name, unit, kind, want):
    """The OTLP type on the wire (gauge, monotonic or non-monotonic sum) decides the suffixes, as in the Collector."""
    dp = m.NumberDataPoint(time_unix_nano=1, as_double=1.0)
    if kind == G:
        metric = m.Metric(name=name, unit=unit, gauge=m.Gauge(data_points=[dp]))
    else:
        metric = m.Metric(name=name, unit=unit, sum=m.Sum(data_points=[dp], is_monotonic=kind == C,
                                                          aggregation_temporality=2))
    state = MetricState()
    state.update(_request(metric))
    (family,) = list(state.collect())
    assert family.samples[0].name == want
