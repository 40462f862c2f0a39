"""Every name the schema marks *semconv* is checked against the installed ``opentelemetry-semantic-conventions``.

Metrics: the name exists, with the same instrument and unit, and our description begins with the conventions' brief,
so that the meaning is theirs (ours only adds detail). Attributes: the key exists; where the conventions enumerate
values (``hw.type``, ``hw.state``), ours are among them. The package's ``create_*`` helpers tell the instrument, unit
and brief: they are called here with a meter that only records what it was asked to create.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import opentelemetry.semconv  # noqa: F401 - in the test extra: a missing package fails here, never skips
import pytest

from otel_gpu import schema
from otel_gpu.schema import MetricType

_INSTRUMENTS = {"create_counter": MetricType.COUNTER, "create_observable_counter": MetricType.COUNTER,
                "create_up_down_counter": MetricType.UPDOWN, "create_observable_up_down_counter": MetricType.UPDOWN,
                "create_gauge": MetricType.GAUGE, "create_observable_gauge": MetricType.GAUGE,
                "create_histogram": MetricType.HISTOGRAM}


class _RecordingMeter:
    def __getattr__(self, method: str):
        def create(**kwargs):
            return method, kwargs
        return create


def _modules(package: str):
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        yield importlib.import_module(f"{package}.{info.name}")


def _semconv_metrics() -> dict[str, tuple[MetricType, str, str]]:
    """name -> (instrument, unit, brief), from every metrics module, stable and incubating."""
    out = {}
    for package in ("opentelemetry.semconv.metrics", "opentelemetry.semconv._incubating.metrics"):
        for module in _modules(package):
            for fname, fn in inspect.getmembers(module, inspect.isfunction):
                if not fname.startswith("create_"):
                    continue
                params = list(inspect.signature(fn).parameters)
                try:
                    method, kw = fn(_RecordingMeter(), *([None] * (len(params) - 1)))
                except Exception:  # noqa: BLE001 - a helper of another shape: not needed here
                    continue
                out[kw["name"]] = (_INSTRUMENTS[method], kw.get("unit", ""), kw.get("description", ""))
    return out


def _semconv_attributes() -> tuple[set[str], dict[str, set[str]]]:
    """Every attribute key; key -> enumerated values, where the conventions enumerate them."""
    keys: set[str] = set()
    values: dict[str, set[str]] = {}
    for package in ("opentelemetry.semconv.attributes", "opentelemetry.semconv._incubating.attributes"):
        for module in _modules(package):
            consts = {name: value for name, value in vars(module).items()
                      if name.isupper() and isinstance(value, str)}
            keys |= set(consts.values())
            for name, cls in vars(module).items():
                if inspect.isclass(cls) and name.endswith("Values") and hasattr(cls, "__members__"):
                    key = consts.get(re.sub(r"(?<!^)(?=[A-Z])", "_", name[:-len("Values")]).upper())
                    if key:
                        values.setdefault(key, set()).update(m.value for m in cls)
    return keys, values


METRICS = _semconv_metrics()
ATTRIBUTE_KEYS, ATTRIBUTE_VALUES = _semconv_attributes()
OURS = [m for m in schema.REGISTRY.metrics.values() if m.semconv]


def _plain(text: str) -> str:
    return text.replace("`", "").rstrip(".").strip().lower()


def test_the_package_has_the_hardware_conventions():
    assert "hw.gpu.memory.utilization" in METRICS and "hw.network.io" in METRICS, \
        "this opentelemetry-semantic-conventions has no hw.* metrics: pip install -U opentelemetry-semantic-conventions"
    assert {"hw.model", "hw.vendor", "hw.driver_version", "hw.id"} <= ATTRIBUTE_KEYS


@pytest.mark.parametrize("metric", OURS, ids=[m.name for m in OURS])
def test_semconv_metric_name_instrument_unit_and_meaning(metric):
    assert metric.name in METRICS, f"{metric.name} is marked semconv but the conventions have no such metric"
    instrument, unit, brief = METRICS[metric.name]
    assert metric.type is instrument, f"{metric.name}: the conventions make it a {instrument.value}"
    assert metric.unit == unit, f"{metric.name}: the conventions' unit is {unit!r}"
    assert _plain(metric.description).startswith(_plain(brief)), \
        f"{metric.name}: the description must begin with the conventions' meaning {brief!r}"


SEMCONV_ATTRS = [a for a in schema.REGISTRY.attributes.values() if a.semconv]


@pytest.mark.parametrize("attr", SEMCONV_ATTRS, ids=[a.name for a in SEMCONV_ATTRS])
def test_semconv_attribute_keys_and_values(attr):
    assert attr.name in ATTRIBUTE_KEYS, f"{attr.name} is marked semconv but the conventions have no such attribute"
    if attr.values and attr.name in ATTRIBUTE_VALUES:
        assert set(attr.values) <= ATTRIBUTE_VALUES[attr.name], \
            f"{attr.name}: {sorted(set(attr.values) - ATTRIBUTE_VALUES[attr.name])} are not the conventions' values"


def test_own_names_stay_out_of_the_conventions_namespaces():
    """Our metrics either are the conventions' or live where the conventions define nothing (gpu.*, otel_gpu.*)."""
    for m in schema.REGISTRY.metrics.values():
        if not m.semconv:
            assert m.name not in METRICS, f"{m.name} is a semconv metric: mark it semconv"
            assert not m.name.startswith("hw."), f"{m.name}: hw.* belongs to the conventions"
    assert not any(name.startswith(("gpu.", "otel_gpu.")) for name in METRICS)
    assert not any(key.startswith(("gpu.", "nic.", "otel_gpu.")) for key in ATTRIBUTE_KEYS)


def test_the_issue_s_meanings():
    """hw.gpu.memory.utilization is memory used (not bandwidth activity); the product name is hw.model."""
    from otel_gpu.schema import gpu

    assert _plain(METRICS["hw.gpu.memory.utilization"][2]) == "fraction of gpu memory used"
    assert gpu.MEMORY_ACTIVITY.name == "gpu.memory.activity" and not gpu.MEMORY_ACTIVITY.semconv
    names = {a.name for a in gpu.GPU_ATTRS}
    assert {"hw.model", "hw.vendor", "hw.driver_version", "hw.id", "hw.type"} <= names and "hw.name" not in names
