"""``otlp`` (gRPC) and ``otlphttp`` exporters: batches out to any OTLP backend, from a bounded queue with retry.

A batch received over OTLP is sent with the bytes it arrived with (no re-serialization). ``export()`` only
enqueues (``ExportResult.QUEUED``); a full queue drops the batch, counted as dropped. See README.md.

Example config::

    exporters:
      otlp:
        endpoint: backend.example:4317
        compression: gzip
        retry_on_failure: {enabled: true, initial_interval: 5s, max_interval: 30s, max_elapsed_time: 5m}
        sending_queue: {enabled: true, queue_size: 1000, num_consumers: 10,
                        persistent: {path: /var/lib/otel-gpu/queue, max_size_mib: 256}}  # survives restarts
      otlphttp:
        endpoint: http://backend.example:4318
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.exporters.otlp.config import (OtlpExporterConfig, OtlpHttpExporterConfig, PersistentQueueConfig,
                                            QueueConfig, RetryConfig, TlsConfig)
from otel_gpu.exporters.otlp.exporter import OtlpExporter, OtlpHttpExporter

__all__ = ["FACTORY", "HTTP_FACTORY", "OtlpExporter", "OtlpExporterConfig", "OtlpHttpExporter",
           "OtlpHttpExporterConfig", "PersistentQueueConfig", "QueueConfig", "RetryConfig", "TlsConfig"]

FACTORY = ComponentFactory("otlp", "exporter", OtlpExporterConfig, OtlpExporter,
                           description="OTLP/gRPC to any backend, with a bounded queue and retry.")
HTTP_FACTORY = ComponentFactory("otlphttp", "exporter", OtlpHttpExporterConfig, OtlpHttpExporter,
                                description="OTLP/HTTP (protobuf) to any backend, with a bounded queue and retry.")
