"""The building blocks of the schema: typed definitions of metrics, spans, attributes and enumerations.

Every name otel-gpu emits is declared once with one of these classes; ``docs/schema.md`` is generated from them
(``python -m otel_gpu.schema``) and a test fails when the two differ.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Attr", "Metric", "MetricType", "SpanDef", "EventDef", "Registry", "REGISTRY"]


class MetricType(str, enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"  # monotonic sum
    UPDOWN = "updowncounter"  # non-monotonic sum
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Attr:
    """An attribute key. ``str(attr)`` is its name, so ``{schema.RANK: 3}`` reads naturally."""

    name: str
    type: str  # "string" | "int" | "double" | "bool" | "string[]" | ...
    description: str
    group: str = ""
    values: tuple[str, ...] = ()
    semconv: bool = False  # defined by the OpenTelemetry semantic conventions

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Metric:
    """A metric name with its instrument type, unit (UCUM) and the attributes it carries."""

    name: str
    type: MetricType
    unit: str
    description: str
    group: str = ""
    attributes: tuple[Attr, ...] = ()
    semconv: bool = False
    dcgm: str = ""  # the dcgm-exporter field users know for the same signal, when there is one

    def __str__(self) -> str:
        return self.name

    @property
    def prometheus_name(self) -> str:
        """The name the Prometheus exporter exposes, following OpenTelemetry's Prometheus compatibility rules."""
        from otel_gpu.schema.prom import prometheus_name

        return prometheus_name(self.name, self.unit, self.type)


@dataclass(frozen=True)
class SpanDef:
    name: str
    description: str
    group: str = ""
    attributes: tuple[Attr, ...] = ()

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class EventDef:
    """A log record with an ``event_name`` (OTLP LogRecord field 12) and a JSON body."""

    name: str
    description: str
    group: str = ""
    attributes: tuple[Attr, ...] = ()
    body: str = ""  # what the JSON body holds

    def __str__(self) -> str:
        return self.name


@dataclass
class Registry:
    """Every definition, in declaration order, keyed by name; a second definition of a name is a bug."""

    attributes: dict[str, Attr] = field(default_factory=dict)
    metrics: dict[str, Metric] = field(default_factory=dict)
    spans: dict[str, SpanDef] = field(default_factory=dict)
    events: dict[str, EventDef] = field(default_factory=dict)
    enums: dict[str, type[enum.Enum]] = field(default_factory=dict)

    def _add(self, table: dict, item):
        existing = table.get(item.name)
        if existing is not None and existing != item:
            raise ValueError(f"schema: {item.name!r} is defined twice with different definitions")
        table[item.name] = item
        return item


REGISTRY = Registry()


def attr(name: str, type: str, description: str, *, group: str = "", values=(), semconv: bool = False) -> Attr:
    values = tuple(v.value if isinstance(v, enum.Enum) else v for v in values)
    return REGISTRY._add(REGISTRY.attributes, Attr(name, type, description, group, values, semconv))


def metric(name: str, type: MetricType, unit: str, description: str, *, group: str = "", attributes=(),
           semconv: bool = False, dcgm: str = "") -> Metric:
    return REGISTRY._add(REGISTRY.metrics, Metric(name, type, unit, description, group, tuple(attributes), semconv, dcgm))


def span(name: str, description: str, *, group: str = "", attributes=()) -> SpanDef:
    return REGISTRY._add(REGISTRY.spans, SpanDef(name, description, group, tuple(attributes)))


def event(name: str, description: str, *, group: str = "", attributes=(), body: str = "") -> EventDef:
    return REGISTRY._add(REGISTRY.events, EventDef(name, description, group, tuple(attributes), body))


def enumeration(cls: type[enum.Enum]) -> type[enum.Enum]:
    REGISTRY.enums[cls.__name__] = cls
    return cls
