"""Typed configuration from YAML mappings, with errors that name the key and the fix.

Every component's settings are a dataclass with a default for each field; :func:`build` turns a mapping into one,
checking unknown keys (with a did-you-mean hint) and types, then calls its ``validate()``.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class PollConfig:
    ...     interval_s: float = 1.0
    ...     def validate(self):
    ...         if self.interval_s <= 0:
    ...             raise ValueError(f"interval_s must be > 0 (got {self.interval_s})")
    >>> build(PollConfig, {"interval_s": 2}, "receivers.nvml").interval_s
    2.0
    >>> build(PollConfig, {"intervall_s": 2}, "receivers.nvml")
    Traceback (most recent call last):
    ...
    otel_gpu.config.ConfigError: receivers.nvml.intervall_s: unknown setting (did you mean 'interval_s'? known: interval_s)
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigError", "build", "env_value", "did_you_mean"]


class ConfigError(ValueError):
    """A configuration problem; ``str()`` lists every problem, one per line, each naming its key."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


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
        return build(tp, value, path)
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
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(repr(m.value) for m in tp)}") from None
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
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        if key not in fields:
            problems.append(f"{path}.{key}: unknown setting ({did_you_mean(key, fields)}known: {', '.join(fields)})")
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], f"{path}.{key}")
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
            raise ConfigError([p if p.startswith(path) else f"{path}.{p}" for p in exc.problems]) from None
        except ValueError as exc:
            raise ConfigError(f"{path}.{exc}") from None
    return obj


def env_value(name: str, default: Any, parse=str, *, logger=None) -> Any:
    """An ``OTEL_GPU_*`` / ``OTEL_*`` environment value; a bad one warns and falls back to ``default``."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except (TypeError, ValueError):
        if logger is not None:
            logger.warning("ignoring %s=%r: not a valid %s; using %r", name, raw, getattr(parse, "__name__", parse),
                           default)
        return default
