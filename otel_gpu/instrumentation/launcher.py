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

Exit truth for every launcher (torchrun, Lightning, ``mp.spawn``, accelerate, a shell script, ``srun``): how a
process ended is, in order, what CMD's own ``waitpid`` said (CMD itself), what an instrumented parent's ``waitpid``
noted, the status the kernel keeps for a zombie until its parent reaps it (read at once from ``/proc/PID/stat``, so
a parent that reaps late, as Lightning's every 5 s, changes nothing), the status of an orphan ``otel-gpu run``
reaped itself (it is the subreaper of its descendants), the process's own last record, and only then "vanished":
gone with no status anyone could read, which is a death, never a clean exit (``process.exit.how``). Each record is
stamped with when the process ended (woken by its pidfd), not when its status was read, so that the first rank to
die comes first. Live ranks that freeze (state T or D for 2 s: SIGSTOP, stuck in the kernel or the GPU driver) get an
``otel_gpu.process.state`` record with the state and wait channel, and another when they run again.

Being the subreaper changes one thing a program can see: an orphaned descendant's parent becomes ``otel-gpu run``,
not pid 1, so code that detects its parent's death by ``os.getppid() == 1`` (rather than by comparing with the parent
it started with, or by ``PR_SET_PDEATHSIG``) would not notice it.
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

from otel_gpu.instrumentation import _procstate, jobid

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
        self.procs: dict[int, dict] = {}  # the registry's processes, as last read
        self._dead_since: dict[int, float] = {}
        self._died_at: dict[int, float] = {}  # wall clock when first seen ended (the pidfd woke us then)
        self._kernel: dict[int, int] = {}  # waitpid status from the kernel: a zombie's, or an orphan we reaped

    def note_status(self, pid: int, status: int, when: float | None = None) -> None:
        """The exact waitpid status of ``pid`` (an orphan this launcher reaped as its subreaper)."""
        self._kernel.setdefault(pid, status)
        self._died_at.setdefault(pid, time.time() if when is None else when)

    def pending(self) -> bool:
        """Some process is gone but not yet reported (waiting for its record within the grace period)."""
        return any(pid not in self.reported for pid in self._dead_since)

    def scan(self, final: bool = False, direct: tuple[int, int] | None = None) -> list[dict]:
        """New exit reports. ``direct`` is (pid, returncode) of the launched command once it ended."""
        from otel_gpu.instrumentation import _registry

        procs, events, waits = _registry.read(self.registry)
        self.known.update(procs)
        self.procs = procs
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
                if pid not in self._kernel:
                    st = _procstate.read_stat(pid)
                    if st is not None and st.state not in ("Z", "X"):
                        continue  # alive
                    if st is not None and st.exit_status is not None:
                        self._kernel[pid] = st.exit_status  # a zombie: its parent has not reaped it yet
                    elif st is None and _alive(pid):
                        continue
            self._dead_since.setdefault(pid, now)
            self._died_at.setdefault(pid, time.time())
            wait = waits.get(pid)
            own = events.get(pid, [])
            ended = next((e for e in reversed(own) if e.get("kind") == "atexit"), None)
            signalled = next((e for e in reversed(own) if e.get("kind") == "signal"), None)
            exc = next((e for e in reversed(own) if e.get("kind") == "exception"), None)
            # When it ended: the earliest of its own last word, our first sight of its end, its parent's reaping
            # (which can be seconds late: Lightning polls its children every 5 s).
            times = [t for t in ((wait or {}).get("t"), self._died_at.get(pid),
                                 next((e.get("t") for e in reversed(own)), None)) if t is not None]
            t_end = min(times) if times else None
            kernel = self._kernel.get(pid)
            rep = {"pid": pid, "rank": info.get("rank"), "local_rank": info.get("local_rank"), "ended_at": t_end,
                   "role": info.get("role"), "host": info.get("host"), "argv": info.get("argv")}
            if direct is not None and pid == direct[0]:
                rc = direct[1]
                rep.update(code=rc, signal=_signame(-rc) if rc < 0 else None, source="launcher")
            elif wait is not None:
                rep.update(code=wait.get("code", -wait["signal"] if "signal" in wait else None),
                           signal=_signame(wait.get("signal")), source="waitpid")
            elif kernel is not None:
                sig = os.WTERMSIG(kernel) if os.WIFSIGNALED(kernel) else None
                rep.update(code=-sig if sig else (os.WEXITSTATUS(kernel) if os.WIFEXITED(kernel) else None),
                           signal=_signame(sig), source="kernel")
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
            if ended is None and signalled is None and rep["source"] in ("waitpid", "kernel") and not rep["signal"]:
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
        if rep.get("how") is not None:
            attrs[str(tr.EXIT_HOW)] = rep["how"]
        severity = _export.INFO if rep.get("code") == 0 and rep.get("how") != "vanished" else _export.ERROR
        # stamped with when it ended: the attribution orders deaths by it (the first rank to die, not to report)
        t_ns = int(rep["ended_at"] * 1e9) if isinstance(rep.get("ended_at"), (int, float)) else time.time_ns()
        records.append((str(tr.EXIT_EVENT), t_ns, attrs, rep, severity))
    client.send_logs(_export.logs_request(_export.make_resource(identity.attributes()), records))


def _send_states(client, identity, reports: list[dict]) -> None:
    """``otel_gpu.process.state`` records: a rank frozen (state T or D), or running again."""
    if not reports:
        return
    from otel_gpu.instrumentation import _export
    from otel_gpu.schema import identity as ids
    from otel_gpu.schema import training as tr

    records = []
    for rep in reports:
        attrs = {str(ids.JOB_ID): identity.job_id, str(ids.RANK): _int_or_none(rep.get("rank")),
                 str(tr.PROCESS_STATE): rep["state"], str(tr.PROCESS_WCHAN): rep.get("wchan") or "",
                 str(ids.PROCESS_PID): rep["pid"]}
        if rep.get("how"):
            attrs[str(tr.PROCESS_FROZEN)] = rep["how"]
        severity = _export.INFO if rep.get("resumed") else _export.ERROR
        records.append((str(tr.STATE_EVENT), int(rep["since"] * 1e9), attrs, rep, severity))
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
        self.ended_at: float | None = None  # wall clock when CMD was seen ended
        self._ends = EndWaiter()
        self._frozen = _procstate.FrozenRanks()
        self.subreaper = False
        self.orphan_wait_s = 5.0  # after CMD ended: how long ranks that outlive it may take to end

    def _adopt(self, agreed: str | None) -> None:
        """The job id the ranks agreed on, for the launcher's own records (otel_gpu.instrumentation.jobid)."""
        self.job.adopt(agreed, self.identity)
        self.job_id = self.job.value

    def start(self) -> None:
        """Starts CMD. Raises OSError when it cannot be started. This process becomes the subreaper of CMD's
        descendants first, so that a rank whose parent died before it is reaped here, with its exact status."""
        self.subreaper = _procstate.become_subreaper()
        self.proc = subprocess.Popen(self.cmd, env=self.env)

    def _reap(self) -> None:
        """Reaps orphans this launcher inherited (as subreaper) and notes how they ended."""
        if not self.subreaper:
            return
        now = time.time()
        for pid, status in _procstate.reap_orphans(self.proc.pid if self.rc is None else None):
            self.watcher.note_status(pid, status, now)

    def poll(self, timeout_s: float) -> int | None:
        """Waits up to ``timeout_s`` for CMD to end, sending the exit record of each process that ends meanwhile as
        soon as it ended (woken by its end, then re-reading the registry every 50 ms until its parent wrote how it
        ended, within the grace period); CMD's return code once it ended, else None."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            self.rc = self.proc.poll()
            if self.rc is not None:
                self.ended_at = self.ended_at or time.time()
                return self.rc
            self._reap()
            _send(self.client, self.identity, self.watcher.scan())
            _send_states(self.client, self.identity, self._frozen.check(self.watcher.procs, time.time()))
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._ends.watch([self.proc.pid, *self.watcher.known])
            self._ends.wait(min(left, 0.05) if self.watcher.pending() else min(left, self._frozen.interval_s))

    def finish(self) -> None:
        """After CMD ended: the last exit records. A process that just ended may get its record a moment after its
        pid is gone (its parent writes it after reaping it): such processes get the grace period before they are
        called vanished."""
        assert self.proc is not None and self.rc is not None
        watcher = self.watcher
        direct = (self.proc.pid, self.rc)
        watcher._died_at.setdefault(self.proc.pid, self.ended_at or time.time())
        self._reap()
        deadline = time.monotonic() + watcher.grace_s
        _send(self.client, self.identity, watcher.scan(direct=direct))
        # Ranks that outlive CMD (orphans of a parent that died: they fail in their next collective) get a moment to
        # end, so that their exits are reported too.
        orphan_deadline = time.monotonic() + self.orphan_wait_s
        while (watcher.pending() and time.monotonic() < deadline) or (
                self._outliving() and time.monotonic() < orphan_deadline):
            self._ends.watch(self._outliving())
            self._ends.wait(0.1)
            self._reap()
            _send(self.client, self.identity, watcher.scan(direct=direct))
        _send(self.client, self.identity, watcher.scan(final=True, direct=direct))

    def _outliving(self) -> list[int]:
        """Processes of this start that outlive CMD and may still end on their own: registered ranks still running,
        and orphans this launcher inherited (a rank that has not registered yet among them). Not frozen ones: a
        stopped rank would hold the launcher up for nothing."""
        pids = {pid for pid, info in self.watcher.procs.items()
                if info.get("rank") is not None and pid not in self.watcher.reported}
        if self.subreaper:
            pids.update(_procstate.children())
        out = []
        for pid in pids:
            st = _procstate.read_stat(pid)
            if st is not None and st.state not in ("Z", "X") and st.state not in _procstate.FROZEN_STATES:
                out.append(pid)
        return out

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
