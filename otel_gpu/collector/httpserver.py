"""The one HTTP(S) server of the collector's listeners: the OTLP/HTTP receiver, the Prometheus exporter, the verdict
API, the health_check extension and the collector's own metrics (``service.telemetry``).

A threaded stdlib ``http.server`` with what every listener of ours needs, in one place so that they cannot drift:

- ``SO_REUSEADDR`` (a restarted collector rebinds at once; a port in active use still fails);
- no reverse DNS at bind (``HTTPServer.server_bind`` calls ``socket.getfqdn``, which can stall start-up);
- IPv6 when the host has a ``:``;
- one daemon thread per connection, at most ``max_connections``: past that a plaintext client gets ``503`` with
  ``Retry-After: 1`` at once (a TLS client is closed: it could not read a plaintext answer), logged once;
- TLS (an :class:`ssl.SSLContext` from :func:`otel_gpu.collector.security.server_ssl_context`) wrapped on the connection's own
  thread, so a slow or broken handshake never holds up the accept loop; the handshake gets ``handshake_timeout_s``;
- every connection, plaintext or TLS, then reads with ``read_timeout_s`` (an idle or trickling client is dropped);
- errors while serving a connection are logged at debug level, never printed to stderr.

Example:
    >>> import http.client
    >>> from http.server import BaseHTTPRequestHandler
    >>> class Hello(BaseHTTPRequestHandler):
    ...     def do_GET(self):
    ...         self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
    ...         self.wfile.write(b"hi")
    ...     def log_message(self, *args):
    ...         pass
    >>> server = serve("127.0.0.1", 0, Hello, what="example")
    >>> conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
    >>> conn.request("GET", "/"); conn.getresponse().read()
    b'hi'
    >>> conn.close(); stop(server)
"""
from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from wsgiref.simple_server import WSGIServer

__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_CONNECTIONS", "READ_TIMEOUT_S", "HttpEndpoint", "Response", "ThreadedHttpServer",
           "WsgiHttpServer", "make_server", "serve", "stop", "url"]

_logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class ThreadedHttpServer(ThreadingHTTPServer):
    """See the module docstring; build it with :func:`make_server` (which sets the class attributes below)."""

    daemon_threads = True  # a stuck client never holds the collector's exit
    allow_reuse_address = True  # SO_REUSEADDR
    ssl_context: ssl.SSLContext | None = None
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    read_timeout_s: float | None = READ_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    what: str = "HTTP"  # names the listener in log lines

    def __init__(self, server_address, handler_class, bind_and_activate: bool = True):
        self._open = 0
        self._open_lock = threading.Lock()
        self._warned_full = False
        super().__init__(server_address, handler_class, bind_and_activate)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # not HTTPServer's: it resolves our own name (getfqdn)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port

    def handle_error(self, request, client_address) -> None:
        _logger.debug("%s: error serving %s", self.what, client_address, exc_info=True)

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            full = self._open >= self.max_connections
            if not full:
                self._open += 1
        if full:
            if not self._warned_full:  # logged before the answer goes out, so whoever got the 503 can find the line
                self._warned_full = True
                _logger.warning("%s: %d connections open; refusing more with 503 until some close (logged once)",
                                self.what, self.max_connections)
            if self.ssl_context is None:
                try:
                    request.settimeout(1.0)
                    request.sendall(_BUSY)
                except OSError:
                    pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._open_lock:
                self._open -= 1
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1

    def finish_request(self, request, client_address) -> None:
        if self.ssl_context is not None:
            request.settimeout(self.handshake_timeout_s)
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError) as exc:  # plaintext client, untrusted client certificate, timeout
                _logger.debug("%s: TLS handshake with %s failed: %s", self.what, client_address, exc)
                return
        request.settimeout(self.read_timeout_s)
        try:
            super().finish_request(request, client_address)
        finally:
            if self.ssl_context is not None:
                try:
                    request.close()
                except OSError:
                    pass


class WsgiHttpServer(ThreadedHttpServer, WSGIServer):
    """The same server for a WSGI application (``set_app``), e.g. prometheus_client's ``make_wsgi_app``."""

    def server_bind(self) -> None:
        ThreadedHttpServer.server_bind(self)
        self.setup_environ()


def make_server(host: str, port: int, handler_class: type[BaseHTTPRequestHandler], *,
                ssl_context: ssl.SSLContext | None = None, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                read_timeout_s: float | None = READ_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                what: str = "HTTP", base: type[ThreadedHttpServer] = ThreadedHttpServer) -> ThreadedHttpServer:
    """A bound, listening server (not yet serving). Raises OSError when the address cannot be bound."""
    attrs = {"ssl_context": ssl_context, "handshake_timeout_s": handshake_timeout_s,
             "read_timeout_s": read_timeout_s, "max_connections": max_connections, "what": what}
    if ":" in host:
        attrs["address_family"] = socket.AF_INET6
    cls = type(base.__name__, (base,), attrs)
    return cls((host, port), handler_class)


def serve(host: str, port: int, handler_class: type[BaseHTTPRequestHandler], *, thread_name: str = "",
          **options) -> ThreadedHttpServer:
    """:func:`make_server` and a daemon thread serving it (stopped by :func:`stop`)."""
    server = make_server(host, port, handler_class, **options)
    server._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                      name=thread_name or f"otel-gpu-{options.get('what', 'http')}", daemon=True)
    server._thread.start()
    return server


def stop(server: ThreadedHttpServer, timeout_s: float = 5.0) -> None:
    """Stops serving (returns within the poll interval), closes the socket and joins the serving thread."""
    thread = getattr(server, "_thread", None)
    if thread is not None:
        server.shutdown()
        thread.join(timeout_s)
    server.server_close()


def url(server: ThreadedHttpServer | None) -> str:
    """``http(s)://host:port`` of the bound address (``[v6]`` bracketed, https with TLS); ``""`` for no server."""
    if server is None:
        return ""
    host, port = server.server_address[:2]
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if server.ssl_context is not None else 'http'}://{host}:{port}"


#: (status, content type, body) of a :class:`HttpEndpoint` handler.
Response = tuple[int, str, bytes]


class HttpEndpoint:
    """Serves ``handle(method, path) -> Response`` on ``host:port`` from a daemon thread; ``port`` after binding.

    For the collector's small endpoints (health_check, the self-metrics page): the same server as every other
    listener (connection cap, read timeout, no reverse DNS, ``SO_REUSEADDR``), with a handler that is one function.
    ``authorize`` (the ``Authorization`` header value or None -> allowed?) answers 401 before ``handle`` runs;
    ``ssl_context`` serves https. Raises OSError when the address cannot be bound.
    """

    def __init__(self, host: str, port: int, handle: Callable[[str, str], Response], name: str, *,
                 ssl_context: ssl.SSLContext | None = None, max_connections: int = 32,
                 authorize: Callable[[str | None], bool] | None = None,
                 read_timeout_s: float | None = READ_TIMEOUT_S):
        handler = type("Handler", (_EndpointHandler,), {"handle_request": staticmethod(handle),
                                                        "authorize": staticmethod(authorize) if authorize else None})
        self._server = make_server(host, port, handler, ssl_context=ssl_context, max_connections=max_connections,
                                   read_timeout_s=read_timeout_s, what=name)
        self.port: int = self._server.server_address[1]
        self._name = name

    def start(self) -> None:
        self._server._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                                name=self._name, daemon=True)
        self._server._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        stop(self._server, timeout_s)


class _EndpointHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "otel-gpu"
    sys_version = ""
    handle_request: Callable[[str, str], Response]
    authorize: Callable[[str | None], bool] | None = None
    _UNAUTHORIZED: Response = (401, "text/plain; charset=utf-8", b"unauthorized: send Authorization: Bearer <token>\n")

    def log_message(self, fmt: str, *args) -> None:
        _logger.debug("%s: " + fmt, self.address_string(), *args)

    def _serve(self) -> None:
        extra: tuple[tuple[str, str], ...] = ()
        try:
            if self.authorize is not None and not self.authorize(self.headers.get("Authorization")):
                # the presented token is never echoed or logged
                status, ctype, body = self._UNAUTHORIZED
                extra = (("WWW-Authenticate", 'Bearer realm="otel-gpu"'),)
            else:
                status, ctype, body = self.handle_request(self.command, self.path.partition("?")[0])
        except Exception:  # a bug here must not take the thread (or the collector) down
            _logger.exception("error serving %s %s", self.command, self.path)
            status, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for key, value in extra:
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError:
            self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _serve
