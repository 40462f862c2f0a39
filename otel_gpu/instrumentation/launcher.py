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
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from otel_gpu.instrumentation import jobid

_logger = logging.getLogger(__name__)

__all__ = ["run", "bootstrap_dir", "launch_env", "EndWaiter", "ExitWatcher", "Launch", "resolve_job_id", "send_event",
           "this_host"]


def bootstrap_dir() -> str:
    from otel_gpu.instrumentation import _bootstrap

    return os.path.dirname(os.path.abspath(_bootstrap.__file__))


#: Credentials of ``otel-gpu run`` itself (the verdict API's token, the trusted-forwarder token its restart decisions
#: carry): never passed on to the training command, whose code (and every library it loads) is not the operator's.
PRIVATE_ENV = ("OTEL_GPU_VERDICT_TOKEN", "OTEL_GPU_VERDICT_TOKEN_FILE", "OTEL_GPU_FORWARDER_TOKEN",
               "OTEL_GPU_FORWARDER_TOKEN_FILE")


def launch_env(registry: str, endpoint: str | None, job_id: str, base: dict | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in PRIVATE_ENV}
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


class EndWaiter:
    """Sleeps until one of the watched processes ends, or a timeout: the launcher learns of a rank's death when it
    happens, not at its next poll (``pidfd_open``, Linux >= 5.3; the processes need not be our children). Where
    pidfds are missing it sleeps the timeout.

    >>> import subprocess, sys, time
    >>> child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    >>> waiter = EndWaiter()
    >>> waiter.watch([child.pid])
    >>> t0 = time.monotonic(); ended = waiter.wait(10.0); ended or not waiter.supported, time.monotonic() - t0 < 5
    (True, True)
    >>> _ = child.wait(); waiter.close()
    """

    def __init__(self) -> None:
        self.supported = hasattr(os, "pidfd_open")
        self._poll = select.poll() if self.supported else None
        self._fds: dict[int, int] = {}  # fd -> pid
        self._watched: set[int] = set()
        self._gone_unseen = False  # a pid that was gone before we could watch it: wake at once

    def watch(self, pids) -> None:
        if not self.supported:
            return
        for pid in pids:
            if pid in self._watched:
                continue
            self._watched.add(pid)
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone_unseen = True
                continue
            except OSError:  # no permission, a kernel without pidfds: this one is found by the periodic scan
                continue
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)

    def wait(self, timeout_s: float) -> bool:
        """True when a watched process ended (or was gone already) within ``timeout_s``."""
        if self._gone_unseen:
            self._gone_unseen = False
            return True
        if self._poll is None or not self._fds:
            time.sleep(max(0.0, timeout_s))
            return False
        events = self._poll.poll(max(0, int(timeout_s * 1000)))
        for fd, _mask in events:
            self._poll.unregister(fd)
            os.close(fd)
            del self._fds[fd]
        return bool(events)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


class ExitWatcher:
    """Decides, from the registry, how each registered process ended; each process is reported once."""

    def __init__(self, registry: str, grace_s: float = 1.5, on_job_id=None):
        self.registry = registry
        self.on_job_id = on_job_id  # called with the job id the ranks agreed on (otel_gpu.instrumentation.jobid)
        self.grace_s = grace_s
        self.reported: dict[int, dict] = {}
        self.known: set[int] = set()  # every pid that registered
        self._dead_since: dict[int, float] = {}

    def pending(self) -> bool:
        """Some process is gone but not yet reported (waiting for its record within the grace period)."""
        return any(pid not in self.reported for pid in self._dead_since)

    def scan(self, final: bool = False, direct: tuple[int, int] | None = None) -> list[dict]:
        """New exit reports. ``direct`` is (pid, returncode) of the launched command once it ended."""
        from otel_gpu.instrumentation import _registry

        procs, events, waits = _registry.read(self.registry)
        self.known.update(procs)
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
            elif not final and now - self._dead_since[pid] < self.grace_s and _will_reap(info, procs):
                continue  # its instrumented parent is about to write how it ended: more than the process itself knew
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


def _will_reap(info: dict, procs: dict[int, dict]) -> bool:
    """The process's parent is instrumented and alive, so it will append the child's wait status shortly."""
    parent = _int_or_none(info.get("ppid"))
    return parent is not None and parent in procs and _alive(parent)


def send_event(launch: Launch, name: str, attributes: dict, body: dict, warning: bool = False,
               token: str | None = None) -> None:
    """Sends one log event (``name``, e.g. ``otel_gpu.restart.decision``) with the launch's own resource; with
    ``token``, as a trusted forwarder (``receivers.otlp.trusted_forwarders``: a record that acts is dropped from any
    other sender) on a client of its own, so the token never reaches the ranks' exporters."""
    from otel_gpu.instrumentation import _export

    severity = _export.WARN if warning else _export.INFO
    request = _export.logs_request(_export.make_resource(launch.identity.attributes()),
                                   [(name, time.time_ns(), attributes, body, severity)])
    if not token:
        launch.client.send_logs(request)
        return
    cfg = launch.config
    client = _export.OtlpClient(cfg.endpoint, cfg.protocol, {**cfg.headers, "authorization": f"Bearer {token}"},
                                cfg.export_timeout_s)
    try:
        client.send_logs(request)
    finally:
        client.close()


def this_host(environ: dict[str, str] | None = None) -> str | None:
    """This host's name as the instrumentation reports it (``host.name`` from OTEL_RESOURCE_ATTRIBUTES, else the
    node's name); None when it cannot be told."""
    from otel_gpu.instrumentation._identity import Identity
    from otel_gpu.instrumentation.config import InstrumentationConfig

    env = dict(os.environ if environ is None else environ)
    return Identity("-", None, InstrumentationConfig.from_env(env).resource_attributes).host


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


class Launch:
    """One start of CMD with the instrumentation's environment: sends exit records while it runs.

    ``otel-gpu run`` makes one; ``otel-gpu run --restart`` (:mod:`otel_gpu.supervisor`) makes one per incarnation,
    with ``restart_count`` in the environment (``OTEL_GPU_RESTART_COUNT``) so that the collector re-arms.
    """

    def __init__(self, cmd: list[str], endpoint: str | None, job_id: str, restart_count: int | None = None,
                 extra_env: dict[str, str] | None = None, keep_registry: bool = False,
                 job: jobid.LaunchJobId | None = None):
        from otel_gpu.instrumentation._export import OtlpClient
        from otel_gpu.instrumentation._identity import Identity
        from otel_gpu.instrumentation.config import InstrumentationConfig
        from otel_gpu.schema import training as tr

        self.cmd = cmd
        self.job_id = job_id
        self.keep_registry = keep_registry
        self.registry = tempfile.mkdtemp(prefix="otel-gpu-run-")
        self.env = launch_env(self.registry, endpoint, job_id)
        self.job = job
        if job is not None:
            job.apply(self.env)  # a provisional id: the ranks agree on one at their rendezvous
        if restart_count is not None:
            self.env["OTEL_GPU_RESTART_COUNT"] = str(restart_count)
        self.env.update(extra_env or {})
        cfg = InstrumentationConfig.from_env(self.env)
        self.config = cfg
        self.identity = Identity(job_id, cfg.service_name, {**cfg.resource_attributes,
                                                            str(tr.PROCESS_ROLE): "launcher"})
        self.identity.rank = self.identity.local_rank = self.identity.world_size = None
        if restart_count is not None:
            self.identity.restart_count = restart_count
        self.client = OtlpClient(cfg.endpoint, cfg.protocol, cfg.headers, cfg.export_timeout_s)
        self.watcher = ExitWatcher(self.registry, on_job_id=self._adopt if job is not None else None)
        self.proc: subprocess.Popen | None = None
        self.rc: int | None = None
        self._ends = EndWaiter()

    def _adopt(self, agreed: str | None) -> None:
        """The job id the ranks agreed on, for the launcher's own records (otel_gpu.instrumentation.jobid)."""
        self.job.adopt(agreed, self.identity)
        self.job_id = self.job.value

    def start(self) -> None:
        """Starts CMD. Raises OSError when it cannot be started."""
        self.proc = subprocess.Popen(self.cmd, env=self.env)

    def poll(self, timeout_s: float) -> int | None:
        """Waits up to ``timeout_s`` for CMD to end, sending the exit record of each process that ends meanwhile as
        soon as it ended (woken by its end, then re-reading the registry every 50 ms until its parent wrote how it
        ended, within the grace period); CMD's return code once it ended, else None."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            self.rc = self.proc.poll()
            if self.rc is not None:
                return self.rc
            _send(self.client, self.identity, self.watcher.scan())
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._ends.watch([self.proc.pid, *self.watcher.known])
            self._ends.wait(min(left, 0.05) if self.watcher.pending() else left)

    def finish(self) -> None:
        """After CMD ended: the last exit records. A process that just ended may get its record a moment after its
        pid is gone (its parent writes it after reaping it): such processes get the grace period before they are
        called vanished."""
        assert self.proc is not None and self.rc is not None
        watcher = self.watcher
        direct = (self.proc.pid, self.rc)
        deadline = time.monotonic() + watcher.grace_s
        _send(self.client, self.identity, watcher.scan(direct=direct))
        while watcher.pending() and time.monotonic() < deadline:
            time.sleep(0.1)
            _send(self.client, self.identity, watcher.scan(direct=direct))
        _send(self.client, self.identity, watcher.scan(final=True, direct=direct))

    def pids(self) -> set[int]:
        """Every process of this start that registered (ranks in their own sessions included)."""
        from otel_gpu.instrumentation import _registry

        procs, _events, _waits = _registry.read(self.registry)
        return set(procs) | ({self.proc.pid} if self.proc is not None else set())

    def torchelastic_restarts(self) -> int:
        """The highest TORCHELASTIC_RESTART_COUNT a process of this start registered with (torchrun's own
        restarts inside one start)."""
        from otel_gpu.instrumentation import _registry

        procs, _events, _waits = _registry.read(self.registry)
        return max((_int_or_none(p.get("restart_count")) or 0 for p in procs.values()), default=0)

    def close(self) -> None:
        self._ends.close()
        self.client.close()
        if not self.keep_registry:
            shutil.rmtree(self.registry, ignore_errors=True)

    def print_ends(self, prefix: str = "otel-gpu run") -> None:
        for rep in self.watcher.reported.values():
            if rep.get("how") is None:
                continue
            if rep.get("code") not in (0, None) or rep.get("signal") or rep["source"] == "vanished":
                who = f"rank {rep['rank']}" if rep.get("rank") is not None else rep.get("role") or "process"
                how = rep.get("signal") or (f"exit code {rep['code']}" if rep.get("code") is not None else
                                            "vanished without an exit record (SIGKILL or os._exit)")
                print(f"{prefix}: {who} (pid {rep['pid']}) ended: {how}", file=sys.stderr)

    @property
    def status(self) -> int:
        """CMD's exit status as a shell reports it (128 + signal when it was killed)."""
        assert self.rc is not None
        return self.rc if self.rc >= 0 else 128 - self.rc


def resolve_job_id(job_id: str | None = None, cmd: list[str] | tuple = ()) -> str:
    """The job id every process of this run shares: ``job_id``, else the scheduler's or launcher's
    (:func:`otel_gpu.instrumentation.jobid.resolve`: OTEL_GPU_JOB_ID, torchrun's --rdzv-id, Slurm, Kubernetes), else a generated
    one. (``otel-gpu run`` without ``--restart`` lets the ranks agree on one instead: :class:`jobid.LaunchJobId`.)"""
    return job_id or (jobid.resolve(os.environ, cmd) or jobid.JobId(jobid.generated(), "generated")).value


def forward_signals(target) -> dict:
    """Forwards SIGTERM/SIGINT/SIGHUP to ``target(signum)`` (main thread only); returns what to restore."""
    previous = {}
    if threading_is_main():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, _frame: target(signum))
    return previous


def restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def run(cmd: list[str], endpoint: str | None = None, job_id: str | None = None, poll_s: float = 0.5,
        keep_registry: bool = False) -> int:
    """Runs ``cmd`` instrumented; returns its exit status (128 + signal when it was killed)."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("otel-gpu run: no command given (usage: otel-gpu run [--endpoint URL] -- CMD ...)", file=sys.stderr)
        return 2
    job = jobid.LaunchJobId(cmd, job_id)  # the scheduler's or launcher's id, else agreed by the ranks (adopted)
    job.announce()
    launch = Launch(cmd, endpoint, job.value, keep_registry=keep_registry, job=job)
    print(f"otel-gpu run: job {launch.job_id}; telemetry to {launch.config.endpoint} ({launch.config.protocol})",
          file=sys.stderr, flush=True)
    try:
        launch.start()
    except OSError as exc:
        print(f"otel-gpu run: cannot start {cmd[0]!r}: {exc}", file=sys.stderr)
        launch.close()
        return 127

    def _forward(signum):
        try:
            launch.proc.send_signal(signum)
        except OSError:
            pass

    previous = forward_signals(_forward)
    try:
        while launch.poll(poll_s) is None:
            pass
        launch.finish()
    finally:
        restore_signals(previous)
        launch.close()
    launch.print_ends()
    status = launch.status
    print(f"otel-gpu run: job {launch.job_id} ended with status {status}; what happened: otel-gpu report --job "
          f"{launch.job_id}", file=sys.stderr, flush=True)
    return status


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
