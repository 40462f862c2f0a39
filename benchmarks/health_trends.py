"""Replays a day of GPU counters for 64 simulated GPUs (8 nodes x 8) through the health processor in compressed time.

Most GPUs are noisy but stable (correctable ECC, PCIe replays and NVLink CRC errors at their own steady rates, with
occasional small bursts; some start with lifetime dirt: thousands of aggregate errors, remapped rows, retired pages);
a few degrade for one to three hours until they fail (uncorrectable ECC + XID 48, a row-remap failure + XID 64, PCIe
replays climbing until XID 79, NVLink CRC errors climbing until XID 74 + 79).

Every node sends one metrics batch per simulated second, in the nvml receiver's own shape (the batch is built once by
the real receiver over the fake NVML, then its counters are moved), so the processor sees the receivers' 1 Hz; XIDs
arrive as the receiver's XID log records. The processor's CPU time (thread time around its calls only) is reported as
a fraction of a core per 1,000 GPUs at 1 Hz.

Prints, per GPU, the state timeline and, for a degrading one, how long before its failure it was marked drain.
Floor: every degrading GPU drained before its failure, no stable GPU flagged, cost < 1% of a core per 1,000 devices.

    python benchmarks/health_trends.py [--hours 24] [--seed 15] [--nodes 8]
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from typing import Any

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.config import build
from otel_gpu.otlp_build import LogsBuilder
from otel_gpu.pdata import Batch, Signal
from otel_gpu.processors.health import HealthConfig, HealthProcessor
from otel_gpu.receivers.nvml import NvmlReceiver
from otel_gpu.receivers.nvml.config import NvmlReceiverConfig
from otel_gpu.schema import gpu as G
from otel_gpu.schema import identity as I
from otel_gpu.testing.fake_nvml import FakeClock, FakeNvml

GPUS_PER_NODE = 8
T0 = 1_800_000_000.0


class _Null:
    def consume(self, batch: Batch) -> None:
        return None


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    if lam > 30:
        return max(0, int(rng.gauss(lam, math.sqrt(lam)) + 0.5))
    n, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1


class Gpu:
    """One simulated GPU's counters and its story."""

    def __init__(self, node: int, index: int, uuid: str, rng: random.Random, hours: float):
        self.node, self.index, self.uuid = node, index, uuid
        self.id = f"gpu:{uuid}"
        # steady per-minute rates: many clean, some noisy (log-uniform), a few very noisy
        self.rates = {k: (0.0 if rng.random() < 0.4 else 10 ** rng.uniform(-1.5, 1.0))
                      for k in ("ecc", "replay", "nvlink")}
        self.burst_every_h = rng.uniform(2, 8)
        self.counters = {"ecc": rng.choice((0, 0, 120, 5_000)), "ecc_unc": 0, "replay": rng.choice((0, 0, 40, 900)),
                         "nvlink": rng.choice((0, 0, 7, 300)), "remap_failure": 0, "retired": rng.choice((0, 0, 2))}
        self.mode: str | None = None
        self.fail_at: float | None = None
        self.degrade_from: float | None = None
        self.failed = False
        self.hours = hours

    def degrade(self, mode: str, rng: random.Random) -> None:
        self.mode = mode
        self.fail_at = T0 + rng.uniform(0.35, 0.9) * self.hours * 3600
        duration = {"ecc_dbe": 3600.0, "ecc_remap": rng.uniform(5400, 9000), "pcie": rng.uniform(3600, 7200),
                     "nvlink": rng.uniform(3600, 10800)}[mode]
        self.degrade_from = self.fail_at - duration
        key = {"ecc_dbe": "ecc", "ecc_remap": "ecc", "pcie": "replay", "nvlink": "nvlink"}[mode]
        self.rates[key] = max(self.rates[key], 0.2)

    def step(self, t: float, dt: float, rng: random.Random) -> list[int]:
        """Moves the counters by ``dt`` seconds at ``t``; returns the XIDs that happened."""
        xids: list[int] = []
        for key, counter in (("ecc", "ecc"), ("replay", "replay"), ("nvlink", "nvlink")):
            rate = self.rates[key]
            if self.degrade_from is not None and not self.failed and t >= self.degrade_from:
                degrading = {"ecc_dbe": "ecc", "ecc_remap": "ecc", "pcie": "replay", "nvlink": "nvlink"}[self.mode]
                if key == degrading:
                    total = self.fail_at - self.degrade_from
                    rate *= 2 ** (8 * (t - self.degrade_from) / total)  # 256x its usual rate at the failure
            self.counters[counter] += _poisson(rng, rate * dt / 60)
            if rng.random() < dt / (self.burst_every_h * 3600):  # a small burst now and then (noisy but stable)
                self.counters[counter] += rng.randint(2, 8)
        if self.fail_at is not None and not self.failed and t >= self.fail_at:
            self.failed = True
            if self.mode == "ecc_dbe":
                self.counters["ecc_unc"] += 1
                xids.append(48)
            elif self.mode == "ecc_remap":
                self.counters["remap_failure"] = 1
                xids.append(64)
            elif self.mode == "pcie":
                xids.append(79)
            else:
                xids += [74, 79]
        return xids


class Node:
    """One node's metrics batch in the nvml receiver's shape, with the counter points located once."""

    def __init__(self, n: int, rng: random.Random, hours: float):
        self.host = f"node-{n:02d}"
        fake = FakeNvml({"gpu_count": GPUS_PER_NODE}, clock=FakeClock())
        for g in fake.gpus:
            g["uuid"] = f"GPU-{n:04x}{g['uuid'][8:]}"
        rx = NvmlReceiver(NvmlReceiverConfig(backend="fake", host_name=self.host, xid_events=False),
                          ComponentHost("nvml", PrometheusSelfTelemetry(), {}))
        rx.backend = fake
        rx._init()  # a benchmark may use the receiver's set-up steps; start() would add its own threads
        rx._discover()
        self.template = rx.poll()
        self.gpus = [Gpu(n, i, fake.gpus[i]["uuid"], rng, hours) for i in range(GPUS_PER_NODE)]
        by_uuid = {g.uuid: g for g in self.gpus}
        self.points: list[tuple[Any, Gpu, str]] = []  # (data point, gpu, counter)
        for sm in self.template.resource_metrics[0].scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points:
                    a = {kv.key: kv.value for kv in p.attributes}
                    gpu = by_uuid.get(a[str(I.HW_ID)].string_value)
                    counter = None
                    if m.name == G.ECC_ERRORS.name and a[str(G.ECC_COUNTER)].string_value == "volatile":
                        counter = "ecc" if a[str(G.ERROR_TYPE)].string_value == "corrected" else "ecc_unc"
                    elif m.name == G.PCIE_REPLAY.name:
                        counter = "replay"
                    elif m.name == G.NVLINK_ERRORS.name and a[str(G.NVLINK_LINK)].int_value == 0 and \
                            a[str(G.ERROR_TYPE)].string_value == "crc_flit":
                        counter = "nvlink"
                    elif m.name == G.REMAP_FAILURE.name:
                        counter = "remap_failure"
                    elif m.name == G.RETIRED_PAGES.name and \
                            a[str(G.RETIREMENT_CAUSE)].string_value == "multiple_single_bit_ecc":
                        counter = "retired"
                    if counter is not None:
                        self.points.append((p, gpu, counter))
        self.refresh()  # the GPUs' lifetime dirt is there from the first batch
        self.points_per_batch = sum(len(getattr(m, m.WhichOneof("data")).data_points)
                                    for sm in self.template.resource_metrics[0].scope_metrics for m in sm.metrics)

    def refresh(self) -> Batch:
        for p, gpu, counter in self.points:
            p.as_int = int(gpu.counters[counter])
        self.batch = Batch.from_message(Signal.METRICS, self.template)  # new wire bytes
        return self.batch

    def xid_batch(self, gpu: Gpu, code: int, t: float) -> Batch:
        lb = LogsBuilder({str(I.HOST_NAME): self.host}, scope="otel_gpu.receivers.nvml")
        lb.event(G.XID_EVENT, {"code": code}, {str(I.GPU_INDEX): gpu.index, str(I.HW_ID): gpu.uuid},
                 {str(G.XID_CODE): code, str(G.XID_SOURCE): "nvml"}, time_ns=int(t * 1e9), severity=LogsBuilder.ERROR)
        return Batch.from_message(Signal.LOGS, lb.build())


def _clock_str(t: float) -> str:
    s = int(t - T0)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--degrading", type=int, default=5, help="GPUs that degrade and fail")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    nodes = [Node(n, rng, args.hours) for n in range(args.nodes)]
    gpus = [g for node in nodes for g in node.gpus]
    modes = ("ecc_dbe", "ecc_remap", "pcie", "nvlink")
    for k, gpu in enumerate(rng.sample(gpus, args.degrading)):
        gpu.degrade(modes[k % len(modes)], rng)
    now = [T0]
    host = ComponentHost("health", PrometheusSelfTelemetry(), {Signal.METRICS: _Null(), Signal.LOGS: _Null()}, {})
    proc = HealthProcessor(build(HealthConfig, {}, "processors.health"), host)
    proc._clock = lambda: now[0]
    cfg = proc.config
    timeline: dict[str, list[tuple[float, str]]] = {}
    cpu = 0.0
    batches = 0
    seconds = int(args.hours * 3600)
    wall0 = time.perf_counter()
    for s in range(1, seconds + 1):
        now[0] = T0 + s
        sample = s % 10 == 0  # the counters move in 10 s steps (the processor reads every sample_interval_s)
        for node in nodes:
            xids = []
            if sample:
                for gpu in node.gpus:
                    xids += [(gpu, c) for c in gpu.step(now[0], 10.0, rng)]
                batch = node.refresh()
            else:
                batch = node.batch
            c0 = time.thread_time()
            proc.process(batch)
            for gpu, code in xids:
                proc.process(node.xid_batch(gpu, code, now[0]))
            cpu += time.thread_time() - c0
            batches += 1
        if s % int(cfg.evaluate_interval_s) == 0:
            c0 = time.thread_time()
            changes = proc.evaluate(now[0])
            cpu += time.thread_time() - c0
            for ch in changes:
                timeline.setdefault(ch.device.id, []).append((ch.time, ch.state.value))
    wall = time.perf_counter() - wall0
    ok = True
    print(f"replayed {args.hours:g} h of 1 Hz batches from {len(nodes)} nodes x {GPUS_PER_NODE} GPUs "
          f"({batches:,} metrics batches of {nodes[0].points_per_batch} points) in {wall:.1f} s wall")
    print()
    print(f"{'GPU':<48} {'story':<28} timeline (hh:mm since start)")
    leads = []
    for gpu in gpus:
        tl = timeline.get(gpu.id, [])
        text = " -> ".join(f"{state}@{_clock_str(t)}" for t, state in tl) or "-"
        if gpu.mode is None:
            story = "stable" + (" (noisy)" if max(gpu.rates.values()) >= 1 else "")
            flagged = [st for _, st in tl if st != "healthy"]
            verdict = "OK" if not flagged else "FALSE ALARM"
            ok &= not flagged
        else:
            story = f"degrading: {gpu.mode} fails@{_clock_str(gpu.fail_at)}"
            drained = next((t for t, st in tl if st == "drain"), None)
            if drained is not None and drained < gpu.fail_at:
                lead = (gpu.fail_at - drained) / 60
                leads.append(lead)
                verdict = f"drained {lead:.0f} min before the failure"
            else:
                verdict = "MISSED (not drained before the failure)"
                ok = False
        print(f"{gpu.id:<48} {story:<28} {text}   {verdict}")
    devices = len(gpus)
    core_fraction = cpu / seconds
    per_1000 = core_fraction * 1000 / devices
    stable = [g for g in gpus if g.mode is None]
    print()
    print(f"degrading GPUs drained before their failure: {len(leads)}/{args.degrading}"
          + (f"; lead time min {min(leads):.0f} / median {sorted(leads)[len(leads) // 2]:.0f} / max {max(leads):.0f} "
             f"min" if leads else ""))
    print(f"stable GPUs flagged: {sum(1 for g in stable if any(st != 'healthy' for _, st in timeline.get(g.id, [])))}"
          f"/{len(stable)} (noisy among them: {sum(1 for g in stable if max(g.rates.values()) >= 1)})")
    print(f"processor CPU: {cpu:.2f} s for {seconds:,} simulated s x {devices} GPUs = {core_fraction * 100:.4f}% of a "
          f"core; per 1,000 devices at 1 Hz: {per_1000 * 100:.3f}% of a core (floor 1%)")
    ok &= per_1000 < 0.01
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
