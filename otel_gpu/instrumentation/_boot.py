"""Start-up of a process launched by ``otel-gpu run`` (called from the bootstrap sitecustomize).

The torchrun agent itself is registered (its waitpid notes its workers' exits) but not instrumented; every other
process is instrumented as soon as it imports torch, so processes that never import torch pay nothing.
"""
from __future__ import annotations

import logging
import os
import sys

from otel_gpu.instrumentation import _registry
from otel_gpu.instrumentation.config import env

_logger = logging.getLogger(__name__)

_AGENT_MARKERS = ("torch.distributed.run", "torch.distributed.launch", "torchrun")


def is_torchrun_agent(argv: list[str]) -> bool:
    if not argv:
        return False
    if os.path.basename(argv[0]) in ("torchrun",) or argv[0].endswith("/torchrun"):
        return True
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in _AGENT_MARKERS[:2]:
            return True
    return False


def _instrument_now() -> None:
    try:
        from otel_gpu.instrumentation import instrument

        instrument()
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"otel-gpu: auto-instrumentation failed ({exc!r})\n")


def boot() -> None:
    folder = env("OTEL_GPU_REGISTRY")
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    agent = is_torchrun_agent(argv[1:] if argv and "python" in os.path.basename(argv[0]) else argv)
    if folder and os.path.isdir(folder):
        _registry.write_proc(folder, {"pid": os.getpid(), "ppid": os.getppid(), "role": "agent" if agent else
                                      "python", "rank": env("RANK"), "argv": argv[:8],
                                      "restart_count": env("TORCHELASTIC_RESTART_COUNT")})
    if agent or env("OTEL_GPU_AUTO_SKIP") == "1":
        return
    if "torch" in sys.modules:
        _instrument_now()
    else:
        from otel_gpu.instrumentation._wrappers import AfterImport

        sys.meta_path.insert(0, AfterImport("torch", lambda _module: _instrument_now()))
