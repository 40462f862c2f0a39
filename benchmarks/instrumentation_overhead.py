"""Cost of the instrumentation, in one run: per-collective hot-path cost and a DDP training step.

Example:
    /work/venv/bin/python benchmarks/instrumentation_overhead.py            # ~1-2 min on 2 cores
    /work/venv/bin/python benchmarks/instrumentation_overhead.py --quick

Part 1 (hot path, one process): the wrapper generated for ``dist.all_reduce`` around a no-op with the same
signature (so only the wrapper is timed), against the bare no-op, a minimal hand-written wrapper that stores a tuple
into a preallocated list (the floor any wrapper pays), and one OpenTelemetry SDK span (BatchSpanProcessor, null
exporter). Then a real 1-rank gloo all_reduce, instrumented and not.

Part 2 (DDP, 2 gloo ranks): median step time of a small MLP under DDP, uninstrumented vs instrumented (flight
recorder on, exporting to an OTLP sink), jobs alternated A B A B to spread machine noise.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def _best_ns_per_call(fn, n: int, reps: int, between=None) -> float:
    best = float("inf")
    for _ in range(reps):
        if between:
            between()
        gc.disable()
        t0 = time.perf_counter_ns()
        fn(n)
        dt = time.perf_counter_ns() - t0
        gc.enable()
        best = min(best, dt / n)
    return best


def hot_path(n: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from otel_gpu.instrumentation import _hot

    def noop(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return None

    pg_stub = object()  # a group object, as the wrapper sees one
    t = torch.ones(16)
    _hot.reset(1 << 21)
    wrapped = _hot.make_collective(noop, "all_reduce", nbytes="tensor.nbytes", dtype="tensor.dtype")
    _hot.NS["_on"] = True

    def drain():
        _hot.NS["_buf"][:] = [None] * _hot.NS["_N"]
        _hot.NS["_w"] = _hot.NS["_r"] = 0
        _hot.NS["_seq"].clear()

    def loop_bare(k):
        for _ in range(k):
            noop(t, group=pg_stub)

    def loop_wrapped(k):
        for _ in range(k):
            wrapped(t, group=pg_stub)

    buf = [None] * (1 << 21)
    idx = [0]

    def minimal(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        t0 = time.time_ns()
        r = noop(tensor, op, group, async_op)
        i = idx[0]
        buf[i] = (t0, time.time_ns(), group)
        idx[0] = i + 1
        return r

    def loop_minimal(k):
        idx[0] = 0
        for _ in range(k):
            minimal(t, group=pg_stub)

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class NullExporter(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(NullExporter(), max_queue_size=1 << 16))
    tracer = provider.get_tracer("bench")

    def loop_sdk(k):
        for _ in range(k):
            with tracer.start_as_current_span("otel_gpu.collective", attributes={
                    "collective.op": "all_reduce", "collective.seq": 1, "collective.bytes": 64}):
                noop(t, group=pg_stub)

    bare = _best_ns_per_call(loop_bare, n, reps)
    minimal_ns = _best_ns_per_call(loop_minimal, n, reps)
    wrapped_ns = _best_ns_per_call(loop_wrapped, n, reps, between=drain)
    _hot.NS["_on"] = False
    off_ns = _best_ns_per_call(loop_wrapped, n, reps)
    sdk_ns = _best_ns_per_call(loop_sdk, max(n // 10, 1000), reps)
    provider.shutdown()
    return {"noop_call_ns": bare, "minimal_wrapper_ns": minimal_ns, "instrumented_wrapper_ns": wrapped_ns,
            "uninstrumented_wrapper_off_ns": off_ns, "sdk_span_ns": sdk_ns,
            "added_per_collective_ns": wrapped_ns - bare, "minimal_added_ns": minimal_ns - bare,
            "sdk_added_ns": sdk_ns - bare}


def real_all_reduce(n: int, reps: int) -> dict:
    """World size 1 gloo all_reduce (a few us) instrumented vs not, in this process."""
    import torch
    import torch.distributed as dist

    import otel_gpu

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"  # nothing there: records are dropped
    otel_gpu.instrument(flight_recorder=False, crash_hooks=False)
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(16)

    def loop(k):
        for _ in range(k):
            dist.all_reduce(t)

    on = _best_ns_per_call(loop, n, reps)
    otel_gpu.uninstrument()
    off = _best_ns_per_call(loop, n, reps)
    dist.destroy_process_group()
    return {"gloo_all_reduce_ns": off, "gloo_all_reduce_instrumented_ns": on}


# ------------------------------------------------------------------------------------------------ DDP
def ddp_worker(rank: int, world: int, port: int, steps: int, instrumented, out_path: str) -> None:
    """instrumented: True, False, or "alternate" (blocks of 40 steps, instrumented and not, same processes)."""
    import torch
    import torch.distributed as dist

    import otel_gpu

    if instrumented:
        otel_gpu.instrument()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10)), bucket_cap_mb=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    times = []
    block = 40
    for i in range(steps):
        if instrumented == "alternate" and i % block == 0:
            on = (i // block) % 2 == 0
            if on and not otel_gpu.instrumentation.is_instrumented():
                otel_gpu.instrument()
            elif not on and otel_gpu.instrumentation.is_instrumented():
                otel_gpu.uninstrument()
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        dt = time.perf_counter() - t0
        if instrumented == "alternate":
            times.append((dt, otel_gpu.instrumentation.is_instrumented(), i % block >= 5))
        else:
            times.append(dt)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(times, fh)
    dist.destroy_process_group()


def ddp_job(steps: int, instrumented: bool, endpoint: str) -> list[float]:
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
    code = ("import sys, torch.multiprocessing as mp; sys.path.insert(0, %r); import instrumentation_overhead as b; "
            "mp.spawn(b.ddp_worker, args=(2, %d, %d, %r, %r), nprocs=2)"
            % (os.path.dirname(os.path.abspath(__file__)), port, steps, instrumented, out))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600,
                   stderr=subprocess.DEVNULL)
    with open(out) as fh:
        times = json.load(fh)
    os.unlink(out)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--alternate-only", action="store_true", help="only the same-job DDP comparison")
    args = parser.parse_args()
    n, reps = (20000, 3) if args.quick else (200000, 5)
    if not args.alternate_only:
        micro(n, reps)
    if args.quick:
        return
    ddp(args)


def micro(n: int, reps: int) -> None:
    hp = hot_path(n, reps)
    print("== hot path, ns per call (best of %d x %d calls) ==" % (reps, n))
    for k, v in hp.items():
        print(f"  {k:32s} {v:10.1f}")
    print(f"  instrumented / minimal-wrapper added cost: {hp['added_per_collective_ns'] / hp['minimal_added_ns']:.2f}x;"
          f" SDK span / instrumented added cost: {hp['sdk_added_ns'] / hp['added_per_collective_ns']:.1f}x")
    ra = real_all_reduce(max(n // 20, 2000), reps)
    print("== real gloo all_reduce, world size 1, ns per call ==")
    for k, v in ra.items():
        print(f"  {k:32s} {v:10.1f}")
    print(f"  ratio instrumented/plain: {ra['gloo_all_reduce_instrumented_ns'] / ra['gloo_all_reduce_ns']:.3f}")


def ddp(args) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from otel_gpu.testing.otlp_sink import OtlpSink

    warm = args.steps // 5
    plain, inst = [], []
    with OtlpSink() as sink:
        for _ in range(0 if args.alternate_only else args.pairs):
            plain.extend(ddp_job(args.steps, False, sink.endpoint)[warm:])
            inst.extend(ddp_job(args.steps, True, sink.endpoint)[warm:])
        spans = sink.span_count()
    mp_, mi = (statistics.median(plain), statistics.median(inst)) if plain else (float("nan"),) * 2
    print("== DDP step (2 gloo ranks, MLP 512-1024-1024-10, batch 64), rank 0, after %d warm-up steps ==" % warm)
    if plain:
        print("  separate jobs, alternated A B A B (includes the flight recorder's own C++ cost):")
        print(f"  uninstrumented median {mp_ * 1e3:8.3f} ms  (n={len(plain)})")
        print(f"  instrumented   median {mi * 1e3:8.3f} ms  (n={len(inst)}, spans received by the sink: {spans})")
        print(f"  ratio instrumented/uninstrumented: {mi / mp_:.4f}")
    with OtlpSink() as sink:
        alt = ddp_job(args.steps * 2, "alternate", sink.endpoint)
    on = [dt for dt, inst_, steady in alt[2 * 40:] if inst_ and steady]
    off = [dt for dt, inst_, steady in alt[2 * 40:] if not inst_ and steady]
    print("  same job, blocks of 40 steps instrumented / uninstrumented in turn (flight recorder on throughout; "
          "first 5 steps of each block skipped):")
    print(f"  uninstrumented median {statistics.median(off) * 1e3:8.3f} ms  (n={len(off)})")
    print(f"  instrumented   median {statistics.median(on) * 1e3:8.3f} ms  (n={len(on)})")
    print(f"  ratio instrumented/uninstrumented: {statistics.median(on) / statistics.median(off):.4f}")


if __name__ == "__main__":
    main()
