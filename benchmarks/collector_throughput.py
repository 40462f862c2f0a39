"""Collector pass-through throughput: OTLP/gRPC in -> ``otlp`` exporter out, measured in collector CPU time.

A bounded load generator sends one pre-encoded OTLP trace request (1,000 spans of about 10 attributes each) over
gRPC, ``--batches`` times from ``--concurrency`` threads, to an ``otel-gpu collector`` subprocess whose only pipeline
is ``otlp`` receiver -> ``otlp`` exporter, which forwards to an OtlpSink running in a third process. It prints the
end-to-end spans/s and the collector's CPU seconds (user + system, from /proc/<pid>/stat) per 100k spans.
Floor (issue 2): >= 150,000 spans/s per collector CPU core, i.e. <= 0.667 collector CPU-seconds per 100k spans.

``--pipeline default`` runs the collector with its built-in default config instead (only the ports and the store
path moved): otlp -> memory_limiter, attribution, goodput -> store (+ prometheus for metrics), fed with what training
ranks send: per rank, collective spans with the instrumentation's attributes and one step span per 50 collectives
(step numbers advancing), 8 ranks of one job. The receiver runs the pipeline before it answers, so the load is done
when the last request returns. Floor (issue 10): >= 100,000 collective spans/s per collector core.

Example:
    .venv/bin/python benchmarks/collector_throughput.py                  # 300 batches = 300k spans
    .venv/bin/python benchmarks/collector_throughput.py --batches 500 --compression gzip --json
    .venv/bin/python benchmarks/collector_throughput.py --pipeline default
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests"))  # collector_proc: the collector-subprocess helper the tests use

FLOOR_SPANS_PER_CORE_S = 150_000
FLOOR_DEFAULT_PIPELINE = 100_000
TRACES_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def encoded_batch(n_spans: int = 1000, n_attrs: int = 10) -> bytes:
    """One ExportTraceServiceRequest as a training job's spans look: collectives on 8 ranks."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for key, value in (("service.name", "trainer"), ("host.name", "node-0017"), ("otel_gpu.job.id", "job-42")):
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = key, value
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "otel_gpu.instrumentation", "0.1.0"
    t0 = 1_750_000_000_000_000_000
    for i in range(n_spans):
        span = ss.spans.add()
        span.trace_id = (i // 100 + 1).to_bytes(16, "big")  # an all-zero trace id is invalid (refused)
        span.span_id = (i + 1).to_bytes(8, "big")
        span.parent_span_id = (i // 100 * 100 + 1).to_bytes(8, "big")
        span.name = "collective.all_reduce"
        span.kind = 1
        span.start_time_unix_nano = t0 + i * 1_000_000
        span.end_time_unix_nano = t0 + i * 1_000_000 + 650_000
        attrs = [("rank", i % 8), ("otel_gpu.collective.seq", i), ("otel_gpu.collective.op", "all_reduce"),
                 ("otel_gpu.collective.bytes", 262144), ("otel_gpu.process_group", "default_pg"),
                 ("otel_gpu.collective.backend", "nccl"), ("otel_gpu.step", i // 50), ("otel_gpu.gpu.index", i % 8),
                 ("otel_gpu.collective.duration_ms", 0.65), ("otel_gpu.collective.dtype", "bfloat16")][:n_attrs]
        for key, value in attrs:
            kv = span.attributes.add()
            kv.key = key
            if isinstance(value, str):
                kv.value.string_value = value
            elif isinstance(value, float):
                kv.value.double_value = value
            else:
                kv.value.int_value = value
    return req.SerializeToString()


def training_batches(n_batches: int, n_spans: int = 1000, ranks: int = 8) -> list[bytes]:
    """What ranks of one job send: per request one rank's collective spans (instrumentation attributes, DDP-sized
    all-reduces, sequence numbers advancing) and a step span every 50 collectives."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from otel_gpu.schema import identity as I
    from otel_gpu.schema import training as T

    out = []
    seq = [0] * ranks
    step = [0] * ranks
    # Live times (10 min ago onwards): the goodput processor refuses spans outside its window around receipt
    # (time_window_past 24h), and a fixed 2025 date would measure a pipeline that skips its accounting.
    t = [time.time_ns() - 600 * 1_000_000_000] * ranks
    for b in range(n_batches):
        rank = b % ranks
        req = trace_service_pb2.ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        for key, value in ((I.SERVICE_NAME, "trainer"), (I.HOST_NAME, f"node-{rank // 8:04d}"),
                           (I.JOB_ID, "job-42"), (I.RANK, rank), (I.LOCAL_RANK, rank % 8),
                           (I.WORLD_SIZE, ranks), (I.PROCESS_PID, 4000 + rank), (I.RESTART_COUNT, 0)):
            kv = rs.resource.attributes.add()
            kv.key = str(key)
            if isinstance(value, int):
                kv.value.int_value = value
            else:
                kv.value.string_value = value
        ss = rs.scope_spans.add()
        ss.scope.name, ss.scope.version = "otel_gpu.instrumentation", "0.1.0"
        for i in range(n_spans):
            span = ss.spans.add()
            span.trace_id = (b + 1).to_bytes(16, "big")
            span.span_id = (i + 1).to_bytes(8, "big")
            span.start_time_unix_nano = t[rank]
            if i % 50 == 49:  # a step span closes every 50 collectives
                step[rank] += 1
                span.name = T.STEP_SPAN.name
                span.start_time_unix_nano = t[rank] - 50 * 1_000_000
                span.end_time_unix_nano = t[rank]
                attrs = [(T.STEP, step[rank]), (T.STEP_COLLECTIVE_S, 0.03), (T.STEP_DATA_S, 0.001),
                         (T.STEP_CHECKPOINT_S, 0.0)]
            else:
                seq[rank] += 1
                span.name = T.COLLECTIVE_SPAN.name
                span.end_time_unix_nano = t[rank] + 650_000
                attrs = [(T.COLL_OP, "all_reduce"), (T.COLL_PG, "0"), (T.COLL_PG_SIZE, ranks), (T.COLL_SEQ, seq[rank]),
                         (T.COLL_BYTES, 26_214_400), (T.COLL_DTYPE, "bfloat16"), (T.COLL_ASYNC, True),
                         (T.COLL_SOURCE, "flight_recorder"), (T.COLL_DURATION_KNOWN, True), (T.STEP, step[rank] + 1)]
            t[rank] += 1_000_000
            for key, value in attrs:
                kv = span.attributes.add()
                kv.key = str(key)
                if isinstance(value, bool):
                    kv.value.bool_value = value
                elif isinstance(value, str):
                    kv.value.string_value = value
                elif isinstance(value, float):
                    kv.value.double_value = value
                else:
                    kv.value.int_value = value
        out.append(req.SerializeToString())
    return out


def _sink_main(port_queue, counter, stop) -> None:
    """A counting OtlpSink (it keeps counts, not requests, so a long run cannot fill memory)."""
    from otel_gpu.testing.otlp_sink import OtlpSink

    class CountingSink(OtlpSink):
        def _record(self, store, request, context):
            n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            with counter.get_lock():
                counter.value += n

    sink = CountingSink(max_workers=4).start()
    port_queue.put(sink.port)
    stop.wait()
    sink.stop()


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces; fields after it start at #3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _send(port: int, body: bytes | list[bytes], batches: int, concurrency: int) -> None:
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)])
    export = channel.unary_unary(TRACES_EXPORT)
    bodies = body if isinstance(body, list) else None
    todo = iter(bodies if bodies is not None else [body] * batches)
    lock = threading.Lock()
    errors: list[Exception] = []

    def worker() -> None:
        while True:
            with lock:
                item = next(todo, None)
                if item is None:
                    return
            try:
                export(item, timeout=30)
            except grpc.RpcError as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.close()
    if errors:
        raise RuntimeError(f"load generator: {errors[0]}")


def run(batches: int, concurrency: int, compression: str, spans_per_batch: int, warmup: int) -> dict:
    from collector_proc import free_port, start_collector

    ctx = mp.get_context("spawn")
    port_queue, counter, stop = ctx.Queue(), ctx.Value("q", 0), ctx.Event()
    sink = ctx.Process(target=_sink_main, args=(port_queue, counter, stop), daemon=True)
    sink.start()
    sink_port = port_queue.get(timeout=30)
    grpc_port = free_port()
    config = f"""
receivers:
  otlp:
    grpc: {{endpoint: "127.0.0.1:{grpc_port}", max_recv_msg_size_mib: 64}}
    http: null
exporters:
  otlp:
    endpoint: "127.0.0.1:{sink_port}"
    compression: {compression}
    sending_queue: {{queue_size: 1000, num_consumers: 4}}
service:
  telemetry: {{logs: {{level: warning}}}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [otlp]}}
"""
    body = encoded_batch(spans_per_batch)
    with tempfile.TemporaryDirectory() as tmp:
        collector = start_collector(config, tmp)
        try:
            def wait_count(n: int, timeout_s: float) -> None:
                deadline = time.monotonic() + timeout_s
                while counter.value < n:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"sink got {counter.value} of {n} spans:\n{collector.stderr_text()[-2000:]}")
                    time.sleep(0.005)

            _send(grpc_port, body, warmup, concurrency)
            wait_count(warmup * spans_per_batch, 60)
            cpu0, t0 = _cpu_seconds(collector.pid), time.monotonic()
            _send(grpc_port, body, batches, concurrency)
            wait_count((warmup + batches) * spans_per_batch, 120)
            wall = time.monotonic() - t0
            cpu = _cpu_seconds(collector.pid) - cpu0
            assert counter.value == (warmup + batches) * spans_per_batch
        finally:
            rc = collector.stop()
            stop.set()
            sink.join(10)
    spans = batches * spans_per_batch
    per_core = spans / cpu if cpu > 0 else float("inf")
    return {
        "spans": spans, "batch_bytes": len(body), "spans_per_batch": spans_per_batch, "concurrency": concurrency,
        "compression": compression, "wall_s": round(wall, 3), "spans_per_s": round(spans / wall),
        "collector_cpu_s": round(cpu, 3), "collector_cpu_s_per_100k_spans": round(cpu / spans * 100_000, 4),
        "spans_per_collector_cpu_s": round(per_core), "floor_spans_per_core_s": FLOOR_SPANS_PER_CORE_S,
        "meets_floor": per_core >= FLOOR_SPANS_PER_CORE_S, "collector_exit_code": rc, "host_cpus": os.cpu_count(),
    }


def run_default(batches: int, concurrency: int, spans_per_batch: int, warmup: int) -> dict:
    """The built-in default pipeline (issue 10): otlp -> memory_limiter, attribution, goodput -> store/prometheus."""
    from collector_proc import free_port, start_collector

    from otel_gpu.collector.config import DEFAULT_CONFIG_TEXT

    grpc_port = free_port()
    config = DEFAULT_CONFIG_TEXT
    for old, new in (("127.0.0.1:4317", grpc_port), ("127.0.0.1:4318", free_port()),
                     ("127.0.0.1:9464", free_port())):
        config = config.replace(old, f"127.0.0.1:{new}")
    bodies = training_batches(warmup + batches, spans_per_batch)
    collectives = sum(1 for i in range(spans_per_batch) if i % 50 != 49) * batches
    with tempfile.TemporaryDirectory() as tmp:
        collector = start_collector(config, tmp)  # cwd tmp: the store lands in tmp/otel-gpu-data
        try:
            _send(grpc_port, bodies[:warmup], warmup, concurrency)
            cpu0, t0 = _cpu_seconds(collector.pid), time.monotonic()
            _send(grpc_port, bodies[warmup:], batches, concurrency)
            wall = time.monotonic() - t0
            cpu = _cpu_seconds(collector.pid) - cpu0
            if not collector.alive:
                raise RuntimeError(f"collector died:\n{collector.stderr_text()[-2000:]}")
        finally:
            rc = collector.stop()
    spans = batches * spans_per_batch
    per_core = collectives / cpu if cpu > 0 else float("inf")
    return {
        "pipeline": "default", "spans": spans, "collective_spans": collectives, "batch_bytes": len(bodies[-1]),
        "spans_per_batch": spans_per_batch, "concurrency": concurrency, "wall_s": round(wall, 3),
        "spans_per_s": round(spans / wall), "collector_cpu_s": round(cpu, 3),
        "collector_cpu_s_per_100k_spans": round(cpu / spans * 100_000, 4),
        "spans_per_collector_cpu_s": round(spans / cpu) if cpu > 0 else None,
        "collective_spans_per_collector_cpu_s": round(per_core), "floor_spans_per_core_s": FLOOR_DEFAULT_PIPELINE,
        "meets_floor": per_core >= FLOOR_DEFAULT_PIPELINE, "collector_exit_code": rc, "host_cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=300, help="requests to send after warm-up (default 300)")
    parser.add_argument("--spans-per-batch", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4, help="sender threads (default 4)")
    parser.add_argument("--warmup", type=int, default=20, help="requests sent before measuring (default 20)")
    parser.add_argument("--compression", choices=("none", "gzip"), default="none",
                        help="the collector's exporter compression (default none: loopback)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--pipeline", choices=("passthrough", "default"), default="passthrough",
                        help="passthrough: otlp -> otlp exporter (issue 2); default: the built-in default config")
    args = parser.parse_args(argv)
    if not 1 <= args.batches <= 100_000 or not 1 <= args.concurrency <= 64:
        parser.error("--batches must be within 1..100000 and --concurrency within 1..64")
    if args.pipeline == "default":
        result = run_default(args.batches, args.concurrency, args.spans_per_batch, args.warmup)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"default pipeline (otlp -> memory_limiter, attribution, goodput -> store): {result['spans']:,} "
                  f"spans ({result['collective_spans']:,} collective) in {args.batches} requests from 8 ranks, "
                  f"{args.concurrency} senders, {result['host_cpus']} host CPUs")
            print(f"end-to-end throughput:        {result['spans_per_s']:>12,} spans/s ({result['wall_s']} s)")
            print(f"collector CPU:                {result['collector_cpu_s']:>12} s "
                  f"= {result['collector_cpu_s_per_100k_spans']} CPU-s per 100k spans")
            print(f"collective spans per collector CPU core: {result['collective_spans_per_collector_cpu_s']:>12,}/s "
                  f"(floor {FLOOR_DEFAULT_PIPELINE:,}: {'PASS' if result['meets_floor'] else 'FAIL'})")
        return 0 if result["meets_floor"] else 1
    result = run(args.batches, args.concurrency, args.compression, args.spans_per_batch, args.warmup)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"sent {result['spans']:,} spans in {args.batches} requests of {result['spans_per_batch']} spans "
              f"({result['batch_bytes']:,} bytes), {args.concurrency} senders, exporter compression "
              f"{args.compression}, {result['host_cpus']} host CPUs")
        print(f"end-to-end throughput:        {result['spans_per_s']:>12,} spans/s ({result['wall_s']} s)")
        print(f"collector CPU:                {result['collector_cpu_s']:>12} s "
              f"= {result['collector_cpu_s_per_100k_spans']} CPU-s per 100k spans")
        print(f"spans per collector CPU core: {result['spans_per_collector_cpu_s']:>12,} spans/s "
              f"(floor {FLOOR_SPANS_PER_CORE_S:,}: {'PASS' if result['meets_floor'] else 'FAIL'})")
    return 0 if result["meets_floor"] else 1


if __name__ == "__main__":
    sys.exit(main())
