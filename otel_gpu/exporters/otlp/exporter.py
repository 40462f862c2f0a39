"""The ``otlp`` (gRPC) and ``otlphttp`` exporters: send each batch's wire bytes as they are, from a queue.

Example (into an OTLP sink on a free loopback port):
    >>> from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    >>> from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    >>> from otel_gpu.component import ComponentHost
    >>> from otel_gpu.config import build
    >>> from otel_gpu.exporters.otlp import OtlpExporter, OtlpExporterConfig
    >>> from otel_gpu.pdata import Batch, Signal
    >>> from otel_gpu.testing.otlp_sink import OtlpSink
    >>> request = ExportTraceServiceRequest()
    >>> _ = request.resource_spans.add().scope_spans.add().spans.add(name="step")
    >>> with OtlpSink() as sink:
    ...     cfg = build(OtlpExporterConfig, {"endpoint": sink.endpoint, "compression": "none"}, "exporters.otlp")
    ...     exporter = OtlpExporter(cfg, ComponentHost("otlp", PrometheusSelfTelemetry()))
    ...     exporter.start()
    ...     print(exporter.export(Batch.from_message(Signal.TRACES, request)))
    ...     print(sink.wait_for(lambda s: s.span_count() == 1, timeout_s=10))
    ...     exporter.shutdown()
    ExportResult.QUEUED
    True
"""
from __future__ import annotations

import email.utils
import gzip
import http.client
import logging
import ssl
import threading
import time
from urllib.parse import urlsplit

import grpc
from google.rpc import error_details_pb2, status_pb2

from otel_gpu.collector.security import read_optional
from otel_gpu.exporters.otlp._queued import Attempt, QueuedExporter
from otel_gpu.pdata import Signal

__all__ = ["OtlpExporter", "OtlpHttpExporter"]

_logger = logging.getLogger(__name__)

_METHODS = {
    Signal.TRACES: "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    Signal.METRICS: "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
    Signal.LOGS: "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
}
# The OTLP specification's retryable codes. RESOURCE_EXHAUSTED is retried only when the server sends RetryInfo:
# without it, it usually means "message too large", which no retry fixes.
_RETRYABLE = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                        grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
_HTTP_RETRYABLE = frozenset({429, 502, 503, 504})


def _rejected(signal: Signal, response: bytes) -> tuple[int, str]:
    """Items refused in an Export*ServiceResponse's partial_success (an empty response means all accepted)."""
    if not response:
        return 0, ""
    try:
        message = signal.response_type().FromString(response)
    except Exception:  # noqa: BLE001 - an odd response body does not undo a 200 / OK
        return 0, ""
    if not message.HasField("partial_success"):
        return 0, ""
    ps = message.partial_success
    n = getattr(ps, {Signal.TRACES: "rejected_spans", Signal.METRICS: "rejected_data_points",
                     Signal.LOGS: "rejected_log_records"}[signal])
    return int(n), ps.error_message


def _retry_info_delay(error: grpc.RpcError) -> float | None:
    """The delay a server asked for in google.rpc.RetryInfo (trailer grpc-status-details-bin), if any."""
    try:
        trailers = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001
        return None
    for key, value in trailers:
        if key != "grpc-status-details-bin":
            continue
        try:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
        except Exception:  # noqa: BLE001
            return None
    return None


def _auth(exporter) -> None:
    """Sets ``exporter._token`` (``() -> bytes`` or None) from ``auth``; warns when a token would travel in clear text
    to another machine (loopback is fine: a sidecar on the same node)."""
    cfg = exporter.config
    exporter._token = cfg.auth.token_source("auth.bearer_token") if cfg.auth is not None else None
    if exporter._token is not None and not cfg.use_tls:
        host = urlsplit(cfg.endpoint if "://" in cfg.endpoint else f"//{cfg.endpoint}").hostname or ""
        if host not in ("127.0.0.1", "::1", "localhost"):
            _logger.warning("%s: the bearer token is sent without TLS to %s; use https:// or tls: {insecure: false}",
                            exporter.host.component_id, host)


def _bearer(exporter) -> str | None:
    return f"Bearer {exporter._token().decode('utf-8', 'replace')}" if exporter._token is not None else None


class OtlpExporter(QueuedExporter):
    """OTLP/gRPC: one channel; each signal's Export method called with identity (de)serializers."""

    def _open(self) -> None:
        cfg = self.config
        # Reconnect within seconds of the backend's return: gRPC's default reconnect backoff grows to 120 s, which
        # held a 60 s outage's queue back for ~25 s more (benchmarks/outage.py).
        options = [("grpc.enable_retries", 0), ("grpc.max_send_message_length", -1),
                   ("grpc.max_receive_message_length", 4 * 1024 * 1024), ("grpc.initial_reconnect_backoff_ms", 500),
                   ("grpc.min_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]
        compression = grpc.Compression.Gzip if cfg.compression == "gzip" else grpc.Compression.NoCompression
        if cfg.use_tls:
            if cfg.tls.insecure_skip_verify:
                raise ValueError("tls.insecure_skip_verify is not supported by the gRPC exporter; give tls.ca_file "
                                 "(the server's CA) instead")
            if cfg.tls.server_name_override:
                options.append(("grpc.ssl_target_name_override", cfg.tls.server_name_override))
            credentials = grpc.ssl_channel_credentials(read_optional(cfg.tls.ca_file, "tls.ca_file"),
                                                       read_optional(cfg.tls.key_file, "tls.key_file"),
                                                       read_optional(cfg.tls.cert_file, "tls.cert_file"))
            self._channel = grpc.secure_channel(cfg.target, credentials, options, compression=compression)
        else:
            self._channel = grpc.insecure_channel(cfg.target, options, compression=compression)
        self._calls = {s: self._channel.unary_unary(m, request_serializer=None, response_deserializer=None)
                       for s, m in _METHODS.items()}
        self._metadata = tuple((k.lower(), v) for k, v in cfg.headers.items()) or None
        _auth(self)

    def _send_once(self, signal: Signal, body: bytes, timeout_s: float) -> Attempt:
        metadata = self._metadata
        bearer = _bearer(self)
        if bearer is not None:
            metadata = (*(metadata or ()), ("authorization", bearer))
        try:
            response = self._calls[signal](body, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            message = f"{code.name}: {exc.details() if hasattr(exc, 'details') else exc}"
            delay = _retry_info_delay(exc)
            retryable = code in _RETRYABLE or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None)
            return Attempt(False, retryable, delay, message)
        rejected, why = _rejected(signal, response)
        return Attempt(True, rejected=rejected, message=why)

    def _close(self) -> None:
        channel = getattr(self, "_channel", None)
        if channel is not None:
            channel.close()


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class OtlpHttpExporter(QueuedExporter):
    """OTLP/HTTP protobuf: one keep-alive connection per sender thread."""

    def _open(self) -> None:
        cfg = self.config
        url = urlsplit(cfg.endpoint)
        self._host = url.hostname
        self._port = url.port or (443 if cfg.use_tls else 80)
        base = url.path.rstrip("/")
        self._paths = {s: f"{base}/v1/{s.value}" for s in Signal}
        self._ssl = None
        if cfg.use_tls:
            self._ssl = ssl.create_default_context(cafile=cfg.tls.ca_file or None)
            if cfg.tls.cert_file:
                self._ssl.load_cert_chain(cfg.tls.cert_file, cfg.tls.key_file)
            if cfg.tls.insecure or cfg.tls.insecure_skip_verify:
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
        self._headers = {"Content-Type": "application/x-protobuf", "User-Agent": "otel-gpu",
                         **({"Content-Encoding": "gzip"} if cfg.compression == "gzip" else {}), **cfg.headers}
        _auth(self)
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []
        self._conns_lock = threading.Lock()

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._ssl is not None:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _send_once(self, signal: Signal, body: bytes, timeout_s: float) -> Attempt:
        if self.config.compression == "gzip":
            body = gzip.compress(body, compresslevel=6)
        try:
            conn = self._connection(timeout_s)
            bearer = _bearer(self)
            headers = self._headers if bearer is None else {**self._headers, "Authorization": bearer}
            conn.request("POST", self._paths[signal], body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            status = response.status
            if response.will_close:
                self._drop_connection()
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            return Attempt(False, True, None, f"{type(exc).__name__}: {exc}")
        if 200 <= status < 300:
            rejected, why = _rejected(signal, payload) if "protobuf" in (response.getheader(
                "Content-Type") or "") else (0, "")
            return Attempt(True, rejected=rejected, message=why)
        message = f"HTTP {status}"
        try:
            detail = status_pb2.Status.FromString(payload).message if "protobuf" in (response.getheader(
                "Content-Type") or "") else payload[:200].decode("utf-8", "replace")
            if detail:
                message += f": {detail}"
        except Exception:  # noqa: BLE001
            pass
        return Attempt(False, status in _HTTP_RETRYABLE, _retry_after(response.getheader("Retry-After")), message)

    def _close(self) -> None:
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
