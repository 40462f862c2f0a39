"""Typed configuration from YAML mappings, with errors that name the key and the fix.

Every component's settings are a dataclass with a default for each field; :func:`build` turns a mapping into one,
checking unknown keys (with a did-you-mean hint) and types, then calls its ``validate()``.

Durations are written as the OpenTelemetry Collector writes them, Go duration strings (``5s``, ``250ms``, ``1m30s``),
under the field's name without its unit: a field ``timeout_s`` (seconds) or ``flush_timeout_ms`` / ``_millis``
(milliseconds) is the YAML key ``timeout`` / ``flush_timeout``, and Python code keeps the unit in the name. The old
spelling (``timeout: 5s``) is refused with the new one in the message. ``field(metadata={"key": "name"})`` sets a
field's YAML key by hand, ``metadata={"duration": False}`` keeps a number.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class PollConfig:
    ...     interval_s: float = 1.0
    ...     def validate(self):
    ...         if self.interval_s <= 0:
    ...             raise ValueError(f"interval_s must be > 0 (got {self.interval_s})")
    >>> build(PollConfig, {"interval": "2s"}, "receivers.nvml").interval_s
    2.0
    >>> build(PollConfig, {"interval": "1m30s"}, "receivers.nvml").interval_s
    90.0
    >>> build(PollConfig, {"intervall": "2s"}, "receivers.nvml")
    Traceback (most recent call last):
    ...
    otel_gpu.config.ConfigError: receivers.nvml.intervall: unknown setting (did you mean 'interval'? known: interval)
    >>> build(PollConfig, {"interval_s": 0.25}, "receivers.nvml")
    Traceback (most recent call last):
    ...
    otel_gpu.config.ConfigError: receivers.nvml.interval_s was renamed: write interval: 250ms
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigError", "build", "did_you_mean", "format_duration", "parse_duration", "yaml_keys"]


class ConfigError(ValueError):
    """A configuration problem; ``str()`` lists every problem, one per line, each naming its key."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


_UNITS_S = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
# field-name suffix -> seconds per unit of the field
_SUFFIXES = (("_seconds", 1.0), ("_millis", 1e-3), ("_ms", 1e-3), ("_s", 1.0))


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string (``300ms``, ``1.5h``, ``2h45m``, ``-1s``; ``0`` alone needs no unit), the
    syntax of the OpenTelemetry Collector's ``time.Duration`` settings. Raises ValueError.

    >>> parse_duration("1m30s"), parse_duration("250ms"), parse_duration("0")
    (90.0, 0.25, 0.0)
    """
    s = text.strip()
    sign = -1.0 if s.startswith("-") else 1.0
    s = s[1:] if s[:1] in "+-" else s
    if s == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if m is None:
            raise ValueError(f"not a duration: {text!r} (write e.g. 5s, 250ms, 1m30s; units ns, us, ms, s, m, h)")
        total += float(m.group(1)) * _UNITS_S[m.group(2)]
        pos = m.end()
    if not s:
        raise ValueError(f"not a duration: {text!r} (write e.g. 5s, 250ms, 1m30s; units ns, us, ms, s, m, h)")
    return sign * total


def format_duration(seconds: float) -> str:
    """The shortest usual Go spelling of ``seconds``: ``5s``, ``250ms``, ``1m30s``, ``2h``.

    >>> format_duration(0.25), format_duration(90), format_duration(7200), format_duration(0)
    ('250ms', '1m30s', '2h', '0s')
    """
    if seconds != seconds or seconds in (math.inf, -math.inf):
        return f"{seconds}"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1:
        for unit, scale in (("ms", 1e3), ("us", 1e6), ("ns", 1e9)):
            value = seconds * scale
            if abs(value - round(value)) < 1e-6 or unit == "ns":
                return f"{round(value, 3):g}{unit}"
    out = ""
    whole = round(seconds, 6)
    if whole == int(whole):
        whole = int(whole)
        h, rest = divmod(whole, 3600)
        m, sec = divmod(rest, 60)
        out = (f"{h}h" if h else "") + (f"{m}m" if m else "") + (f"{sec}s" if sec else "")
        return out
    return f"{whole:g}s"


@dataclasses.dataclass(frozen=True)
class _Key:
    field: str  # the dataclass field
    scale: float | None  # seconds per unit of the field, for durations; None: not a duration


def _is_number_type(tp: Any) -> bool:
    if tp in (float, int):
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(a in (float, int) for a in typing.get_args(tp))
    return False


@functools.lru_cache(maxsize=None)
def yaml_keys(cls: type) -> dict[str, _Key]:
    """YAML key -> field of dataclass ``cls``: a numeric field named ``*_s`` / ``*_seconds`` / ``*_ms`` / ``*_millis``
    is a duration under its name without the suffix (the Collector's ``timeout``, ``check_interval``)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, _Key] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, scale = f.metadata.get("key", f.name), None
        if f.metadata.get("duration", True) and _is_number_type(hints[f.name]):
            for suffix, unit in _SUFFIXES:
                if f.name.endswith(suffix) and len(f.name) > len(suffix):
                    key, scale = f.metadata.get("key", f.name[: -len(suffix)]), unit
                    break
        if key in out:
            raise TypeError(f"{cls.__name__}: fields {out[key].field} and {f.name} both map to the YAML key {key!r}")
        out[key] = _Key(f.name, scale)
    return out


def _duration(value: Any, path: str) -> float:
    if isinstance(value, str):
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        return seconds
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    raise ConfigError(f"{path}: expected a duration such as 5s, 250ms or 1m (Go duration syntax, as in the "
                      f"OpenTelemetry Collector), got {type(value).__name__} {value!r}")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0] if errors else ConfigError(f"{path}: must not be null")
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        return build(typing.cast(type, tp), value, path)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise ConfigError(f"{path}: {value} is too large for a number") from None
            if number != number:  # NaN passes every "> 0" check in validate() and breaks what uses it later
                raise ConfigError(f"{path}: expected a number, got NaN")
            return number
        raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
    if isinstance(tp, type) and issubclass(tp, __import__("enum").Enum):
        try:
            return tp(value)
        except ValueError:
            members = typing.cast(Any, tp)
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(repr(m.value) for m in members)}") from None
    return value


def build(cls: type, data: Any, path: str) -> Any:
    """Builds dataclass ``cls`` from mapping ``data``; ``path`` is the YAML key it came from, for messages.

    Raises:
        ConfigError: listing every unknown key, wrong type and failed ``validate()`` check.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    keys = yaml_keys(cls)
    renamed = {k.field: key for key, k in keys.items() if k.field != key}
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        spec = keys.get(key)
        if spec is None:
            if key in renamed:
                new = renamed[key]
                scale = keys[new].scale
                example = value
                if scale is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                    example = format_duration(value * scale)
                problems.append(f"{path}.{key} was renamed: write {new}: {example}")
                continue
            problems.append(f"{path}.{key}: unknown setting ({did_you_mean(key, keys)}known: {', '.join(keys)})")
            continue
        try:
            if spec.scale is not None:
                value = _duration(value, f"{path}.{key}") / spec.scale
                tp = hints[spec.field]
                if tp is int or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                                 and float not in typing.get_args(tp)):
                    value = int(round(value))
                elif math.isinf(value):
                    raise ConfigError(f"{path}.{key}: {value!r} is too large")
            kwargs[spec.field] = _coerce(value, hints[spec.field], f"{path}.{key}")
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError([_yaml_names(p if p.startswith(path) else f"{path}.{p}", renamed)
                               for p in exc.problems]) from None
        except ValueError as exc:
            raise ConfigError(_yaml_names(f"{path}.{exc}", renamed)) from None
    return obj


def _yaml_names(message: str, renamed: dict[str, str]) -> str:
    """A validate() message speaks of fields (``timeout_s``); the user wrote YAML keys (``timeout``)."""
    for name, key in renamed.items():
        message = re.sub(rf"\b{re.escape(name)}\b", key, message)
    return message
