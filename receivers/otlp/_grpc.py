"""The OTLP/gRPC server: generic handlers that take each request as raw bytes (no per-span Python objects)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from otel_gpu.pdata import MalformedBatch, Signal

__all__ = ["GrpcServer", "SERVICES"]

_logger = logging.getLogger(__name__)

SERVICES = {
    Signal.TRACES: "opentelemetry.proto.collector.trace.v1.TraceService",
    Signal.METRICS: "opentelemetry.proto.collector.metrics.v1.MetricsService",
    Signal.LOGS: "opentelemetry.proto.collector.logs.v1.LogsService",
}


class PipelineRefused(RuntimeError):
    """The pipeline raised while taking a batch: the client should retry."""


Accept = Callable[[Signal, bytes, bool], None]  # (signal, bytes, trusted); raises MalformedBatch or PipelineRefused
Authorize = Callable[[str | None], bool]  # the Authorization header value -> allowed?
IsForwarder = Callable[[str | None, tuple[str, ...]], bool]  # (Authorization, client certificate names) -> trusted?
Admit = Callable[[Signal], "float | None"]  # None: accept; else refuse, retry after that many seconds


def retry_info_trailer(message: str, delay_s: float) -> tuple[tuple[str, bytes], ...]:
    """Trailers carrying a RetryInfo delay: ``grpc-status-details-bin`` (a google.rpc.Status, RESOURCE_EXHAUSTED, with
    the RetryInfo in its details) and ``google.rpc.retryinfo-bin`` (the RetryInfo alone)."""
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
        seconds=int(delay_s), nanos=int((delay_s - int(delay_s)) * 1e9)))
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message, details=[detail])
    # The standard rich-error trailer (the OpenTelemetry Collector's and Go/Java clients' way), and the bare RetryInfo
    # under the name opentelemetry-python's exporter reads.
    return (("grpc-status-details-bin", status.SerializeToString()),
            ("google.rpc.retryinfo-bin", info.SerializeToString()))


class GrpcServer:
    def __init__(self, host: str, port: int, max_recv_bytes: int, max_workers: int, signals: list[Signal],
                 accept: Accept, *, credentials: grpc.ServerCredentials | None = None,
                 authorize: Authorize | None = None, admit: Admit | None = None,
                 is_forwarder: IsForwarder | None = None):
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="otlp-grpc"),
            options=[
                ("grpc.max_receive_message_length", max_recv_bytes),
                ("grpc.max_send_message_length", 4 * 1024 * 1024),
                # grpc-core sets SO_REUSEPORT by default, which lets a second collector bind the same port silently.
                ("grpc.so_reuseport", 0),
            ],
        )
        for signal in signals:
            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                SERVICES[signal],
                {"Export": grpc.unary_unary_rpc_method_handler(_export_handler(signal, accept, authorize, admit, is_forwarder),
                                                               request_deserializer=None,
                                                               response_serializer=None)}),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if credentials is not None:
                self.port = self._server.add_secure_port(address, credentials)
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for OTLP/gRPC on {address}: the address is in use or not available "
                          f"({exc}); is another collector running? set grpc.endpoint to a free port") from None
        if self.port == 0:  # older grpcio reports failure this way
            raise OSError(f"cannot listen for OTLP/gRPC on {address}: the address is in use or not available; "
                          f"is another collector running? set grpc.endpoint to a free port")
        self.address = f"{host}:{self.port}"

    def start(self) -> None:
        self._server.start()

    def stop(self, timeout_s: float) -> None:
        self._server.stop(grace=max(0.0, min(2.0, timeout_s / 2))).wait(timeout_s)


def peer_names(context: grpc.ServicerContext) -> tuple[str, ...]:
    """The subject CN and DNS names of the client's certificate, verified by mutual TLS (grpc sets them only then)."""
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001 - an odd transport: no names
        return ()
    names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return tuple(n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names)


def _export_handler(signal: Signal, accept: Accept, authorize: Authorize | None, admit: Admit | None,
                    is_forwarder: IsForwarder | None):
    def export(raw: bytes, context: grpc.ServicerContext) -> bytes:
        header = None
        if authorize is not None or is_forwarder is not None:
            header = next((v for k, v in context.invocation_metadata() if k == "authorization"), None)
        trusted = is_forwarder is not None and is_forwarder(header, peer_names(context))
        if authorize is not None and not trusted:
            if not authorize(header):
                # Never echo what the client sent: it may be a (wrong or someone else's) token.
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token "
                              "(send metadata authorization: Bearer <token>)")
        if admit is not None:
            delay = admit(signal)
            if delay is not None:
                message = f"the collector is over its memory limit; retry after {delay:g}s"
                context.set_trailing_metadata(retry_info_trailer(message, delay))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        try:
            accept(signal, raw, trusted)
        except MalformedBatch as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except PipelineRefused as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return b""  # an empty Export*ServiceResponse: full success

    return export
