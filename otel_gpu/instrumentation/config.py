"""Settings of the in-process instrumentation: explicit argument > ``OTEL_GPU_*`` / ``OTEL_*`` variable > default.

The OpenTelemetry SDK's environment variables for exporters, resources and the SDK switch are read here too (the
fast export path honours them; see README.md for the table): :func:`signal_routes` turns the per-signal
``OTEL_EXPORTER_OTLP_{TRACES,METRICS,LOGS}_*`` variables into one :class:`~otel_gpu.instrumentation._export.Route`
per signal. A bad value warns (naming the variable) and falls back.

Example:
    >>> cfg = InstrumentationConfig.from_env({"OTEL_GPU_HEARTBEAT_S": "1"}, stack_after_s=5.0)
    >>> (cfg.heartbeat_s, cfg.stack_after_s)
    (1.0, 5.0)
    >>> env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    ...        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://logs:4318/ingest", "OTEL_TRACES_EXPORTER": "none"}
    >>> routes = signal_routes(InstrumentationConfig.from_env(env), env)
    >>> routes["metrics"].url, routes["logs"].url, routes["traces"].otlp
    ('http://c:4318/v1/metrics', 'http://logs:4318/ingest', False)
"""
from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

_logger = logging.getLogger(__name__)

__all__ = ["InstrumentationConfig", "ENV", "VARIABLES", "env", "set_env", "attribute_limits", "signal_routes",
           "unsupported_settings"]

#: option name -> environment variable. A bad environment value warns and falls back to the default.
ENV = {
    "endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "protocol": "OTEL_EXPORTER_OTLP_PROTOCOL",
    "headers": "OTEL_EXPORTER_OTLP_HEADERS",
    "service_name": "OTEL_SERVICE_NAME",
    "resource_attributes": "OTEL_RESOURCE_ATTRIBUTES",
    "job_id": "OTEL_GPU_JOB_ID",
    "heartbeat_s": "OTEL_GPU_HEARTBEAT_S",
    "stack_after_s": "OTEL_GPU_STACK_AFTER_S",
    "export_interval_s": "OTEL_GPU_EXPORT_INTERVAL_S",
    "export_timeout_s": "OTEL_GPU_EXPORT_TIMEOUT_S",
    "ring_size": "OTEL_GPU_RING_SIZE",
    "flight_recorder": "OTEL_GPU_FLIGHT_RECORDER",
    "flight_recorder_size": "OTEL_GPU_FLIGHT_RECORDER_SIZE",
    "crash_hooks": "OTEL_GPU_CRASH_HOOKS",
    "flush_timeout_s": "OTEL_GPU_FLUSH_TIMEOUT_S",
    "registry_dir": "OTEL_GPU_REGISTRY",
    "sdk_disabled": "OTEL_SDK_DISABLED",
}


_SIGNAL_VARS = tuple(f"OTEL_EXPORTER_OTLP_{signal}_{name}" for signal in ("TRACES", "METRICS", "LOGS")
                     for name in ("ENDPOINT", "PROTOCOL", "HEADERS", "TIMEOUT", "COMPRESSION", "INSECURE",
                                  "CERTIFICATE", "CLIENT_CERTIFICATE", "CLIENT_KEY"))
_TLS_VARS = tuple(f"OTEL_EXPORTER_OTLP_{name}" for name in ("TIMEOUT", "COMPRESSION", "INSECURE", "CERTIFICATE",
                                                            "CLIENT_CERTIFICATE", "CLIENT_KEY"))

#: Every environment variable the instrumentation reads (or sets), in one place: name -> (default, kind). Kinds:
#: ``setting`` (ours, in README.md's settings table: the variables of ``ENV`` and the settings without an option),
#: ``sdk`` (the OpenTelemetry SDK's, README.md's SDK tables), ``launcher`` (set by torchrun, Slurm, ``otel-gpu run``
#: or the container runtime; read for identity), ``torch`` (torch's and gRPC's own, set for them). Defaults are the
#: text of an unset variable's effect ("": see the option's default, or unset means nothing). The SDK variables that
#: do not apply (``_UNSUPPORTED``) are added below that table. Modules read and set them through :func:`env` and
#: :func:`set_env` only (tests/test_instrumentation_unit.py checks).
VARIABLES: dict[str, tuple[str, str]] = {
    **{var: ("", "setting") for var in ENV.values() if var.startswith("OTEL_GPU_")},
    "OTEL_GPU_EXPORT_BUFFER_MIB": ("8", "setting"),
    **{var: ("", "sdk") for var in ENV.values() if not var.startswith("OTEL_GPU_")},
    "OTEL_BSP_SCHEDULE_DELAY": ("", "sdk"),
    **{f"OTEL_{signal}_EXPORTER": ("otlp", "sdk") for signal in ("TRACES", "METRICS", "LOGS")},
    **{var: ("", "sdk") for var in _SIGNAL_VARS + _TLS_VARS},
    **{var: ("", "sdk") for var in ("OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
                                   "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
                                   "OTEL_LOGRECORD_ATTRIBUTE_COUNT_LIMIT",
                                   "OTEL_LOGRECORD_ATTRIBUTE_VALUE_LENGTH_LIMIT")},
    **{var: ("", "launcher") for var in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "CUDA_VISIBLE_DEVICES",
        "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA",
        "OTEL_GPU_AUTO", "OTEL_GPU_AUTO_SKIP", "OTEL_GPU_RESTART_COUNT", "OTEL_GPU_JOB_ID_PROVISIONAL")},
    **{var: ("", "torch") for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                                     "TORCH_NCCL_ENABLE_TIMING", "GRPC_ENABLE_FORK_SUPPORT")},
}


def env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name`` (one of :data:`VARIABLES`) in ``environ`` (default ``os.environ``), None when unset.

    >>> env("OTEL_GPU_HEARTBEAT_S", {"OTEL_GPU_HEARTBEAT_S": "1"})
    '1'
    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in otel_gpu.instrumentation.config.VARIABLES: add it there (and to README.md)")
    return (os.environ if environ is None else environ).get(name)


def set_env(name: str, value: str | None, only_if_unset: bool = False) -> None:
    """Sets (``value`` None: removes) one of :data:`VARIABLES` in this process's environment, for torch or gRPC."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in otel_gpu.instrumentation.config.VARIABLES")
    if value is None:
        os.environ.pop(name, None)
    elif not (only_if_unset and name in os.environ):
        os.environ[name] = value


SIGNALS = ("traces", "metrics", "logs")


@dataclass
class Route:
    """Where and how one signal is sent (from the OTEL_EXPORTER_OTLP_* variables, see config.signal_routes).

    ``url`` is the full URL for HTTP (``.../v1/traces``) and ``[scheme://]host:port`` for gRPC; ``secure`` decides TLS
    for a gRPC endpoint; ``otlp`` False drops the signal (OTEL_*_EXPORTER=none or console only); ``console`` also
    writes each request as one OTLP/JSON line to stdout."""

    url: str
    protocol: str = "grpc"  # grpc | http/protobuf
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 2.0
    compression: str = "none"  # none | gzip
    secure: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    otlp: bool = True
    console: bool = False

    @property
    def tls_files(self) -> tuple[str, str, str]:
        return self.ca_file, self.cert_file, self.key_file


def signal_url(endpoint: str, protocol: str, signal: str) -> str:
    """The generic endpoint (OTEL_EXPORTER_OTLP_ENDPOINT) for one signal: HTTP appends ``/v1/<signal>`` to its path
    (``http://h:4318/base`` -> ``http://h:4318/base/v1/traces``), gRPC uses it as it is.

    >>> signal_url("http://c:4318/otlp/", "http/protobuf", "logs"), signal_url("c:4317", "grpc", "logs")
    ('http://c:4318/otlp/v1/logs', 'c:4317')
    """
    if protocol == "grpc":
        return endpoint
    url = endpoint.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return f"{url}/v1/{signal}"


def export_buffer_mib(default: float = 8.0) -> float:
    """OTEL_GPU_EXPORT_BUFFER_MIB: MiB of unsent requests kept while the collector is down."""
    raw = (env("OTEL_GPU_EXPORT_BUFFER_MIB") or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        _logger.warning("otel-gpu: OTEL_GPU_EXPORT_BUFFER_MIB=%r is not a size in MiB >= 0; using %s", raw, default)
        return default


def _parse_kv(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` with percent-encoded values (the OTEL_RESOURCE_ATTRIBUTES / _HEADERS format)."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if "=" not in item:
            continue
        k, v = item.split("=", 1)
        if k.strip():
            out[urllib.parse.unquote(k.strip())] = urllib.parse.unquote(v.strip())
    return out


@dataclass
class InstrumentationConfig:
    """Every setting with its default (see README.md)."""

    endpoint: str = "http://127.0.0.1:4317"
    protocol: str = "grpc"  # grpc | http/protobuf
    headers: dict[str, str] = field(default_factory=dict)
    service_name: str = "otel-gpu-training"
    resource_attributes: dict[str, str] = field(default_factory=dict)
    job_id: str | None = None
    heartbeat_s: float = 2.0
    stack_after_s: float = 10.0
    export_interval_s: float = 1.0
    export_timeout_s: float = 2.0
    ring_size: int = 65536
    flight_recorder: bool = True
    flight_recorder_size: int = 2000
    crash_hooks: bool = True
    flush_timeout_s: float = 3.0
    registry_dir: str | None = None
    sdk_disabled: bool = False  # OTEL_SDK_DISABLED=true: instrument() does nothing

    def validate(self) -> None:
        """Raises ValueError naming the bad option."""
        for name in ("heartbeat_s", "stack_after_s", "export_interval_s", "export_timeout_s", "flush_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"instrumentation option {name} must be > 0 (got {value!r})")
        if not isinstance(self.ring_size, int) or self.ring_size < 16:
            raise ValueError(f"instrumentation option ring_size must be an int >= 16 (got {self.ring_size!r})")
        if self.protocol not in ("grpc", "http/protobuf"):
            raise ValueError(f"instrumentation option protocol must be grpc or http/protobuf (got {self.protocol!r}; "
                             f"http/json is not supported by the fast export path)")
        if not isinstance(self.flight_recorder_size, int) or self.flight_recorder_size < 0:
            raise ValueError("instrumentation option flight_recorder_size must be an int >= 0 "
                             f"(got {self.flight_recorder_size!r})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options) -> InstrumentationConfig:
        """Builds the config: ``options`` win over ``environ`` (default ``os.environ``), which wins over defaults."""
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        unknown = set(options) - set(known)
        if unknown:
            raise ValueError(f"unknown instrumentation option(s): {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(sorted(known))})")
        cfg = cls()
        cfg.set_by = {}  # option -> "argument" or the variable that set it (what signal_routes' precedence needs)
        for name, var in ENV.items():
            raw = env(var, environ)
            if raw is None or raw == "":
                continue
            default = getattr(cfg, name)
            try:
                if name in ("headers", "resource_attributes"):
                    value = _parse_kv(raw)
                elif isinstance(default, bool):
                    if raw.strip().lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                        raise ValueError(raw)
                    value = raw.strip().lower() in ("1", "true", "yes", "on")
                elif isinstance(default, int):
                    value = int(raw)
                elif isinstance(default, float):
                    value = float(raw)
                else:
                    value = raw.strip()
                setattr(cfg, name, value)
                cfg.validate()
                cfg.set_by[name] = var
            except ValueError:
                _logger.warning("ignoring %s=%r: not a valid value for %s (keeping %r)", var, raw, name, default)
                setattr(cfg, name, default)
        for name, value in options.items():
            if value is not None:
                if isinstance(getattr(cls, name, None), float) and type(value) is int:
                    value = float(value)
                setattr(cfg, name, value)
                cfg.set_by[name] = "argument"
        if "export_interval_s" not in cfg.set_by:
            # The SDK's batch span processor delay (ms) is our export period when OTEL_GPU_EXPORT_INTERVAL_S is unset.
            delay = _env_number(environ, "OTEL_BSP_SCHEDULE_DELAY", scale=1e-3)
            if delay is not None:
                cfg.export_interval_s = delay
                cfg.set_by["export_interval_s"] = "OTEL_BSP_SCHEDULE_DELAY"
        cfg.validate()
        return cfg


def _warn(var: str, raw: str, hint: str) -> None:
    _logger.warning("otel-gpu: ignoring %s=%r: %s", var, raw, hint)


def _env_number(environ: Mapping[str, str], var: str, scale: float = 1.0) -> float | None:
    """A positive number of milliseconds (or other unit, ``scale`` to seconds) from ``var``; None when unset or bad."""
    raw = (env(var, environ) or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
        if not value > 0 or value == float("inf"):
            raise ValueError
    except ValueError:
        _warn(var, raw, "expected a number > 0 (milliseconds)")
        return None
    return value * scale


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(variable, value) of the first of ``names`` set to something non-empty."""
    for name in names:
        raw = env(name, environ)
        if raw is not None and raw.strip():
            return name, raw.strip()
    return None


_EXPORTER_VALUES = {"otlp", "console", "logging", "none"}


def _exporters(environ: Mapping[str, str], signal: str) -> tuple[bool, bool]:
    """(otlp, console) from OTEL_{SIGNAL}_EXPORTER: a comma-separated list of otlp, console (logging: its old name),
    none. Values the fast path cannot serve (zipkin, prometheus, ...) warn and are left out; none valid: otlp."""
    var = f"OTEL_{signal.upper()}_EXPORTER"
    raw = (env(var, environ) or "").strip()
    if not raw:
        return True, False
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    bad = [n for n in names if n not in _EXPORTER_VALUES]
    if bad:
        _warn(var, raw, f"{', '.join(bad)} not available on otel-gpu's fast export path (it sends OTLP itself); "
                        f"known: otlp, console, none")
    good = [n for n in names if n in _EXPORTER_VALUES]
    if not good:
        return True, False
    if good == ["none"]:
        return False, False
    return "otlp" in good, bool({"console", "logging"} & set(good))


def signal_routes(cfg: InstrumentationConfig, environ: Mapping[str, str] | None = None) -> dict:
    """One Route per signal (traces, metrics, logs) from ``cfg`` and the OTEL_EXPORTER_OTLP_* variables.

    Per setting: an explicit argument (``instrument(endpoint=...)``) > the signal's variable
    (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) > the generic one (``OTEL_EXPORTER_OTLP_ENDPOINT``) > the default. A
    signal's own HTTP endpoint is used as it is; the generic one gets ``/v1/<signal>`` appended.
    """
    environ = os.environ if environ is None else environ
    set_by = getattr(cfg, "set_by", {})
    explicit = {name for name, how in set_by.items() if how == "argument"}
    routes = {}
    for signal in SIGNALS:
        sig = f"OTEL_EXPORTER_OTLP_{signal.upper()}_"
        otlp, console = _exporters(environ, signal)
        protocol = cfg.protocol
        if "protocol" not in explicit and (found := _first(environ, sig + "PROTOCOL")):
            if found[1] in ("grpc", "http/protobuf"):
                protocol = found[1]
            else:
                _warn(found[0], found[1], f"expected grpc or http/protobuf (http/json is not supported by the fast "
                                          f"export path); using {protocol}")
        if "endpoint" in explicit:
            url = signal_url(cfg.endpoint, protocol, signal)
        elif found := _first(environ, sig + "ENDPOINT"):
            url = found[1] if protocol == "grpc" or found[1].startswith(("http://", "https://")) \
                else "http://" + found[1]
        elif "endpoint" in set_by:
            url = signal_url(cfg.endpoint, protocol, signal)
        else:  # the default: the local collector, on the protocol's port
            url = signal_url("http://127.0.0.1:4318" if protocol != "grpc" else cfg.endpoint, protocol, signal)
        headers = dict(cfg.headers)
        if "headers" not in explicit and (found := _first(environ, sig + "HEADERS")):
            headers = _parse_kv(found[1])
        timeout_s = cfg.export_timeout_s
        if "export_timeout_s" not in set_by:
            for var in (sig + "TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
                value = _env_number(environ, var, scale=1e-3)
                if value is not None:
                    timeout_s = value
                    break
        compression = "none"
        if found := _first(environ, sig + "COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"):
            if found[1].lower() in ("gzip", "none"):
                compression = found[1].lower()
            else:
                _warn(found[0], found[1], "expected gzip or none; sending uncompressed")
        insecure = None
        if found := _first(environ, sig + "INSECURE", "OTEL_EXPORTER_OTLP_INSECURE"):
            if found[1].lower() in ("true", "false"):
                insecure = found[1].lower() == "true"
            else:
                _warn(found[0], found[1], "expected true or false")
        if url.startswith("https://"):
            secure = True
        elif url.startswith(("http://", "grpc://")):
            secure = False
        else:  # a bare host:port: OTEL_EXPORTER_OTLP_INSECURE decides (unset: plaintext, see README)
            secure = insecure is False
        files = []
        for name in ("CERTIFICATE", "CLIENT_CERTIFICATE", "CLIENT_KEY"):
            found = _first(environ, sig + name, f"OTEL_EXPORTER_OTLP_{name}")
            files.append(found[1] if found else "")
        routes[signal] = Route(url, protocol, headers, timeout_s, compression, secure, files[0], files[1], files[2],
                               otlp=otlp, console=console)
    return routes


def attribute_limits(environ: Mapping[str, str] | None = None) -> dict[str, tuple[int | None, int | None] | None]:
    """{"spans": (count, length), "logs": (count, length)} from OTEL_SPAN_ATTRIBUTE_* / OTEL_LOGRECORD_ATTRIBUTE_*,
    each falling back to OTEL_ATTRIBUTE_COUNT_LIMIT / OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT; None where nothing is set.
    (The spec's default count limit of 128 is above what any otel-gpu span or record carries.) Resources are exempt."""
    environ = os.environ if environ is None else environ

    def number(*names: str) -> int | None:
        found = _first(environ, *names)
        if found is None:
            return None
        try:
            value = int(found[1])
            if value < 0:
                raise ValueError
            return value
        except ValueError:
            _warn(found[0], found[1], "expected an integer >= 0; no limit")
            return None

    out: dict[str, tuple[int | None, int | None] | None] = {}
    for key, prefix in (("spans", "OTEL_SPAN_ATTRIBUTE_"), ("logs", "OTEL_LOGRECORD_ATTRIBUTE_")):
        limits = (number(prefix + "COUNT_LIMIT", "OTEL_ATTRIBUTE_COUNT_LIMIT"),
                  number(prefix + "VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"))
        out[key] = None if limits == (None, None) else limits
    return out


#: Variables of the SDK specification that cannot apply to the fast export path, with what happens instead. Values
#: that describe what the fast path does anyway (always_on sampling) are not reported.
_UNSUPPORTED = {
    "OTEL_TRACES_SAMPLER": "every span is kept: attribution needs every step and collective (sample in the collector)",
    "OTEL_TRACES_SAMPLER_ARG": "no sampler on the fast path",
    "OTEL_SPAN_EVENT_COUNT_LIMIT": "spans carry no events",
    "OTEL_SPAN_LINK_COUNT_LIMIT": "spans carry no links",
    "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT": "spans carry no events",
    "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT": "spans carry no links",
    "OTEL_BSP_MAX_QUEUE_SIZE": "the hot path's ring (OTEL_GPU_RING_SIZE) bounds what waits",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "requests hold up to 2000 spans",
    "OTEL_BSP_EXPORT_TIMEOUT": "OTEL_EXPORTER_OTLP_TIMEOUT / OTEL_GPU_EXPORT_TIMEOUT_S bound each request",
    "OTEL_BLRP_SCHEDULE_DELAY": "records go out with the span export (OTEL_GPU_EXPORT_INTERVAL_S) or at once",
    "OTEL_BLRP_MAX_QUEUE_SIZE": "records wait in a bounded queue of 4096",
    "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE": "records are sent in requests of up to 512",
    "OTEL_BLRP_EXPORT_TIMEOUT": "OTEL_EXPORTER_OTLP_TIMEOUT / OTEL_GPU_EXPORT_TIMEOUT_S bound each request",
    "OTEL_METRIC_EXPORT_INTERVAL": "metrics go out with every heartbeat (OTEL_GPU_HEARTBEAT_S)",
    "OTEL_METRIC_EXPORT_TIMEOUT": "OTEL_EXPORTER_OTLP_TIMEOUT / OTEL_GPU_EXPORT_TIMEOUT_S bound each request",
    "OTEL_METRICS_EXEMPLAR_FILTER": "no exemplars are recorded",
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "sums and histograms are cumulative",
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "histograms have fixed explicit buckets",
    "OTEL_PROPAGATORS": "no context crosses process boundaries (a step's trace id is derived from job and step)",
}
VARIABLES.update({var: ("", "sdk") for var in _UNSUPPORTED})  # read only to warn that they do not apply
_MATCHING = {"OTEL_TRACES_SAMPLER": ("always_on", "parentbased_always_on")}


def unsupported_settings(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(variable, value, what happens instead) for each SDK variable set that the fast path cannot honour."""
    environ = os.environ if environ is None else environ
    out = []
    for var, instead in _UNSUPPORTED.items():
        raw = (env(var, environ) or "").strip()
        if raw and raw.lower() not in _MATCHING.get(var, ()):
            out.append((var, raw, instead))
    return out
