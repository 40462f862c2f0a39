"""Settings of the ``prometheus`` exporter.

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(PrometheusExporterConfig, {"resource_to_telemetry_conversion": {"enabled": False}},
    ...             "exporters.prometheus")
    >>> cfg.endpoint, cfg.resource_to_telemetry_conversion
    ('127.0.0.1:9464', False)
    >>> parse_endpoint("[::1]:9464")
    ('::1', 9464)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from otel_gpu._security import BasicAuthConfig, ServerTlsConfig

__all__ = ["PrometheusExporterConfig", "parse_endpoint"]

_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_NAMESPACE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port).

    Raises:
        ValueError: when the port is missing or out of range.
    """
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, e.g. 127.0.0.1:9464 (got {endpoint!r})")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535 (got {port})")
    host = host.strip("[]") or "0.0.0.0"
    return host, port


@dataclass
class PrometheusExporterConfig:
    """Where to serve ``/metrics`` and how OTLP metrics become Prometheus series.

    ``resource_to_telemetry_conversion`` accepts ``true``/``false`` or the OpenTelemetry Collector's
    ``{enabled: true}`` form.
    """

    endpoint: str = "127.0.0.1:9464"
    namespace: str = ""
    metric_expiration_s: float = 300.0
    resource_to_telemetry_conversion: bool | dict[str, bool] = True
    const_labels: dict[str, str] = field(default_factory=dict)
    tls: ServerTlsConfig | None = None  # {cert_file, key_file, client_ca_file}: serve https (mTLS with client_ca_file)
    basic_auth: BasicAuthConfig | None = None  # {username, password_file}: /metrics needs it; /health stays open

    def validate(self) -> None:
        try:
            parse_endpoint(self.endpoint)
        except ValueError as exc:
            raise ValueError(f"endpoint: {exc}") from None
        if self.namespace and not _NAMESPACE.match(self.namespace):
            raise ValueError(f"namespace must match [a-zA-Z_:][a-zA-Z0-9_:]* (got {self.namespace!r})")
        if not self.metric_expiration_s > 0:
            raise ValueError(f"metric_expiration_s must be > 0 (got {self.metric_expiration_s})")
        if isinstance(self.resource_to_telemetry_conversion, dict):
            unknown = set(self.resource_to_telemetry_conversion) - {"enabled"}
            if unknown:
                raise ValueError(f"resource_to_telemetry_conversion: unknown setting {sorted(unknown)[0]!r} "
                                 "(known: enabled)")
            self.resource_to_telemetry_conversion = bool(self.resource_to_telemetry_conversion.get("enabled", False))
        for name in self.const_labels:
            if not _LABEL.match(name) or name.startswith("__"):
                raise ValueError(f"const_labels.{name}: not a valid Prometheus label name "
                                 "(letters, digits and _, not starting with a digit or __)")
