"""OTLP metrics -> the latest value of each Prometheus series, kept in memory and served by ``collect()``.

One :class:`MetricState` per exporter. ``update()`` walks the data points of an export request (Python, but only
data points and their attributes; resources are converted once per request) and stores plain values under a lock;
``collect()`` builds prometheus-client metric families from them at scrape time and drops expired series.

Mapping (OpenTelemetry "Prometheus and OpenMetrics compatibility"):

- gauge -> gauge
- monotonic sum, cumulative -> counter (``_total``); delta -> accumulated into a counter
- non-monotonic sum -> gauge (delta: accumulated)
- explicit-bucket histogram -> histogram (delta: accumulated while the bounds stay the same)
- summary, exponential histogram -> skipped (logged once per metric name)
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from otel_gpu.component import LogOnce
from otel_gpu.pdata import point_value, to_python
from otel_gpu.schema.prom import prometheus_name

__all__ = ["MetricState"]

_logger = logging.getLogger(__name__)

_DELTA = 1  # AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
_NO_RECORDED_VALUE = 1  # DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK
_BAD_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")
_CACHE_MAX = 20_000
_SERVICE_NAME, _SERVICE_NAMESPACE, _SERVICE_INSTANCE_ID = "service.name", "service.namespace", "service.instance.id"
_IDENTIFYING = frozenset((_SERVICE_NAME, _SERVICE_NAMESPACE, _SERVICE_INSTANCE_ID))
TARGET_INFO = "target_info"

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
UPDOWN = "updowncounter"  # OTLP non-monotonic sum (exposed as a gauge)


def label_value(value: Any) -> str:
    """An OTLP AnyValue as a Prometheus label value (non-strings as JSON, like the OpenTelemetry Collector)."""
    v = to_python(value, json_safe=True)
    kind = type(v)
    if kind is str:
        return v
    if kind is bool:
        return "true" if v else "false"
    if kind is int:
        return str(v)
    if kind is float:
        return floatToGoString(v)
    if v is None:
        return ""
    return json.dumps(v, separators=(",", ":"), sort_keys=True)


class MetricState:
    """The latest value of every series, by family; a prometheus-client custom collector.

    Resources become labels as in the OpenTelemetry Collector's prometheus exporter: ``job`` (``service.namespace/``
    ``service.name``) and ``instance`` (``service.instance.id``) on every series, and a ``target_info`` gauge (value 1)
    per resource carrying its other attributes, to join on ``job``/``instance``. Prometheus' OTLP ingestion makes
    ``target_info`` the same way: only for a resource with ``job`` or ``instance`` and at least one other attribute.

    Args:
        namespace: prefix for every family name (``"<namespace>_<name>"``); empty for none.
        expiration_s: series (and ``target_info`` entries) not updated for this long are dropped.
        resource_labels: copy every resource attribute into labels (the Collector's
            ``resource_to_telemetry_conversion``; data point attributes win on a clash).
        const_labels: added to every series (lowest precedence).
        log_once: where unsupported metric types are reported, once per metric name.
        promote: resource attributes copied into labels even when ``resource_labels`` is off (like Prometheus'
            ``otlp.promote_resource_attributes``).
        max_series: series held at most (all families); a data point that would start a new one past it is refused
            (existing series keep updating) and counted through ``on_refused``, with one warning.
    """

    def __init__(self, namespace: str = "", expiration_s: float = 300.0, resource_labels: bool = False,
                 const_labels: dict[str, str] | None = None, log_once: LogOnce | None = None,
                 promote: Iterable[str] = (), max_series: int = 0, on_refused=None):
        self._max_series = max_series  # 0: unbounded
        self._on_refused = on_refused
        self._n_series = 0
        self._refused = 0
        self._prefix = f"{namespace}_" if namespace else ""
        self._expiration_s = expiration_s
        self._resource_labels = resource_labels
        self._promote = frozenset(promote)
        # target_info label set -> last update (monotonic)
        self._targets: dict[tuple[tuple[str, str], ...], float] = {}
        self._const = dict(const_labels or {})
        self._log_once = log_once or LogOnce(_logger)
        self._lock = threading.Lock()
        # family name -> [type, help, {labels tuple: series}]; series: [value, time_ns, updated]
        # or for histograms [bounds, counts, sum|None, count, time_ns, updated]
        self._families: dict[str, list[Any]] = {}
        self._names: dict[tuple[str, str, str], str] = {}
        self._label_names: dict[str, str] = {}
        self._last_sweep = time.monotonic()

    # -- names ---------------------------------------------------------------------------------------------------
    def _family_name(self, name: str, unit: str, kind: str) -> str:
        key = (name, unit, kind)
        out = self._names.get(key)
        if out is None:
            out = self._prefix + prometheus_name(name, unit, kind)
            if kind == COUNTER:
                out = out.removesuffix("_total")  # prometheus-client adds it to the sample (and the text TYPE line)
            if len(self._names) > _CACHE_MAX:
                self._names.clear()
            self._names[key] = out
        return out

    def _label_name(self, key: str) -> str:
        out = self._label_names.get(key)
        if out is None:
            out = re.sub(r"__+", "_", _BAD_LABEL_CHARS.sub("_", key)) if key else "key_empty"
            if out[0].isdigit():
                out = "key_" + out
            elif out.startswith("__"):
                out = "key" + out
            if len(self._label_names) > _CACHE_MAX:
                self._label_names.clear()
            self._label_names[key] = out
        return out

    def _labels(self, attributes: Iterable[Any], base: dict[str, str]) -> tuple[tuple[str, str], ...]:
        labels = dict(base)
        seen: set[str] = set()
        for kv in attributes:
            name = self._label_name(kv.key)
            value = label_value(kv.value)
            if name in seen:  # two keys that sanitize alike: join the values, as the specification says
                labels[name] = f"{labels[name]};{value}"
            else:
                seen.add(name)
                labels[name] = value
        return tuple(sorted(labels.items()))

    # -- update --------------------------------------------------------------------------------------------------
    def update(self, request: Any) -> int:
        """Applies an ``ExportMetricsServiceRequest``; returns how many data points were taken."""
        now = time.monotonic()
        taken = 0
        with self._lock:
            for rm in request.resource_metrics:
                base = self._resource(rm.resource.attributes, now)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        taken += self._update_metric(metric, base, now)
            if now - self._last_sweep > min(10.0, self._expiration_s):
                self._expire(now)
            refused, self._refused = self._refused, 0
        if refused and self._on_refused is not None:
            self._on_refused(refused)
        return taken

    def _room(self) -> bool:
        """Whether a new series may start (``max_series``); a refusal is counted and warned about once."""
        if not self._max_series or self._n_series < self._max_series:
            self._n_series += 1
            return True
        self._refused += 1
        self._log_once("max_series", logging.WARNING, "prometheus exporter: %d series held (max_series); data points "
                       "that would start new series are refused until old ones expire (counted in "
                       "otel_gpu.collector.series_refused; logged once)", self._max_series)
        return False

    def _resource(self, attributes: Iterable[Any], now: float) -> dict[str, str]:
        """The labels a resource gives each of its series; records its ``target_info`` entry."""
        base = dict(self._const)
        values = {kv.key: label_value(kv.value) for kv in attributes}
        name = values.get(_SERVICE_NAME)
        job = f"{values[_SERVICE_NAMESPACE]}/{name}" if name is not None and _SERVICE_NAMESPACE in values else name
        instance = values.get(_SERVICE_INSTANCE_ID)
        info: dict[str, str] = {}
        for key, value in values.items():
            if key in _IDENTIFYING:
                if self._resource_labels:
                    base[self._label_name(key)] = value
                continue
            label = self._label_name(key)
            info[label] = f"{info[label]};{value}" if label in info else value
            if self._resource_labels or key in self._promote:
                base[label] = value
        for label, value in (("job", job), ("instance", instance)):
            if value is not None:
                base[label] = info[label] = value
        if (job is not None or instance is not None) and len(info) > (job is not None) + (instance is not None):
            if len(self._targets) > _CACHE_MAX:
                self._targets.clear()
            self._targets[tuple(sorted(info.items()))] = now
        return base

    def _family(self, name: str, kind: str, help_text: str) -> dict:
        family = self._families.get(name)
        if family is None or family[0] != kind:
            if family is not None:
                self._log_once(("type", name), logging.WARNING, "metric %s changed type from %s to %s; its old series "
                               "are dropped (logged once)", name, family[0], kind)
            if family is not None:
                self._n_series -= len(family[2])
            family = self._families[name] = [kind, help_text, {}]
        elif help_text and family[1] != help_text:
            family[1] = help_text
        return family[2]

    def _update_metric(self, metric: Any, base: dict[str, str], now: float) -> int:
        data = metric.WhichOneof("data")
        if not metric.name:
            self._log_once("noname", logging.WARNING, "prometheus exporter: metrics without a name are skipped "
                           "(logged once)")
            return 0
        if data == "gauge":
            series = self._family(self._family_name(metric.name, metric.unit, GAUGE), GAUGE, metric.description)
            return self._numbers(series, metric.gauge.data_points, base, now, delta=False)
        if data == "sum":
            s = metric.sum
            kind = COUNTER if s.is_monotonic else GAUGE
            # a non-monotonic sum is a Prometheus gauge, but named as one (no _ratio for unit 1, as the reference)
            otlp_kind = COUNTER if s.is_monotonic else UPDOWN
            series = self._family(self._family_name(metric.name, metric.unit, otlp_kind), kind, metric.description)
            return self._numbers(series, s.data_points, base, now, delta=s.aggregation_temporality == _DELTA)
        if data == "histogram":
            h = metric.histogram
            series = self._family(self._family_name(metric.name, metric.unit, HISTOGRAM), HISTOGRAM,
                                  metric.description)
            return self._histograms(series, h.data_points, base, now, delta=h.aggregation_temporality == _DELTA)
        if data is not None:
            self._log_once(("unsupported", metric.name, data), logging.INFO, "prometheus exporter: metric %s is a %s, "
                           "which is not exported to Prometheus (logged once)", metric.name, data)
        return 0

    def _numbers(self, series: dict, points: Iterable[Any], base: dict[str, str], now: float, delta: bool) -> int:
        n = 0
        for dp in points:
            key = self._labels(dp.attributes, base)
            if dp.flags & _NO_RECORDED_VALUE:
                if series.pop(key, None) is not None:
                    self._n_series -= 1
                continue
            value = point_value(dp)
            t = dp.time_unix_nano
            old = series.get(key)
            if old is None:
                if not self._room():
                    continue
                series[key] = [value, t, now]
            elif delta:
                old[0] += value
                old[1] = max(old[1], t)
                old[2] = now
            elif t >= old[1]:  # a late, older point does not overwrite a newer one
                old[0], old[1], old[2] = value, t, now
            n += 1
        return n

    def _histograms(self, series: dict, points: Iterable[Any], base: dict[str, str], now: float, delta: bool) -> int:
        n = 0
        for dp in points:
            key = self._labels(dp.attributes, base)
            if dp.flags & _NO_RECORDED_VALUE:
                if series.pop(key, None) is not None:
                    self._n_series -= 1
                continue
            bounds = tuple(dp.explicit_bounds)
            counts = list(dp.bucket_counts)
            if len(counts) != len(bounds) + 1:  # no buckets (or malformed ones): keep the total only
                bounds, counts = (), [dp.count]
            total = dp.sum if dp.HasField("sum") else None
            t = dp.time_unix_nano
            old = series.get(key)
            if old is None and not self._room():
                continue
            if old is not None and delta and old[0] == bounds:
                old[1] = [a + b for a, b in zip(old[1], counts)]
                old[2] = None if old[2] is None or total is None else old[2] + total
                old[3] += dp.count
                old[4], old[5] = max(old[4], t), now
            elif old is None or delta or t >= old[4]:
                series[key] = [bounds, counts, total, dp.count, t, now]
            n += 1
        return n

    # -- expiry and scrape ---------------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        cutoff = now - self._expiration_s
        for name in list(self._families):
            kind, _, series = self._families[name]
            stamp = 5 if kind == HISTOGRAM else 2
            stale = [k for k, s in series.items() if s[stamp] < cutoff]
            for k in stale:
                del series[k]
            self._n_series -= len(stale)
            if not series:
                del self._families[name]
        for key in [k for k, t in self._targets.items() if t < cutoff]:
            del self._targets[key]
        self._last_sweep = now

    def series_count(self) -> int:
        with self._lock:
            return sum(len(f[2]) for f in self._families.values())

    def describe(self) -> list[Metric]:
        """Nothing fixed: the families change with the data (prometheus-client then skips duplicate checks)."""
        return []

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        out: list[Metric] = []
        with self._lock:
            self._expire(now)
            if self._targets:
                info = Metric(self._prefix + TARGET_INFO, "Target metadata", GAUGE)
                info.samples.extend(Sample(info.name, dict(key), 1.0, None, None) for key in self._targets)
                out.append(info)
            for name, (kind, help_text, series) in sorted(self._families.items()):
                try:
                    family = Metric(name, help_text or name, kind)
                except ValueError:  # a name prometheus-client refuses must not fail the whole scrape
                    self._log_once(("badname", name), logging.WARNING, "prometheus exporter: cannot expose %r "
                                   "(logged once)", name)
                    continue
                samples = family.samples
                if kind == GAUGE:
                    for key, s in series.items():
                        samples.append(Sample(name, dict(key), s[0], None, None))
                elif kind == COUNTER:
                    sample_name = name + "_total"
                    for key, s in series.items():
                        samples.append(Sample(sample_name, dict(key), s[0], None, None))
                else:
                    self._histogram_samples(name, series, samples)
                out.append(family)
        yield from out

    @staticmethod
    def _histogram_samples(name: str, series: dict, samples: list) -> None:
        bucket, count_name, sum_name = name + "_bucket", name + "_count", name + "_sum"
        for key, (bounds, counts, total, count, _, _) in series.items():
            labels = dict(key)
            running = 0
            for bound, c in zip(bounds, counts):
                running += c
                samples.append(Sample(bucket, {**labels, "le": floatToGoString(bound)}, float(running), None, None))
            samples.append(Sample(bucket, {**labels, "le": "+Inf"}, float(count), None, None))
            samples.append(Sample(count_name, labels, float(count), None, None))
            if total is not None and not math.isnan(total):
                samples.append(Sample(sum_name, labels, float(total), None, None))
