"""Settings of the ``prometheus`` exporter.

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(PrometheusExporterConfig, {"resource_to_telemetry_conversion": {"enabled": False}},
    ...             "exporters.prometheus")
    >>> cfg.endpoint, cfg.resource_to_telemetry_conversion
    ('127.0.0.1:9464', False)
    >>> cfg.promote_resource_attributes
    ['training.job.id', 'host.name', 'training.rank', 'gpu.index']
    >>> parse_endpoint("[::1]:9464")
    ('::1', 9464)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from otel_gpu.collector.security import BasicAuthConfig, ServerTlsConfig
from otel_gpu.schema.identity import PROMOTED_RESOURCE_ATTRIBUTES

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
    ``{enabled: true}`` form; off by default, as in the Collector: resources then reach Prometheus as ``target_info``
    plus ``job``/``instance``, and only ``promote_resource_attributes`` (the job id, host, rank and GPU the dashboards
    filter on; the name of Prometheus' own OTLP setting) become labels of every series.
    """

    endpoint: str = "127.0.0.1:9464"
    namespace: str = ""
    metric_expiration_s: float = 300.0
    max_series: int = 100_000  # series held at most; points that would start new ones past it are refused, counted
    resource_to_telemetry_conversion: bool | dict[str, bool] = False
    promote_resource_attributes: list[str] = field(
        default_factory=lambda: [str(a) for a in PROMOTED_RESOURCE_ATTRIBUTES])
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
        if self.max_series < 1:
            raise ValueError(f"max_series must be >= 1 (got {self.max_series})")
        if not self.metric_expiration_s > 0:
            raise ValueError(f"metric_expiration_s must be > 0 (got {self.metric_expiration_s})")
        if isinstance(self.resource_to_telemetry_conversion, dict):
            unknown = set(self.resource_to_telemetry_conversion) - {"enabled"}
            if unknown:
                raise ValueError(f"resource_to_telemetry_conversion: unknown setting {sorted(unknown)[0]!r} "
                                 "(known: enabled)")
            self.resource_to_telemetry_conversion = bool(self.resource_to_telemetry_conversion.get("enabled", False))
        for i, key in enumerate(self.promote_resource_attributes):
            if not isinstance(key, str) or not key:
                raise ValueError(f"promote_resource_attributes[{i}] must be a resource attribute key, e.g. host.name "
                                 f"(got {key!r})")
        for name in self.const_labels:
            if not _LABEL.match(name) or name.startswith("__"):
                raise ValueError(f"const_labels.{name}: not a valid Prometheus label name "
                                 "(letters, digits and _, not starting with a digit or __)")
