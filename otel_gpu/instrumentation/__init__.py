"""Auto-instrumentation of PyTorch training: steps, every collective (DDP/FSDP included through torch's flight
recorder), data-loader waits, checkpoints, an in-flight watchdog and crash hooks, exported over OTLP.

Example::

    import otel_gpu
    otel_gpu.instrument(heartbeat_s=2.0)
    for n, batch in enumerate(loader):
        loss = model(batch).sum(); loss.backward(); opt.step()   # steps come from the optimizer hook
    with otel_gpu.checkpoint("ckpt.pt"):
        torch.save(model.state_dict(), "ckpt.pt")

The same from outside the program: ``opentelemetry-instrument python train.py`` (entry point
``opentelemetry_instrumentor: otel_gpu``), ``otel-gpu run -- torchrun ... train.py`` or ``import otel_gpu.auto``.
See README.md in this folder for the settings and what is seen on which torch version.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Collection, Iterator
from dataclasses import fields

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_gpu.instrumentation import _hot, _wrappers
from otel_gpu.instrumentation._hot import NS
from otel_gpu.instrumentation._wrappers import COLLECTIVES, AfterImport, checkpoint_span
from otel_gpu.instrumentation.config import InstrumentationConfig, signal_routes, unsupported_settings

_logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _log_once(key: str, level: int, msg: str, *args) -> None:
    """Once per process: a re-instrument (or a second rank thread) does not repeat what the first one said."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        _logger.log(level, msg, *args)

__all__ = ["TorchDistributedInstrumentor", "InstrumentationConfig", "instrument", "uninstrument", "step",
           "checkpoint", "flush", "is_instrumented", "COLLECTIVES"]

# Options that opentelemetry-instrument passes to every instrumentor; we export on our own path.
_OTEL_KWARGS = {"tracer_provider", "meter_provider", "logger_provider", "event_logger_provider",
                "skip_dep_check", "raise_exception_on_conflict"}


# ---------------------------------------------------------------------------------------------- instrumentor
class TorchDistributedInstrumentor(BaseInstrumentor):
    """Wraps torch.distributed (one table for wrap and unwrap), hooks optimizer steps, data loading and checkpoints,
    and runs the export and watchdog threads. ``instrument(**options)`` takes the fields of InstrumentationConfig."""

    _patches: list[tuple[object, str, object, object]] = []
    _runtime = None
    _step_hook = None
    _dcp_hook = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("torch >= 2.2",)

    def _targets(self):
        """(owner, attribute, wrapper factory) for everything patched (``_wrappers.targets``)."""
        return _wrappers.targets()

    @staticmethod
    def _dcp_targets(dcp):
        return _wrappers.dcp_targets(dcp)

    def _patch(self, targets) -> None:
        try:
            import torch.distributed as dist_pkg
        except Exception:  # noqa: BLE001
            dist_pkg = None
        for owner, name, factory in targets:
            orig = getattr(owner, name, None)
            if orig is None or getattr(orig, "_otel_gpu_wrapper", False):
                continue
            try:
                wrapper = factory(orig)
            except Exception as exc:  # noqa: BLE001 - an unexpected signature: leave that one alone
                _logger.warning("otel-gpu: not instrumenting %s.%s (%s)", getattr(owner, "__name__", owner), name,
                                exc)
                continue
            wrapper._otel_gpu_wrapper = True
            setattr(owner, name, wrapper)
            self._patches.append((owner, name, orig, wrapper))
            # torch.distributed re-exports the c10d functions: patch the alias too
            if dist_pkg is not None and owner is not dist_pkg and getattr(dist_pkg, name, None) is orig:
                setattr(dist_pkg, name, wrapper)
                self._patches.append((dist_pkg, name, orig, wrapper))
            if name in ("save", "load") and getattr(owner, "__name__", "") == "torch":
                import torch.serialization as ser

                if getattr(ser, name, None) is orig:
                    setattr(ser, name, wrapper)
                    self._patches.append((ser, name, orig, wrapper))

    def _on_dcp_import(self, module) -> None:
        if NS["_on"]:
            self._patch(self._dcp_targets(module))

    def _instrument(self, **kwargs) -> None:
        from otel_gpu.instrumentation import _runtime

        options = {k: v for k, v in kwargs.items() if k not in _OTEL_KWARGS}
        cfg = InstrumentationConfig.from_env(**options)
        if cfg.sdk_disabled:
            _log_once("disabled", logging.INFO, "otel-gpu: OTEL_SDK_DISABLED=true: instrumentation is off in this "
                      "process (nothing is wrapped or exported)")
            return
        for var, value, instead in unsupported_settings():
            _log_once(var, logging.WARNING, "otel-gpu: %s=%s has no effect on otel-gpu's export path: %s", var,
                      value, instead)
        for signal, route in signal_routes(cfg).items():
            if signal == "logs" and not route.otlp:
                _log_once("logs-off", logging.WARNING, "otel-gpu: OTEL_LOGS_EXPORTER has no otlp: heartbeats, stacks "
                          "and exceptions are not sent, so hangs and crashes cannot be attributed")
        _hot.reset(cfg.ring_size)
        rt = _runtime.Runtime(cfg)
        rt.enable_flight_recorder()  # TORCH_FR_BUFFER_SIZE, before any process group is created from now on
        type(self)._patches = []
        self._patch(self._targets())  # imports torch here, in the calling thread, before our threads start
        rt.start()
        if "torch.distributed.checkpoint" not in sys.modules:
            type(self)._dcp_hook = AfterImport("torch.distributed.checkpoint", self._on_dcp_import)
            sys.meta_path.insert(0, type(self)._dcp_hook)
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            type(self)._step_hook = register_optimizer_step_post_hook(rt.on_optimizer_step)
        except Exception:  # noqa: BLE001
            _logger.info("otel-gpu: no global optimizer step hook in this torch; use otel_gpu.step()")
        type(self)._runtime = rt
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rt.on_process_group_created()
        except Exception:  # noqa: BLE001
            pass
        NS["_on"] = True

    def _uninstrument(self, **kwargs) -> None:
        NS["_on"] = False
        if type(self)._dcp_hook is not None:
            try:
                sys.meta_path.remove(type(self)._dcp_hook)
            except ValueError:
                pass
            type(self)._dcp_hook = None
        for owner, name, orig, wrapper in reversed(type(self)._patches):
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, orig)
            else:
                _logger.info("otel-gpu: %s was re-wrapped by someone else; leaving it (it passes through now)",
                             name)
        type(self)._patches = []
        if type(self)._step_hook is not None:
            type(self)._step_hook.remove()
            type(self)._step_hook = None
        rt, type(self)._runtime = type(self)._runtime, None
        if rt is not None:
            rt.shutdown()


def instrument(**options) -> TorchDistributedInstrumentor:
    """Instruments this process (idempotent). Options: the fields of InstrumentationConfig."""
    unknown = set(options) - {f.name for f in fields(InstrumentationConfig)}
    if unknown:
        raise ValueError(f"unknown instrumentation option(s): {', '.join(sorted(unknown))}")
    inst = TorchDistributedInstrumentor()
    if not inst.is_instrumented_by_opentelemetry:
        inst.instrument(skip_dep_check=True, **options)
    return inst


def uninstrument() -> None:
    inst = TorchDistributedInstrumentor()
    if inst.is_instrumented_by_opentelemetry:
        inst.uninstrument()


def is_instrumented() -> bool:
    return bool(NS.get("_on"))


def flush(timeout_s: float | None = None) -> bool:
    """Exports what is buffered now (bounded); False when not instrumented or it timed out."""
    from otel_gpu.instrumentation import _runtime

    rt = _runtime.current()
    return rt.flush(timeout_s) if rt is not None else False


@contextlib.contextmanager
def step(n: int | None = None) -> Iterator[int]:
    """Marks one training step. Once used, the optimizer hook stops marking steps (explicit wins)."""
    from otel_gpu.instrumentation import _runtime

    rt = _runtime.current()
    if rt is None or not NS["_on"]:
        yield n if n is not None else 0
        return
    rt.explicit_steps = True
    n = NS["_step"] if n is None else int(n)
    NS["_step"] = n
    t0 = time.time_ns()
    err = None
    try:
        yield n
    except BaseException as exc:
        err = _hot._error_text(exc)
        raise
    finally:
        rt.end_step(n, t0, time.time_ns(), err)


def checkpoint(path: str | None = None):
    """Marks the blocking part of a checkpoint save (``with otel_gpu.checkpoint("ckpt.pt"): ...``)."""
    return checkpoint_span("save", path)
