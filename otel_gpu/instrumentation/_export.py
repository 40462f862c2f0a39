"""Private OTLP encoding (opentelemetry-proto messages built directly, no SDK) and a small OTLP client.

The client never blocks its caller for longer than ``timeout_s`` (one request) and never retries in the caller's
thread. While the collector is unreachable (a failed request starts a backoff of 0.5 s doubling to 2 s), requests
go into a bounded in-memory buffer (``buffer_mib``, default 8 MiB, ``OTEL_GPU_EXPORT_BUFFER_MIB``) and are re-sent, in
order and before any newer request, once a request gets through again (each drain gives the buffer at most about a
second). What does not fit is refused (``send_*`` returns False: the caller counts it as dropped, newest dropped
first) and counted in ``buffer_dropped``; the buffer is lost if the process ends while the collector is still down
(counted in ``lost_at_close`` and logged). A permanent error (the collector answered, e.g. UNIMPLEMENTED for a
signal it has no pipeline for, INVALID_ARGUMENT, HTTP 4xx) drops that request (``rejected``) without a backoff.
"""
from __future__ import annotations

import base64
import collections
import gzip
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.logs.v1 import logs_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from otel_gpu.instrumentation.config import SIGNALS, Route, env, export_buffer_mib, set_env, signal_url

__all__ = ["OtlpClient", "Route", "SIGNALS", "signal_url", "make_resource", "logs_request"]

_logger = logging.getLogger(__name__)

SCOPE = common_pb2.InstrumentationScope(name="otel_gpu.instrumentation", version="0.1.0")


def set_attr(kv_list, key: str, value) -> None:
    kv = kv_list.add()
    kv.key = key
    v = kv.value
    if isinstance(value, bool):
        v.bool_value = value
    elif isinstance(value, int):
        v.int_value = value
    elif isinstance(value, float):
        v.double_value = value
    elif isinstance(value, (list, tuple)):
        for item in value:
            v.array_value.values.add().string_value = str(item)
    else:
        v.string_value = str(value)


def make_resource(attrs: dict) -> resource_pb2.Resource:
    res = resource_pb2.Resource()
    for k, v in attrs.items():
        set_attr(res.attributes, k, v)
    return res


def add_span(scope_spans, name: str, trace_id: bytes, span_id: bytes, parent_id: bytes | None, start_ns: int,
             end_ns: int, attrs: dict, error: str | None = None) -> None:
    sp = scope_spans.spans.add()
    sp.trace_id = trace_id
    sp.span_id = span_id
    if parent_id:
        sp.parent_span_id = parent_id
    sp.name = name
    sp.kind = trace_pb2.Span.SPAN_KIND_INTERNAL
    sp.start_time_unix_nano = start_ns
    sp.end_time_unix_nano = max(end_ns, start_ns)
    for k, v in attrs.items():
        if v is not None:
            set_attr(sp.attributes, k, v)
    if error is not None:
        sp.status.code = trace_pb2.Status.STATUS_CODE_ERROR
        sp.status.message = error


def trace_request(resource: resource_pb2.Resource):
    """Returns (request, scope_spans) to add spans into."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.CopyFrom(resource)
    ss = rs.scope_spans.add()
    ss.scope.CopyFrom(SCOPE)
    return req, ss


#: (attribute count limit, value length limit) of log records (OTEL_LOGRECORD_ATTRIBUTE_* / OTEL_ATTRIBUTE_*); None: none
LOG_LIMITS: tuple[int | None, int | None] | None = None


def logs_request(resource: resource_pb2.Resource, records: list[tuple[str, int, dict, dict, int]]):
    """records: (event_name, time_ns, attributes, body (JSON-able), severity_number)."""
    from otel_gpu.instrumentation._pbenc import limited

    req = logs_service_pb2.ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.CopyFrom(resource)
    sl = rl.scope_logs.add()
    sl.scope.CopyFrom(SCOPE)
    for event_name, t_ns, attrs, body, severity in records:
        lr = sl.log_records.add()
        lr.time_unix_nano = t_ns
        lr.observed_time_unix_nano = time.time_ns()
        lr.event_name = event_name
        lr.severity_number = severity
        lr.severity_text = logs_pb2.SeverityNumber.Name(severity).replace("SEVERITY_NUMBER_", "")
        lr.body.string_value = json.dumps(body, default=str, separators=(",", ":"))
        if LOG_LIMITS is not None:
            attrs = limited(attrs, LOG_LIMITS)
        for k, v in attrs.items():
            if v is not None:
                set_attr(lr.attributes, k, v)
    return req


INFO = logs_pb2.SEVERITY_NUMBER_INFO
WARN = logs_pb2.SEVERITY_NUMBER_WARN
ERROR = logs_pb2.SEVERITY_NUMBER_ERROR
FATAL = logs_pb2.SEVERITY_NUMBER_FATAL


_OK, _RETRY, _REJECTED = "ok", "retry", "rejected"
# Worth sending again (the OTLP specification's list; RESOURCE_EXHAUSTED: a collector's memory limiter). Anything
# else the server answered is permanent; errors without an answer (connection refused, timeouts) are retried.
_RETRYABLE_GRPC = frozenset({"CANCELLED", "DEADLINE_EXCEEDED", "ABORTED", "OUT_OF_RANGE", "UNAVAILABLE", "DATA_LOSS",
                             "RESOURCE_EXHAUSTED", "UNKNOWN"})
_RETRYABLE_HTTP = frozenset({408, 429, 502, 503, 504})


def _permanent(exc: BaseException) -> bool:
    code = getattr(exc, "code", None)
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code not in _RETRYABLE_HTTP and exc.code < 500
    if callable(code) and type(exc).__module__.startswith("grpc"):
        try:
            return code().name not in _RETRYABLE_GRPC
        except Exception:  # noqa: BLE001
            return False
    return False


_DRAIN_BUDGET_S = 1.0  # longest one call spends re-sending the buffer (the watchdog's heartbeats go through here)


def _tls_files_from_env() -> tuple[str, str, str]:
    """(CA, client certificate, client key) file paths from the generic OTEL_EXPORTER_OTLP_* variables."""
    return tuple(env(f"OTEL_EXPORTER_OTLP_{name}") or ""  # type: ignore[return-value]
                 for name in ("CERTIFICATE", "CLIENT_CERTIFICATE", "CLIENT_KEY"))


def to_json_line(signal: str, data: bytes) -> str:
    """An export request as one line of OTLP/JSON (ids in hex): what ``OTEL_*_EXPORTER=console`` writes."""
    from google.protobuf import json_format

    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2

    cls = {"traces": trace_service_pb2.ExportTraceServiceRequest, "logs": logs_service_pb2.ExportLogsServiceRequest,
           "metrics": metrics_service_pb2.ExportMetricsServiceRequest}[signal]
    doc = json_format.MessageToDict(cls.FromString(data))

    def hexify(node: object) -> object:
        if isinstance(node, dict):
            return {k: (base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str)
                        else hexify(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [hexify(v) for v in node]
        return node

    return json.dumps(hexify(doc), separators=(",", ":"))


def _read_file(path: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        _logger.warning("otel-gpu: cannot read %s (%s); TLS to the collector will use the system defaults", path,
                        exc.strerror)
        return None


class OtlpClient:
    """Sends export requests over OTLP gRPC (or HTTP/protobuf), buffering them while the collector is down.
    Thread-safe; never raises.

    Counters: ``sent`` (requests delivered, buffered ones included), ``failed`` (attempts that failed),
    ``buffered`` (requests that went through the buffer), ``buffer_dropped`` (refused: buffer full), and
    ``buffer_requests`` / ``buffer_bytes`` (waiting now).
    """

    def __init__(self, endpoint: str, protocol: str = "grpc", headers: dict[str, str] | None = None,
                 timeout_s: float = 2.0, buffer_mib: float | None = None, routes: dict[str, Route] | None = None):
        self.endpoint = endpoint
        self.protocol = protocol
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s
        if routes is None:
            ca, cert, key = _tls_files_from_env()
            routes = {sig: Route(signal_url(endpoint, protocol, sig), protocol, dict(self.headers), timeout_s,
                                 secure=endpoint.startswith("https://"), ca_file=ca, cert_file=cert, key_file=key)
                      for sig in SIGNALS}
        self.routes: dict[str, Route] = routes
        self.timeout_s = max(r.timeout_s for r in routes.values())
        self.sent = 0
        self.failed = 0
        self.dropped_backoff = 0  # requests refused without an attempt: down and the buffer full
        self.buffered = 0
        self.buffer_dropped = 0
        self.buffer_bytes = 0
        self.lost_at_close = 0  # spans and log records still buffered at close()
        self.rejected = 0  # requests the collector refused for good (permanent error)
        self._seen: set = set()
        self.max_buffer_bytes = int((export_buffer_mib() if buffer_mib is None else buffer_mib) * 1024 * 1024)
        self._buffer: collections.deque[tuple[str, bytes]] = collections.deque()
        self._drain_lock = threading.Lock()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff_s = 0.5
        self._warned = False
        self._channels: dict[tuple, object] = {}  # (target, secure, tls files) -> grpc channel
        self._calls: dict[str, object] = {}  # signal -> raw unary-unary callable
        self._ssl_contexts: dict[tuple, object] = {}
        self._console_lock = threading.Lock()

    def _grpc_call(self, signal: str, route: Route):
        call = self._calls.get(signal)
        if call is not None:
            return call
        if "grpc" not in sys.modules and env("GRPC_ENABLE_FORK_SUPPORT") is None:
            # DataLoader workers fork while our export thread may be inside gRPC: without this, gRPC logs
            # "skipping fork() handlers" at every fork. Children never use our channel (instrumentation is off
            # after fork). Read once at import; not left in the environment for the user's own processes.
            set_env("GRPC_ENABLE_FORK_SUPPORT", "false")
            try:
                import grpc
            finally:
                set_env("GRPC_ENABLE_FORK_SUPPORT", None)
        import grpc

        target = route.url
        for prefix in ("http://", "https://", "grpc://"):
            if target.startswith(prefix):
                target = target[len(prefix):]
        target = target.rstrip("/")
        key = (target, route.secure, route.tls_files)
        channel = self._channels.get(key)
        if channel is None:
            # reconnect within seconds once the collector is back (gRPC's default backoff grows to 120 s)
            opts = [("grpc.max_send_message_length", 32 * 1024 * 1024), ("grpc.enable_retries", 0),
                    ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
                    ("grpc.max_reconnect_backoff_ms", 1000)]
            if route.secure:
                ca, cert, key_file = (_read_file(f) for f in route.tls_files)
                creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key_file,
                                                     certificate_chain=cert)
                channel = grpc.secure_channel(target, creds, options=opts)
            else:
                channel = grpc.insecure_channel(target, options=opts)
            self._channels[key] = channel
        service = {"traces": "trace.v1.TraceService", "logs": "logs.v1.LogsService",
                   "metrics": "metrics.v1.MetricsService"}[signal]
        # the Export method taking pre-serialized request bytes
        call = channel.unary_unary(f"/opentelemetry.proto.collector.{service}/Export", request_serializer=None,
                                   response_deserializer=None)
        self._calls[signal] = call
        return call

    def _https_context(self, route: Route):
        """The TLS context of OTLP/HTTP: the trusted CA (OTEL_EXPORTER_OTLP_[SIGNAL_]CERTIFICATE) and the client
        certificate and key of mutual TLS, when set; None (urllib's default) otherwise."""
        if not route.url.startswith("https://") or not any(route.tls_files):
            return None
        ctx = self._ssl_contexts.get(route.tls_files)
        if ctx is None:
            import ssl

            ca, cert, key = route.tls_files
            ctx = ssl.create_default_context(cafile=ca or None)
            if cert:
                ctx.load_cert_chain(cert, key or None)
            self._ssl_contexts[route.tls_files] = ctx
        return ctx

    def _console(self, signal: str, data: bytes) -> None:
        try:
            line = to_json_line(signal, data)
            with self._console_lock:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        except Exception:  # telemetry never raises into the host
            _logger.debug("otel-gpu: console export failed", exc_info=True)

    @property
    def buffer_requests(self) -> int:
        return len(self._buffer)

    def _post(self, signal: str, data: bytes) -> str:
        """One attempt: _OK, _RETRY (unreachable, overloaded: starts or extends the backoff) or _REJECTED (the
        collector answered with a permanent error, e.g. UNIMPLEMENTED for a signal it has no pipeline for, or HTTP
        400: sending it again cannot help, and the collector is up)."""
        route = self.routes[signal]
        try:
            if route.protocol == "http/protobuf":
                headers = {"Content-Type": "application/x-protobuf", **route.headers}
                if route.compression == "gzip":
                    data = gzip.compress(data, compresslevel=5)
                    headers["Content-Encoding"] = "gzip"
                # An HTTP route's URL is always http(s):// (config.signal_url and signal_routes build it so).
                req = urllib.request.Request(route.url, data=data, method="POST", headers=headers)  # noqa: S310
                with urllib.request.urlopen(req, timeout=route.timeout_s,  # noqa: S310
                                            context=self._https_context(route)) as resp:
                    resp.read()
            else:
                call = self._grpc_call(signal, route)
                kwargs = {}
                if route.compression == "gzip":
                    import grpc

                    kwargs["compression"] = grpc.Compression.Gzip
                call(data, timeout=route.timeout_s, metadata=tuple(route.headers.items()) or None, **kwargs)
        except Exception as exc:  # noqa: BLE001 - telemetry never raises into the host
            if _permanent(exc):
                with self._lock:
                    self.rejected += 1
                if ("rejected", signal) not in self._seen:
                    self._seen.add(("rejected", signal))
                    _logger.warning("otel-gpu: %s refused %s (%s); such requests are dropped and counted",
                                    self.endpoint, signal, str(exc).splitlines()[0][:200])
                return _REJECTED
            with self._lock:
                self.failed += 1
                self._down_until = time.monotonic() + self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, 2.0)
            if not self._warned:
                self._warned = True
                _logger.warning("otel-gpu: OTLP export to %s failed (%s); buffering up to %.1f MiB of telemetry "
                                "while it is down", self.endpoint, str(exc).splitlines()[0][:200],
                                self.max_buffer_bytes / 2**20)
            return _RETRY
        with self._lock:
            self.sent += 1
            self._backoff_s = 0.5
            if self._warned:
                self._warned = False
                _logger.info("otel-gpu: OTLP export to %s works again", self.endpoint)
        return _OK

    def _buffer_locked(self, signal: str, data: bytes, count: bool = True) -> bool:
        if self.buffer_bytes + len(data) > self.max_buffer_bytes:
            if count:
                self.buffer_dropped += 1
            return False
        self._buffer.append((signal, data))
        self.buffer_bytes += len(data)
        self.buffered += 1
        return True

    def _drain(self, budget_s: float = _DRAIN_BUDGET_S) -> None:
        """Re-sends buffered requests oldest first until one fails, the buffer is empty, or the budget is spent.
        One thread at a time; another caller returns at once (its request is already in the buffer)."""
        if not self._drain_lock.acquire(blocking=False):
            return
        try:
            deadline = time.monotonic() + budget_s
            while time.monotonic() < deadline:
                with self._lock:
                    if not self._buffer or time.monotonic() < self._down_until:
                        return
                    signal, data = self._buffer[0]
                outcome = self._post(signal, data)
                if outcome == _RETRY:
                    return
                with self._lock:
                    self._buffer.popleft()
                    self.buffer_bytes -= len(data)
                    if outcome == _REJECTED:
                        self.buffer_dropped += 1  # accepted earlier, lost now: counted with the overflow
        finally:
            self._drain_lock.release()

    def _send(self, signal: str, request) -> bool:
        """True when delivered or buffered for delivery; False when refused (buffer full): count it as dropped."""
        route = self.routes[signal]
        if not route.otlp:  # OTEL_<SIGNAL>_EXPORTER without otlp
            if route.console:
                self._console(signal, request if isinstance(request, bytes) else request.SerializeToString())
            return True
        data = request if isinstance(request, bytes) else request.SerializeToString()
        if route.console:
            self._console(signal, data)
        with self._lock:
            queued = bool(self._buffer) or time.monotonic() < self._down_until
            accepted = queued and self._buffer_locked(signal, data, count=False)
        if queued:  # behind older requests: keep the order
            self._drain()  # (also when the buffer was full: the drain may make room)
            if not accepted:
                with self._lock:
                    accepted = self._buffer_locked(signal, data)
                    if not accepted:
                        self.dropped_backoff += 1
            return accepted
        outcome = self._post(signal, data)
        if outcome != _RETRY:
            return outcome == _OK
        with self._lock:
            return self._buffer_locked(signal, data)

    def send_traces(self, request) -> bool:
        return self._send("traces", request)

    def send_logs(self, request) -> bool:
        return self._send("logs", request)

    def send_metrics(self, request) -> bool:
        return self._send("metrics", request)

    def is_down(self) -> bool:
        """True while requests would be refused: the collector is down and the buffer is full (callers can skip
        building them)."""
        return time.monotonic() < self._down_until and self.buffer_bytes >= self.max_buffer_bytes - 65536

    def reset_backoff(self) -> None:
        """Lets the next request through and re-sends the buffer first (within ``timeout_s``): the final flush."""
        self._down_until = 0.0
        self._drain(self.timeout_s)

    def close(self) -> None:
        if self._buffer and time.monotonic() >= self._down_until:
            self._drain(self.timeout_s)
        if self._buffer:
            items = 0
            for signal, data in self._buffer:
                try:
                    if signal == "traces":
                        req = trace_service_pb2.ExportTraceServiceRequest.FromString(data)
                        items += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
                    elif signal == "metrics":
                        items += 1
                    else:
                        req = logs_service_pb2.ExportLogsServiceRequest.FromString(data)
                        items += sum(len(sl.log_records) for rl in req.resource_logs for sl in rl.scope_logs)
                except Exception:  # noqa: BLE001 - only for the message
                    pass
            self.lost_at_close = items
            _logger.warning("otel-gpu: %d telemetry requests (%d spans and log records) were still buffered for %s "
                            "when the process ended (the collector was still down) and are lost",
                            len(self._buffer), items, self.endpoint)
        for channel in self._channels.values():
            try:
                channel.close()
            except Exception:  # noqa: BLE001
                pass
