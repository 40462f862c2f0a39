"""``otel-gpu run [--endpoint URL] -- CMD ...``: run a training command with every Python process it starts
instrumented, and report how each of them ended.

Example:
    otel-gpu run --endpoint http://127.0.0.1:4317 -- torchrun --standalone --nproc-per-node 4 train.py

How: a bootstrap ``sitecustomize`` folder goes first on PYTHONPATH (chaining any existing sitecustomize), with
OTEL_GPU_AUTO=1, a shared OTEL_GPU_JOB_ID and a registry folder (OTEL_GPU_REGISTRY). Each Python process registers
its pid there (and its rank once known), appends its own end (exception, signal, atexit), and notes the exit status
of every child it reaps (so torchrun's agent reports its workers' exit codes and signals). The launcher watches the
registry while CMD runs and sends one ``otel_gpu.process.exit`` log record per process as soon as it has ended,
including processes that vanished without a word (SIGKILL, ``os._exit``); it returns CMD's exit status.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from otel_gpu import jobid

_logger = logging.getLogger(__name__)

__all__ = ["run", "bootstrap_dir", "launch_env", "ExitWatcher"]


def bootstrap_dir() -> str:
    from otel_gpu.instrumentation import _bootstrap

    return os.path.dirname(os.path.abspath(_bootstrap.__file__))


def launch_env(registry: str, endpoint: str | None, job_id: str, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    boot = bootstrap_dir()
    parts = [boot] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != boot]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["OTEL_GPU_AUTO"] = "1"
    env["OTEL_GPU_REGISTRY"] = registry
    env["OTEL_GPU_JOB_ID"] = job_id
    if endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    return env


def _alive(pid: int) -> bool:
    """False once the process is gone or a zombie (ended, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _signame(num: int | None) -> str | None:
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"SIG{num}"


class ExitWatcher:
    """Decides, from the registry, how each registered process ended; each process is reported once."""

    def __init__(self, registry: str, grace_s: float = 1.5, on_job_id=None):
        self.registry = registry
        self.on_job_id = on_job_id  # called with the job id the ranks agreed on (otel_gpu.jobid)
        self.grace_s = grace_s
        self.reported: dict[int, dict] = {}
        self._dead_since: dict[int, float] = {}

    def pending(self) -> bool:
        """Some process is gone but not yet reported (waiting for its record within the grace period)."""
        return any(pid not in self.reported for pid in self._dead_since)

    def scan(self, final: bool = False, direct: tuple[int, int] | None = None) -> list[dict]:
        """New exit reports. ``direct`` is (pid, returncode) of the launched command once it ended."""
        from otel_gpu.instrumentation import _registry

        procs, events, waits = _registry.read(self.registry)
        if direct is not None and direct[0] not in procs:
            procs[direct[0]] = {"pid": direct[0], "role": "command", "rank": None}
        now = time.monotonic()
        out = []
        if self.on_job_id is not None:
            self.on_job_id(next((i["job_id"] for i in procs.values() if i.get("job_id") and i.get("rank") is not None),
                                None))
        for pid, info in procs.items():
            if pid in self.reported:
                continue
            if direct is None or pid != direct[0]:
                if _alive(pid):
                    continue
            self._dead_since.setdefault(pid, now)
            wait = waits.get(pid)
            own = events.get(pid, [])
            ended = next((e for e in reversed(own) if e.get("kind") == "atexit"), None)
            signalled = next((e for e in reversed(own) if e.get("kind") == "signal"), None)
            exc = next((e for e in reversed(own) if e.get("kind") == "exception"), None)
            t_end = (wait or {}).get("t") or next((e.get("t") for e in reversed(own)), None)
            rep = {"pid": pid, "rank": info.get("rank"), "local_rank": info.get("local_rank"), "ended_at": t_end,
                   "role": info.get("role"), "host": info.get("host"), "argv": info.get("argv")}
            if direct is not None and pid == direct[0]:
                rc = direct[1]
                rep.update(code=rc, signal=_signame(-rc) if rc < 0 else None, source="launcher")
            elif wait is not None:
                rep.update(code=wait.get("code", -wait["signal"] if "signal" in wait else None),
                           signal=_signame(wait.get("signal")), source="waitpid")
            elif ended is not None or signalled is not None:
                src = ended or signalled
                rep.update(code=src.get("code", 0 if src.get("how") == "atexit" else None),
                           signal=src.get("signal"), source="self")
            elif final or now - self._dead_since[pid] >= self.grace_s:
                rep.update(code=None, signal=None, source="vanished")
            else:
                continue  # its parent may not have reaped it yet
            if exc is not None:
                rep["exception"] = {"type": exc.get("type"), "hint": exc.get("hint")}
            if rep["signal"]:
                rep["how"] = "killed"
            elif rep["source"] == "vanished":
                # Gone without an atexit record and nobody reaped it here: SIGKILL or os._exit.
                rep["how"] = "vanished"
            elif rep.get("code") == 0:
                rep["how"] = "exited"
            else:
                rep["how"] = "exception" if exc is not None else "exited"
            if (info.get("role") == "python" and info.get("rank") is None and pid != (direct or (0,))[0]
                    and not rep.get("signal") and rep.get("code") in (0, None) and exc is None):
                rep["how"] = None  # not printed either
                self.reported[pid] = rep  # a helper process (mp.spawn's parent, resource tracker): not worth a record
                continue
            if ended is None and signalled is None and rep["source"] == "waitpid" and not rep["signal"]:
                rep["no_atexit"] = True  # exited without running atexit: os._exit
            self.reported[pid] = rep
            out.append(rep)
        return out


def _send(client, identity, reports: list[dict]) -> None:
    if not reports:
        return
    from otel_gpu.instrumentation import _export
    from otel_gpu.schema import identity as ids
    from otel_gpu.schema import training as tr

    records = []
    for rep in reports:
        attrs = {str(ids.JOB_ID): identity.job_id, str(ids.RANK): _int_or_none(rep.get("rank")),
                 str(tr.EXIT_CODE): rep.get("code"), str(tr.EXIT_SIGNAL): rep.get("signal"),
                 str(ids.PROCESS_PID): rep["pid"]}
        severity = _export.INFO if rep.get("code") == 0 else _export.ERROR
        records.append((str(tr.EXIT_EVENT), time.time_ns(), attrs, rep, severity))
    client.send_logs(_export.logs_request(_export.make_resource(identity.attributes()), records))


def _int_or_none(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def run(cmd: list[str], endpoint: str | None = None, job_id: str | None = None, poll_s: float = 0.5,
        keep_registry: bool = False) -> int:
    """Runs ``cmd`` instrumented; returns its exit status (128 + signal when it was killed)."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("otel-gpu run: no command given (usage: otel-gpu run [--endpoint URL] -- CMD ...)", file=sys.stderr)
        return 2
    from otel_gpu.instrumentation._export import OtlpClient
    from otel_gpu.instrumentation._identity import Identity
    from otel_gpu.instrumentation.config import InstrumentationConfig
    from otel_gpu.schema import training as tr

    job = jobid.LaunchJobId(cmd, job_id)  # the scheduler's or launcher's id, else agreed by the ranks (adopted)
    job.announce()
    job_id = job.value
    registry = tempfile.mkdtemp(prefix="otel-gpu-run-")
    env = job.apply(launch_env(registry, endpoint, job_id))
    cfg = InstrumentationConfig.from_env(env)
    identity = Identity(job_id, cfg.service_name, {**cfg.resource_attributes, str(tr.PROCESS_ROLE): "launcher"})
    identity.rank = identity.local_rank = identity.world_size = None
    client = OtlpClient(cfg.endpoint, cfg.protocol, cfg.headers, cfg.export_timeout_s)
    watcher = ExitWatcher(registry, on_job_id=lambda agreed: job.adopt(agreed, identity))
    print(f"otel-gpu run: job {job_id}; telemetry to {cfg.endpoint} ({cfg.protocol})", file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        print(f"otel-gpu run: cannot start {cmd[0]!r}: {exc}", file=sys.stderr)
        shutil.rmtree(registry, ignore_errors=True)
        return 127

    def _forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    previous = {}
    if threading_is_main():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _forward)
    try:
        while True:
            try:
                rc = proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                _send(client, identity, watcher.scan())
        # A process that just ended may get its record a moment after its pid is gone (its parent writes it after
        # reaping it): give such processes the grace period before calling them vanished.
        direct = (proc.pid, rc)
        deadline = time.monotonic() + watcher.grace_s
        _send(client, identity, watcher.scan(direct=direct))
        while watcher.pending() and time.monotonic() < deadline:
            time.sleep(0.1)
            _send(client, identity, watcher.scan(direct=direct))
        _send(client, identity, watcher.scan(final=True, direct=direct))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        client.close()
        if not keep_registry:
            shutil.rmtree(registry, ignore_errors=True)
    for rep in watcher.reported.values():
        if rep.get("how") is None:
            continue
        if rep.get("code") not in (0, None) or rep.get("signal") or rep["source"] == "vanished":
            who = f"rank {rep['rank']}" if rep.get("rank") is not None else rep.get("role") or "process"
            how = rep.get("signal") or (f"exit code {rep['code']}" if rep.get("code") is not None else
                                        "vanished without an exit record (SIGKILL or os._exit)")
            print(f"otel-gpu run: {who} (pid {rep['pid']}) ended: {how}", file=sys.stderr)
    status = rc if rc >= 0 else 128 - rc
    print(f"otel-gpu run: job {job.value} ended with status {status}; what happened: otel-gpu report --job {job.value}",
          file=sys.stderr, flush=True)
    return status


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
