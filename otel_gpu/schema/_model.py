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


class Attr(str):
    """An attribute key: the string of its name, carrying its type and description.

    Being a ``str``, it goes wherever a key goes (``{identity.RANK: 3}``, ``kv.key = identity.RANK``, JSON) without
    ``str()``, and compares and hashes as its name. Frozen, like the other definitions.

    >>> rank = Attr("training.rank", "int", "Global rank.")
    >>> rank == "training.rank", {rank: 3}["training.rank"], rank.type, f"{rank}"
    (True, 3, 'int', 'training.rank')
    """

    type: str  # "string" | "int" | "double" | "bool" | "string[]" | ...
    description: str
    group: str
    values: tuple[str, ...]
    semconv: bool  # defined by the OpenTelemetry semantic conventions

    def __new__(cls, name: str, type: str, description: str, group: str = "", values: tuple[str, ...] = (),
                semconv: bool = False) -> Attr:
        self = super().__new__(cls, name)
        for key, value in (("type", type), ("description", description), ("group", group),
                           ("values", tuple(values)), ("semconv", semconv)):
            object.__setattr__(self, key, value)
        return self

    def __setattr__(self, key: str, value) -> None:
        raise AttributeError(f"schema attribute {str.__str__(self)!r} is frozen")

    def __getnewargs__(self):
        return (str.__str__(self), self.type, self.description, self.group, self.values, self.semconv)

    @property
    def name(self) -> str:
        return str.__str__(self)

    def definition(self) -> tuple:
        """Everything that defines it (two definitions of one name must agree)."""
        return (self.name, self.type, self.description, self.group, self.values, self.semconv)

    def __repr__(self) -> str:
        return f"Attr({self.name!r}, {self.type!r})"


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
        if existing is not None and _definition(existing) != _definition(item):
            raise ValueError(f"schema: {item.name!r} is defined twice with different definitions")
        table[item.name] = item
        return item


REGISTRY = Registry()


def _definition(item) -> object:
    return item.definition() if isinstance(item, Attr) else item


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
