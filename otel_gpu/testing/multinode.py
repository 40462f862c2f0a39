"""A multi-node training job over a :class:`~otel_gpu.testing.cluster.Cluster`, deployed as the docs say.

- On every node host: a sidecar ``otel-gpu collector`` built from ``docs/examples/sidecar.yaml`` (its ``nic`` receiver
  reads the host's real ``/sys/class/net`` for ``eth0`` and ``data0``; a fake 2-GPU NVML per host, since the machine
  has no GPU), and ``otel-gpu run -- torchrun --nnodes N --node-rank i --nproc-per-node R --rdzv-backend c10d
  --rdzv-endpoint node0:29400 -m otel_gpu.testing.scenarios.train`` over gloo on ``data0`` (``GLOO_SOCKET_IFNAME``).
- On the ``agg`` host: the job's aggregator, built from ``docs/examples/aggregator.yaml``, listening on the
  management network; its store is what ``otel-gpu report --store`` reads.

Each namespace has its own loopback, so the fixed ports here (4317, 29400) never meet another run's.

Faults (:class:`Bed` methods), each named by host: ``cut_link`` (``ip link set data0 down``), ``lose_node`` (every
process of the host killed at once, sidecar included), ``degrade_link`` (``tc ... tbf rate 20mbit``),
``restart_agent`` (the host's sidecar killed and started again); a user exception on a rank comes from the training
script's own fault switch (``OTEL_GPU_FAULT=exception``).

Node digests (docs/scale.md): ``Bed(digests=True)`` turns ``processors.compact.digests`` on in every sidecar; the
default comes from ``OTEL_GPU_BED_DIGESTS`` (``1``: on), so that a whole test module can be run with digests on:
``OTEL_GPU_BED_DIGESTS=1 python -m pytest tests/test_multihost.py``.

Command line (root): ``python -m otel_gpu.testing.cluster --hosts 2 [--ranks-per-host 2] [--fault link_cut]``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from otel_gpu.testing.cluster import DATA_IF, MGMT_IF, Cluster, ClusterUnavailable, Host, leftovers

__all__ = ["Bed", "Job", "FAULTS", "DIGESTS_ENV", "main"]

_logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"
OTLP_PORT, RDZV_PORT, WITNESS_PORT, VERDICT_PORT = 4317, 29400, 4329, 4319
READY_LINE = "otel-gpu collector ready"
FAULTS = ("none", "link_cut", "node_lost", "degraded_link", "agent_restart", "exception", "failover")
#: The failover demo's restart policy: short waits so that it fits a minute (docs/restart.md has the defaults).
FAILOVER_POLICY = {"stop_grace": "3s", "budget": {"backoff_initial": "1s"},
                   "verdict": {"poll_interval": "500ms", "wait": "30s"}}

#: Attribution settings of the bed's aggregator: short timeouts, since the bed's steps take ~0.1 s.
AGG_ATTRIBUTION = {"hang_timeout": "6s", "heartbeat_timeout": "5s", "tick_interval": "250ms"}
#: ``1``: every bed's sidecars send node digests unless the bed is told otherwise (``Bed(digests=...)``).
DIGESTS_ENV = "OTEL_GPU_BED_DIGESTS"


def digests_default() -> bool:
    """``OTEL_GPU_BED_DIGESTS``: 1/true/yes/on or 0/false/no/off/empty; another value warns and means off."""
    raw = os.environ.get(DIGESTS_ENV, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw not in ("", "0", "false", "no", "off"):
        _logger.warning("%s must be 1 or 0 (got %r): node digests stay off", DIGESTS_ENV, raw)
    return False


def _load_example(name: str) -> dict:
    path = EXAMPLES / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the bed builds its collectors from the documented example "
                                "configs (run from a source checkout)")
    return yaml.safe_load(path.read_text())


def sidecar_config(host: Host, aggregator: str, nvml_scenario: Path, xid_log: Path,
                   nic_interval: str = "500ms", forwarder_token: str = "", digests: bool = False) -> dict:
    """docs/examples/sidecar.yaml for ``host``: the job's processes send to its loopback; no backend in the bed.
    ``forwarder_token``: ``otel-gpu run`` on this host presents it with its decisions (trusted_forwarders), and the
    sidecar presents it to the aggregator. ``digests``: the example's commented-out ``digests: true``, on."""
    cfg = _load_example("sidecar.yaml")
    if digests:
        cfg["processors"]["compact"]["digests"] = True
    cfg["receivers"]["otlp"] = {"grpc": {"endpoint": f"127.0.0.1:{OTLP_PORT}"}, "http": None}
    if forwarder_token:
        cfg["receivers"]["otlp"]["trusted_forwarders"] = {"bearer_token": forwarder_token}
        cfg["exporters"]["otlp/aggregator"]["auth"] = {"bearer_token": forwarder_token}
    cfg["receivers"]["nvml"] = {"backend": "fake", "scenario": str(nvml_scenario), "interval": "1s"}
    cfg["receivers"]["nic"] = {"interfaces": [MGMT_IF, DATA_IF], "exclude_interfaces": [], "infiniband": False,
                               "interval": nic_interval}
    cfg["receivers"]["xid"] = {"backend": "none", "path": str(xid_log)}
    cfg["exporters"]["otlp/aggregator"].update(endpoint=f"{aggregator}:{OTLP_PORT}",
                                               retry_on_failure={"initial_interval": "200ms", "max_interval": "1s"})
    # No tracing backend in the bed: the backend pipelines and exporter go (the aggregator path is what is tested).
    del cfg["exporters"]["otlp/backend"]
    for name in [n for n, p in cfg["service"]["pipelines"].items() if "otlp/backend" in p["exporters"]]:
        del cfg["service"]["pipelines"][name]
    return cfg


def aggregator_config(listen: str, store: Path, attribution: dict | None = None, forwarder_token: str = "",
                      verdict_token: str = "") -> dict:
    """docs/examples/aggregator.yaml listening on ``listen`` (the management address), no backend. Its verdict and
    jobs API listens there too, with ``verdict_token`` (else on the agg host's loopback only)."""
    cfg = _load_example("aggregator.yaml")
    cfg["receivers"]["otlp"] = {"grpc": {"endpoint": f"{listen}:{OTLP_PORT}"}, "http": None}
    if forwarder_token:
        cfg["receivers"]["otlp"]["trusted_forwarders"] = {"bearer_token": forwarder_token}
    cfg["exporters"]["verdict"] = {"endpoint": f"{listen if verdict_token else '127.0.0.1'}:{VERDICT_PORT}"}
    if verdict_token:
        cfg["exporters"]["verdict"]["auth"] = {"bearer_token": verdict_token}
    cfg["processors"]["attribution"] = dict(AGG_ATTRIBUTION, **(attribution or {}))
    cfg["processors"]["goodput"] = {"report_interval": "2s"}
    cfg["exporters"]["store"] = {"path": str(store)}
    cfg["exporters"]["prometheus"] = {"endpoint": "127.0.0.1:9464"}  # the agg host's own loopback
    # The job's backend is the bed's witness on the agg host's loopback: it records every step span that reached
    # the aggregator, which is how the tests prove that nothing was lost.
    cfg["exporters"]["otlp/backend"] = {"endpoint": f"127.0.0.1:{WITNESS_PORT}", "compression": "none"}
    for name, pipe in cfg["service"]["pipelines"].items():
        if not name.startswith("traces"):
            pipe["exporters"] = [e for e in pipe["exporters"] if e != "otlp/backend"]
    return cfg


def witness(port: int, out: Path) -> None:
    """The bed's tracing backend: appends ``{"job", "rank", "host", "step"}`` per step span received to ``out``."""
    from otel_gpu.pdata import attribute, attributes_dict, spans
    from otel_gpu.testing.otlp_sink import OtlpSink

    seen = 0
    with OtlpSink(port=port) as sink, open(out, "a") as fh:
        print(READY_LINE, flush=True)
        while True:
            time.sleep(0.5)
            traces = list(sink.traces)
            for req in traces[seen:]:
                for rs, _, span in spans(req):
                    if span.name == "otel_gpu.step":
                        res = attributes_dict(rs.resource.attributes, json_safe=True)
                        who = {"job": res.get("training.job.id"), "rank": res.get("training.rank"),
                               "host": res.get("host.name")}
                        step = attribute(span.attributes, "training.step")
                        fh.write(json.dumps({**who, "step": step}) + "\n")
            seen = len(traces)
            fh.flush()


@dataclass
class Collector:
    host: Host
    role: str
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 60.0, since: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if READY_LINE in self.text()[since:]:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} collector on {self.host.name} exited ({self.proc.returncode}):\n"
                                   f"{self.text()[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.role} collector on {self.host.name} not ready in {timeout_s} s:\n"
                           f"{self.text()[-3000:]}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(5)


@dataclass
class Job:
    """One multi-node job: an ``otel-gpu run -- torchrun ...`` per node host."""

    launchers: dict[str, subprocess.Popen]
    logs: dict[str, Path]
    rdzv_id: str | None
    started: float = field(default_factory=time.time)

    def wait(self, timeout_s: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in self.launchers.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {name: p.poll() for name, p in self.launchers.items()}

    def stop(self) -> None:
        for proc in self.launchers.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.launchers.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def wait_output(self, host: str, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.output(host):
                return True
            time.sleep(0.2)
        return False

    def output(self, host: str) -> str:
        try:
            return self.logs[host].read_text(errors="replace")
        except OSError:
            return ""


class Bed:
    """A cluster of ``hosts`` node hosts plus an aggregator host, with a sidecar per node and the aggregator running.

    Use as a context manager; :meth:`close` stops everything and tears the namespaces down."""

    def __init__(self, hosts: int = 2, *, attribution: dict | None = None, root: str | Path | None = None,
                 acting: bool = False, digests: bool | None = None):
        """``acting``: the aggregator serves its verdict and jobs API on the management network with a token, and
        trusts the sidecars (and ``otel-gpu run`` on each node) as forwarders: the setup for ``--restart auto``
        across nodes (docs/restart.md). ``digests``: every sidecar sends node digests instead of its ranks'
        heartbeats and step spans (None: ``OTEL_GPU_BED_DIGESTS``, else off)."""
        import secrets

        self.cluster = Cluster(hosts, aggregator_host=True, root=root)
        self.attribution = attribution
        self.digests = digests_default() if digests is None else bool(digests)
        self.forwarder_token = secrets.token_hex(16) if acting else ""
        self.verdict_token = secrets.token_hex(16) if acting else ""
        self.sidecars: dict[str, Collector] = {}
        self.aggregator: Collector | None = None
        self.witness: Collector | None = None
        self.jobs: list[Job] = []

    def __enter__(self) -> Bed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def hosts(self) -> list[Host]:
        return self.cluster.hosts

    @property
    def witness_file(self) -> Path:
        return self.cluster.root / "agg" / "steps.jsonl"

    def steps_seen(self, job_id: str) -> dict[int, set[int]]:
        """Step numbers per rank of ``job_id`` that reached the aggregator (and through it the backend)."""
        out: dict[int, set[int]] = {}
        try:
            lines = self.witness_file.read_text().splitlines()
        except OSError:
            return out
        for line in lines:
            rec = json.loads(line)
            if rec["job"] == job_id and rec["rank"] is not None:
                out.setdefault(rec["rank"], set()).add(rec["step"])
        return out

    @property
    def store(self) -> Path:
        return self.cluster.root / "agg" / "store"

    def start(self) -> Bed:
        self.cluster.start()
        try:
            agg = self.cluster.agg
            self.witness = Collector(agg, "witness", agg.spawn(
                [sys.executable, "-m", "otel_gpu.testing.multinode", "witness", str(WITNESS_PORT),
                 str(self.witness_file)], log=agg.workdir / "witness.log"), agg.workdir / "witness.log")
            self.aggregator = self._collector(agg, "aggregator",
                                              aggregator_config(agg.mgmt_addr, self.store, self.attribution,
                                                                self.forwarder_token, self.verdict_token))
            for host in self.hosts:
                self.start_sidecar(host, wait=False)
            self.aggregator.wait_ready()
            self.witness.wait_ready()
            for host in self.hosts:
                self.sidecars[host.name].wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _collector(self, host: Host, role: str, cfg: dict) -> Collector:
        path = host.workdir / f"{role}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        log = host.workdir / f"{role}.log"
        proc = host.spawn([sys.executable, "-m", "otel_gpu", "collector", "--config", str(path)], log=log,
                          env={"PYTHONUNBUFFERED": "1"})
        return Collector(host, role, proc, log)

    def start_sidecar(self, host: Host, wait: bool = True) -> Collector:
        scenario = host.workdir / "nvml.yaml"
        if not scenario.exists():
            idx = self.hosts.index(host)
            scenario.write_text(yaml.safe_dump({"gpu_count": 2, "gpus": {
                g: {"uuid": f"GPU-{idx:08x}-0000-4000-8000-{g:012x}"} for g in range(2)}}))
            (host.workdir / "kern.log").write_text("")
        log_size = 0
        if host.name in self.sidecars:
            log_size = len(self.sidecars[host.name].text())
        cfg = sidecar_config(host, "agg", scenario, host.workdir / "kern.log",
                             forwarder_token=self.forwarder_token, digests=self.digests)
        side = self._collector(host, "sidecar", cfg)
        self.sidecars[host.name] = side
        if wait:
            side.wait_ready(since=log_size)
        return side

    # -- jobs -----------------------------------------------------------------------------------------------------
    def launch(self, ranks_per_host: int = 2, *, steps: int = 60, step_sleep_s: float = 0.05,
               rdzv_id: str | None = "bedjob", env: dict[str, str] | None = None,
               hosts: int | None = None) -> Job:
        """Starts the job on the first ``hosts`` node hosts (default: all)."""
        nodes = self.hosts[:hosts or len(self.hosts)]
        bindir = os.path.dirname(sys.executable)
        launchers, logs = {}, {}
        for i, host in enumerate(nodes):
            torchrun = [os.path.join(bindir, "torchrun"), "--nnodes", str(len(nodes)), "--node-rank", str(i),
                        "--nproc-per-node", str(ranks_per_host), "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"{nodes[0].name}:{RDZV_PORT}", "--max-restarts", "0"]
            if rdzv_id:
                torchrun += ["--rdzv-id", rdzv_id]
            torchrun += ["-m", "otel_gpu.testing.scenarios.train"]
            job_env = {"GLOO_SOCKET_IFNAME": DATA_IF, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{OTLP_PORT}",
                       "OTEL_GPU_HEARTBEAT_S": "1", "OTEL_GPU_STEPS": str(steps),
                       "OTEL_GPU_STEP_SLEEP_S": str(step_sleep_s), "PYTHONUNBUFFERED": "1",
                       "OTEL_GPU_SCENARIO_DIR": str(host.workdir), "TORCH_FR_BUFFER_SIZE": "2000",
                       "OMP_NUM_THREADS": "1", "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
            job_env.update(env or {})
            for key in ("OTEL_GPU_JOB_ID", "OTEL_GPU_JOB_ID_PROVISIONAL", "TORCHELASTIC_RUN_ID"):
                os.environ.get(key) and job_env.setdefault(key, "")  # never inherit the caller's job id
            logs[host.name] = host.workdir / f"job-{len(self.jobs)}.log"
            launchers[host.name] = host.spawn([sys.executable, "-m", "otel_gpu", "run", "--", *torchrun],
                                              env=job_env, log=logs[host.name])
        job = Job(launchers, logs, rdzv_id)
        self.jobs.append(job)
        return job

    def launch_failover(self, *, active: int = 2, ranks_per_host: int = 2, steps: int = 300,
                        step_sleep_s: float = 0.05, rdzv_id: str = "failover", env: dict[str, str] | None = None,
                        policy: dict | None = None, nnodes: str | None = None, spare_delay_s: float = 0.0,
                        supervised: bool = True, torchrun_restarts: int = 0, spares: int | None = None) -> Job:
        """Every node host runs the same ``otel-gpu run --restart auto --verdict-url http://agg:4319 --policy P --
        torchrun --nnodes N ... -m otel_gpu.testing.restart_train`` (docs/restart.md, "Many nodes"); the first
        ``active`` hosts register first (the job's members), the others after them (spares). The training script
        checkpoints into a directory every host sees (``shared``, as a shared filesystem would be).

        ``supervised=False``: the baseline, plain elastic torchrun (``--max-restarts torchrun_restarts``) under
        ``otel-gpu run`` that only observes; the spares start once the members train (torchrun's own spares).
        ``spares``: how many of the other hosts take part as spares (default: all)."""
        shared = self.cluster.root / "shared"
        shared.mkdir(exist_ok=True)
        for stale in list(shared.glob("fault-*-struck")) + [shared / "progress.jsonl", shared / "checkpoint.pt"]:
            stale.unlink(missing_ok=True)  # a fresh job: no checkpoint or fault marker of an earlier one
        policy_file = shared / f"policy-{len(self.jobs)}.yaml"
        policy_file.write_text(yaml.safe_dump(policy or {}))
        bindir = os.path.dirname(sys.executable)
        launchers, logs = {}, {}
        job = Job(launchers, logs, rdzv_id)
        self.jobs.append(job)
        hosts = self.hosts[:active + spares] if spares is not None else self.hosts
        for i, host in enumerate(hosts):
            torchrun = [os.path.join(bindir, "torchrun"), "--nnodes", nnodes or str(active), "--nproc-per-node",
                        str(ranks_per_host), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"{self.hosts[0].name}:{RDZV_PORT}", "--rdzv-id", rdzv_id, "--max-restarts",
                        str(torchrun_restarts),
                        "-m", "otel_gpu.testing.restart_train"]
            job_env = {"GLOO_SOCKET_IFNAME": DATA_IF, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{OTLP_PORT}",
                       "OTEL_GPU_HEARTBEAT_S": "1", "OTEL_GPU_STEPS": str(steps),
                       "OTEL_GPU_STEP_SLEEP_S": str(step_sleep_s), "PYTHONUNBUFFERED": "1",
                       "OTEL_GPU_WORKDIR": str(shared), "OMP_NUM_THREADS": "1",
                       "OTEL_GPU_VERDICT_TOKEN": self.verdict_token, "OTEL_GPU_FORWARDER_TOKEN": self.forwarder_token,
                       "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
            job_env.update(env or {})
            for key in ("OTEL_GPU_JOB_ID", "OTEL_GPU_JOB_ID_PROVISIONAL", "TORCHELASTIC_RUN_ID"):
                os.environ.get(key) and job_env.setdefault(key, "")
            logs[host.name] = host.workdir / f"job-{len(self.jobs) - 1}.log"
            if i == active and supervised:  # the spares register after the members
                for name in list(launchers):
                    job.wait_output(name, "otel-gpu run: job ", 60)
                time.sleep(spare_delay_s)
            elif i == active:
                self.wait_first_step()
                time.sleep(spare_delay_s)
            acting = ["--restart", "auto", "--verdict-url", f"http://agg:{VERDICT_PORT}", "--policy",
                      str(policy_file)] if supervised else []
            launchers[host.name] = host.spawn([sys.executable, "-m", "otel_gpu", "run", *acting, "--", *torchrun],
                                              env=job_env, log=logs[host.name])
        return job

    def wait_first_step(self, timeout_s: float = 120.0) -> bool:
        """Waits until the failover job's first incarnation has done a step (its rank 0 wrote ``first_step``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.get("event") == "first_step" for p in self.progress()):
                return True
            time.sleep(0.3)
        return False

    def progress(self) -> list[dict]:
        """The failover job's progress.jsonl (launch, start with its hosts, first_step, fault, done)."""
        try:
            lines = (self.cluster.root / "shared" / "progress.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    # -- faults (each returns the time it was done) ------------------------------------------------------------------
    def cut_link(self, host: Host) -> float:
        return host.set_link(DATA_IF, up=False)

    def lose_node(self, host: Host) -> float:
        t, _ = host.kill_all()
        return t

    def degrade_link(self, host: Host, rate: str = "20mbit") -> float:
        return host.degrade(DATA_IF, rate=rate)

    def restart_agent(self, host: Host, down_s: float = 2.0, sig: int = signal.SIGTERM) -> float:
        """Stops the host's sidecar with ``sig`` (SIGTERM: a restart, as a DaemonSet rollout does; SIGKILL: a crash,
        which loses what the sidecar had accepted but not yet forwarded: up to ``compact.batch_interval_s``), keeps
        it down ``down_s``, starts it again."""
        side = self.sidecars[host.name]
        t = time.time()
        side.proc.send_signal(sig)
        try:
            side.proc.wait(20)
        except subprocess.TimeoutExpired:
            side.proc.kill()
            side.proc.wait(10)
        time.sleep(down_s)
        self.start_sidecar(host)
        return t

    # -- what the aggregator knows ------------------------------------------------------------------------------------
    def report(self, timeout_s: float = 60.0, job_id: str | None = None) -> dict:
        out = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(self.store), "--format",
                              "json", *(["--job", job_id] if job_id else [])], capture_output=True, text=True,
                             timeout=timeout_s)
        if out.returncode != 0:
            return {}
        try:
            return json.loads(out.stdout)
        except ValueError:
            return {}

    def report_text(self, job_id: str | None = None) -> str:
        out = subprocess.run([sys.executable, "-m", "otel_gpu", "report", "--store", str(self.store),
                              *(["--job", job_id] if job_id else [])], capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    def members(self, job_id: str | None = None) -> dict[str, set]:
        """Hosts and ranks the aggregator's store knows for ``job_id`` (all jobs: None)."""
        db = next(iter(sorted(self.store.glob("*.db")) + sorted(self.store.glob("*.sqlite*"))), None)
        if db is None:
            return {"hosts": set(), "ranks": set()}
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            where, args = ("WHERE job_id = ?", (job_id,)) if job_id else ("", ())
            hosts = {r[0] for r in conn.execute(f"SELECT host FROM job_hosts {where}", args)}
            ranks = {r[0] for r in conn.execute(f"SELECT rank FROM job_ranks {where}", args)}
        return {"hosts": hosts, "ranks": ranks}

    def wait_failures(self, predicate, timeout_s: float) -> tuple[list[dict], float | None]:
        """Polls the aggregator's store until ``predicate(failures)``; returns (failures, when it became true)."""
        deadline = time.monotonic() + timeout_s
        failures: list[dict] = []
        while time.monotonic() < deadline:
            failures = self.report().get("failures", [])
            if predicate(failures):
                return failures, time.time()
            time.sleep(0.5)
        return failures, None

    def mgmt_bytes(self) -> dict[str, int]:
        """Bytes each node host sent on its management link (sidecar to aggregator) and the aggregator received."""
        out = {h.name: h.counters(MGMT_IF)["tx_bytes"] for h in self.hosts}
        out["agg_rx"] = self.cluster.agg.counters(MGMT_IF)["rx_bytes"]
        return out

    def close(self) -> None:
        for job in self.jobs:
            job.stop()
        for side in self.sidecars.values():
            if side.proc.poll() is None:
                side.proc.kill()
        if self.aggregator is not None and self.aggregator.proc.poll() is None:
            try:
                self.aggregator.stop(timeout_s=10)
            except Exception:  # noqa: BLE001
                pass
        self.cluster.close()


def run_demo(hosts: int, ranks_per_host: int, fault: str, fault_host: int, out=sys.stdout) -> int:
    """Builds the bed, runs one job with ``fault`` on host ``fault_host``, prints what the aggregator concluded."""
    steps = 60 if fault in ("none", "exception") else 400
    env = {}
    if fault == "exception":
        env = {"OTEL_GPU_FAULT": "exception", "OTEL_GPU_FAULT_RANK": str(fault_host * ranks_per_host),
               "OTEL_GPU_FAULT_STEP": "30"}
    with Bed(hosts) as bed:
        print(f"bed: {hosts} hosts ({', '.join(h.name + ' ' + str(h.data_addr) for h in bed.hosts)}), aggregator "
              f"on agg {bed.cluster.agg.mgmt_addr}; namespaces {bed.cluster.prefix}*", file=out, flush=True)
        job = bed.launch(ranks_per_host, steps=steps, env=env)
        target = bed.hosts[fault_host]
        if fault not in ("none", "exception"):
            wait_training(bed, 3.0, 120)
            action = {"link_cut": bed.cut_link, "node_lost": bed.lose_node, "degraded_link": bed.degrade_link,
                      "agent_restart": bed.restart_agent}[fault]
            print(f"fault: {fault} on {target.name}", file=out, flush=True)
            action(target)
        if fault in ("link_cut", "node_lost"):
            bed.wait_failures(lambda f: bool(f), 60)
            job.stop()
        else:
            job.wait(300)
        time.sleep(3)
        print(bed.report_text(), file=out, flush=True)
        members = bed.members()
        print(f"aggregator saw hosts {sorted(members['hosts'])}, ranks {sorted(members['ranks'])}", file=out)
    left = leftovers()
    print(f"torn down; namespaces left: {len(left)}", file=out)
    return 0


def run_failover_demo(hosts: int, ranks_per_host: int, fault_host: int, out=sys.stdout) -> int:
    """``otel-gpu demo --hosts 3 --scenario failover``: hosts-1 nodes run the job, the last waits as a spare; node
    ``fault_host``'s data link is cut mid-job. Prints the decision trail and RIGHT or WRONG: the cut node left, the
    job completed on the others and the spare from its checkpoint, its first new step within 60 s of the cut."""
    if hosts < 3:
        print("otel-gpu demo: the failover scenario needs --hosts 3 or more (members and a spare)", file=out)
        return 2
    active = hosts - 1
    fault_host = min(fault_host, active - 1)
    with Bed(hosts, acting=True) as bed:
        print(f"bed: {hosts} hosts ({', '.join(h.name + ' ' + str(h.data_addr) for h in bed.hosts)}), aggregator "
              f"(verdict and jobs API) on agg {bed.cluster.agg.mgmt_addr}; {active} nodes run the job, "
              f"{bed.hosts[-1].name} waits as a spare", file=out, flush=True)
        job = bed.launch_failover(active=active, ranks_per_host=ranks_per_host, steps=250, policy=FAILOVER_POLICY,
                                  rdzv_id="failover-demo")
        bed.wait_first_step()
        time.sleep(3.0)
        target = bed.hosts[fault_host]
        t_cut = bed.cut_link(target)
        print(f"fault: {target.name}'s data link cut (ip link set {DATA_IF} down)", file=out, flush=True)
        rcs = job.wait(240)
        job.stop()
        time.sleep(2.0)
        print("\nthe decision trail, as each node's otel-gpu run printed it:", file=out)
        for host in bed.hosts:
            for line in job.output(host.name).splitlines():
                if line.startswith("otel-gpu run:") and "job id" not in line:
                    print(f"  [{host.name}] {line[len('otel-gpu run: '):]}", file=out)
        print(f"exit statuses: {rcs}", file=out)
        print("\n" + bed.report_text(job_id="failover-demo"), file=out, flush=True)
        progress = bed.progress()
        starts = [p for p in progress if p.get("event") == "start"]
        firsts = [p for p in progress if p.get("event") == "first_step" and p.get("restart_count") == "1"]
        survivors = sorted(h.name for h in bed.hosts if h is not target)
        right = (rcs.get(target.name) == 75 and all(rcs.get(h) == 0 for h in survivors)
                 and len(starts) == 2 and starts[1].get("hosts") == survivors and starts[1].get("resumed_from", 0) > 0
                 and any(p.get("event") == "done" for p in progress) and bool(firsts)
                 and firsts[0]["t"] - t_cut <= 60.0)
        gap = f"{firsts[0]['t'] - t_cut:.1f} s" if firsts else "never"
        print(f"{'RIGHT' if right else 'WRONG'}: {target.name} excluded (exit {rcs.get(target.name)}), the job went "
              f"on on {', '.join(starts[1]['hosts']) if len(starts) > 1 else '?'} from step "
              f"{starts[1].get('resumed_from') if len(starts) > 1 else '?'}; first new step {gap} after the cut "
              "(floor 60 s)", file=out)
    print(f"torn down; namespaces left: {len(leftovers())}", file=out)
    return 0 if right else 1


def wait_training(bed: Bed, productive_s: float, timeout_s: float, ranks: int | None = None,
                  job_id: str | None = None) -> bool:
    """Waits until the aggregator has seen every rank (``ranks``) of ``job_id`` (None: any job that has none of
    its failures yet) and ``productive_s`` of productive step time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rep = bed.report()
        failed = {f["job_id"] for f in rep.get("failures", [])}
        for job in rep.get("jobs", []):
            if (job_id is not None and job["job_id"] != job_id) or (job_id is None and job["job_id"] in failed):
                continue
            goodput = job.get("goodput")
            if not isinstance(goodput, dict):
                goodput = rep.get("goodput") if (rep.get("goodput") or {}).get("job_id") == job["job_id"] else {}
            done = (goodput or {}).get("productive_time_s") or 0.0
            if (ranks is None or job.get("ranks", 0) >= ranks) and done >= productive_s:
                return True
        time.sleep(1.0)
    return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["witness"]:
        witness(int(argv[1]), Path(argv[2]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m otel_gpu.testing.cluster",
                                 description="Network-namespace hosts on this machine (root): a multi-node job with "
                                             "a sidecar per host and the job's aggregator, and one fault.")
    ap.add_argument("--hosts", type=int, default=2, help="node hosts (2..4)")
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-host", type=int, default=1, help="which node host the fault hits")
    args = ap.parse_args(argv)
    if not 2 <= args.hosts <= 4:
        ap.error(f"--hosts must be 2..4 (got {args.hosts})")
    if not 0 <= args.fault_host < args.hosts:
        ap.error(f"--fault-host must be 0..{args.hosts - 1} (got {args.fault_host})")
    try:
        if args.fault == "failover":
            return run_failover_demo(args.hosts, args.ranks_per_host, args.fault_host)
        return run_demo(args.hosts, args.ranks_per_host, args.fault, args.fault_host)
    except ClusterUnavailable as exc:
        print(f"otel-gpu cluster: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
