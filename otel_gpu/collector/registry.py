"""The one table of built-in components, by kind and type name. Third parties add theirs through the
``otel_gpu.components`` entry-point group (the entry point loads a module or object with a ``FACTORY``)."""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from otel_gpu.component import ComponentFactory

__all__ = ["BUILTIN", "known_types", "load_factory"]

BUILTIN: dict[str, dict[str, str]] = {
    "receiver": {
        "otlp": "otel_gpu.receivers.otlp",
        "nvml": "otel_gpu.receivers.nvml",
        "nic": "otel_gpu.receivers.nic",
        "xid": "otel_gpu.receivers.xid",
    },
    "processor": {
        "attribution": "otel_gpu.processors.attribution",
        "goodput": "otel_gpu.processors.goodput",
        "memory_limiter": "otel_gpu.processors.memory_limiter",
        "compact": "otel_gpu.processors.compact",
        "batch": "otel_gpu.processors.batch",
        "health": "otel_gpu.processors.health",
    },
    "exporter": {
        "otlp": "otel_gpu.exporters.otlp",
        "otlphttp": "otel_gpu.exporters.otlp:HTTP_FACTORY",
        "prometheus": "otel_gpu.exporters.prometheus",
        "store": "otel_gpu.exporters.store",
        "debug": "otel_gpu.exporters.debug",
        "verdict": "otel_gpu.exporters.verdict",
    },
    "extension": {
        "health_check": "otel_gpu.extensions.health_check",
    },
}


def _plugins(kind: str) -> dict[str, object]:
    found = {}
    for ep in entry_points(group="otel_gpu.components"):
        kind_name, _, type_name = ep.name.partition(".")
        if kind_name == kind and type_name:
            found[type_name] = ep
    return found


def known_types(kind: str) -> list[str]:
    return sorted(set(BUILTIN.get(kind, {})) | set(_plugins(kind)))


def load_factory(kind: str, type_name: str) -> ComponentFactory | None:
    target = BUILTIN.get(kind, {}).get(type_name)
    if target is not None:
        module_name, _, attr = target.partition(":")
        obj = getattr(importlib.import_module(module_name), attr or "FACTORY")
    else:
        ep = _plugins(kind).get(type_name)
        if ep is None:
            return None
        obj = ep.load()
        obj = getattr(obj, "FACTORY", obj)
    if not isinstance(obj, ComponentFactory) or obj.kind != kind:
        raise TypeError(f"{target or type_name}: not a {kind} ComponentFactory")
    return obj
