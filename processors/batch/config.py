"""Settings of the ``batch`` processor (the OpenTelemetry Collector's keys and defaults).

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(BatchConfig, {"send_batch_size": 100, "timeout": "1s"}, "processors.batch")
    >>> cfg.send_batch_size, cfg.timeout_s, cfg.send_batch_max_size
    (100, 1.0, 0)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BatchConfig:
    send_batch_size: int = 8192  # items that trigger a send, whatever the timeout
    timeout_s: float = 0.2  # YAML `timeout`: a batch waits at most this long; 0: pass on at once (only splitting)
    send_batch_max_size: int = 0  # items per outgoing request at most; 0: no limit
    metadata_keys: list[str] = field(default_factory=list)  # the Collector's per-client batching: not supported
    metadata_cardinality_limit: int = 1000

    def validate(self) -> None:
        if self.send_batch_size < 0:
            raise ValueError(f"send_batch_size must be >= 0 (got {self.send_batch_size})")
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (got {self.timeout_s})")
        if self.send_batch_max_size < 0:
            raise ValueError(f"send_batch_max_size must be >= 0 (got {self.send_batch_max_size})")
        if self.send_batch_max_size and self.send_batch_max_size < self.send_batch_size:
            raise ValueError(f"send_batch_max_size must be 0 or >= send_batch_size ({self.send_batch_size}) "
                             f"(got {self.send_batch_max_size})")
        if self.metadata_keys:
            raise ValueError("metadata_keys: batching by client metadata is not supported by otel-gpu; remove it")
