"""The ``otlp`` receiver: OTLP/gRPC and OTLP/HTTP (protobuf and JSON) in, batches out, bytes kept as received.

Example:
    >>> from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    >>> from otel_gpu.component import ComponentHost
    >>> from otel_gpu.receivers.otlp import OtlpReceiver, OtlpReceiverConfig
    >>> from otel_gpu.receivers.otlp.config import GrpcServerConfig
    >>> got = []
    >>> class Keep:
    ...     def consume(self, batch): got.append(batch)
    >>> host = ComponentHost("otlp", PrometheusSelfTelemetry(), {s: Keep() for s in Signal})
    >>> receiver = OtlpReceiver(OtlpReceiverConfig(grpc=GrpcServerConfig("127.0.0.1:0"), http=None), host)
    >>> receiver.start(); receiver.grpc_port > 0
    True
    >>> receiver.shutdown()
"""
from __future__ import annotations

import logging
import threading

from otel_gpu.collector.security import BearerChecker, grpc_server_credentials, server_ssl_context
from otel_gpu.component import ADMISSION, Receiver
from otel_gpu.pdata import Batch, MalformedBatch, Signal
from otel_gpu.receivers.otlp._grpc import GrpcServer, PipelineRefused
from otel_gpu.receivers.otlp._ids import check_ids
from otel_gpu.receivers.otlp._limits import enforce
from otel_gpu.receivers.otlp.config import OtlpReceiverConfig, split_endpoint

__all__ = ["OtlpReceiver"]

_logger = logging.getLogger(__name__)
_MIB = 1024 * 1024


class OtlpReceiver(Receiver):
    """Serves the OTLP services of every signal some pipeline consumes; ``grpc_port`` / ``http_port`` after start."""

    config: OtlpReceiverConfig

    def __init__(self, config: OtlpReceiverConfig, host):
        super().__init__(config, host)
        self._grpc: GrpcServer | None = None
        self._http = None
        self._consumers = {}
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._lock = threading.Lock()
        self._forwarder_token: BearerChecker | None = None
        tf = config.trusted_forwarders
        self._forwarder_names = frozenset(n.strip() for n in tf.client_names) if tf is not None else frozenset()

    # -- who is sending ------------------------------------------------------------------------------------------
    def is_forwarder(self, authorization: str | bytes | None, peer_names: tuple[str, ...] = ()) -> bool:
        """Whether a request comes from a trusted forwarder: it presents the forwarders' bearer token, or a verified
        client certificate named in ``trusted_forwarders.client_names`` (``peer_names``: its CN and DNS names)."""
        if self._forwarder_token is not None and self._forwarder_token.check(authorization):
            return True
        return bool(self._forwarder_names) and any(n in self._forwarder_names for n in peer_names)

    # -- the one path every request takes ------------------------------------------------------------------------
    def accept(self, signal: Signal, raw: bytes, trusted: bool = False) -> None:
        """Validates protobuf bytes and hands them on. Raises MalformedBatch or PipelineRefused."""
        try:
            batch = Batch.from_bytes(signal, raw)
            check_ids(signal, batch.message)
        except MalformedBatch:
            self.host.telemetry.refused(self.host.component_id, signal, 1)
            raise
        self.accept_batch(batch, trusted)

    def accept_parsed(self, batch: Batch, trusted: bool = False) -> None:
        """A request parsed from another encoding (OTLP/JSON): the same id checks, then on."""
        try:
            check_ids(batch.signal, batch.message)
        except MalformedBatch:
            self.host.telemetry.refused(self.host.component_id, batch.signal, 1)
            raise
        self.accept_batch(batch, trusted)

    def refused_request(self, signal: Signal) -> None:
        """Counts a request refused before it was parsed (bad body, size, encoding or media type)."""
        self.host.telemetry.refused(self.host.component_id, signal, 1)

    def accept_batch(self, batch: Batch, trusted: bool = False) -> None:
        """Bounds the batch's attributes (``limits``) and hands it on: as a trusted forwarder's (records that act
        kept) only when ``trusted``; else the collector's receiver output drops records that act."""
        limits = self.config.limits
        cuts = enforce(batch, limits.max_attributes, limits.max_attribute_value_bytes)
        if cuts:
            self.host.telemetry.truncated(self.host.component_id, batch.signal, cuts)
            self.host.log_once(("truncated", batch.signal), logging.WARNING, "%s: cut %d attribute(s) of a %s "
                               "request past limits.max_attributes=%d / max_attribute_value_bytes=%d (counted in "
                               "otel_gpu.collector.truncated; logged once)", self.host.component_id, cuts,
                               batch.signal.value, limits.max_attributes, limits.max_attribute_value_bytes)
        consumer = self._consumers.get(batch.signal)
        if consumer is None:
            consumer = self.host.consumer(batch.signal)
        try:
            if trusted and hasattr(consumer, "consume_trusted"):
                consumer.consume_trusted(batch)
            else:
                consumer.consume(batch)
        except Exception as exc:  # noqa: BLE001 - the pipeline's fault must not take the server down
            self.host.log_once(("consume", batch.signal), logging.ERROR, "%s: the %s pipeline raised; the client is "
                               "told to retry (logged once)", self.host.component_id, batch.signal.value,
                               exc_info=True)
            self.host.telemetry.refused(self.host.component_id, batch.signal, batch.item_count())
            raise PipelineRefused(f"the {batch.signal.value} pipeline could not take the batch: {exc}") from None

    def admit(self, signal: Signal) -> float | None:
        """Asks every admission check (``host.services.get(ADMISSION)``, e.g. the memory_limiter's) before a request
        is read or parsed: None to accept, else the retry delay in seconds. A refusal counts 1 refused request."""
        for check in self.host.services.get(ADMISSION):
            try:
                delay = check()
            except Exception:  # noqa: BLE001 - a broken check must not refuse everything
                self.host.log_once(("admission", id(check)), logging.ERROR, "%s: an admission check raised; it is "
                                   "ignored (logged once)", self.host.component_id, exc_info=True)
                continue
            if delay is not None:
                self.host.telemetry.refused(self.host.component_id, signal, 1)
                return float(delay)
        return None

    def signals(self) -> list[Signal]:
        """Signals to serve: those some pipeline consumes (all three when used outside a collector)."""
        served = [s for s in Signal if self.host.has_consumer(s)]
        return served or list(Signal)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        signals = self.signals()
        self._consumers = {s: self.host.consumer(s) for s in signals}
        cfg = self.config
        forwarder_auth = cfg.trusted_forwarders.bearer() if cfg.trusted_forwarders is not None else None
        if forwarder_auth is not None:  # reads bearer_token_file now: a missing file fails start-up, naming it
            self._forwarder_token = BearerChecker(forwarder_auth, "trusted_forwarders.bearer_token")
        try:
            if cfg.grpc is not None:
                host, port = split_endpoint(cfg.grpc.endpoint, "grpc.endpoint")
                self._grpc = GrpcServer(
                    host, port, int(cfg.grpc.max_recv_msg_size_mib * _MIB), cfg.grpc.max_workers, signals, self.accept,
                    credentials=grpc_server_credentials(cfg.grpc.tls, "grpc.tls") if cfg.grpc.tls else None,
                    authorize=BearerChecker(cfg.grpc.auth, "grpc.auth.bearer_token").check if cfg.grpc.auth else None,
                    admit=self.admit, is_forwarder=self.is_forwarder if cfg.trusted_forwarders else None)
                self._grpc.start()
                self.grpc_port = self._grpc.port
                _logger.info("%s: OTLP/gRPC listening on %s%s (%s)", self.host.component_id, self._grpc.address,
                             _extras(cfg.grpc, cfg.trusted_forwarders is not None), ", ".join(s.value for s in signals))
            if cfg.http is not None:
                from otel_gpu.receivers.otlp._http import HttpServer

                host, port = split_endpoint(cfg.http.endpoint, "http.endpoint")
                self._http = HttpServer(
                    host, port, int(cfg.http.max_request_body_size_mib * _MIB), cfg.http.read_timeout_s, signals, self,
                    ssl_context=server_ssl_context(cfg.http.tls, "http.tls") if cfg.http.tls else None,
                    authorize=BearerChecker(cfg.http.auth, "http.auth.bearer_token").check if cfg.http.auth else None,
                    max_connections=cfg.http.max_connections,
                    is_forwarder=self.is_forwarder if cfg.trusted_forwarders else None)
                self._http.start()
                self.http_port = self._http.port
                _logger.info("%s: OTLP/HTTP listening on %s://%s%s (%s)", self.host.component_id,
                             "https" if cfg.http.tls else "http", self._http.address,
                             _extras(cfg.http, cfg.trusted_forwarders is not None),
                             ", ".join(f"/v1/{s.value}" for s in signals))
        except BaseException:
            self.shutdown(2.0)
            raise

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            grpc_server, http_server, self._grpc, self._http = self._grpc, self._http, None, None
        if http_server is not None:
            http_server.stop(timeout_s / 2)
        if grpc_server is not None:
            grpc_server.stop(timeout_s / 2)


def _extras(server_cfg, trusted: bool = False) -> str:
    """`` with TLS (mTLS), bearer auth`` for the start-up line; never the secrets themselves."""
    parts = []
    if server_cfg.tls is not None:
        parts.append("mutual TLS" if server_cfg.tls.client_ca_file else "TLS")
    if server_cfg.auth is not None:
        parts.append("bearer-token auth")
    if trusted:
        parts.append("trusted forwarders")
    return f" with {', '.join(parts)}" if parts else ""
