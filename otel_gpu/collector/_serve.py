"""A small threaded HTTP server for the collector's own endpoints (health_check, service.telemetry metrics).

``SO_REUSEADDR`` is set, as Go's listeners (and so the OpenTelemetry Collector) do: a collector restarted while
connections of its previous run sit in TIME_WAIT (a Prometheus scrape leaves one for a minute) binds again at once;
a port another process is listening on still fails.
"""
from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["HttpEndpoint", "Response"]

_logger = logging.getLogger(__name__)

#: (status, content type, body)
Response = tuple[int, str, bytes]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host name (socket.getfqdn), which can stall without DNS; the name is
        # unused. TCPServer.server_bind sets SO_REUSEADDR (allow_reuse_address) and binds.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]


class HttpEndpoint:
    """Serves ``handle(method, path) -> Response`` on ``host:port`` from a daemon thread; ``port`` after start."""

    def __init__(self, host: str, port: int, handle: Callable[[str, str], Response], name: str):
        handler = type("Handler", (_Handler,), {"handle_request": staticmethod(handle)})
        server_cls = type("Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in host else _Server
        self._server = server_cls((host, port), handler)  # OSError when the address is taken
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout_s)
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "otel-gpu"
    sys_version = ""
    timeout = 30
    handle_request: Callable[[str, str], Response]

    def log_message(self, fmt: str, *args) -> None:
        _logger.debug("%s: " + fmt, self.address_string(), *args)

    def _serve(self) -> None:
        try:
            status, ctype, body = self.handle_request(self.command, self.path.partition("?")[0])
        except Exception:  # noqa: BLE001 - a bug here must not take the thread (or the collector) down
            _logger.exception("error serving %s %s", self.command, self.path)
            status, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError:
            self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _serve
