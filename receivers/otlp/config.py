"""Settings of the ``otlp`` receiver.

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(OtlpReceiverConfig, {"grpc": {"endpoint": "127.0.0.1:0"}, "http": None}, "receivers.otlp")
    >>> cfg.grpc.endpoint, cfg.http
    ('127.0.0.1:0', None)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from otel_gpu.collector.security import BearerAuthConfig, ServerTlsConfig, validate_secret

__all__ = ["GrpcServerConfig", "HttpServerConfig", "LimitsConfig", "OtlpReceiverConfig", "ProtocolsConfig",
           "TrustedForwardersConfig", "split_endpoint"]


def split_endpoint(endpoint: str, key: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) into its parts; raises ValueError naming ``key``."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{key} must be HOST:PORT, e.g. 127.0.0.1:4317 (got {endpoint!r})")
    return host.strip("[]"), int(port)


@dataclass
class GrpcServerConfig:
    endpoint: str = "127.0.0.1:4317"
    max_recv_msg_size_mib: float = 16.0
    max_workers: int = 8  # threads serving requests
    tls: ServerTlsConfig | None = None  # {cert_file, key_file, client_ca_file}: TLS (mutual with client_ca_file)
    auth: BearerAuthConfig | None = None  # {bearer_token_file} or {bearer_token: ${env:VAR}}

    def validate(self) -> None:
        split_endpoint(self.endpoint, "endpoint")
        if self.max_recv_msg_size_mib <= 0:
            raise ValueError(f"max_recv_msg_size_mib must be > 0 (got {self.max_recv_msg_size_mib})")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1 (got {self.max_workers})")


@dataclass
class HttpServerConfig:
    endpoint: str = "127.0.0.1:4318"
    max_request_body_size_mib: float = 16.0
    read_timeout_s: float = 30.0  # a client that stops sending mid-body is dropped after this
    max_connections: int = 256  # open connections served at once (one thread each); more get 503 + Retry-After
    tls: ServerTlsConfig | None = None
    auth: BearerAuthConfig | None = None

    def validate(self) -> None:
        split_endpoint(self.endpoint, "endpoint")
        if self.max_request_body_size_mib <= 0:
            raise ValueError(f"max_request_body_size_mib must be > 0 (got {self.max_request_body_size_mib})")
        if self.read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be > 0 (got {self.read_timeout_s})")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (got {self.max_connections})")


@dataclass
class ProtocolsConfig:
    """The OpenTelemetry Collector's spelling (``protocols: {grpc: {...}}``): only the protocols named are served.

    The fields are typed non-optional on purpose: ``grpc:`` with no value (YAML null) means "on, with defaults", as
    in the OpenTelemetry Collector, while a protocol that is not named at all stays ``None`` (off).
    """

    grpc: GrpcServerConfig = None  # type: ignore[assignment]
    http: HttpServerConfig = None  # type: ignore[assignment]

    def validate(self) -> None:
        return None


@dataclass
class TrustedForwardersConfig:
    """Peers that may send records that act (failures, device states, restart decisions, goodput): the sidecars
    that forward to an aggregator, and ``otel-gpu run``. A request is a trusted forwarder's when it presents
    ``bearer_token`` (``authorization: Bearer <token>``), or, over mutual TLS, a client certificate whose subject
    CN or a DNS subject-alternative name is in ``client_names``."""

    bearer_token: Any = ""
    bearer_token_file: str = ""
    client_names: list[str] = field(default_factory=list)

    def validate(self) -> None:
        self.bearer_token = validate_secret(self.bearer_token, "bearer_token")
        if self.bearer_token and self.bearer_token_file:
            raise ValueError("bearer_token: set bearer_token or bearer_token_file, not both")
        if not self.bearer_token and not self.bearer_token_file and not self.client_names:
            raise ValueError("bearer_token_file: trusted_forwarders needs bearer_token_file (or bearer_token: "
                             "${env:VAR}) or client_names (mutual TLS); remove it to trust no sender")
        for i, name in enumerate(self.client_names):
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"client_names[{i}]: a certificate subject CN or DNS name (got {name!r})")

    def bearer(self) -> BearerAuthConfig | None:
        if not self.bearer_token and not self.bearer_token_file:
            return None
        return BearerAuthConfig(self.bearer_token, self.bearer_token_file)


@dataclass
class LimitsConfig:
    """Per-request bounds on what one sender can make the collector hold: attributes past ``max_attributes`` on a
    resource, a scope or an item (span, data point, log record) are dropped, and string / bytes values longer than
    ``max_attribute_value_bytes`` (also inside lists and maps) are cut to it; each cut counts 1 in
    ``otel_gpu.collector.truncated``."""

    max_attributes: int = 128
    max_attribute_value_bytes: int = 16384

    def validate(self) -> None:
        if self.max_attributes < 1:
            raise ValueError(f"max_attributes must be >= 1 (got {self.max_attributes})")
        if self.max_attribute_value_bytes < 64:
            raise ValueError(f"max_attribute_value_bytes must be >= 64 (got {self.max_attribute_value_bytes})")


@dataclass
class OtlpReceiverConfig:
    """``grpc`` and ``http`` are served by default; set one to null to turn it off."""

    grpc: GrpcServerConfig | None = field(default_factory=GrpcServerConfig)
    http: HttpServerConfig | None = field(default_factory=HttpServerConfig)
    protocols: ProtocolsConfig | None = None
    trusted_forwarders: TrustedForwardersConfig | None = None  # who may send records that act; none by default
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    def validate(self) -> None:
        if self.protocols is not None:
            # As in the OpenTelemetry Collector, `protocols:` lists what to serve; a protocol left out is off.
            self.grpc, self.http = self.protocols.grpc, self.protocols.http
        if self.grpc is None and self.http is None:
            raise ValueError("grpc: both grpc and http are null; enable at least one protocol")
        tf = self.trusted_forwarders
        if tf is not None and tf.client_names:
            mtls = [s for s in (self.grpc, self.http) if s is not None and s.tls is not None and s.tls.client_ca_file]
            if not mtls:
                raise ValueError("trusted_forwarders.client_names: names client certificates, which needs mutual "
                                 "TLS: set grpc.tls.client_ca_file (or http.tls.client_ca_file)")
