"""The one seam between receivers and the hardware sources they read: a registry of backends by (kind, name).

A receiver's config names a backend (``backend: auto | nvml | fake``); the receiver asks :func:`load` for it and
gets an object with the real library's interface, so the *same* receiver code runs on a GPU node and in the tests.
Receivers never import (or name) the testing package: the fakes are registered here by dotted path, imported only
when a config asks for them, and other packages may add backends through the ``otel_gpu.collector.backends`` entry-point group
(entry point name ``<kind>.<name>``, value ``module:factory``).

Kinds and names registered here:

====== ======== =========================================================================================
kind   name     what :func:`load` returns
====== ======== =========================================================================================
nvml   auto     the ``pynvml`` module (nvidia-ml-py); ``None`` when it is not installed (without a driver the
                receiver finds out at ``nvmlInit`` and idles)
nvml   nvml     the same, named explicitly
nvml   fake     ``otel_gpu.testing.fake_nvml.FakeNvml(scenario)``: pynvml's functions, structs and errors
====== ======== =========================================================================================

sysfs and the kernel log are file sources: the nic receiver reads below ``sysfs_root`` and the xid receiver follows
``path``; their fakes (``FakeSysfs``, ``FakeKernelLog``) write a tree or a file that the config points at, so they
need no registry entry and the receivers do not know them either.

Example:
    >>> from otel_gpu.collector import backends
    >>> backends.names("nvml")
    ['auto', 'nvml', 'fake']
    >>> nv = backends.load("nvml", "fake", scenario={"gpu_count": 2})
    >>> nv.nvmlInit(); nv.nvmlDeviceGetCount()
    2
    >>> backends.load("gpu", "fake")
    Traceback (most recent call last):
    ...
    KeyError: "no backend 'fake' of kind 'gpu'; registered: nvml: auto, nvml, fake"
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib import metadata
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "load", "names", "register"]

_logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "otel_gpu.collector.backends"


def _pynvml(**_options: Any) -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


#: (kind, name) -> factory, or "module:attribute" of one (imported on first use).
_REGISTRY: dict[tuple[str, str], Callable[..., Any] | str] = {
    ("nvml", "auto"): _pynvml,
    ("nvml", "nvml"): _pynvml,
    ("nvml", "fake"): "otel_gpu.testing.fake_nvml:FakeNvml",
}
_entry_points_loaded = False


def register(kind: str, name: str, factory: Callable[..., Any] | str) -> None:
    """Adds (or replaces) the backend ``name`` of ``kind``; ``factory(**options)`` builds it."""
    _REGISTRY[(kind, name)] = factory


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        kind, _, name = ep.name.partition(".")
        if not name:
            _logger.warning("otel-gpu: entry point %s in %s is not named <kind>.<name>; ignored", ep.name,
                            ENTRY_POINT_GROUP)
            continue
        _REGISTRY.setdefault((kind, name), ep.value)


def names(kind: str) -> list[str]:
    """The backend names registered for ``kind``, in registration order."""
    _load_entry_points()
    return [n for k, n in _REGISTRY if k == kind]


def load(kind: str, name: str, **options: Any) -> Any:
    """Builds the backend ``name`` of ``kind`` with ``options`` (e.g. ``scenario`` for a fake).

    Raises:
        KeyError: nothing registered under (kind, name); the message lists what is.
    """
    _load_entry_points()
    factory = _REGISTRY.get((kind, name))
    if factory is None:
        known = "; ".join(f"{k}: {', '.join(names(k))}" for k in sorted({k for k, _ in _REGISTRY}))
        raise KeyError(f"no backend {name!r} of kind {kind!r}; registered: {known}")
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        _REGISTRY[(kind, name)] = factory
    return factory(**options)
