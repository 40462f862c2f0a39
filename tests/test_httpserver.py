"""The one HTTP server behind the OTLP/HTTP receiver and the Prometheus exporter: both listeners are built by
otel_gpu.collector.httpserver with the same socket options and timeouts; idle clients are dropped, a full server answers 503."""
from __future__ import annotations

import socket
import time
from http.server import BaseHTTPRequestHandler

import pytest

from otel_gpu.collector import httpserver
from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"hi")

    def log_message(self, *args):
        pass


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        return out


def test_otlp_http_receiver_and_prometheus_exporter_share_one_server():
    collector = Collector(load_text("""
receivers: {otlp: {protocols: {http: {endpoint: "127.0.0.1:0", read_timeout: 7s}}}}
exporters: {prometheus: {endpoint: "127.0.0.1:0"}}
service: {pipelines: {metrics: {receivers: [otlp], exporters: [prometheus]}}}
"""))
    collector.start()
    try:
        otlp = collector.component("receiver", "otlp")._http._server
        prom = collector.component("exporter", "prometheus")._server
        for server in (otlp, prom):
            assert isinstance(server, httpserver.ThreadedHttpServer)
            assert server.socket.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
            assert server.daemon_threads and server.handshake_timeout_s == httpserver.HANDSHAKE_TIMEOUT_S
        assert isinstance(prom, httpserver.WsgiHttpServer)
        assert otlp.read_timeout_s == 7 and prom.read_timeout_s == httpserver.READ_TIMEOUT_S
        assert otlp.max_connections == prom.max_connections == httpserver.MAX_CONNECTIONS
    finally:
        collector.shutdown(5)


def test_an_idle_client_is_dropped_after_the_read_timeout_and_others_are_served():
    server = httpserver.serve("127.0.0.1", 0, _Hello, read_timeout_s=0.5, what="test")
    try:
        port = server.server_address[1]
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        idle.sendall(b"GET / HTTP/1.1\r\n")  # half a request, then nothing
        assert b"200 OK" in _get(port)  # served meanwhile
        t0 = time.monotonic()
        assert idle.recv(100) == b""  # closed by the server
        assert time.monotonic() - t0 < 5
        idle.close()
    finally:
        httpserver.stop(server)


def test_past_max_connections_a_client_gets_503_at_once_then_the_server_recovers(caplog):
    server = httpserver.serve("127.0.0.1", 0, _Hello, max_connections=1, read_timeout_s=5, what="test")
    try:
        port = server.server_address[1]
        held = socket.create_connection(("127.0.0.1", port), timeout=10)
        held.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive: the one slot stays taken
        assert b"200 OK" in held.recv(4096)
        busy = _get(port)
        assert busy.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in busy
        assert "test: 1 connections open; refusing more with 503" in caplog.text
        held.close()
        deadline = time.monotonic() + 10
        while b"200 OK" not in _get(port):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        httpserver.stop(server)


def test_port_in_use_fails_but_a_restart_rebinds_at_once():
    first = httpserver.serve("127.0.0.1", 0, _Hello)
    port = first.server_address[1]
    with pytest.raises(OSError):
        httpserver.make_server("127.0.0.1", port, _Hello)
    _get(port)  # leaves a connection in TIME_WAIT on the server side
    httpserver.stop(first)
    again = httpserver.make_server("127.0.0.1", port, _Hello)  # SO_REUSEADDR
    again.server_close()
