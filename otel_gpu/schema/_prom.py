"""OpenTelemetry metric name -> Prometheus name, per the OTel "Prometheus and OpenMetrics compatibility" spec."""
from __future__ import annotations

import re

_UNIT_WORDS = {
    "s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes",
    "W": "watts", "J": "joules", "Cel": "celsius", "Hz": "hertz", "MHz": "megahertz",
    "V": "volts", "A": "amperes", "%": "percent", "m": "meters",
}
_PER_UNIT_WORDS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year"}
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


def sanitize(name: str) -> str:
    out = _INVALID.sub("_", name)
    out = re.sub(r"__+", "_", out)
    if out and out[0].isdigit():
        out = "_" + out
    return out


def unit_suffix(unit: str) -> str:
    if not unit or unit.startswith("{"):
        return ""
    if unit == "1":
        return "ratio"
    if "/" in unit:
        num, _, den = unit.partition("/")
        a, b = _UNIT_WORDS.get(num, num), _PER_UNIT_WORDS.get(den, _UNIT_WORDS.get(den, den))
        return f"{a}_per_{b}".strip("_")
    return _UNIT_WORDS.get(unit, unit)


def prometheus_name(name: str, unit: str, type) -> str:
    base = sanitize(name)
    suffix = sanitize(unit_suffix(unit)) if unit else ""
    type_value = getattr(type, "value", type)
    is_counter = type_value == "counter"
    if suffix == "ratio" and is_counter:
        suffix = ""
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if is_counter and not base.endswith("_total"):
        base += "_total"
    return base
