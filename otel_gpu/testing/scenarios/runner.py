"""Runs one scenario: collector in this process, the training job as ``otel-gpu run -- torchrun ...`` (or with the
ranks started by ``torch.multiprocessing.spawn`` or by Lightning's own launcher: ``Scenario.launcher``), the hardware
part of the fault injected into the fake NVML / fake sysfs before, with or after the faulty rank's symptom, on fake
hardware that can start dirty (ports down since boot, a power cap already on, background error counts, an old XID).

What counts is what a user sees: the verdicts are read back from the collector's store (the latest version of each
failure; withdrawn verdicts are not failures), with the time each first appeared there.

With ``sidecar`` (``benchmarks/attribution_suite.py --digests``) the node-sidecar stage of a multi-node deployment
stands in front of attribution, as docs/examples/sidecar.yaml deploys it: a second in-process collector (the node
agent) takes the job's OTLP and the fake NVML / sysfs receivers, runs them through the ``compact`` processor
(``batch_interval`` 1 s; ``{"digests": True}``: node digests) and exports them over OTLP on loopback to the
aggregator collector, which attributes and stores. A node-agent restart then restarts the sidecar only.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.exporters.store import db
from otel_gpu.testing.fake_sysfs import FakeSysfs

__all__ = ["SCENARIOS", "Scenario", "ScenarioResult", "Dirt", "Case", "draw_cases", "run_scenario", "run_case",
           "collector_config", "sidecar_config", "FakeSysfs"]

WORLD = 4
IB_PORT = ("mlx5_0", 1)  # the job's port: up when the job starts


@dataclass(frozen=True)
class Expect:
    """One verdict a scenario must produce: kind, root cause, and whose it is (``"k"``: the drawn culprit, ``"k2"``:
    the second drawn rank, ``"0"``..: a fixed rank)."""
    kind: str
    root_cause: str
    who: str = "k"


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
    timeout_s: float = 150.0  # a loaded machine takes a minute to start 4 ranks
    also: tuple[Expect, ...] = ()  # further verdicts in the same incarnation (culprit "k2": the second drawn rank)
    fixed_rank: int | None = None  # the fault's rank is not drawn (e.g. rank 0's checkpoint)
    kinds: tuple[str, ...] = ()  # other kinds accepted for the first verdict (uneven inputs: peers wait or fail)
    agent_restart_s: float = 0.0  # restart the collector (the node agent) for this long when the fault begins
    #: True statements that are no failure verdict: a 40 s save reported as rank 0's checkpoint_stall slowdown
    #: (issue 10: a long checkpoint is "a checkpoint_stall/busy rank, not a hang"). Never a hang or a crash.
    tolerated: tuple[Expect, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    ci: bool = False  # part of the seeded CI subset
    #: who starts the ranks: torchrun (its agent reaps them), spawn (torch.multiprocessing.spawn's parent), lightning
    #: (Lightning's subprocess launcher: rank 0 starts ranks 1.. and SIGKILLs the survivors once one died)
    launcher: str = "torchrun"
    draw_from: tuple[int, ...] = ()  # the ranks the culprit is drawn from (default: every rank)

    @property
    def expected(self) -> tuple[Expect, ...]:
        return ((Expect(self.kind, self.root_cause),) if self.kind else ()) + self.also


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("healthy", "none", None, None, "a healthy run: no failure at all", steps=60, ci=True),
    Scenario("exception", "exception", "crash", "python_exception", "rank k raises ValueError in user code"),
    Scenario("sigkill", "sigkill", "crash", "rank_process_died", "rank k is killed with SIGKILL", ci=True),
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
             hardware="xid79", wait_ack=True, ci=True),
    Scenario("thermal", "straggler", "slowdown", "gpu_thermal_throttle",
             "rank k's GPU enters HW thermal slowdown (SM clock 900 MHz)", hardware="thermal", wait_ack=True),
    Scenario("ecc_dbe", "cuda_error", "crash", "gpu_ecc_uncorrectable",
             "an uncorrectable (double-bit) ECC error on rank k's GPU", hardware="ecc_dbe", wait_ack=True),
    Scenario("nic_down", "comm_hang", "hang", "nic_link_down", "the InfiniBand link of rank k's node goes down",
             hardware="nic_down", wait_ack=True, culprit_is_node=True),
    Scenario("nic_symbol_errors", "comm_slow", "slowdown", "nic_errors",
             "symbol errors rise on rank k's node's InfiniBand port", hardware="nic_symbol_errors", wait_ack=True,
             culprit_is_node=True),
    # -- issue 10's adversarial cases -----------------------------------------------------------------------------
    Scenario("two_failures", "straggler_then_exception", "slowdown", "straggler_compute",
             "rank k straggles from step 20, then rank k2 raises ValueError at step 45 (one incarnation)",
             steps=80, also=(Expect("crash", "python_exception", "k2"),), env=(("OTEL_GPU_FAULT_STEP", "20"),)),
    Scenario("subgroup_chain", "subgroup_sleep", "hang", "rank_not_in_collective",
             "subgroups [0,1] and [2,3]: rank k sleeps before its subgroup all_reduce; its partner waits there, "
             "the other pair waits for both in DDP's all-reduce", ci=True),
    Scenario("uneven_inputs", "uneven_inputs", "hang", "rank_exited_early",
             "rank k runs out of data and exits 0 at step 25 while its peers wait in the next all-reduce",
             kinds=("crash",), ci=True),
    Scenario("long_checkpoint", "long_checkpoint", None, None,
             "rank 0 saves a checkpoint for 40 s inside torch.save while the others wait (a healthy run)",
             fixed_rank=0, steps=30, timeout_s=200.0, env=(("OTEL_GPU_CKPT_STALL_S", "40"),),
             tolerated=(Expect("slowdown", "checkpoint_stall", "0"),)),
    Scenario("agent_restart", "agent_restart", None, None,
             "the collector (node agent) restarts for 12 s mid-job (a healthy run)", steps=150, timeout_s=200.0,
             agent_restart_s=12.0),
    Scenario("thread_exception", "thread_exception", None, None,
             "a background thread of rank k raises; training goes on to the end (a healthy run)"),
    # -- issue 22: launchers that start ranks themselves; ranks that stop without dying ----------------------------
    Scenario("frozen", "sigstop", "hang", "rank_frozen", "rank k stops itself with SIGSTOP (alive, state T, frozen)",
             ci=True),
    *(s for launcher in ("lightning", "spawn") for s in (
        Scenario(f"{launcher}_healthy", "none", None, None, f"a healthy run under {launcher}'s launcher",
                 launcher=launcher),
        Scenario(f"{launcher}_exception", "exception", "crash", "python_exception",
                 f"rank k raises ValueError ({launcher}'s launcher)", launcher=launcher),
        Scenario(f"{launcher}_sigkill", "sigkill", "crash", "rank_process_died",
                 f"rank k (not 0) is killed with SIGKILL ({launcher}'s launcher"
                 + (": rank 0 then SIGKILLs the survivors and itself)" if launcher == "lightning" else ")"),
                 launcher=launcher, draw_from=(1, 2, 3), ci=True),
        Scenario(f"{launcher}_sigkill_rank0", "sigkill", "crash", "rank_process_died",
                 f"rank 0 is killed with SIGKILL ({launcher}'s launcher"
                 + (": its children, orphaned, fail next)" if launcher == "lightning" else ")"),
                 launcher=launcher, fixed_rank=0),
        Scenario(f"{launcher}_hang", "sleep_before_collective", "hang", "rank_not_in_collective",
                 f"rank k sleeps before a collective ({launcher}'s launcher)", launcher=launcher),
        Scenario(f"{launcher}_straggler", "straggler", "slowdown", "straggler_compute",
                 f"rank k computes 0.2 s longer per step ({launcher}'s launcher)", launcher=launcher),
        Scenario(f"{launcher}_frozen", "sigstop", "hang", "rank_frozen",
                 f"rank k stops itself with SIGSTOP ({launcher}'s launcher)", launcher=launcher),
    )),
)}


@dataclass(frozen=True)
class Dirt:
    """How dirty the fake hardware is before the job starts (what a real node looks like)."""
    extra_ports: bool = False  # a second IB port and ifb0/docker0 down since boot, eth0 up
    power_cap: bool = False  # sw_power_cap active on every GPU before the job (a busy GPU's normal state)
    background: bool = False  # error counters non-zero and slowly rising (symbol errors, PCIe replays, rx_errors)
    old_xid: bool = False  # an application XID (13) on a GPU, seconds before the job, from no rank of it

    @classmethod
    def all(cls) -> Dirt:
        return cls(True, True, True, True)

    @classmethod
    def draw(cls, rng: random.Random) -> Dirt:
        return cls(*(rng.random() < 0.75 for _ in range(4)))

    def __str__(self) -> str:
        names = [n for n, on in (("ports", self.extra_ports), ("powercap", self.power_cap),
                                 ("bg", self.background), ("oldxid", self.old_xid)) if on]
        return "+".join(names) or "clean"


@dataclass(frozen=True)
class Case:
    """One drawn run of a scenario."""
    scenario: Scenario
    culprit_rank: int
    second_rank: int | None = None
    dirt: Dirt = Dirt()
    evidence_lag_s: float = -1.5  # hardware evidence relative to the symptom: < 0 before, 0 with, > 0 after


def draw_cases(rng: random.Random, runs: int, names: list[str] | None = None, *,
               healthy_share: float = 0.2) -> list[Case]:
    """``runs`` randomized cases: every scenario in turn (a healthy-type one at least ``healthy_share`` of the
    time), the culprit drawn from every rank (0 included), dirt and evidence timing drawn per run."""
    names = list(names or SCENARIOS)
    healthy = [n for n in names if SCENARIOS[n].kind is None]
    faulty = [n for n in names if SCENARIOS[n].kind is not None]
    order: list[str] = []
    n_healthy = min(runs, max(len(healthy) and int(round(runs * healthy_share)), 0)) if faulty else runs
    for i in range(n_healthy):
        order.append(healthy[i % len(healthy)])
    for i in range(runs - n_healthy):
        order.append(faulty[i % len(faulty)])
    rng.shuffle(order)
    cases = []
    for name in order:
        s = SCENARIOS[name]
        rank = s.fixed_rank if s.fixed_rank is not None else rng.choice(s.draw_from or range(WORLD))
        second = rng.choice([r for r in range(WORLD) if r != rank]) if any(e.who == "k2" for e in s.also) else None
        lag = rng.choice([-1.5, -0.5, 0.0, 0.5, 1.5, 3.0, 5.0]) if s.hardware else -1.5
        cases.append(Case(s, rank, second, Dirt.draw(rng), lag))
    return cases


@dataclass
class ScenarioResult:
    scenario: Scenario
    culprit_rank: int
    second_rank: int | None = None
    dirt: Dirt = Dirt()
    evidence_lag_s: float = -1.5
    records: list[dict[str, Any]] = field(default_factory=list)  # latest version per failure, withdrawn left out
    withdrawn: list[dict[str, Any]] = field(default_factory=list)
    first_seen: dict[str, float] = field(default_factory=dict)  # failure key -> when it first showed in the store
    fault_time: float | None = None  # when the faulty rank said the fault began
    first_exit_time: float | None = None  # when the first rank process ended
    symptom_time: float | None = None  # when the faulty rank was told to show its symptom (after hardware that leads)
    exit_code: int | None = None
    wall_s: float = 0.0
    job_output: str = ""

    @property
    def found(self) -> dict[str, Any] | None:
        return self.records[0] if self.records else None

    @property
    def latency_s(self) -> float | None:
        """Detection time of the first verdict minus the fault's start."""
        if not self.records or self.fault_time is None:
            return None
        return min(r["detected_time"] for r in self.records) - self.fault_time

    @property
    def store_latency_s(self) -> float | None:
        """First verdict visible in the store minus the first rank's exit (crashes), else minus the symptom."""
        if not self.first_seen:
            return None
        # A record in the store before any rank ended: from the symptom (hardware that leads comes 1.5 s before).
        origin = self.first_exit_time or self.symptom_time or self.fault_time
        return None if origin is None else min(self.first_seen.values()) - origin

    def _rank_for(self, who: str) -> int | None:
        if who == "k":
            return self.culprit_rank
        if who == "k2":
            return self.second_rank
        return int(who)

    def _matches(self, record: dict[str, Any], expect: Expect, first: bool) -> bool:
        kinds = {expect.kind, *(self.scenario.kinds if first else ())}
        if record.get("kind") not in kinds or record.get("root_cause") != expect.root_cause:
            return False
        culprit = record.get("culprit") or {}
        if culprit.get("rank") == self._rank_for(expect.who):
            return True
        return bool(self.scenario.culprit_is_node and culprit.get("host"))

    @property
    def unmatched(self) -> tuple[list[Expect], list[dict[str, Any]]]:
        """(expected verdicts not found, verdicts found that nobody expected)."""
        left = list(self.records)
        missing = []
        for i, expect in enumerate(self.scenario.expected):
            hit = next((r for r in left if self._matches(r, expect, i == 0)), None)
            if hit is None:
                missing.append(expect)
            else:
                left.remove(hit)
        left = [r for r in left if not any(self._matches(r, t, False) for t in self.scenario.tolerated)]
        return missing, left

    @property
    def tolerated(self) -> list[dict[str, Any]]:
        """Verdicts found that the scenario tolerates (reported, not counted as false alarms)."""
        return [r for r in self.records if any(self._matches(r, t, False) for t in self.scenario.tolerated)]

    @property
    def ok(self) -> bool:
        missing, extra = self.unmatched
        return not missing and not extra


def _failure_key(record: dict[str, Any]) -> str:
    return str(record.get("failure_id") or record.get("signature") or json.dumps(record, sort_keys=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collector_config(workdir: Path, *, grpc_port: int, prometheus_port: int | None = None,
                     hang_timeout_s: float = 8.0, fake_hardware: bool = True,
                     nvml: dict[str, Any] | None = None, attribution: dict[str, Any] | None = None) -> str:
    """The collector config of the suite and the demo: OTLP in, fake NVML and sysfs, attribution, goodput, store.

    ``nvml``: the fake NVML's scenario (default: ``WORLD`` clean GPUs); ``attribution``: settings over the suite's."""
    nvml_scenario = workdir / "nvml.yaml"
    nvml_scenario.write_text(json.dumps(nvml or {"gpu_count": WORLD}))
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
                                       "heartbeat_timeout": "6s", **(attribution or {})},
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


def sidecar_config(workdir: Path, *, grpc_port: int, aggregator_port: int, nvml: dict[str, Any] | None = None,
                   compact: dict[str, Any] | None = None) -> str:
    """The node sidecar of docs/examples/sidecar.yaml in front of the suite's aggregator (:func:`collector_config`
    with ``fake_hardware=False`` on ``aggregator_port``): the job's OTLP and the fake NVML and sysfs in, the
    ``compact`` processor (``compact``: settings over ``batch_interval: 1s``, e.g. ``{"digests": True}``), OTLP out.
    No backend pipelines (nothing here reads them)."""
    nvml_scenario = workdir / "nvml.yaml"
    nvml_scenario.write_text(json.dumps(nvml or {"gpu_count": WORLD}))
    to_aggregator = {"receivers": None, "processors": ["compact"], "exporters": ["otlp/aggregator"]}
    config = {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}, "http": None},
                      "nvml": {"backend": "fake", "scenario": str(nvml_scenario), "interval": "500ms",
                               "pcie_throughput": False},
                      "nic": {"sysfs_root": str(workdir / "sys"), "interval": "500ms"}},
        # job_id empty, as the example's ${env:OTEL_GPU_JOB_ID:-} is here: learned from the training processes
        "processors": {"compact": {"job_id": None, "batch_interval": "1s", **(compact or {})}},
        "exporters": {"otlp/aggregator": {"endpoint": f"127.0.0.1:{aggregator_port}", "compression": "gzip",
                                          "retry_on_failure": {"initial_interval": "200ms", "max_interval": "1s"}}},
        "service": {"telemetry": {"logs": {"level": "warning"}}, "pipelines": {
            "traces/aggregator": dict(to_aggregator, receivers=["otlp"]),
            "metrics/aggregator": dict(to_aggregator, receivers=["otlp", "nvml", "nic"]),
            "logs": dict(to_aggregator, receivers=["otlp", "nvml"]),
        }},
    }
    return json.dumps(config, indent=2)


# Counters a GPU keeps across a node-agent restart (the driver keeps them; only the agent restarted).
_NVML_KEPT = ("pcie_replay", "ecc_corrected_volatile", "ecc_corrected_aggregate", "ecc_uncorrected_volatile",
              "ecc_uncorrected_aggregate", "clocks_event_reasons", "sm_clock_mhz", "temperature_c")


def _nvml_scenario(dirt: Dirt) -> dict[str, Any]:
    scenario: dict[str, Any] = {"gpu_count": WORLD}
    defaults: dict[str, Any] = {}
    if dirt.power_cap:
        defaults["clocks_event_reasons"] = ["sw_power_cap"]
    if dirt.background:
        defaults.update(pcie_replay=37, ecc_corrected_aggregate=112, ecc_corrected_volatile=3)
    if defaults:
        scenario["defaults"] = defaults
    return scenario


def _sysfs(root: Path, dirt: Dirt) -> FakeSysfs:
    counters = {"symbol_error": 1843, "port_rcv_errors": 27, "link_downed": 2, "link_error_recovery": 5} \
        if dirt.background else {}
    spec: dict[str, Any] = {"infiniband": {IB_PORT[0]: {"ports": {IB_PORT[1]: {
        "counters": counters, "rates": {"port_xmit_data": 2.0e8, "port_rcv_data": 2.0e8}}}}}}
    if dirt.extra_ports:
        spec["infiniband"]["mlx5_1"] = {"ports": {1: {"state": "1: DOWN", "phys_state": "3: Disabled"}}}
        spec["net"] = {"eth0": {"statistics": {"rx_errors": 12} if dirt.background else {}},
                       "ifb0": {"operstate": "down", "carrier": 0, "carrier_changes": 0},
                       "docker0": {"operstate": "down", "carrier": 0, "carrier_changes": 0}}
    return FakeSysfs(root, spec)


class _Background(threading.Thread):
    """Background error counts a healthy node shows: one symbol error, PCIe replay or rx_error every few seconds."""

    def __init__(self, sysfs: FakeSysfs, nvml: Callable[[], Any], rng: random.Random, extra_ports: bool):
        super().__init__(name="scenario-background", daemon=True)
        self.sysfs, self.nvml, self.rng, self.extra_ports = sysfs, nvml, rng, extra_ports
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(2.0, 4.0)):
            try:
                what = self.rng.randrange(3)
                if what == 0:
                    self.sysfs.add_ib(IB_PORT[0], IB_PORT[1], "symbol_error", 1)
                elif what == 1 and self.nvml() is not None:
                    self.nvml().inject({"gpu": self.rng.randrange(WORLD), "add": {"pcie_replay": 1}})
                elif self.extra_ports:
                    self.sysfs.add_net_stat("eth0", "rx_errors", 1)
            except Exception:  # noqa: BLE001 - a collector restarting under us
                pass


def _inject_hardware(kind: str, nvml: Any, sysfs: FakeSysfs, gpu: int) -> None:
    if kind in ("xid79", "ecc_dbe", "thermal"):
        if kind == "xid79":
            nvml.inject({"gpu": gpu, "xid": 79})
        elif kind == "ecc_dbe":
            nvml.inject({"gpu": gpu, "xid": 48})
            nvml.inject({"gpu": gpu, "add": {"ecc_uncorrected_volatile": 1, "ecc_uncorrected_aggregate": 1}})
        else:
            nvml.inject({"gpu": gpu, "set": {"clocks_event_reasons": ["hw_thermal_slowdown"], "sm_clock_mhz": 900,
                                             "temperature_c": 92}})
    elif kind == "nic_down":
        sysfs.set_ib_link(IB_PORT[0], IB_PORT[1], False)
    elif kind == "nic_symbol_errors":
        sysfs.add_ib(IB_PORT[0], IB_PORT[1], "symbol_error", 250)


def _read_store(folder: Path, job_id: str) -> list[dict[str, Any]]:
    try:
        conn = db.open_reader(folder)
    except (db.StoreMissing, sqlite3.Error):
        return []
    try:
        return db.failures(conn, job_id)
    except sqlite3.Error:
        return []
    finally:
        conn.close()


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def run_scenario(scenario: Scenario, culprit_rank: int = 1, *, workdir: Path | None = None,
                 progress: Callable[[str], None] | None = None, hang_timeout_s: float = 8.0,
                 prometheus_port: int | None = None, dirt: Dirt = Dirt(), evidence_lag_s: float = -1.5,
                 second_rank: int | None = None, seed: int | None = None,
                 attribution: dict[str, Any] | None = None, sidecar: dict[str, Any] | None = None) -> ScenarioResult:
    """Runs one scenario end to end; returns what the collector attributed (read back from its store).

    ``sidecar``: ``compact`` settings of a node sidecar put in front of the attribution collector (see the module
    docstring; ``{"digests": True}``: node digests); None: the job and the fake hardware send to it directly."""
    say = progress or (lambda _msg: None)
    rng = random.Random(seed)
    if scenario.fixed_rank is not None:
        culprit_rank = scenario.fixed_rank
    if second_rank is None and any(e.who == "k2" for e in scenario.also):
        second_rank = (culprit_rank + 1 + rng.randrange(WORLD - 1)) % WORLD
    own_dir = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"otel-gpu-{scenario.name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sysfs = _sysfs(workdir / "sys", dirt).start(0.2)
    grpc_port = _free_port()
    nvml_spec = _nvml_scenario(dirt)

    aggregator: Collector | None = None
    if sidecar is not None:
        aggregator_port = _free_port()
        aggregator = Collector(load_text(collector_config(
            workdir, grpc_port=aggregator_port, prometheus_port=prometheus_port, hang_timeout_s=hang_timeout_s,
            fake_hardware=False, attribution=attribution), f"<scenario {scenario.name}: aggregator>"))
        aggregator.start()

    def new_collector(spec: dict[str, Any]) -> Collector:
        """The node agent: the one collector, or the sidecar in front of ``aggregator``."""
        if sidecar is not None:
            text = sidecar_config(workdir, grpc_port=grpc_port, aggregator_port=aggregator_port, nvml=spec,
                                  compact=sidecar)
        else:
            text = collector_config(workdir, grpc_port=grpc_port, prometheus_port=prometheus_port,
                                    hang_timeout_s=hang_timeout_s, nvml=spec, attribution=attribution)
        c = Collector(load_text(text, f"<scenario {scenario.name}>"))
        c.start()
        return c

    try:
        collector: Collector | None = new_collector(nvml_spec)
    except BaseException:
        if aggregator is not None:
            aggregator.shutdown(timeout_s=5)
        raise
    holder = {"collector": collector}

    def fake_nvml() -> Any:
        c = holder["collector"]
        return None if c is None else c.component("receiver", "nvml").backend

    if dirt.old_xid:  # an application XID from an earlier job, on a GPU this job will use, before it starts
        fake_nvml().inject({"gpu": rng.randrange(WORLD), "xid": 13})
    background = _Background(sysfs, fake_nvml, rng, dirt.extra_ports)
    if dirt.background:
        background.start()
    result = ScenarioResult(scenario, culprit_rank, second_rank, dirt, evidence_lag_s)
    job_id = f"{scenario.name}-{os.getpid()}-{int(time.time() * 1000) % 10**9}"
    env = dict(os.environ, OTEL_GPU_FAULT=scenario.fault, OTEL_GPU_FAULT_RANK=str(culprit_rank),
               OTEL_GPU_FAULT_RANK2=str(second_rank if second_rank is not None else -1),
               OTEL_GPU_STEPS=str(scenario.steps), OTEL_GPU_SCENARIO_DIR=str(workdir), OTEL_GPU_JOB_ID=job_id,
               OTEL_GPU_FAULT_WAIT_ACK="1" if scenario.wait_ack else "0", OTEL_GPU_HEARTBEAT_S="1",
               OTEL_GPU_STACK_AFTER_S=str(max(2.0, hang_timeout_s / 2)),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(dict(scenario.env))
    env.update(OTEL_GPU_LAUNCHER=scenario.launcher, OTEL_GPU_WORLD=str(WORLD))
    cmd = [sys.executable, "-m", "otel_gpu", "run", "--endpoint", f"http://127.0.0.1:{grpc_port}", "--",
           sys.executable]
    if scenario.launcher == "torchrun":
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", "--max-restarts=0",
                "--monitor-interval=0.2"]
    cmd += ["-m", "otel_gpu.testing.scenarios.train"]
    start = time.time()
    who = f"k={culprit_rank}" + (f", k2={second_rank}" if second_rank is not None else "")
    say(f"[{scenario.name}] starting a {WORLD}-rank gloo job ({scenario.launcher}); fault: {scenario.description} ({who}); "
        f"hardware {dirt}" + (f"; evidence {evidence_lag_s:+.1f} s from the symptom" if scenario.hardware else ""))
    log_path = workdir / "job.log"
    with open(log_path, "wb") as log:
        job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    trigger = workdir / "trigger"
    injected = acked = restarted = False
    deadline = start + scenario.timeout_s
    settle_after_exit = 4.0 if scenario.expected else 3.0
    # Late evidence may revise a verdict: keep watching until it had its chance, plus a moment for a wrong extra.
    grace = max(1.5, evidence_lag_s + 2.5 if scenario.hardware else 1.5)
    exited_at = complete_at = None
    pids: dict[int, int] = {}
    seen: dict[str, float] = {}
    store = workdir / "store"
    try:
        while time.time() < deadline:
            now = time.time()
            if result.fault_time is None and trigger.exists():
                try:
                    result.fault_time = float(trigger.read_text().strip() or now)
                except ValueError:
                    result.fault_time = now
                say(f"[{scenario.name}] fault begins on rank {culprit_rank}")
            if result.fault_time is not None and scenario.hardware and not injected:
                if evidence_lag_s < 0:  # the hardware signal is in before the symptom
                    _inject_hardware(scenario.hardware, fake_nvml(), sysfs, gpu=culprit_rank)
                    injected = True
                    time.sleep(-evidence_lag_s)
                if not acked:  # the faulty rank shows its symptom now
                    (workdir / "ack").write_text("ok")
                    acked = True
                    result.symptom_time = time.time()
                if not injected and time.time() - result.fault_time >= evidence_lag_s:
                    _inject_hardware(scenario.hardware, fake_nvml(), sysfs, gpu=culprit_rank)
                    injected = True
            if result.fault_time is not None and scenario.agent_restart_s and not restarted:
                restarted = True
                say(f"[{scenario.name}] node agent (collector) restarts for {scenario.agent_restart_s:.0f} s")
                kept = {i: {k: g[k] for k in _NVML_KEPT if k in g} for i, g in enumerate(fake_nvml().gpus)}
                holder["collector"] = None
                collector.shutdown(timeout_s=10)
                time.sleep(scenario.agent_restart_s)
                collector = new_collector({**nvml_spec, "gpus": kept})
                holder["collector"] = collector
            if len(pids) < WORLD:
                for rank in range(WORLD):
                    pid_file = workdir / f"pid-{rank}"
                    if rank not in pids and pid_file.exists():
                        try:
                            pids[rank] = int(pid_file.read_text().strip())
                        except ValueError:
                            pass
            if result.first_exit_time is None and pids and any(_ended(p) for p in pids.values()):
                result.first_exit_time = time.time()
            stored = _read_store(store, job_id)
            for record in stored:
                seen.setdefault(_failure_key(record), time.time())
            live = [r for r in stored if not db.is_withdrawn(r)]
            if scenario.expected and len(live) >= len(scenario.expected):
                complete_at = complete_at or time.time()
            else:
                complete_at = None  # a verdict withdrawn meanwhile: keep watching for the real one
            if complete_at is not None and time.time() - complete_at > grace:
                break
            if exited_at is None and job.poll() is not None:
                exited_at = time.time()
            if exited_at is not None and time.time() - exited_at > max(settle_after_exit, grace):
                break
            time.sleep(0.05)
        # What was attributed while the job ran; stopping the job below is the runner's doing, not a fault.
        final = _read_store(store, job_id)
        result.records = [r for r in final if not db.is_withdrawn(r)]
        result.withdrawn = [r for r in final if db.is_withdrawn(r)]
        result.first_seen = {k: t for k, t in seen.items() if k in {_failure_key(r) for r in result.records}}
    finally:
        background.stop.set()
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
        _kill_leftover_ranks(pids.values())
        result.exit_code = job.returncode
        if collector is not None:
            collector.shutdown(timeout_s=10)
        if aggregator is not None:
            aggregator.shutdown(timeout_s=10)
        sysfs.stop()
    result.wall_s = time.time() - start
    result.job_output = log_path.read_text(errors="replace")[-6000:]
    if own_dir and result.ok:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _kill_leftover_ranks(pids: Iterable[int]) -> None:
    """SIGKILL the ranks that outlived the job: torchrun puts each worker in its own process group, and a rank
    blocked in C++ (a gloo collective that never completes, a future never set) cannot run Python's SIGTERM handler,
    so once the agent is gone nothing else would end it."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
            if b"otel_gpu.testing.scenarios.train" not in cmdline and b"multiprocessing" not in cmdline:
                continue  # ended, and the pid is someone else's now
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            continue


def run_case(case: Case, **kwargs: Any) -> ScenarioResult:
    """Runs one drawn :class:`Case`."""
    return run_scenario(case.scenario, case.culprit_rank, dirt=case.dirt, evidence_lag_s=case.evidence_lag_s,
                        second_rank=case.second_rank, **kwargs)
