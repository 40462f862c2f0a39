"""Loaded at start-up of every Python process that ``otel-gpu run`` launches (its folder is first on PYTHONPATH).

With OTEL_GPU_AUTO=1 it records this process in the job's registry, notes the exit status of every child it reaps
(os.waitpid), and instruments the process when torch is imported. Then it chains to the sitecustomize that was
shadowed, if any. It never raises: a broken telemetry set-up must not stop the user's program.
"""
import os
import sys


def _otel_gpu_hook_waitpid(folder):
    orig = os.waitpid

    def waitpid(pid, options):
        result = orig(pid, options)
        if result[0] > 0:
            try:
                from otel_gpu.instrumentation import _registry

                _registry.append_wait(folder, result[0], result[1])
            except Exception:  # noqa: BLE001
                pass
        return result

    waitpid.__wrapped__ = orig
    os.waitpid = waitpid


def _otel_gpu_boot():
    if os.environ.get("OTEL_GPU_AUTO") != "1":
        return
    folder = os.environ.get("OTEL_GPU_REGISTRY")
    if folder and os.path.isdir(folder):
        _otel_gpu_hook_waitpid(folder)  # first, before subprocess binds os.waitpid
    try:
        from otel_gpu.instrumentation import _boot

        _boot.boot()
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"otel-gpu: auto-instrumentation disabled in this process ({exc!r})\n")


def _otel_gpu_chain():
    """Imports the next sitecustomize on sys.path (the one ours shadows)."""
    here = os.path.dirname(os.path.abspath(__file__))
    mod = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError:
        if mod is not None:
            sys.modules["sitecustomize"] = mod
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"otel-gpu: the chained sitecustomize failed ({exc!r})\n")
    finally:
        sys.path[:] = saved


_otel_gpu_boot()
_otel_gpu_chain()
