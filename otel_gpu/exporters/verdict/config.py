"""Settings of the ``verdict`` exporter (the failures HTTP API that ``otel-gpu run --restart`` reads).

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(VerdictExporterConfig, {"endpoint": "127.0.0.1:0"}, "exporters.verdict")
    >>> cfg.endpoint, cfg.max_jobs, cfg.auth
    ('127.0.0.1:0', 1000, None)
"""
from __future__ import annotations

from dataclasses import dataclass

from otel_gpu.collector.security import BearerAuthConfig, ServerTlsConfig

__all__ = ["DEFAULT_PORT", "VerdictExporterConfig", "parse_endpoint"]

#: 4317/4318 are OTLP, 9464 Prometheus, 13133 the health check: 4319 sits next to OTLP and is free of them.
DEFAULT_PORT = 4319


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ValueError naming ``endpoint``."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"endpoint must be HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT} (got {endpoint!r})")
    return host.strip("[]"), int(port)


@dataclass
class VerdictExporterConfig:
    """Where the API listens and how much it remembers (in memory: the latest version of each failure)."""

    endpoint: str = f"127.0.0.1:{DEFAULT_PORT}"
    max_jobs: int = 1000  # jobs remembered; the least recently updated is forgotten first
    max_failures_per_job: int = 200  # newest failures kept per job
    max_devices: int = 100_000  # device states kept (latest per device id); the least recently changed goes first
    tls: ServerTlsConfig | None = None  # {cert_file, key_file, client_ca_file}
    auth: BearerAuthConfig | None = None  # {bearer_token_file} or {bearer_token: ${env:VAR}}

    def validate(self) -> None:
        parse_endpoint(self.endpoint)
        for key in ("max_jobs", "max_failures_per_job", "max_devices"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1 (got {getattr(self, key)})")
