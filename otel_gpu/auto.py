"""``import otel_gpu.auto``: instrument this process with the defaults (OTEL_* / OTEL_GPU_* variables apply).

Example:
    import otel_gpu.auto  # noqa: F401  (first line of train.py)
"""
from __future__ import annotations

from otel_gpu.instrumentation import instrument as _instrument

INSTRUMENTOR = _instrument()
