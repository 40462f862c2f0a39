"""``otlp`` receiver: OTLP/gRPC (default 127.0.0.1:4317) and OTLP/HTTP protobuf + JSON (127.0.0.1:4318) in.

Requests are validated and passed on as :class:`otel_gpu.pdata.Batch` with their wire bytes, so a pass-through
pipeline never builds Python objects per span. See README.md for every setting.

Example config::

    receivers:
      otlp:
        grpc: {endpoint: 127.0.0.1:4317, max_recv_msg_size_mib: 16}
        http: {endpoint: 127.0.0.1:4318, max_request_body_size_mib: 16}   # or null to turn it off
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.receivers.otlp.config import GrpcServerConfig, HttpServerConfig, OtlpReceiverConfig
from otel_gpu.receivers.otlp.receiver import OtlpReceiver

__all__ = ["FACTORY", "GrpcServerConfig", "HttpServerConfig", "OtlpReceiver", "OtlpReceiverConfig"]

FACTORY = ComponentFactory("otlp", "receiver", OtlpReceiverConfig, OtlpReceiver,
                           description="OTLP over gRPC and HTTP (protobuf and JSON).")
