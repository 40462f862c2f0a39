"""otel-gpu: why a GPU training job crashed, hung or slowed down, told within seconds, over OpenTelemetry.

Inside a training process::

    import otel_gpu.auto            # instrument with defaults (same as otel_gpu.instrument())

    with otel_gpu.step(n):          # explicit step boundaries, when no optimizer hook fits
        ...
    with otel_gpu.checkpoint():     # a blocking checkpoint save
        ...

On a node: ``otel-gpu collector`` runs the sidecar collector; ``otel-gpu report`` shows failures and goodput.
Importing this package loads nothing heavy: the instrumentation is imported on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "instrument", "uninstrument", "step", "checkpoint"]


def instrument(**options):
    """Instruments torch.distributed, optimizer steps, data loading and checkpoints in this process."""
    from otel_gpu.instrumentation import instrument as _instrument

    return _instrument(**options)


def uninstrument() -> None:
    from otel_gpu.instrumentation import uninstrument as _uninstrument

    _uninstrument()


def step(n: int | None = None):
    """Context manager marking one training step (``with otel_gpu.step(n): ...``)."""
    from otel_gpu.instrumentation import step as _step

    return _step(n)


def checkpoint(path: str | None = None):
    """Context manager marking the blocking part of a checkpoint save."""
    from otel_gpu.instrumentation import checkpoint as _checkpoint

    return _checkpoint(path)
