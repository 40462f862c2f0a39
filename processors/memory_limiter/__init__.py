"""``memory_limiter`` processor: keeps the collector's memory bounded by refusing data at the door.

Like the OpenTelemetry Collector's memory_limiter: every ``check_interval`` it reads the process's resident memory
(``/proc/self/statm``); above the soft limit (``limit - spike``) receivers that ask refuse new requests (OTLP: gRPC
``RESOURCE_EXHAUSTED`` with a ``google.rpc.RetryInfo`` delay, HTTP 429 with ``Retry-After``); above the hard limit it
also runs the garbage collector (and glibc's ``malloc_trim``). Batches that already passed a receiver go through
unchanged: refusing at the door tells the client to retry, dropping later would lose data it was told was delivered.

How a receiver asks: the processor publishes a check under ``ADMISSION`` (:mod:`otel_gpu.component`), one of a list of callables
``() -> float | None`` (``None``: accept; a number: refuse and tell the client to retry after that many seconds).
A receiver calls each before it reads or parses a request; receivers and processors never import each other::

    processors:
      memory_limiter: {check_interval: 1s, limit_mib: 1500, spike_limit_mib: 300}
    service:
      pipelines:
        traces: {receivers: [otlp], processors: [memory_limiter, attribution], exporters: [store]}
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.processors.memory_limiter.config import MemoryLimiterConfig
from otel_gpu.processors.memory_limiter.processor import MemoryLimiterProcessor, available_memory_bytes, rss_bytes

__all__ = ["FACTORY", "MemoryLimiterConfig", "MemoryLimiterProcessor", "available_memory_bytes", "rss_bytes"]

FACTORY = ComponentFactory("memory_limiter", "processor", MemoryLimiterConfig, MemoryLimiterProcessor,
                           description="Refuses new data (RESOURCE_EXHAUSTED / 429) above a memory limit.")
