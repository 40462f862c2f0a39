"""Settings of the ``otlp`` (gRPC) and ``otlphttp`` exporters, in the OpenTelemetry Collector's shape.

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(OtlpExporterConfig, {"endpoint": "backend:4317", "sending_queue": {"queue_size": 50}},
    ...             "exporters.otlp")
    >>> cfg.sending_queue.queue_size, cfg.retry_on_failure.initial_interval_s
    (50, 5.0)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from otel_gpu.collector.security import BearerAuthConfig, ClientTlsConfig

__all__ = ["OtlpExporterConfig", "OtlpHttpExporterConfig", "PersistentQueueConfig", "QueueConfig", "RetryConfig",
           "TlsConfig"]


@dataclass
class RetryConfig:
    """Exponential backoff with jitter, as the OpenTelemetry Collector's ``retry_on_failure``."""

    enabled: bool = True
    initial_interval_s: float = 5.0
    max_interval_s: float = 30.0
    max_elapsed_time_s: float = 300.0  # give up (drop and count) after this long; 0 = retry until shutdown
    multiplier: float = 1.5
    randomization_factor: float = 0.5

    def validate(self) -> None:
        if self.initial_interval_s <= 0:
            raise ValueError(f"initial_interval_s must be > 0 (got {self.initial_interval_s})")
        if self.max_interval_s < self.initial_interval_s:
            raise ValueError(f"max_interval_s must be >= initial_interval_s (got {self.max_interval_s})")
        if self.max_elapsed_time_s < 0:
            raise ValueError(f"max_elapsed_time_s must be >= 0 (got {self.max_elapsed_time_s})")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1 (got {self.multiplier})")
        if not 0 <= self.randomization_factor <= 1:
            raise ValueError(f"randomization_factor must be within 0..1 (got {self.randomization_factor})")


@dataclass
class PersistentQueueConfig:
    """``sending_queue.persistent``: keep the queue on disk (SQLite) so that it survives a restart; see README."""

    path: str = ""  # a directory; empty: the queue lives in memory only
    max_size_mib: float = 256.0  # bound on the stored request bytes
    sync: str = "normal"  # normal: survives a killed collector; full: fsync per batch, survives power loss
    full_policy: str = "drop_oldest"  # when full: drop_oldest (queued, not in flight) or drop_newest

    def validate(self) -> None:
        if self.max_size_mib <= 0:
            raise ValueError(f"max_size_mib must be > 0 (got {self.max_size_mib})")
        if self.sync not in ("normal", "full"):
            raise ValueError(f"sync must be normal or full (got {self.sync!r})")
        if self.full_policy not in ("drop_oldest", "drop_newest"):
            raise ValueError(f"full_policy must be drop_oldest or drop_newest (got {self.full_policy!r})")


@dataclass
class QueueConfig:
    """A bounded queue of batches (in memory, or on disk with ``persistent.path``), drained by ``num_consumers``
    threads; a full queue drops."""

    enabled: bool = True  # false: export() sends (and retries) on the caller's thread, blocking the receiver
    queue_size: int = 1000  # batches
    num_consumers: int = 10
    persistent: PersistentQueueConfig = field(default_factory=PersistentQueueConfig)

    def validate(self) -> None:
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1 (got {self.queue_size})")
        if self.num_consumers < 1:
            raise ValueError(f"num_consumers must be >= 1 (got {self.num_consumers})")
        if self.persistent.path and not self.enabled:
            raise ValueError("persistent.path needs enabled: true (a disabled queue sends on the caller's thread)")


# ``tls``: insecure, ca_file, cert_file + key_file (client certificate for mTLS), insecure_skip_verify,
# server_name_override. One class for every client of ours (see otel_gpu.collector.security).
TlsConfig = ClientTlsConfig


def _validate_common(cfg) -> None:
    if cfg.timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 (got {cfg.timeout_s})")
    if cfg.compression not in ("gzip", "none", ""):
        raise ValueError(f"compression must be gzip or none (got {cfg.compression!r})")
    for key in cfg.headers:
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"headers: {key!r} is not a valid header name")


@dataclass
class _OtlpSettings:
    """The settings both OTLP exporters take; each validates its own endpoint form."""

    endpoint: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 5.0
    compression: str = "gzip"
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: BearerAuthConfig | None = None  # sends authorization: Bearer <token> (token from a file or ${env:VAR})
    retry_on_failure: RetryConfig = field(default_factory=RetryConfig)
    sending_queue: QueueConfig = field(default_factory=QueueConfig)


@dataclass
class OtlpExporterConfig(_OtlpSettings):
    """``otlp``: OTLP/gRPC. ``endpoint`` is ``host:port`` (plaintext) or ``https://host:port`` (TLS)."""

    def validate(self) -> None:
        if not self.endpoint:
            raise ValueError("endpoint is required, e.g. endpoint: backend.example:4317")
        target = self.endpoint.split("://", 1)[-1].rstrip("/")
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"endpoint must be HOST:PORT or http(s)://HOST:PORT, e.g. backend.example:4317 "
                             f"(got {self.endpoint!r})")
        _validate_common(self)

    @property
    def target(self) -> str:
        return self.endpoint.split("://", 1)[-1].rstrip("/")

    @property
    def use_tls(self) -> bool:
        if self.tls.insecure is not None:
            return not self.tls.insecure
        return self.endpoint.startswith("https://")


@dataclass
class OtlpHttpExporterConfig(_OtlpSettings):
    """``otlphttp``: OTLP/HTTP protobuf. ``endpoint`` is the base URL; ``/v1/traces`` etc. are appended."""

    def validate(self) -> None:
        if not self.endpoint:
            raise ValueError("endpoint is required, e.g. endpoint: http://backend.example:4318")
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint must be a URL like http://backend.example:4318 (got {self.endpoint!r})")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ValueError(f"endpoint has a bad port (got {self.endpoint!r})") from None
        _validate_common(self)

    @property
    def use_tls(self) -> bool:
        """TLS follows the URL's scheme; ``tls.insecure: true`` with https:// skips certificate verification."""
        return urlsplit(self.endpoint).scheme == "https"
