"""OpenTelemetry metric name -> Prometheus name, by the reference translation that Prometheus and the OpenTelemetry
Collector share.

The rules are those of ``prometheus/otlptranslator`` (``metric_namer.go``: ``normalizeName`` / ``addUnitTokens``,
``unit_namer.go``: ``buildUnitSuffixes`` / ``cleanUpUnit``), which came from the Collector's
``pkg/translator/prometheus/normalize_name.go`` (``BuildCompliantName`` with ``addMetricSuffixes``) and which both the
Collector's ``prometheus`` exporter and Prometheus' own OTLP ingestion use with suffixes on and UTF-8 escaped:

- the name is split into tokens at every character outside ``[a-zA-Z0-9:]`` (so ``.``, ``-`` and runs of ``_``
  become one ``_``);
- the unit's main part is mapped through a fixed table (``By`` -> ``bytes``, ``s`` -> ``seconds``, ``Cel`` ->
  ``celsius``, ...); a unit the table lacks is kept as it is (``MHz`` stays ``MHz``); ``{annotations}`` and ``1`` add
  nothing; ``X/Y`` adds ``per_<Y>`` (``s`` -> ``second``, ...); a suffix already among the name's tokens is not added
  twice;
- monotonic sums get ``total`` (any ``total`` token moves to the end); gauges with unit ``1`` get ``ratio`` (only
  gauges: a non-monotonic sum in ``1``, such as ``hw.status``, gets nothing);
- a name that starts with a digit gets a leading ``_``.

Example:
    >>> prometheus_name("hw.status", "1", "updowncounter"), prometheus_name("hw.gpu.utilization", "1", "gauge")
    ('hw_status', 'hw_gpu_utilization_ratio')
    >>> prometheus_name("otel_gpu.nic.packets.rate", "{packet}/s", "gauge")
    'otel_gpu_nic_packets_rate_per_second'
    >>> prometheus_name("gpu.clock.frequency", "MHz", "gauge"), prometheus_name("hw.energy", "J", "counter")
    ('gpu_clock_frequency_MHz', 'hw_energy_joules_total')
"""
from __future__ import annotations

import re

__all__ = ["prometheus_name", "sanitize", "unit_suffix"]

# otlptranslator's unitMap: OTLP (UCUM) unit -> Prometheus unit word. "1" maps to nothing.
_UNIT_WORDS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds", "us": "microseconds",
    "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tibibytes",
    "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "Cel": "celsius", "Hz": "hertz", "1": "", "%": "percent",
}
# otlptranslator's perUnitMap: the unit after "/" -> the word after "per_" (singular).
_PER_UNIT_WORDS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year"}
_TOKEN = re.compile(r"[a-zA-Z0-9:]+")
_INVALID = re.compile(r"[^a-zA-Z0-9:]")
_INVALID_LABEL = re.compile(r"[^a-zA-Z0-9_:]")

_MONOTONIC = "counter"
_GAUGE = "gauge"


def sanitize(name: str) -> str:
    """A name with every character outside ``[a-zA-Z0-9_:]`` replaced by ``_`` (runs collapsed), as a label.

    >>> sanitize("training.rank"), sanitize("9lives")
    ('training_rank', '_9lives')
    """
    out = re.sub(r"__+", "_", _INVALID_LABEL.sub("_", name))
    if out and out[0].isdigit():
        out = "_" + out
    return out


def _clean_unit(unit: str) -> str:
    return re.sub(r"__+", "_", _INVALID.sub("_", unit)).removeprefix("_")


def _unit_suffixes(unit: str) -> tuple[str, str]:
    """(main, per) suffixes of a unit, before clean-up: ``"By/s"`` -> ``("bytes", "per_second")``."""
    parts = unit.split("/", 1)
    main = ""
    main_otel = parts[0].strip()
    if main_otel and "{" not in main_otel and "}" not in main_otel:
        main = _UNIT_WORDS.get(main_otel, main_otel)
    per = ""
    if len(parts) > 1 and parts[1] != "":
        per_otel = parts[1].strip()
        if per_otel and "{" not in per_otel and "}" not in per_otel:
            per = _PER_UNIT_WORDS.get(per_otel, per_otel)
        if per:
            per = "per_" + per
    return main, per


def unit_suffix(unit: str) -> str:
    """The unit as Prometheus writes it in a name (otlptranslator's ``UnitNamer``): ``"By/s"`` -> ``bytes_per_second``.

    >>> unit_suffix("By/s"), unit_suffix("{packet}/s"), unit_suffix("1"), unit_suffix("MHz")
    ('bytes_per_second', 'per_second', '', 'MHz')
    """
    main, per = (_clean_unit(x) for x in _unit_suffixes(unit))
    out = f"{main}_{per}" if main and per else main or per
    return out.strip("_")


def prometheus_name(name: str, unit: str, type) -> str:  # noqa: A002 - the OTLP metric's type
    """The Prometheus name of an OTLP metric.

    Args:
        name: the OTLP metric name.
        unit: its unit (UCUM, as in OTLP).
        type: ``"gauge"``, ``"counter"`` (monotonic sum), ``"updowncounter"`` (non-monotonic sum) or
            ``"histogram"``, or a :class:`~otel_gpu.schema.MetricType`.
    """
    kind = getattr(type, "value", type)
    tokens = _TOKEN.findall(name)
    main, per = (_clean_unit(x) for x in _unit_suffixes(unit))
    if main in tokens:
        main = ""
    if per == "per_":
        per = ""
    else:
        per = per.removesuffix("_")
        if per in tokens:
            per = ""
    if per:
        main = main.removesuffix("_")
    tokens += [t for t in (main, per) if t]
    if kind == _MONOTONIC:
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if unit == "1" and kind == _GAUGE:
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    out = "_".join(tokens)
    if out and out[0].isdigit():
        out = "_" + out
    return out
