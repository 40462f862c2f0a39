"""The ``prometheus`` exporter: the latest OTLP metrics, plus the collector's self-telemetry, on ``/metrics``."""
from __future__ import annotations

import json
import logging
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, make_wsgi_app

from otel_gpu.collector import httpserver
from otel_gpu.collector.security import BasicAuthChecker, server_ssl_context
from otel_gpu.component import SELF_TELEMETRY_REGISTRY, ComponentHost, ExportResult, Exporter
from otel_gpu.exporters.prometheus._convert import MetricState
from otel_gpu.exporters.prometheus.config import PrometheusExporterConfig, parse_endpoint
from otel_gpu.pdata import Batch, Signal

__all__ = ["PrometheusExporter"]

_logger = logging.getLogger(__name__)
_HEALTH = json.dumps({"status": "ok"}).encode()
_INDEX = b"otel-gpu prometheus exporter: metrics at /metrics, health at /health\n"


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged."""


_UNAUTHORIZED = b"unauthorized: this endpoint needs basic auth\n"


class _Forward:
    """Serves another registry (the self-telemetry one) through ours."""

    def __init__(self, registry: Any):
        self._registry = registry

    def describe(self) -> list:
        return []

    def collect(self):
        return self._registry.collect()


def _registry() -> CollectorRegistry:
    try:  # prometheus-client >= 0.21: collectors without fixed names still work with ?name[]= filters
        return CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    except TypeError:
        return CollectorRegistry(auto_describe=False)


class PrometheusExporter(Exporter):
    """Keeps the latest value of each series; a threaded HTTP server (daemon thread) serves them.

    ``export()`` only updates an in-memory table under a lock; families are built at scrape time.
    """

    def __init__(self, config: PrometheusExporterConfig, host: ComponentHost):
        super().__init__(config, host)
        self.state = MetricState(config.namespace, config.metric_expiration_s,
                                 bool(config.resource_to_telemetry_conversion), config.const_labels, host.log_once,
                                 promote=config.promote_resource_attributes, max_series=config.max_series,
                                 on_refused=lambda n: host.telemetry.series_refused(host.component_id,
                                                                                    Signal.METRICS, n))
        self.registry = _registry()
        self.registry.register(self.state)
        self_telemetry = host.services.get(SELF_TELEMETRY_REGISTRY)
        if self_telemetry is not None:
            self.registry.register(_Forward(self_telemetry))
        self._metrics_app = make_wsgi_app(self.registry)
        self._basic_auth: BasicAuthChecker | None = None
        self._server: httpserver.WsgiHttpServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port actually bound (useful with ``endpoint: 127.0.0.1:0``); 0 before start."""
        return self._server.server_address[1] if self._server is not None else 0

    @property
    def url(self) -> str:
        return httpserver.url(self._server)

    def _app(self, environ: dict, start_response: Any) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        # /health stays open so that liveness probes need no credentials; it tells nothing but "ok".
        if self._basic_auth is not None and path not in ("/health", "/healthz") \
                and not self._basic_auth.check(environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", 'Basic realm="otel-gpu", charset="UTF-8"'),
                                                ("Content-Length", str(len(_UNAUTHORIZED)))])
            return [_UNAUTHORIZED]
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path in ("/health", "/healthz"):
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(_HEALTH)))])
            return [_HEALTH]
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [_INDEX]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: try /metrics or /health\n"]

    def start(self) -> None:
        host, port = parse_endpoint(self.config.endpoint)
        if self.config.basic_auth is not None:  # reads password_file: a missing file fails start-up, naming the key
            self._basic_auth = BasicAuthChecker(self.config.basic_auth, "basic_auth.password")
        ssl_context = server_ssl_context(self.config.tls) if self.config.tls is not None else None
        try:
            self._server = httpserver.make_server(host, port, _Quiet, ssl_context=ssl_context, what="prometheus",
                                                  base=httpserver.WsgiHttpServer)
            self._server.set_app(self._app)
        except OSError as exc:
            hint = (f"port {port} is already in use (another collector or exporter?); set exporters."
                    f"{self.host.component_id}.endpoint to a free port") if port else "check the host address"
            raise RuntimeError(f"prometheus exporter cannot listen on {self.config.endpoint}: "
                               f"{exc.strerror or exc}; {hint}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"otel-gpu-prometheus-{self.host.component_id}", daemon=True)
        self._thread.start()
        _logger.info("prometheus exporter %s serving %s/metrics", self.host.component_id, self.url)

    def export(self, batch: Batch) -> ExportResult:
        if batch.signal is Signal.METRICS:
            self.state.update(batch.message)
        return ExportResult.SUCCESS

    def shutdown(self, timeout_s: float = 5.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()  # returns within poll_interval
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout_s)
