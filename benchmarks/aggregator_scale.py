"""Aggregator capacity: one job of N ranks through the aggregator pipeline, in-process, as fast as it goes.

What the aggregator gets from the node sidecars (docs/examples/sidecar.yaml, after the ``compact`` processor) is
simulated for ``--seconds`` simulated seconds:

- per rank, every second: one trace request with its ``otel_gpu.step`` span and ``otel_gpu.data.wait`` span (the
  collective spans stay on the sidecar -> backend path);
- per rank, every 2 s (staggered): one ``otel_gpu.progress`` heartbeat with the instrumentation's body;
- per node of 8 ranks, in the job's first seconds (second 1 or 2: the compact processor forwards a node's metrics at
  its first poll after a new job's first record there) and then every ``--node-refresh-s`` seconds: what the real
  ``nvml`` receiver (fake 8-GPU NVML) and ``nic`` receiver (fake sysfs, 8 InfiniBand ports + 1 Ethernet interface)
  poll, passed through the real ``compact`` processor (XID, ECC, row-remap, NVLink, PCIe, clock-event, process and
  NIC error/link metrics). The compact processor forwards a metric when its points change and otherwise every
  ``metrics_refresh_s`` (30 s): on a healthy node that is the refresh. The first ones cost the aggregator most (every
  device's state is new); they fall in the warm-up, and the CPU of the first seconds is printed on its own
  (``startup_cpu_s``). Their data points carry no timestamp, so that the aggregator times them with its (simulated)
  clock.

From ``--hang-at`` on, the job hangs: rank N//3 never reaches all_reduce seq k, the others wait in it; every rank's
watchdog sends its stacks 10 s into the stall, as the instrumentation does. The run checks that the hang is named
(kind, cause, culprit) and when.

Each request is encoded just before it is fed as bytes to the OTLP receiver's consumer (the receiver parses it, as it
does off the wire; gRPC itself is not in the measurement) -> ``attribution`` -> ``goodput`` -> ``store`` (SQLite). The
attribution clock is simulated and ticks twice per simulated second (its default tick_interval_s is 0.5); goodput
reports every 5 simulated seconds (its default).

Printed per job size: aggregator CPU seconds per simulated second (process CPU, user + system, minus the CPU the
generator spent encoding requests), peak RSS (VmHWM of the process, generator included, which is small: requests are
encoded and fed one node at a time) and the idle collector's RSS; CPU also split into steady state (seconds 10 to the
hang) and the hang phase (no more steps). Floor (issue 7): 4,096 ranks on one core (CPU s per simulated s < 1.0, in
steady state and overall) with peak RSS < 300 MB. Each size runs in its own process, so that VmHWM is its own.
``--ranks-per-request 8`` merges a node's ranks into one request, as the sidecar's batching does. ``--grpc-cost``
measures what this leaves out: a collector's CPU per OTLP/gRPC request at the front door.

Example:
    /work/venv/bin/python benchmarks/aggregator_scale.py                       # 1024, 4096, 16384 ranks, 60 s each
    /work/venv/bin/python benchmarks/aggregator_scale.py --ranks 4096 --seconds 30 --json
    /work/venv/bin/python benchmarks/aggregator_scale.py --grpc-cost
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR_RANKS = 4096
FLOOR_CPU_PER_S = 1.0
FLOOR_RSS_MB = 300.0
#: issue 20, digest mode, one job: ranks -> (steady CPU s per simulated s, peak RSS MB or None)
DIGEST_FLOORS = {16384: (0.25, None), 131072: (1.0, 1024.0)}
JOB = "bench-job"
RANKS_PER_NODE = 8
COLLECTIVES_PER_STEP = 8
STACKS_AFTER_S = 10


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _node_templates(tmp: Path):
    """One node's compacted GPU and NIC metric requests, from the real receivers over fakes and the real compact
    processor; data point timestamps cleared."""
    import yaml

    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.component import ComponentHost
    from otel_gpu.config import build
    from otel_gpu.pdata import Batch, Signal
    from otel_gpu.processors.compact import CompactConfig, CompactProcessor
    from otel_gpu.receivers.nic import FACTORY as NIC
    from otel_gpu.receivers.nvml import FACTORY as NVML
    from otel_gpu.testing.fake_sysfs import FakeSysfs

    telemetry = PrometheusSelfTelemetry()
    scenario = tmp / "nvml.yaml"
    scenario.write_text(yaml.safe_dump({"gpu_count": 8, "gpus": {
        i: {"processes": [{"pid": 1000 + i, "used_memory_mib": 60000}]} for i in range(8)}}))
    sysfs = FakeSysfs(tmp / "sys", {"infiniband": {f"mlx5_{i}": {"ports": {1: {}}} for i in range(8)},
                                     "net": {"eth0": {}}})
    del sysfs
    compact = CompactProcessor(build(CompactConfig, {"job_id": JOB, "batch_interval": "0s"}, "processors.compact"),
                               ComponentHost("compact", telemetry))
    out = []
    for factory, settings in ((NVML, {"backend": "fake", "scenario": str(scenario), "nvlink_interval": "1s",
                                      "host_name": "node-00000"}),
                              (NIC, {"sysfs_root": str(tmp / "sys"), "host_name": "node-00000"})):
        receiver = factory.create(build(factory.config_class, settings, factory.type), ComponentHost(
            factory.type, telemetry))
        receiver.start()
        try:
            request = receiver.poll()
            if factory is NIC:
                time.sleep(0.05)
                request = receiver.poll() or request  # rates need two reads
        finally:
            receiver.shutdown()
        batch = compact.process(Batch.from_message(Signal.METRICS, request))
        msg = batch.message
        for rm in msg.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    for p in getattr(m, kind).data_points:
                        p.time_unix_nano = 0
                        p.start_time_unix_nano = 0
        host_idx = [i for i, kv in enumerate(msg.resource_metrics[0].resource.attributes) if kv.key == "host.name"][0]
        out.append((msg, host_idx))
    return out


class _Generator:
    """Encodes the requests of one rank or node from reusable templates (one message each, fields overwritten)."""

    def __init__(self, n_ranks: int, t0: float, hang_at: float | None, node_templates, job: str = JOB,
                 crash_at: float | None = None):
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        from otel_gpu.otlp_build import attributes
        from otel_gpu.schema import training as T

        self.n, self.t0, self.hang_at, self.job, self.crash_at = n_ranks, t0, hang_at, job, crash_at
        self.culprit = n_ranks // 3
        self.T = T
        res = {"service.name": "trainer", "training.job.id": job, "training.rank": 0, "training.local_rank": 0,
               "training.world_size": n_ranks, "training.restart_count": 0, "host.name": "node-00000",
               "process.pid": 1000, "gpu.index": 0}
        self._res_keys = list(res)
        self.trace = ExportTraceServiceRequest()
        rs = self.trace.resource_spans.add()
        rs.resource.attributes.extend(attributes(res))
        ss = rs.scope_spans.add()
        ss.scope.name = "otel_gpu.instrumentation"
        self.step_span = ss.spans.add(name=T.STEP_SPAN.name, trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
        self.step_span.attributes.extend(attributes({str(T.STEP): 0, str(T.STEP_COLLECTIVE_S): 0.31,
                                                     str(T.STEP_DATA_S): 0.02, str(T.STEP_CHECKPOINT_S): 0.0}))
        self.data_span = ss.spans.add(name=T.DATA_SPAN.name, trace_id=b"\x01" * 16, span_id=b"\x03" * 8)
        self.data_span.attributes.extend(attributes({str(T.STEP): 0}))
        self.logs = ExportLogsServiceRequest()
        rl = self.logs.resource_logs.add()
        rl.resource.attributes.extend(attributes(res))
        self.scope_logs = rl.scope_logs.add()
        self.scope_logs.scope.name = "otel_gpu.instrumentation"
        self.node_templates = node_templates
        self.res = res

    def res_dict(self, rank: int) -> dict:
        """The rank's resource attributes, as the sidecar decodes them."""
        return {**self.res, "training.rank": rank, "training.local_rank": rank % RANKS_PER_NODE,
                "host.name": f"node-{rank // RANKS_PER_NODE:05d}", "process.pid": 1000 + rank,
                "gpu.index": rank % RANKS_PER_NODE}

    def _identity(self, resource, rank: int) -> None:
        a = resource.attributes
        a[2].value.int_value = rank
        a[3].value.int_value = rank % RANKS_PER_NODE
        a[6].value.string_value = f"node-{rank // RANKS_PER_NODE:05d}"
        a[7].value.int_value = 1000 + rank
        a[8].value.int_value = rank % RANKS_PER_NODE

    def steps_done(self, sim_s: int) -> int:
        return sim_s if self.hang_at is None else min(sim_s, int(self.hang_at))

    def dead(self, rank: int, sim_s: int) -> bool:
        """The rank that crashed sends nothing after its crash."""
        return self.crash_at is not None and rank == 3 and sim_s > int(self.crash_at)

    def step_fields(self, rank: int, sim_s: int) -> tuple[int, float, float] | None:
        """(step, start, end) of the step that ended during second ``sim_s``, as trace_bytes encodes it."""
        if self.hang_at is not None and sim_s > self.hang_at:
            return None
        start = self.t0 + sim_s - 1
        return sim_s, start, start + 0.95

    def trace_bytes(self, rank: int, sim_s: int) -> bytes | None:
        """The step that ended during second ``sim_s`` (none once the job hangs)."""
        if self.hang_at is not None and sim_s > self.hang_at:
            return None
        self._identity(self.trace.resource_spans[0].resource, rank)
        start = self.t0 + sim_s - 1
        ns = lambda t: int(t * 1e9)  # noqa: E731
        self.data_span.start_time_unix_nano, self.data_span.end_time_unix_nano = ns(start), ns(start + 0.02)
        self.data_span.attributes[0].value.int_value = sim_s
        self.step_span.start_time_unix_nano, self.step_span.end_time_unix_nano = ns(start), ns(start + 0.95)
        self.step_span.attributes[0].value.int_value = sim_s
        self.step_span.span_id = (rank * 100_000 + sim_s).to_bytes(8, "big")
        return self.trace.SerializeToString()

    def bodies(self, rank: int, sim_s: int) -> tuple[dict | None, dict | None]:
        """The heartbeat body (every 2 s: odd ranks on odd seconds) and the stacks body (once, 10 s into a stall)."""
        stalled = self.hang_at is not None and sim_s > self.hang_at
        stacks = stalled and sim_s - STACKS_AFTER_S - (rank % 2) == int(self.hang_at) // 2 * 2
        if (sim_s + rank) % 2 and not stacks:
            return None, None
        now = self.t0 + sim_s
        step = self.steps_done(sim_s)
        seq = step * COLLECTIVES_PER_STEP
        counters = {"steps": step, "collectives": seq, "fr_collectives": 0, "dropped": 0, "fr_lost": 0,
                    "spans_sent": step * (COLLECTIVES_PER_STEP + 2), "spans_dropped": 0, "export_failures": 0}
        if not stalled:
            body = {"step": step, "state": "step", "inflight": None, "last_seq": {"0": seq},
                    "last_started_seq": {"0": seq}, "counters": counters, "stalled_s": 0.2,
                    "flight_recorder": False}
        elif rank == self.culprit:
            body = {"step": step, "state": "step", "inflight": None, "last_seq": {"0": seq},
                    "last_started_seq": {"0": seq}, "counters": counters,
                    "stalled_s": round(now - self.hang_at - self.t0, 3), "flight_recorder": False}
        else:
            body = {"step": step, "state": "collective", "last_seq": {"0": seq}, "last_started_seq": {"0": seq + 1},
                    "inflight": {"kind": "collective", "op": "all_reduce", "pg": "0", "seq": seq + 1,
                                 "since": self.t0 + self.hang_at},
                    "counters": counters, "stalled_s": round(now - self.hang_at - self.t0, 3),
                    "flight_recorder": False}
        stack_body = None
        if stacks:
            frames = [{"file": "/usr/lib/python3.12/threading.py", "line": 320, "function": "wait"}] * 3
            frames = [{"file": "/home/user/train.py", "line": 210, "function": "main"},
                      {"file": "/home/user/train.py", "line": 140 if rank == self.culprit else 171,
                       "function": "evaluate" if rank == self.culprit else "train_step"}] + frames
            stack_body = {"threads": [
                {"name": "MainThread", "id": 1, "main": True, "frames": frames},
                {"name": "otel-gpu-watchdog", "id": 2, "main": False, "frames": frames[2:]}],
                "top": "/home/user/train.py:171 train_step", "inflight": body["inflight"]}
        return body, stack_body

    def log_bytes(self, rank: int, sim_s: int, heartbeat: bool = True, stacks: bool = True) -> bytes | None:
        """A rank's own log request: its heartbeat and stacks as :meth:`bodies` says (either left out on request);
        a crash (exception and exit) at ``crash_at`` on rank 3."""
        body, stack_body = self.bodies(rank, sim_s)
        crash = self.crash_at is not None and rank == 3 and sim_s == int(self.crash_at)
        body = body if heartbeat else None
        stack_body = stack_body if stacks else None
        if body is None and stack_body is None and not crash:
            return None
        T = self.T
        now = self.t0 + sim_s
        del self.scope_logs.log_records[:]
        if body is not None:
            rec = self.scope_logs.log_records.add(time_unix_nano=int(now * 1e9),
                                                  observed_time_unix_nano=int(now * 1e9), severity_number=9,
                                                  event_name=T.PROGRESS_EVENT.name)
            rec.body.string_value = json.dumps(body, separators=(",", ":"))
        if stack_body is not None:
            srec = self.scope_logs.log_records.add(time_unix_nano=int(now * 1e9), severity_number=13,
                                                   event_name=T.STACKS_EVENT.name)
            srec.body.string_value = json.dumps(stack_body, separators=(",", ":"))
        if crash:
            from otel_gpu.otlp_build import attributes

            t = int((now - 1) * 1e9)  # processed at the start of the second (the collector clock's t0 + s - 1)
            exc = self.scope_logs.log_records.add(time_unix_nano=t, severity_number=17,
                                                  event_name=T.EXCEPTION_EVENT.name)
            exc.attributes.extend(attributes({str(T.EXC_TYPE): "RuntimeError", str(T.EXC_MESSAGE): "CUDA error: an "
                                              "illegal memory access was encountered", str(T.THREAD_NAME): "MainThread",
                                              str(T.EXC_STACK): "Traceback: train.py line 171"}))
            ex = self.scope_logs.log_records.add(time_unix_nano=t, severity_number=17, event_name=T.EXIT_EVENT.name)
            ex.attributes.extend(attributes({str(T.EXIT_CODE): 1}))
        self._identity(self.logs.resource_logs[0].resource, rank)
        return self.logs.SerializeToString()

    def node_bytes(self, node: int) -> list[bytes]:
        out = []
        for msg, host_idx in self.node_templates:
            msg.resource_metrics[0].resource.attributes[host_idx].value.string_value = f"node-{node:05d}"
            out.append(msg.SerializeToString())
        return out


def _digest_requests(gen: _Generator, node: int, s: int, first: bool, refresh: bool) -> tuple[list, list]:
    """What one node's sidecar with ``digests: true`` sends for second ``s``: its digest (the real builder,
    processors/compact/_digest.py), and the log requests of ranks that stand out (the culprit's stacks, a crash).
    The builder is made anew for each node and second, so that the generator holds no per-rank state in the measured
    process; it is told which identities went out already (every rank's on the first second and every 30 s)."""
    from otel_gpu.otlp_build import LogsBuilder
    from otel_gpu.processors.compact._digest import NodeDigests

    now = gen.t0 + s
    host = f"node-{node:05d}"
    d = NodeDigests(host, clock=lambda: now, refresh_s=1e12)
    # A job past NodeDigests.RANKS_PER_INTERVAL ranks gets its node's digest every few seconds (staggered over the
    # nodes), holding the steps of those seconds.
    every = NodeDigests.intervals_for(gen.n)
    due = (s + node) % every == 0
    own: list[bytes] = []
    for rank in range(node * RANKS_PER_NODE, min(gen.n, (node + 1) * RANKS_PER_NODE)):
        if gen.dead(rank, s):
            continue
        res = gen.res_dict(rank)
        for ss in range(max(1, s - every + 1), s + 1) if due else ():
            st = gen.step_fields(rank, ss)
            if st is not None:
                d.step(res, st[0], st[1], st[2], 0.31, 0.02, 0.0)
        body, stacks = gen.bodies(rank, s)
        if body is not None:
            d.heartbeat(res, body, now)
        else:  # the sidecar holds each rank's newest heartbeat: this rank's came a second ago
            before, _ = gen.bodies(rank, s - 1)
            if before is not None:
                d.heartbeat(res, before, now - 1)
        held = stacks is None or d.stacks_held(res, stacks)
        crash = gen.crash_at is not None and rank == 3 and s == int(gen.crash_at)
        if not held or crash:
            raw = gen.log_bytes(rank, s, heartbeat=False, stacks=not held)
            if raw is not None:
                own.append(raw)
        if crash:
            d.exited(res, {})
    if not (first or refresh):
        for job in d.jobs.values():
            for r in job.ranks.values():
                r.who_sent = now
    if not due:
        return [], own
    digests = []
    for job_id, body in d.bodies(now):
        lb = LogsBuilder({"training.job.id": job_id, "host.name": host, "service.name": "otel-gpu-sidecar"},
                         scope="otel_gpu.processors.compact")
        lb.event(gen.T.NODE_DIGEST_EVENT, body, time_ns=int(now * 1e9))
        digests.append(lb.build().SerializeToString())
    return digests, own


def run_one(n_ranks: int, seconds: int, hang_at: float | None, node_refresh_s: int = 30,
            ranks_per_request: int = 1, mode: str = "per-rank", jobs: int = 1, profile: bool = False,
            nodes_per_request: int = 1) -> dict:
    import logging

    import yaml

    from otel_gpu.collector.config import load_text
    from otel_gpu.collector.runtime import Collector, tune_gc_for_service
    from otel_gpu.pdata import Batch, Signal
    from otel_gpu.processors.compact._digest import NodeDigests

    logging.disable(logging.WARNING)  # the failure record is logged at WARNING; we print it ourselves
    tmp = Path(tempfile.mkdtemp(prefix="otel-gpu-aggscale-"))
    pipe = {"receivers": ["otlp"], "processors": ["attribution", "goodput"], "exporters": ["store"]}
    config = {"receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": None}},
              "processors": {"attribution": {"tick_interval": "1h"}, "goodput": {"report_interval": "1h"}},
              "exporters": {"store": {"path": str(tmp / "store")}},
              "service": {"pipelines": {"traces": pipe, "metrics": pipe, "logs": pipe}}}
    collector = Collector(load_text(yaml.safe_dump(config)))
    collector.start()
    tune_gc_for_service()  # as ``otel-gpu collector`` does once its pipelines started
    attribution = collector.component("processor", "attribution")
    goodput = collector.component("processor", "goodput")
    receiver_host = collector.component("receiver", "otlp").host
    consume = {s: receiver_host.consumer(s).consume for s in Signal}
    node_templates = _node_templates(tmp)
    t0 = float(int(time.time()))
    sim = [t0]
    attribution._clock = lambda: sim[0]  # the engine's clock is the simulation's
    # The jobs: the first hangs (rank N//3 never reaches its all_reduce); a small job of one node crashes at the
    # same moment (rank 3 raises), so that every run also times a crash.
    gens = [_Generator(n_ranks, t0, hang_at, node_templates, job=JOB if j == 0 else f"{JOB}-{j}")
            for j in range(jobs)]
    gens[0].hang_at = hang_at
    for g in gens[1:]:
        g.hang_at = None
    crash_at = hang_at
    crash_gen = _Generator(RANKS_PER_NODE, t0, crash_at, node_templates, job=f"{JOB}-crash", crash_at=crash_at)
    gen = gens[0]
    n_nodes = (n_ranks + RANKS_PER_NODE - 1) // RANKS_PER_NODE
    rss_idle_kb = _status_kb("VmRSS")
    counts = {"trace_requests": 0, "log_requests": 0, "metric_requests": 0}
    records: list = []
    gen_cpu = 0.0
    per_second: list[float] = []  # cumulative aggregator CPU at the end of each simulated second
    rss_mb: list[int] = []  # RSS at the end of each simulated second
    thread_time = time.thread_time
    from_bytes = Batch.from_bytes
    TR, LG, MT = Signal.TRACES, Signal.LOGS, Signal.METRICS
    digest = mode == "digest"
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    # Garbage collections while the aggregator runs (not while the generator encodes): CPU s per generation.
    gc_s = [0.0, 0.0, 0.0]
    gc_start = [0.0]
    in_gen = [False]

    def gc_timer(phase: str, info: dict) -> None:
        if in_gen[0]:
            return
        if phase == "start":
            gc_start[0] = thread_time()
        else:
            gc_s[info["generation"]] += thread_time() - gc_start[0]

    gc.callbacks.append(gc_timer)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    work = [(crash_gen, 0)] + [(g, node) for g in gens for node in range(n_nodes)]
    held: list[bytes] = []  # digests waiting to go as one request (--nodes-per-request)
    mid = len(work) // 2
    for s in range(1, seconds + 1):
        for k, (g, node) in enumerate(work):
            g0 = thread_time()
            in_gen[0] = True
            reqs = []
            if digest:
                digests, own = _digest_requests(g, node, s, s <= NodeDigests.intervals_for(g.n),
                                                (s + node) % 30 == 0)
                reqs += [(LG, raw) for raw in own]
                # A routing tier's batch processor merges many nodes' digests into one request (concatenated
                # export requests are one request: protobuf merges repeated fields).
                held += digests
                if len(held) >= nodes_per_request or k == len(work) - 1:
                    reqs.append((LG, b"".join(held)))
                    held = []
            else:
                traces: list[bytes] = []
                logs: list[bytes] = []
                for rank in range(node * RANKS_PER_NODE, min(g.n, (node + 1) * RANKS_PER_NODE)):
                    if g.dead(rank, s):
                        continue
                    raw = g.trace_bytes(rank, s)
                    if raw is not None:
                        traces.append(raw)
                    raw = g.log_bytes(rank, s)
                    if raw is not None:
                        logs.append(raw)
                # Several ranks per request (a batch processor in the routing tier): concatenated export requests
                # of one type are one request holding all their resources (protobuf merges repeated fields).
                for signal, raws in ((TR, traces), (LG, logs)):
                    for i in range(0, len(raws), ranks_per_request):
                        reqs.append((signal, b"".join(raws[i:i + ranks_per_request])))
            # A node's metrics reach the job's aggregator at the sidecar's first poll after the job's first record
            # there (compact forwards node metrics at once to a new job), then every node_refresh_s unchanged.
            first = 1 + node % 2
            if s >= first and (s - first) % node_refresh_s == 0 and g is not crash_gen:
                for raw in g.node_bytes(node):
                    reqs.append((MT, raw))
            in_gen[0] = False
            gen_cpu += thread_time() - g0
            if k == mid:
                sim[0] = t0 + s - 0.5
                records += attribution.tick()
            for signal, raw in reqs:
                consume[signal](from_bytes(signal, raw))
                counts[f"{'trace' if signal is TR else 'log' if signal is LG else 'metric'}_requests"] += 1
        sim[0] = t0 + s
        records += attribution.tick()
        per_second.append(time.process_time() - cpu0 - gen_cpu)
        rss_mb.append(round(_status_kb("VmRSS") / 1024))
        if s % 5 == 0:
            goodput.report()
    cpu = time.process_time() - cpu0 - gen_cpu
    wall = time.perf_counter() - wall0
    gc.callbacks.remove(gc_timer)
    top: list[str] = []
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        out = io.StringIO()
        lines = int(os.environ.get("BENCH_PROFILE_LINES", "18"))
        stats = pstats.Stats(profiler, stream=out).sort_stats(os.environ.get("BENCH_PROFILE_SORT", "tottime"))
        stats.print_stats(lines)
        top = [line.rstrip() for line in out.getvalue().splitlines() if line.strip()][-(lines + 1):]
        if os.environ.get("BENCH_PROFILE_CALLERS"):  # who calls a function: a regular expression of its name
            out = io.StringIO()
            stats.stream = out  # type: ignore[attr-defined]
            stats.print_callers(os.environ["BENCH_PROFILE_CALLERS"])
            top += [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]
    collector.shutdown()
    hang = [r for r in records if r.kind.value == "hang" and r.job_id == JOB and not r.withdrawn]
    crash = [r for r in records if r.kind.value == "crash" and r.job_id == crash_gen.job]
    steady_end = min(seconds, int(hang_at)) if hang_at is not None else seconds
    warm = min(10, steady_end - 1)  # the first seconds fill the per-rank state
    steady = round((per_second[steady_end - 1] - per_second[warm - 1]) / (steady_end - warm), 3) \
        if steady_end > warm > 0 else None
    hang_s = None if not hang or hang_at is None else round(hang[0].detected_time - (t0 + hang_at), 2)
    result = {
        "ranks": n_ranks, "jobs": jobs, "mode": mode, "nodes": n_nodes * jobs, "simulated_s": seconds,
        "node_refresh_s": node_refresh_s, "ranks_per_request": ranks_per_request,
        "nodes_per_request": nodes_per_request if mode == "digest" else None, "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2), "generator_cpu_s": round(gen_cpu, 2),
        "cpu_per_simulated_s": round(cpu / seconds, 3),
        "steady_cpu_per_s": steady,
        "cpu_per_simulated_s_steady": steady,
        "cpu_per_simulated_s_hang": round((per_second[-1] - per_second[steady_end - 1]) / (seconds - steady_end), 3)
        if seconds > steady_end else None,
        "startup_cpu_s": round(per_second[min(2, seconds) - 1], 2),
        "gc_cpu_s_by_generation": [round(x, 2) for x in gc_s],  # in the aggregator's CPU, whole run  # seconds 1-2: every node's devices first seen
        "peak_rss_mb": round(_status_kb("VmHWM") / 1024, 1),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_idle_mb": round(rss_idle_kb / 1024, 1),
        "rss_mb_by_second": rss_mb,
        "requests_per_simulated_s": round(sum(counts.values()) / seconds),
        **counts,
        "records": [f"{r.job_id} {r.kind.value}/{r.root_cause.value}/rank {r.culprit.rank}" for r in records][:20],
        "hang_detect_s": hang_s,
        "hang_detected_s_after_onset": hang_s,
        "culprit_ok": bool(hang) and hang[0].culprit.rank == gen.culprit
        and hang[0].root_cause.value == "rank_not_in_collective",
        "crash_detect_s": round(crash[0].detected_time - crash[0].onset_time, 2) if crash else None,
        "crash_ok": bool(crash) and crash[0].culprit.rank == 3,
    }
    result["hang_culprit_ok"] = result["culprit_ok"]
    if top:
        result["profile_top"] = top
    return result


def grpc_request_cost(ranks_per_request: int, n_requests: int = 10_000, threads: int = 4) -> dict:
    """Collector CPU per OTLP/gRPC request at the front door: an ``otel-gpu collector`` subprocess with only the OTLP
    gRPC receiver and a ``debug`` exporter gets heartbeat requests of ``ranks_per_request`` ranks each."""
    import threading

    import grpc
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from collector_proc import free_port, start_collector

    port = free_port()
    config = (f"receivers: {{otlp: {{grpc: {{endpoint: 127.0.0.1:{port}}}, http: null}}}}\n"
              "exporters: {debug: {}}\n"
              "service: {telemetry: {logs: {level: warning}}, pipelines: {logs: {receivers: [otlp], "
              "exporters: [debug]}}}\n")
    gen = _Generator(4096, time.time(), None, [])
    raws = [b for b in (gen.log_bytes(r, 2 + r % 2) for r in range(4096)) if b]
    reqs = [logs_service_pb2.ExportLogsServiceRequest.FromString(b"".join(raws[i:i + ranks_per_request]))
            for i in range(0, len(raws), ranks_per_request)]
    per_thread = max(1, n_requests // threads)

    def cpu_s(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def send(k: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = logs_service_pb2_grpc.LogsServiceStub(channel)
            for i in range(per_thread):
                stub.Export(reqs[(k * per_thread + i) % len(reqs)], timeout=10)

    with start_collector(config, tempfile.mkdtemp(prefix="otel-gpu-grpccost-")) as collector:
        send(0)  # warm up
        c0 = cpu_s(collector.pid)
        workers = [threading.Thread(target=send, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        cpu = cpu_s(collector.pid) - c0
    n = per_thread * threads
    return {"ranks_per_request": ranks_per_request, "requests": n, "collector_cpu_s": round(cpu, 2),
            "us_per_request": round(cpu / n * 1e6)}


def _floors(r: dict, hang_timeout_s: float) -> list[tuple[str, bool]]:
    """The floors that apply to one result (issue 7: 4,096 ranks per-rank; issue 20: digest mode)."""
    out: list[tuple[str, bool]] = []
    steady = r["steady_cpu_per_s"] or 0.0
    if r["mode"] == "per-rank" and r["ranks"] == FLOOR_RANKS and r["jobs"] == 1:
        cpu = max(r["cpu_per_simulated_s"], steady)  # the busier of the two
        out.append((f"{FLOOR_RANKS} ranks per-rank: < {FLOOR_CPU_PER_S} CPU s/s, < {FLOOR_RSS_MB:.0f} MB",
                    cpu < FLOOR_CPU_PER_S and r["peak_rss_mb"] < FLOOR_RSS_MB))
    if r["mode"] == "digest" and r["jobs"] == 1 and r["ranks"] in DIGEST_FLOORS:
        cpu_floor, rss_floor = DIGEST_FLOORS[r["ranks"]]
        out.append((f"{r['ranks']} ranks digest: steady <= {cpu_floor} CPU s/s", steady <= cpu_floor))
        if rss_floor is not None:
            out.append((f"{r['ranks']} ranks digest: peak RSS <= {rss_floor:.0f} MB", r["peak_rss_mb"] <= rss_floor))
    if r["hang_detect_s"] is not None:
        out.append((f"hang named <= hang timeout + 5 s ({hang_timeout_s + 5:.0f} s) with the right culprit",
                    r["culprit_ok"] and r["hang_detect_s"] <= hang_timeout_s + 5))
    if r["crash_detect_s"] is not None:
        out.append(("crash named <= 2 s with the right culprit", r["crash_ok"] and r["crash_detect_s"] <= 2.0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="*", default=[1024, 4096, 16384])
    ap.add_argument("--seconds", type=int, default=60, help="simulated seconds per job size")
    ap.add_argument("--hang-at", type=float, default=None,
                    help="simulated second the job hangs (default: seconds - 25; negative: no hang)")
    ap.add_argument("--node-refresh-s", type=int, default=30,
                    help="seconds between a node's metric requests (compact's metrics_refresh_s; 1: worst case)")
    ap.add_argument("--ranks-per-request", type=int, default=1, choices=range(1, RANKS_PER_NODE + 1),
                    metavar=f"1..{RANKS_PER_NODE}",
                    help="ranks of a node merged into one request (1: each rank's own export, as forwarded)")
    ap.add_argument("--nodes-per-request", type=int, default=1, metavar="K",
                    help="digest mode: K nodes' digests merged into one request, as a routing tier's batch "
                         "processor in front of the aggregator does (docs/scale.md); 1: one request per node digest")
    ap.add_argument("--mode", choices=["digest", "per-rank", "both"], default="both",
                    help="what the sidecars send: node digests (compact digests: true), every rank's own records, "
                         "or one run of each per size (default)")
    ap.add_argument("--jobs", type=int, default=1, help="jobs of --ranks ranks each on the one aggregator")
    ap.add_argument("--profile", action="store_true", help="cProfile the aggregator path; print the top entries")
    ap.add_argument("--grpc-cost", action="store_true",
                    help="instead: measure a collector's CPU per OTLP/gRPC request (1 and 8 ranks per request)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per size")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    hang_at = args.hang_at if args.hang_at is not None else max(5.0, args.seconds - 25.0)
    if hang_at < 0:
        hang_at = None
    if args.grpc_cost:
        for k in (1, 8):
            r = grpc_request_cost(k)
            print(json.dumps(r) if args.json else f"OTLP/gRPC front door, {k} rank(s) per request: "
                  f"{r['us_per_request']} us of collector CPU per request ({r['requests']} requests)", flush=True)
        return 0
    if args.child:
        print(json.dumps(run_one(args.ranks[0], args.seconds, hang_at, args.node_refresh_s,
                                 args.ranks_per_request, args.mode, args.jobs, args.profile,
                                 args.nodes_per_request)))
        return 0
    from otel_gpu.processors.attribution import AttributionConfig

    hang_timeout_s = AttributionConfig().hang_timeout_s
    modes = ["digest", "per-rank"] if args.mode == "both" else [args.mode]
    ok = True
    for n in args.ranks:
        for mode in modes:
            cmd = [sys.executable, __file__, "--child", "--ranks", str(n), "--seconds", str(args.seconds),
                   "--hang-at", str(hang_at if hang_at is not None else -1), "--node-refresh-s",
                   str(args.node_refresh_s), "--ranks-per-request", str(args.ranks_per_request), "--mode", mode,
                   "--jobs", str(args.jobs), "--nodes-per-request", str(args.nodes_per_request)] + (
                       ["--profile"] if args.profile else [])
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            floors = _floors(r, hang_timeout_s)
            r["floors_met"] = all(met for _, met in floors)
            ok = ok and r["floors_met"]
            if args.json:
                print(json.dumps(r), flush=True)
                continue
            per_req = f", {r['nodes_per_request']} nodes per request" if r.get("nodes_per_request", 1) != 1 else ""
            print(f"{r['ranks']:>6} ranks x {r['jobs']} job(s), {r['mode']}{per_req} ({r['nodes']} nodes, node metrics every "
                  f"{r['node_refresh_s']} s), {r['simulated_s']} simulated s: "
                  f"{r['cpu_per_simulated_s']:.3f} CPU s per simulated s (steady {r['steady_cpu_per_s']}, "
                  f"during the hang {r['cpu_per_simulated_s_hang']}), peak RSS {r['peak_rss_mb']:.0f} MB "
                  f"(idle collector {r['rss_idle_mb']:.0f} MB), {r['requests_per_simulated_s']} requests/s; "
                  f"hang named {r['hang_detect_s']} s after onset, culprit ok: {r['culprit_ok']}; crash named "
                  f"{r['crash_detect_s']} s after it, culprit ok: {r['crash_ok']}; wall {r['wall_s']} s", flush=True)
            for name, met in floors:
                print(f"  floor {name}: {'met' if met else 'NOT met'}")
            for line in r.get("profile_top", []):
                print("  " + line)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
