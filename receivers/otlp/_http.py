"""The OTLP/HTTP server: a threaded stdlib ``http.server`` (no framework), protobuf and JSON, gzip and deflate."""
from __future__ import annotations

import logging
import math
import ssl
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler

from google.rpc import status_pb2

from otel_gpu.collector import httpserver
from otel_gpu.pdata import Batch, MalformedBatch, Signal
from otel_gpu.receivers.otlp._grpc import PipelineRefused

__all__ = ["HttpServer"]

_logger = logging.getLogger(__name__)

_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_CONTENT_TYPES = {_PROTOBUF: _PROTOBUF, "application/protobuf": _PROTOBUF, _JSON: _JSON}
_GRPC_CODE = {400: 3, 401: 16, 404: 5, 405: 12, 408: 4, 411: 3, 413: 8, 415: 3, 429: 8, 503: 14}


class _BodyError(Exception):
    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.close = status, close


class HttpServer:
    def __init__(self, host: str, port: int, max_body_bytes: int, read_timeout_s: float, signals: list[Signal],
                 receiver, *, ssl_context: ssl.SSLContext | None = None, authorize=None, max_connections: int = 256,
                 is_forwarder=None):
        self.max_body_bytes = max_body_bytes
        self.authorize = authorize  # (Authorization header or None) -> bool
        self.is_forwarder = is_forwarder  # (Authorization header or None, client certificate names) -> bool
        self.receiver = receiver
        self.paths = {f"/v1/{s.value}": s for s in signals}
        self.closing = False
        self._active = 0
        self._cond = threading.Condition()
        handler = type("OtlpHttpHandler", (_Handler,), {"owner": self, "timeout": read_timeout_s})
        try:
            self._server = httpserver.make_server(host, port, handler, ssl_context=ssl_context,
                                                  read_timeout_s=read_timeout_s, max_connections=max_connections,
                                                  what="OTLP/HTTP")
        except OSError as exc:
            raise OSError(f"cannot listen for OTLP/HTTP on {host}:{port}: {exc.strerror or exc}; is another "
                          f"collector running? set http.endpoint to a free port") from None
        self.port = self._server.server_address[1]
        self.address = f"{host}:{self.port}"
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="otlp-http", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self.closing = True
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout_s)
        self._server.server_close()
        deadline = time.monotonic() + timeout_s
        with self._cond:  # let requests already being handled reach the pipeline before it is flushed
            while self._active and time.monotonic() < deadline:
                self._cond.wait(0.05)

    def enter(self) -> None:
        with self._cond:
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()


class _Handler(BaseHTTPRequestHandler):
    owner: HttpServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's exporters expect
    server_version = "otel-gpu"
    sys_version = ""

    def log_message(self, fmt: str, *args) -> None:
        _logger.debug("OTLP/HTTP %s: " + fmt, self.address_string(), *args)

    # -- routing -------------------------------------------------------------------------------------------------
    def _request_kind(self) -> str | None:
        ctype = (self.headers.get("Content-Type") or "").partition(";")[0].strip().lower()
        return _CONTENT_TYPES.get(ctype)

    def do_POST(self) -> None:
        owner = self.owner
        signal = owner.paths.get(self.path.partition("?")[0])
        kind = self._request_kind()
        if signal is None:
            # Answered in the request's encoding (a protobuf Status to a protobuf request), as the OTLP specification
            # asks; JSON when the request is neither.
            return self._reply_error(404, kind or _JSON, f"no OTLP service at {self.path!r}; POST to "
                                     f"{', '.join(sorted(owner.paths))}", close=True)
        if kind is None:
            ctype = (self.headers.get("Content-Type") or "").partition(";")[0].strip().lower()
            owner.receiver.refused_request(signal)
            return self._reply_error(415, _JSON, f"unsupported Content-Type {ctype!r}; use {_PROTOBUF} or {_JSON}",
                                     close=True)
        if owner.closing:
            return self._reply_error(503, kind, "the collector is shutting down", close=True, retry_after=True)
        trusted = owner.is_forwarder is not None and owner.is_forwarder(self.headers.get("Authorization"),
                                                                         self._peer_names())
        if owner.authorize is not None and not trusted and not owner.authorize(self.headers.get("Authorization")):
            # The body is discarded unread. The presented token is never echoed or logged.
            return self._reply_error(401, kind, "missing or invalid bearer token (send Authorization: Bearer "
                                     "<token>)", close=not self._discard_body(),
                                     extra={"WWW-Authenticate": 'Bearer realm="otel-gpu"'})
        delay = owner.receiver.admit(signal)
        if delay is not None:  # refused before the body is read or parsed: nothing of it is held in memory
            return self._reply_error(429, kind, f"the collector is over its memory limit; retry after {delay:g}s",
                                     close=not self._discard_body(), retry_after=delay)
        owner.enter()
        try:
            try:
                body = self._read_body()
                if kind is _PROTOBUF:
                    owner.receiver.accept(signal, body, trusted)
                else:
                    try:
                        batch = Batch.from_json(signal, body)
                    except MalformedBatch:
                        owner.receiver.refused_request(signal)
                        raise
                    owner.receiver.accept_parsed(batch, trusted)
            except _BodyError as exc:
                owner.receiver.refused_request(signal)
                return self._reply_error(exc.status, kind, str(exc), close=exc.close)
            except MalformedBatch as exc:
                return self._reply_error(400, kind, str(exc))
            except PipelineRefused as exc:
                return self._reply_error(503, kind, str(exc), retry_after=True)
            except (TimeoutError, ConnectionError):
                self.close_connection = True
                return None
        finally:
            owner.leave()
        self._reply(200, kind, b"" if kind is _PROTOBUF else b"{}")
        return None

    def _peer_names(self) -> tuple[str, ...]:
        """The subject CN and DNS names of a client certificate verified by mutual TLS; () otherwise."""
        getpeercert = getattr(self.connection, "getpeercert", None)
        if getpeercert is None:
            return ()
        try:
            cert = getpeercert() or {}
        except (ValueError, OSError):
            return ()
        names = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
        names += [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
        return tuple(names)

    def _not_allowed(self) -> None:
        kind = self._request_kind() or _JSON
        if self.path.partition("?")[0] in self.owner.paths:
            self._reply_error(405, kind, f"{self.command} is not allowed; OTLP/HTTP takes POST", close=True,
                              extra={"Allow": "POST"})
        else:
            self._reply_error(404, kind, f"no OTLP service at {self.path!r}", close=True)

    do_GET = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed

    # -- body ----------------------------------------------------------------------------------------------------
    def _discard_body(self) -> bool:
        """Reads and forgets a refused request's body (64 KiB at a time, nothing kept), so that the client gets the
        answer on a keep-alive connection instead of a reset; False when it cannot be (chunked, too large, broken)."""
        try:
            length = int(self.headers.get("Content-Length") or "-1")
        except ValueError:
            return False
        if not 0 <= length <= self.owner.max_body_bytes:
            return False
        try:
            while length > 0:
                chunk = self.rfile.read(min(length, 65536))
                if not chunk:
                    return False
                length -= len(chunk)
        except OSError:
            return False
        return True

    def _read_body(self) -> bytes:
        limit = self.owner.max_body_bytes
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raw = self._read_chunked(limit)
        else:
            length_header = self.headers.get("Content-Length")
            if length_header is None:
                raise _BodyError(411, "Content-Length is required (or Transfer-Encoding: chunked)", close=True)
            try:
                length = int(length_header)
                if length < 0:
                    raise ValueError
            except ValueError:
                raise _BodyError(400, f"bad Content-Length {length_header!r}", close=True) from None
            if length > limit:
                raise _BodyError(413, f"request body of {length} bytes exceeds max_request_body_size_mib "
                                 f"({limit} bytes)", close=True)
            raw = self.rfile.read(length)
            if len(raw) < length:
                raise _BodyError(400, f"truncated request body: got {len(raw)} of {length} bytes", close=True)
        return self._decode(raw, limit)

    def _read_chunked(self, limit: int) -> bytes:
        parts, total = [], 0
        while True:
            line = self.rfile.readline(1024)
            if not line.endswith(b"\n"):
                raise _BodyError(400, "truncated chunked request body", close=True)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BodyError(400, "bad chunk size in chunked request body", close=True) from None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            total += size
            if total > limit:
                raise _BodyError(413, f"request body exceeds max_request_body_size_mib ({limit} bytes)", close=True)
            chunk = self.rfile.read(size + 2)
            if len(chunk) < size + 2:
                raise _BodyError(400, "truncated chunked request body", close=True)
            parts.append(chunk[:size])

    def _decode(self, raw: bytes, limit: int) -> bytes:
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding in ("identity", ""):
            return raw
        if encoding in ("gzip", "x-gzip"):
            decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            decoder = zlib.decompressobj()
        else:
            raise _BodyError(415, f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
        try:
            out = decoder.decompress(raw, limit + 1)
        except zlib.error as exc:
            raise _BodyError(400, f"bad {encoding} body: {exc}") from None
        if len(out) > limit:  # bounded, so a small zip bomb cannot make us allocate gigabytes
            raise _BodyError(413, f"decompressed request body exceeds max_request_body_size_mib ({limit} bytes)")
        if not decoder.eof:
            raise _BodyError(400, f"truncated {encoding} body")
        return out

    # -- replies -------------------------------------------------------------------------------------------------
    def _reply(self, status: int, ctype: str, body: bytes, extra: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError:  # the client went away; nothing to tell it
            self.close_connection = True

    def _reply_error(self, status: int, ctype: str, message: str, *, close: bool = False,
                     retry_after: bool | float = False, extra: dict[str, str] | None = None) -> None:
        if close:
            self.close_connection = True
        status_msg = status_pb2.Status(code=_GRPC_CODE.get(status, 2), message=message)
        if ctype is _PROTOBUF:
            body = status_msg.SerializeToString()
        else:
            from google.protobuf import json_format

            body = json_format.MessageToJson(status_msg, indent=None).encode()
        headers = dict(extra or {})
        if retry_after is not False:
            headers["Retry-After"] = "1" if retry_after is True else str(max(1, math.ceil(retry_after)))
        self._reply(status, ctype, body, headers)
