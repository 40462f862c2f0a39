"""Runs one scenario: collector in this process, the training job as ``otel-gpu run -- torchrun ...``, the hardware
part of the fault injected into the fake NVML / fake sysfs when the faulty rank says the fault begins."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector

__all__ = ["SCENARIOS", "Scenario", "ScenarioResult", "run_scenario", "collector_config", "FakeSysfs"]

WORLD = 4
IB_PORT = ("mlx5_0", "1")


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # OTEL_GPU_FAULT of train.py
    kind: str | None  # expected failure kind; None: no failure at all
    root_cause: str | None
    description: str
    hardware: str | None = None  # xid79 | ecc_dbe | thermal | nic_down | nic_symbol_errors
    wait_ack: bool = False
    culprit_is_node: bool = False  # NIC faults name the node; the rank is whichever of its ranks showed it
    steps: int = 60
    timeout_s: float = 90.0


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("healthy", "none", None, None, "a healthy run: no failure at all", steps=60),
    Scenario("exception", "exception", "crash", "python_exception", "rank k raises ValueError in user code"),
    Scenario("sigkill", "sigkill", "crash", "rank_process_died", "rank k is killed with SIGKILL"),
    Scenario("os_exit", "os_exit", "crash", "rank_process_died", "rank k calls os._exit(3)"),
    Scenario("cuda_oom", "cuda_oom", "crash", "cuda_oom", "rank k raises CUDA out of memory"),
    Scenario("hang", "sleep_before_collective", "hang", "rank_not_in_collective",
             "rank k sleeps before a collective (the others wait in it)"),
    Scenario("deadlock", "deadlock", "hang", "rank_not_in_collective", "rank k deadlocks on a Python lock"),
    Scenario("mismatch", "collective_mismatch", "hang", "collective_mismatch",
             "rank k calls broadcast where the others call all_reduce"),
    Scenario("straggler", "straggler", "slowdown", "straggler_compute", "rank k computes 0.2 s longer per step"),
    Scenario("dataloader_stall", "dataloader_stall", "slowdown", "dataloader_stall",
             "rank k's data loader takes 0.25 s per batch"),
    Scenario("slow_checkpoint", "slow_checkpoint", "slowdown", "checkpoint_stall",
             "rank k's checkpoint save stalls for 4 s"),
    Scenario("xid79", "cuda_error", "crash", "gpu_fell_off_bus", "rank k's GPU falls off the bus (XID 79)",
             hardware="xid79", wait_ack=True),
    Scenario("thermal", "straggler", "slowdown", "gpu_thermal_throttle",
             "rank k's GPU enters HW thermal slowdown (SM clock 900 MHz)", hardware="thermal", wait_ack=True),
    Scenario("ecc_dbe", "cuda_error", "crash", "gpu_ecc_uncorrectable",
             "an uncorrectable (double-bit) ECC error on rank k's GPU", hardware="ecc_dbe", wait_ack=True),
    Scenario("nic_down", "comm_hang", "hang", "nic_link_down", "the InfiniBand link of rank k's node goes down",
             hardware="nic_down", wait_ack=True, culprit_is_node=True),
    Scenario("nic_symbol_errors", "comm_slow", "slowdown", "nic_errors",
             "symbol errors rise on rank k's node's InfiniBand port", hardware="nic_symbol_errors", wait_ack=True,
             culprit_is_node=True),
)}


@dataclass
class ScenarioResult:
    scenario: Scenario
    culprit_rank: int
    records: list[dict[str, Any]] = field(default_factory=list)
    fault_time: float | None = None  # when the faulty rank said the fault began
    exit_code: int | None = None
    wall_s: float = 0.0
    job_output: str = ""

    @property
    def found(self) -> dict[str, Any] | None:
        return self.records[0] if self.records else None

    @property
    def latency_s(self) -> float | None:
        if not self.found or self.fault_time is None:
            return None
        return self.found["detected_time"] - self.fault_time

    @property
    def ok(self) -> bool:
        s = self.scenario
        if s.kind is None:
            return not self.records
        f = self.found
        if f is None or len(self.records) != 1:
            return False
        if (f["kind"], f["root_cause"]) != (s.kind, s.root_cause):
            return False
        return f["culprit"]["rank"] == self.culprit_rank or bool(s.culprit_is_node and f["culprit"]["host"])


class FakeSysfs:
    """A fake ``/sys`` with one InfiniBand port, written the way the kernel lays it out; the nic receiver reads it."""

    def __init__(self, root: Path):
        self.root = root
        self.port = root / "class" / "infiniband" / IB_PORT[0] / "ports" / IB_PORT[1]
        (self.port / "counters").mkdir(parents=True, exist_ok=True)
        self.set_state(True)
        (self.port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        for name in ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors", "port_xmit_discards",
                     "port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets"):
            self.write_counter(name, 0)

    def write_counter(self, name: str, value: int) -> None:
        tmp = self.port / "counters" / f".{name}.tmp"
        tmp.write_text(f"{value}\n")
        tmp.replace(self.port / "counters" / name)

    def read_counter(self, name: str) -> int:
        return int((self.port / "counters" / name).read_text())

    def set_state(self, up: bool) -> None:
        (self.port / "state").write_text("4: ACTIVE\n" if up else "1: DOWN\n")
        (self.port / "phys_state").write_text("5: LinkUp\n" if up else "3: Disabled\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collector_config(workdir: Path, *, grpc_port: int, prometheus_port: int | None = None,
                     hang_timeout_s: float = 8.0, fake_hardware: bool = True) -> str:
    """The collector config of the suite and the demo: OTLP in, fake NVML and sysfs, attribution, goodput, store."""
    nvml_scenario = workdir / "nvml.yaml"
    nvml_scenario.write_text(json.dumps({"gpu_count": WORLD}))
    receivers = {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}, "http": None}}
    metrics_receivers = ["otlp"]
    logs_receivers = ["otlp"]
    if fake_hardware:
        receivers["nvml"] = {"backend": "fake", "scenario": str(nvml_scenario), "interval": "500ms",
                             "pcie_throughput": False}
        receivers["nic"] = {"sysfs_root": str(workdir / "sys"), "interval": "500ms"}
        metrics_receivers += ["nvml", "nic"]
        logs_receivers += ["nvml"]
    exporters: dict[str, Any] = {"store": {"path": str(workdir / "store")}}
    metric_exporters = ["store"]
    if prometheus_port:
        exporters["prometheus"] = {"endpoint": f"127.0.0.1:{prometheus_port}"}
        metric_exporters.append("prometheus")
    config = {
        "receivers": receivers,
        "processors": {"attribution": {"hang_timeout": f"{hang_timeout_s}s", "checkpoint_stall": "3s",
                                       "heartbeat_timeout": "6s"},
                       "goodput": {"report_interval": "2s"}},
        "exporters": exporters,
        "service": {"telemetry": {"logs": {"level": "warning"}}, "pipelines": {
            "traces": {"receivers": ["otlp"], "processors": ["attribution", "goodput"], "exporters": ["store"]},
            "metrics": {"receivers": metrics_receivers, "processors": ["attribution", "goodput"],
                        "exporters": metric_exporters},
            "logs": {"receivers": logs_receivers, "processors": ["attribution", "goodput"], "exporters": ["store"]},
        }},
    }
    return json.dumps(config, indent=2)


def _inject_hardware(kind: str, collector: Collector, sysfs: FakeSysfs, gpu: int) -> None:
    if kind in ("xid79", "ecc_dbe", "thermal"):
        fake = collector.component("receiver", "nvml").backend
        if kind == "xid79":
            fake.inject({"gpu": gpu, "xid": 79})
        elif kind == "ecc_dbe":
            fake.inject({"gpu": gpu, "xid": 48})
            fake.inject({"gpu": gpu, "add": {"ecc_uncorrected_volatile": 1, "ecc_uncorrected_aggregate": 1}})
        else:
            fake.inject({"gpu": gpu, "set": {"clocks_event_reasons": ["hw_thermal_slowdown"], "sm_clock_mhz": 900,
                                             "temperature_c": 92}})
    elif kind == "nic_down":
        sysfs.write_counter("link_downed", sysfs.read_counter("link_downed") + 1)
        sysfs.set_state(False)
    elif kind == "nic_symbol_errors":
        sysfs.write_counter("symbol_error", sysfs.read_counter("symbol_error") + 250)


def run_scenario(scenario: Scenario, culprit_rank: int = 1, *, workdir: Path | None = None,
                 progress: Callable[[str], None] | None = None, hang_timeout_s: float = 8.0,
                 prometheus_port: int | None = None) -> ScenarioResult:
    """Runs one scenario end to end; returns what the collector attributed."""
    say = progress or (lambda _msg: None)
    own_dir = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"otel-gpu-{scenario.name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sysfs = FakeSysfs(workdir / "sys")
    grpc_port = _free_port()
    config = load_text(collector_config(workdir, grpc_port=grpc_port, prometheus_port=prometheus_port,
                                        hang_timeout_s=hang_timeout_s), f"<scenario {scenario.name}>")
    collector = Collector(config)
    collector.start()
    attribution = collector.component("processor", "attribution")
    result = ScenarioResult(scenario, culprit_rank)
    job_id = f"{scenario.name}-{os.getpid()}-{int(time.time())}"
    env = dict(os.environ, OTEL_GPU_FAULT=scenario.fault, OTEL_GPU_FAULT_RANK=str(culprit_rank),
               OTEL_GPU_STEPS=str(scenario.steps), OTEL_GPU_SCENARIO_DIR=str(workdir), OTEL_GPU_JOB_ID=job_id,
               OTEL_GPU_FAULT_WAIT_ACK="1" if scenario.wait_ack else "0", OTEL_GPU_HEARTBEAT_S="1",
               OTEL_GPU_STACK_AFTER_S=str(max(2.0, hang_timeout_s / 2)),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "otel_gpu", "run", "--endpoint", f"http://127.0.0.1:{grpc_port}", "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "--max-restarts=0", "--monitor-interval=0.2", "-m", "otel_gpu.testing.scenarios.train"]
    start = time.time()
    say(f"[{scenario.name}] starting a {WORLD}-rank gloo job; fault: {scenario.description} (k={culprit_rank})")
    log_path = workdir / "job.log"
    with open(log_path, "wb") as log:
        job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    trigger, acked = workdir / "trigger", False
    deadline = start + scenario.timeout_s
    settle_after_exit = 4.0 if scenario.kind is not None else 3.0
    exited_at = None
    try:
        while time.time() < deadline:
            if result.fault_time is None and trigger.exists():
                try:
                    result.fault_time = float(trigger.read_text().strip() or time.time())
                except ValueError:
                    result.fault_time = time.time()
                say(f"[{scenario.name}] fault begins on rank {culprit_rank}")
            if scenario.hardware and result.fault_time is not None and not acked:
                _inject_hardware(scenario.hardware, collector, sysfs, gpu=culprit_rank)
                time.sleep(1.5)  # at least two receiver polls: the hardware signal is in before the symptom
                (workdir / "ack").write_text("ok")
                acked = True
            if attribution.records:
                break
            if exited_at is None and job.poll() is not None:
                exited_at = time.time()
            if exited_at is not None and time.time() - exited_at > settle_after_exit:
                break
            time.sleep(0.1)
        if attribution.records:
            time.sleep(1.0)  # a second record (which would be wrong) has a moment to show
        # What was attributed while the job ran; stopping the job below is the runner's doing, not a fault.
        result.records = [r.to_dict() for r in attribution.records]
    finally:
        if job.poll() is None:
            try:
                os.killpg(job.pid, signal.SIGTERM)
                job.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                job.wait(5)
        result.exit_code = job.returncode
        collector.shutdown(timeout_s=10)
    result.wall_s = time.time() - start
    result.job_output = log_path.read_text(errors="replace")[-6000:]
    if own_dir and result.ok:
        shutil.rmtree(workdir, ignore_errors=True)
    return result
