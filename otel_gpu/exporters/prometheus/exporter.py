"""The ``prometheus`` exporter: the latest OTLP metrics, plus the collector's self-telemetry, on ``/metrics``."""
from __future__ import annotations

import json
import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from otel_gpu.component import ComponentHost, Exporter, ExportResult
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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scraper never holds the collector's exit

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host name (socket.getfqdn), which can stall without DNS; skip it.
        self.socket.bind(self.server_address)
        self.server_address = self.socket.getsockname()
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port
        self.setup_environ()


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
                                 bool(config.resource_to_telemetry_conversion), config.const_labels, host.log_once)
        self.registry = _registry()
        self.registry.register(self.state)
        self_telemetry = host.services.get("self_telemetry_registry")
        if self_telemetry is not None:
            self.registry.register(_Forward(self_telemetry))
        self._metrics_app = make_wsgi_app(self.registry)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port actually bound (useful with ``endpoint: 127.0.0.1:0``); 0 before start."""
        return self._server.server_address[1] if self._server is not None else 0

    @property
    def url(self) -> str:
        if self._server is None:
            return ""
        host = self._server.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def _app(self, environ: dict, start_response: Any) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
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
        server_class = _Server
        if ":" in host:
            server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        try:
            self._server = make_server(host, port, self._app, server_class=server_class, handler_class=_Quiet)
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
