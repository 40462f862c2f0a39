"""Collector configuration in the OpenTelemetry Collector's shape, validated before anything starts.

Example:
    >>> cfg = load_text('''
    ... receivers: {otlp: {}}
    ... exporters: {debug: {}}
    ... service: {pipelines: {traces: {receivers: [otlp], exporters: [debug]}}}
    ... ''')
    >>> [p.name for p in cfg.pipelines]
    ['traces']
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from otel_gpu.collector.registry import known_types, load_factory
from otel_gpu.collector.security import BearerAuthConfig, ServerTlsConfig
from otel_gpu.component import ComponentFactory
from otel_gpu.config import ConfigError, build, did_you_mean
from otel_gpu.pdata import Signal

__all__ = ["CollectorConfig", "ComponentSpec", "PipelineSpec", "load_file", "load_text", "load_default",
           "DEFAULT_CONFIG_TEXT"]

_KINDS = {"receivers": "receiver", "processors": "processor", "exporters": "exporter"}
_ALL_KINDS = {**_KINDS, "extensions": "extension"}
_TOP_KEYS = ("receivers", "processors", "exporters", "extensions", "connectors", "service")
_ID = re.compile(r"^[a-zA-Z][a-zA-Z0-9_]*(/[^/\s]+)?$")
_ENV = re.compile(r"\$\{(?:env:)?([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass
class ComponentSpec:
    id: str  # "type" or "type/name"
    kind: str
    factory: ComponentFactory
    config: Any

    @property
    def type(self) -> str:
        return self.id.partition("/")[0]


@dataclass
class PipelineSpec:
    name: str  # "traces" or "traces/gpu"
    signal: Signal
    receivers: list[str]
    processors: list[str]
    exporters: list[str]


@dataclass
class TelemetryLogsConfig:
    """``service.telemetry.logs``: the Collector's keys; ``level`` and ``encoding`` act, the rest of zap's output
    settings are accepted only with their default values."""

    level: str = "info"  # debug, info, warn (warning), error
    encoding: str = "console"  # console or json
    development: bool = False
    disable_caller: bool = False
    disable_stacktrace: bool = False
    output_paths: list[str] = field(default_factory=lambda: ["stderr"])
    error_output_paths: list[str] = field(default_factory=lambda: ["stderr"])
    initial_fields: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] | None = None

    def validate(self) -> None:
        if self.level.lower() not in ("debug", "info", "warn", "warning", "error"):
            raise ValueError(f"level must be debug, info, warn or error (got {self.level!r})")
        if self.encoding not in ("console", "json"):
            raise ValueError(f"encoding must be console or json (got {self.encoding!r})")
        for key in ("output_paths", "error_output_paths"):
            if any(p not in ("stderr", "stdout") for p in getattr(self, key)):
                raise ValueError(f"{key}: only stderr and stdout are supported by otel-gpu (got "
                                 f"{getattr(self, key)!r}); redirect the process's output instead")

    @property
    def python_level(self) -> str:
        level = self.level.upper()
        return "WARNING" if level == "WARN" else level


@dataclass
class TelemetryMetricsConfig:
    """``service.telemetry.metrics``: where the collector's own metrics are served in the Prometheus format.
    ``address: HOST:PORT`` (the Collector's older key) or ``readers: [{pull: {exporter: {prometheus: {host, port}}}}]``;
    ``level: none`` serves nothing. They are served in any case on every Prometheus exporter's /metrics."""

    level: str = "normal"  # none, basic, normal, detailed (all but none serve the same metrics)
    address: str = ""
    readers: list[dict[str, Any]] = field(default_factory=list)
    # otel-gpu's own (the page lists every component's counters): https, and a bearer token to scrape it
    tls: ServerTlsConfig | None = None
    auth: BearerAuthConfig | None = None
    max_connections: int = 32

    def validate(self) -> None:
        if self.level not in ("none", "basic", "normal", "detailed"):
            raise ValueError(f"level must be none, basic, normal or detailed (got {self.level!r})")
        if self.address:
            _host_port(self.address, "address")
        for i, reader in enumerate(self.readers):
            _reader_address(reader, f"readers[{i}]")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (got {self.max_connections})")

    def addresses(self) -> list[tuple[str, int]]:
        """Every (host, port) to listen on; empty with ``level: none``."""
        if self.level == "none":
            return []
        out = [_host_port(self.address, "address")] if self.address else []
        out += [_reader_address(r, f"readers[{i}]") for i, r in enumerate(self.readers)]
        return out


def _host_port(text: str, key: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{key} must be HOST:PORT, e.g. 127.0.0.1:8888 (got {text!r})")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def _reader_address(reader: Any, key: str) -> tuple[str, int]:
    hint = "use {pull: {exporter: {prometheus: {host: 127.0.0.1, port: 8888}}}}"
    pull = reader.get("pull") if isinstance(reader, dict) else None
    exporter = pull.get("exporter") if isinstance(pull, dict) else None
    prom = exporter.get("prometheus") if isinstance(exporter, dict) else None
    if not isinstance(prom, dict) or set(reader) != {"pull"} or set(exporter) != {"prometheus"}:
        raise ValueError(f"{key}: only a pull reader with a prometheus exporter is supported ({hint}); periodic "
                         f"readers pushing OTLP are not: route the collector's metrics through a pipeline instead")
    unknown = set(prom) - {"host", "port", "without_units", "without_type_suffix", "without_scope_info"}
    if unknown:
        raise ValueError(f"{key}.pull.exporter.prometheus: unknown setting(s) {', '.join(sorted(map(str, unknown)))} "
                         f"(known: host, port)")
    port = prom.get("port", 8888)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"{key}.pull.exporter.prometheus.port must be a port number (got {port!r})")
    return str(prom.get("host") or "127.0.0.1").strip("[]"), port


@dataclass
class TelemetryConfig:
    """``service.telemetry``, in the OpenTelemetry Collector's shape."""

    logs: TelemetryLogsConfig = field(default_factory=TelemetryLogsConfig)
    metrics: TelemetryMetricsConfig = field(default_factory=TelemetryMetricsConfig)
    resource: dict[str, Any] = field(default_factory=dict)  # accepted; attributes of the collector's own telemetry
    traces: dict[str, Any] = field(default_factory=dict)  # accepted; the collector does not trace itself

    def validate(self) -> None:
        return None

    @property
    def log_level(self) -> str:
        """The Python logging level name, lower case (``warn`` -> ``warning``)."""
        return self.logs.python_level.lower()


@dataclass
class CollectorConfig:
    components: dict[str, ComponentSpec] = field(default_factory=dict)  # key: "<kind>:<id>"
    pipelines: list[PipelineSpec] = field(default_factory=list)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    source: str = "<default>"
    extensions: list[str] = field(default_factory=list)  # service.extensions: the extension ids to run, in order

    def component(self, kind: str, cid: str) -> ComponentSpec:
        return self.components[f"{kind}:{cid}"]


def _expand_env(node: Any) -> Any:
    """``${env:NAME}`` / ``${NAME}`` / ``${NAME:-default}`` in string values, as the OpenTelemetry Collector does."""
    if isinstance(node, str):
        def sub(m: re.Match) -> str:
            value = os.environ.get(m.group(1))
            if value is None:
                if m.group(2) is None:
                    raise ConfigError(f"environment variable {m.group(1)} is not set (used as {m.group(0)}); "
                                      f"set it or write ${{{m.group(1)}:-default}}")
                return m.group(2)
            return value
        expanded = _ENV.sub(sub, node)
        if expanded != node and _ENV.fullmatch(node):
            # A whole-value reference may stand for a number or boolean: let YAML type it.
            try:
                return yaml.safe_load(expanded)
            except Exception:  # noqa: BLE001 - see load_text: PyYAML leaks more than YAMLError
                return expanded
        return expanded
    if isinstance(node, dict):
        return {k: _expand_env(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_env(v) for v in node]
    return node


def _parse_components(section: str, data: Any, problems: list[str], out: dict[str, ComponentSpec]) -> None:
    kind = _ALL_KINDS[section]
    if data is None:
        return
    if not isinstance(data, dict):
        problems.append(f"{section}: expected a mapping of component ids to settings, got {type(data).__name__}")
        return
    for cid, settings in data.items():
        cid = str(cid)
        path = f"{section}.{cid}"
        if not _ID.match(cid):
            problems.append(f"{path}: invalid component id; use 'type' or 'type/name' (e.g. otlp/fast)")
            continue
        type_name = cid.partition("/")[0]
        try:
            factory = load_factory(kind, type_name)
        except ImportError as exc:
            problems.append(f"{path}: the {kind} type {type_name!r} could not be loaded ({exc}); is otel-gpu "
                            f"installed with all its dependencies?")
            continue
        if factory is None:
            known = known_types(kind)
            problems.append(f"{path}: unknown {kind} type {type_name!r} ({did_you_mean(type_name, known)}"
                            f"known: {', '.join(known)})")
            continue
        try:
            config = build(factory.config_class, settings, path)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        out[f"{kind}:{cid}"] = ComponentSpec(cid, kind, factory, config)


def _parse_pipelines(data: Any, components: dict[str, ComponentSpec], declared: dict[str, set[str]],
                     problems: list[str]) -> list[PipelineSpec]:
    pipelines: list[PipelineSpec] = []
    if not isinstance(data, dict) or not data:
        problems.append("service.pipelines: at least one pipeline is required, e.g. "
                        "{traces: {receivers: [otlp], exporters: [store]}}")
        return pipelines
    for name, spec in data.items():
        name = str(name)
        path = f"service.pipelines.{name}"
        signal_name = name.partition("/")[0]
        try:
            signal = Signal(signal_name)
        except ValueError:
            problems.append(f"{path}: unknown signal {signal_name!r}; a pipeline is named traces, metrics or logs "
                            f"(optionally traces/NAME)")
            continue
        if not isinstance(spec, dict):
            problems.append(f"{path}: expected a mapping with receivers, processors and exporters")
            continue
        for key in spec:
            if key not in ("receivers", "processors", "exporters"):
                problems.append(f"{path}.{key}: unknown setting ({did_you_mean(str(key), _KINDS)}known: receivers, "
                                f"processors, exporters)")
        lists: dict[str, list[str]] = {}
        for section, kind in _KINDS.items():
            ids = spec.get(section) or []
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                problems.append(f"{path}.{section}: expected a list of component ids, got {ids!r}")
                ids = []
            for cid in ids:
                if cid not in declared[section]:
                    problems.append(f"{path}.{section}: {cid!r} is not defined under {section}: "
                                    f"({did_you_mean(cid, declared[section])}defined: "
                                    f"{', '.join(sorted(declared[section])) or 'none'})")
                    continue
                comp = components.get(f"{kind}:{cid}")
                if comp is not None and signal not in tuple(comp.factory.signals):
                    problems.append(f"{path}.{section}: {cid!r} does not support {signal.value} (it supports "
                                    f"{', '.join(s.value for s in comp.factory.signals)})")
            if len(set(ids)) != len(ids):
                problems.append(f"{path}.{section}: a component is listed twice")
            lists[section] = list(ids)
        if not lists["receivers"]:
            problems.append(f"{path}.receivers: a pipeline needs at least one receiver")
        if not lists["exporters"]:
            problems.append(f"{path}.exporters: a pipeline needs at least one exporter")
        pipelines.append(PipelineSpec(name, signal, lists["receivers"], lists["processors"], lists["exporters"]))
    return pipelines


_SERVICE_KEYS = ("extensions", "pipelines", "telemetry")


def _parse_service_extensions(ids: Any, declared: set[str], problems: list[str]) -> list[str]:
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        problems.append(f"service.extensions: expected a list of extension ids, got {ids!r}")
        return []
    for cid in ids:
        if cid not in declared:
            problems.append(f"service.extensions: {cid!r} is not defined under extensions: "
                            f"({did_you_mean(cid, declared)}defined: {', '.join(sorted(declared)) or 'none'})")
    if len(set(ids)) != len(ids):
        problems.append("service.extensions: an extension is listed twice")
    return [cid for cid in ids if cid in declared]


def parse(data: Any, source: str = "<config>") -> CollectorConfig:
    """Validates a loaded YAML document. Raises ConfigError listing every problem found."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping with receivers, processors, exporters and "
                          f"service (got {type(data).__name__})")
    problems: list[str] = []
    for key in data:
        if key not in _TOP_KEYS:
            problems.append(f"{key}: unknown top-level section ({did_you_mean(str(key), _TOP_KEYS)}known: "
                            f"{', '.join(_TOP_KEYS)})")
    if data.get("connectors"):
        problems.append("connectors: not supported by otel-gpu; remove this section (route with pipelines instead)")
    try:
        data = _expand_env(data)
    except ConfigError as exc:
        raise ConfigError([f"{source}: {p}" for p in exc.problems]) from None
    components: dict[str, ComponentSpec] = {}
    declared: dict[str, set[str]] = {}
    for section in _ALL_KINDS:
        _parse_components(section, data.get(section), problems, components)
        raw = data.get(section)
        declared[section] = {str(k) for k in raw} if isinstance(raw, dict) else set()
    service = data.get("service")
    telemetry = TelemetryConfig()
    pipelines: list[PipelineSpec] = []
    extensions: list[str] = []
    if not isinstance(service, dict):
        problems.append("service: missing; add service: {pipelines: {traces: {receivers: [...], exporters: [...]}}}")
    else:
        for key in service:
            if key not in ("pipelines", "telemetry", "extensions"):
                problems.append(f"service.{key}: unknown setting ({did_you_mean(str(key), _SERVICE_KEYS)}known: "
                                f"{', '.join(_SERVICE_KEYS)})")
        pipelines = _parse_pipelines(service.get("pipelines"), components, declared, problems)
        extensions = _parse_service_extensions(service.get("extensions"), declared["extensions"], problems)
        try:
            telemetry = build(TelemetryConfig, service.get("telemetry"), "service.telemetry")
        except ConfigError as exc:
            problems.extend(exc.problems)
    used = {(kind, cid) for p in pipelines for section, kind in _KINDS.items() for cid in getattr(p, section)}
    used |= {("extension", cid) for cid in extensions}
    for key, comp in components.items():
        if (comp.kind, comp.id) not in used:
            # The OpenTelemetry Collector ignores unused components silently; we say so, since it is usually a typo.
            import logging

            logging.getLogger(__name__).warning("%ss.%s is defined but used by no pipeline", comp.kind, comp.id)
    if problems:
        raise ConfigError([f"{source}: {p}" for p in problems])
    return CollectorConfig(components, pipelines, telemetry, source, extensions)


def load_text(text: str, source: str = "<config>") -> CollectorConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:  # PyYAML composes recursively: [[[...]]] thousands deep
        raise ConfigError(f"{source}: not a usable YAML document: nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - PyYAML's constructors leak IndexError ("!!int"), KeyError ("!!bool
        # maybe"), AttributeError ("!!timestamp x"), ValueError (an int over 4,300 digits): all mean a bad file
        raise ConfigError(f"{source}: not a usable YAML document: {type(exc).__name__}: {exc}") from None
    return parse(data, source)


def load_file(path: str | os.PathLike) -> CollectorConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config {p}: cannot read the file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {p}: not UTF-8 text") from None
    return load_text(text, str(p))


DEFAULT_CONFIG_TEXT = resources.files("otel_gpu.collector").joinpath("default.yaml").read_text(encoding="utf-8")


def load_default() -> CollectorConfig:
    return load_text(DEFAULT_CONFIG_TEXT, "<built-in default config>")
