"""Settings of the ``health_check`` extension (the OpenTelemetry Collector's keys)."""
from __future__ import annotations

from dataclasses import dataclass, field

from otel_gpu.collector.security import BearerAuthConfig, ServerTlsConfig


@dataclass
class ResponseBodyConfig:
    """``response_body``: fixed bodies instead of the JSON status."""

    healthy: str = ""
    unhealthy: str = ""

    def validate(self) -> None:
        return None


@dataclass
class CheckPipelineConfig:
    """``check_collector_pipeline``: accepted for compatibility; the OpenTelemetry Collector's docs advise against it
    and otel-gpu does not implement it (``enabled: true`` is refused)."""

    enabled: bool = False
    interval: str = "5m"
    exporter_failure_threshold: int = 5

    def validate(self) -> None:
        if self.enabled:
            raise ValueError("enabled: true is not supported (the OpenTelemetry Collector deprecates this check); "
                             "remove check_collector_pipeline or set enabled: false")


@dataclass
class HealthCheckConfig:
    endpoint: str = "127.0.0.1:13133"
    path: str = "/"
    response_body: ResponseBodyConfig | None = None
    check_collector_pipeline: CheckPipelineConfig = field(default_factory=CheckPipelineConfig)
    max_connections: int = 32  # connections served at once; more get 503 + Retry-After
    tls: ServerTlsConfig | None = None  # {cert_file, key_file, client_ca_file}: serve https (mTLS with client_ca_file)
    auth: BearerAuthConfig | None = None  # {bearer_token_file}: requests need Authorization: Bearer <token>

    def validate(self) -> None:
        host, sep, port = self.endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"endpoint must be HOST:PORT, e.g. 127.0.0.1:13133 (got {self.endpoint!r})")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (got {self.max_connections})")
        if not self.path.startswith("/"):
            raise ValueError(f"path must start with / (got {self.path!r})")
