"""Settings of the in-process instrumentation: explicit argument > ``OTEL_GPU_*`` / ``OTEL_*`` variable > default.

Example:
    >>> cfg = InstrumentationConfig.from_env({"OTEL_GPU_HEARTBEAT_S": "1"}, stack_after_s=5.0)
    >>> (cfg.heartbeat_s, cfg.stack_after_s)
    (1.0, 5.0)
"""
from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

_logger = logging.getLogger(__name__)

__all__ = ["InstrumentationConfig", "ENV"]

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
}


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

    def validate(self) -> None:
        """Raises ValueError naming the bad option."""
        for name in ("heartbeat_s", "stack_after_s", "export_interval_s", "export_timeout_s", "flush_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"instrumentation option {name} must be > 0 (got {value!r})")
        if not isinstance(self.ring_size, int) or self.ring_size < 16:
            raise ValueError(f"instrumentation option ring_size must be an int >= 16 (got {self.ring_size!r})")
        if self.protocol not in ("grpc", "http/protobuf"):
            raise ValueError(f"instrumentation option protocol must be grpc or http/protobuf (got {self.protocol!r})")
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
        for name, var in ENV.items():
            raw = environ.get(var)
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
            except ValueError:
                _logger.warning("ignoring %s=%r: not a valid value for %s (keeping %r)", var, raw, name, default)
                setattr(cfg, name, default)
        for name, value in options.items():
            if value is not None:
                setattr(cfg, name, value)
        cfg.validate()
        return cfg
