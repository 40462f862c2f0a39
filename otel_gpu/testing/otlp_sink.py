"""An OTLP gRPC server built from the opentelemetry-proto stubs that keeps every request it gets: a backend stand-in
for tests and benchmarks (loopback only).

Example (the OpenTelemetry SDK's OTLP exporter sending to it):
    >>> from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    >>> from opentelemetry.sdk.trace import TracerProvider
    >>> from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    >>> with OtlpSink() as sink:
    ...     provider = TracerProvider()
    ...     provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sink.endpoint, insecure=True)))
    ...     provider.get_tracer("example").start_span("step").end()
    ...     print(sink.wait_for(lambda s: s.span_count() >= 1, timeout_s=10), sink.spans()[0].name)
    ...     provider.shutdown()
    True step
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

__all__ = ["OtlpSink"]


class OtlpSink:
    """Records requests per signal. ``fail_next(n, code)`` makes the next n calls fail with ``code``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_workers: int = 4):
        self.traces: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.logs: list[logs_service_pb2.ExportLogsServiceRequest] = []
        self.calls = 0
        self.metadata: list[dict[str, str]] = []  # the request metadata (headers) of each call, in order
        self._fail: list[grpc.StatusCode] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                                   options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        sink = self

        class _Trace(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                sink._record(sink.traces, request, context)
                return trace_service_pb2.ExportTraceServiceResponse()

        class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                sink._record(sink.metrics, request, context)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class _Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request, context):
                sink._record(sink.logs, request, context)
                return logs_service_pb2.ExportLogsServiceResponse()

        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Trace(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(), self._server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_Logs(), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"{host}:{self.port}"

    def _record(self, store: list, request, context) -> None:
        with self._cond:
            self.calls += 1
            self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
            if self._fail:
                code = self._fail.pop(0)
                context.abort(code, f"injected failure: {code.name}")
            store.append(request)
            self._cond.notify_all()

    def fail_next(self, n: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        with self._cond:
            self._fail.extend([code] * n)

    def spans(self) -> list:
        with self._cond:
            return [s for r in self.traces for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def span_count(self) -> int:
        with self._cond:
            return sum(len(ss.spans) for r in self.traces for rs in r.resource_spans for ss in rs.scope_spans)

    def log_records(self) -> list:
        with self._cond:
            return [lr for r in self.logs for rl in r.resource_logs for sl in rl.scope_logs for lr in sl.log_records]

    def metric_names(self) -> set[str]:
        with self._cond:
            return {m.name for r in self.metrics for rm in r.resource_metrics for sm in rm.scope_metrics
                    for m in sm.metrics}

    def wait_for(self, predicate: Callable[[OtlpSink], bool], timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            if predicate(self):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._cond:
                self._cond.wait(min(remaining, 0.1))

    def start(self) -> OtlpSink:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=0.5).wait(2)

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
