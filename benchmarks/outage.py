"""Backend outage while a load runs: does the collector's persistent sending queue lose anything?

A real ``otel-gpu collector`` subprocess (otlp receiver -> otlp exporter with ``sending_queue.persistent``) forwards
to an :class:`~otel_gpu.testing.otlp_sink.OtlpSink`. A load thread sends spans (unique span ids) and failure-record log
events (``otel_gpu.failure``, unique ``record.id``) at a fixed rate; ``outage_at_s`` into the load the sink stops for
``outage_s`` seconds, then a new sink comes back on the same port. Afterwards we wait until every id arrived (or a
deadline) and count, by unique id, what was lost and what arrived twice (delivery is at-least-once).

Usage::

    python benchmarks/outage.py --outage-s 60 --load-s 75           # the 60 s case of issue 7
    python benchmarks/outage.py --outage-s 8 --load-s 12 --json     # what tests/test_outage.py runs

Measured on the 2-core CI machine (2026-12-03, shared with other jobs; load average ~6), queue on local disk,
``sync: normal``:

| command | outage | load | lost | dup | all delivered after the backend returned |
|---|---|---|---|---|---|
| ``--outage-s 60 --load-s 75 --outage-at-s 5`` | 60 s | 75,000 spans + 750 failure records (1,000 spans/s) | 0 + 0 | 0 | 10.3 s and 10.1 s in two runs (0.26 s / 0.09 s after the load ended) |
| same, before the exporter's reconnect backoff was capped (gRPC default: up to 120 s) | 60 s | same | 0 + 0 | 0 | 27.2 s |
| ``--outage-s 6 --load-s 12 --outage-at-s 2 --rate-hz 300`` | 6 s | 72,000 spans + 720 records (6,000 spans/s) | 0 + 0 | 0 | 4.3 s (0.25 s after the load ended) |
| ``--outage-s 8 --load-s 12 --outage-at-s 2`` (the CI test) | 8 s | 12,000 spans + 120 records | 0 + 0 | 0 | 3.7 s |

The load client's slowest call stayed under 0.6 s in every run (receivers never wait for the backend).

Example (from Python; tests/test_outage.py does this)::

    from outage import run_outage
    result = run_outage(tmp_path, outage_s=8, load_s=12)
    assert result["spans_lost"] == 0
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests"))  # collector_proc: the collector-subprocess helper the tests use

import grpc  # noqa: E402
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

from collector_proc import free_port, start_collector  # noqa: E402
from otel_gpu.testing.otlp_sink import OtlpSink  # noqa: E402

__all__ = ["collector_config", "run_outage", "send_load"]

FORWARDER = "outage-forwarder-token"  # the relay trusts the load generator as a forwarder
TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
LOGS_METHOD = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"
FAILURE_EVENT = "otel_gpu.failure"


def collector_config(recv_port: int, sink_port: int, queue_dir: Path, *, max_size_mib: float = 256,
                     queue_size: int = 100000) -> str:
    """A pass-through collector whose otlp exporter keeps its queue under ``queue_dir``."""
    return f"""
receivers:
  # The load carries failure records, which a collector takes only from a trusted forwarder (docs/security.md).
  otlp: {{grpc: {{endpoint: "127.0.0.1:{recv_port}"}}, http: null, trusted_forwarders: {{bearer_token: {FORWARDER}}}}}
exporters:
  otlp:
    endpoint: "127.0.0.1:{sink_port}"
    compression: none
    timeout: 2s
    retry_on_failure: {{initial_interval: 200ms, max_interval: 1s, max_elapsed_time: 0s}}
    sending_queue:
      num_consumers: 4
      queue_size: {queue_size}
      persistent: {{path: "{queue_dir}", max_size_mib: {max_size_mib}}}
service:
  pipelines:
    traces: {{receivers: [otlp], exporters: [otlp]}}
    logs: {{receivers: [otlp], exporters: [otlp]}}
    metrics: {{receivers: [otlp], exporters: [otlp]}}
"""


def trace_request(first_id: int, n: int) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(first_id, first_id + n):
        sp = ss.spans.add()
        sp.trace_id = struct.pack(">QQ", 7, i // 1000)
        sp.span_id = struct.pack(">Q", i + 1)
        sp.name = "load"
        sp.start_time_unix_nano = time.time_ns()
        sp.end_time_unix_nano = sp.start_time_unix_nano + 1000
    return req.SerializeToString()


def failure_request(record_id: int) -> bytes:
    req = logs_service_pb2.ExportLogsServiceRequest()
    lr = req.resource_logs.add().scope_logs.add().log_records.add()
    lr.event_name = FAILURE_EVENT
    lr.time_unix_nano = time.time_ns()
    kv = lr.attributes.add()
    kv.key = "record.id"
    kv.value.int_value = record_id
    lr.body.string_value = json.dumps({"kind": "crash", "root_cause": "unknown", "record_id": record_id})
    return req.SerializeToString()


def span_ids(sink: OtlpSink) -> set[int]:
    return {struct.unpack(">Q", s.span_id)[0] - 1 for s in sink.spans()}


def record_ids(sink: OtlpSink) -> set[int]:
    out = set()
    for lr in sink.log_records():
        if lr.event_name == FAILURE_EVENT:
            out.update(kv.value.int_value for kv in lr.attributes if kv.key == "record.id")
    return out


def send_load(endpoint: str, duration_s: float, rate_hz: float, spans_per_request: int, records_every: int,
              stop: threading.Event | None = None) -> dict:
    """Sends for ``duration_s``; a refused request is re-sent (we measure the collector, not the client)."""
    channel = grpc.insecure_channel(endpoint)
    traces = channel.unary_unary(TRACE_METHOD, request_serializer=None, response_deserializer=None)
    logs = channel.unary_unary(LOGS_METHOD, request_serializer=None, response_deserializer=None)
    sent = {"spans": 0, "records": 0, "requests": 0, "client_retries": 0, "max_call_s": 0.0}
    start = time.monotonic()
    k = 0
    try:
        while time.monotonic() - start < duration_s and not (stop and stop.is_set()):
            calls = [(traces, trace_request(sent["spans"], spans_per_request))]
            if k % records_every == 0:
                calls.append((logs, failure_request(sent["records"])))
            for call, body in calls:
                for _ in range(50):
                    t0 = time.monotonic()
                    try:
                        call(body, timeout=5, metadata=(("authorization", f"Bearer {FORWARDER}"),))
                        break
                    except grpc.RpcError:
                        sent["client_retries"] += 1
                        time.sleep(0.1)
                    finally:
                        sent["max_call_s"] = max(sent["max_call_s"], time.monotonic() - t0)
            sent["spans"] += spans_per_request
            sent["records"] += 1 if k % records_every == 0 else 0
            sent["requests"] += 1
            k += 1
            next_at = start + k / rate_hz
            time.sleep(max(0.0, next_at - time.monotonic()))
    finally:
        channel.close()
    return sent


def run_outage(tmp: Path | str, *, outage_s: float, load_s: float, outage_at_s: float = 2.0, rate_hz: float = 50,
               spans_per_request: int = 20, records_every: int = 5, drain_timeout_s: float = 60) -> dict:
    """Runs the scenario of the module docstring; returns the counts (``*_lost`` must be 0)."""
    tmp = Path(tmp)
    sink_port, recv_port = free_port(), free_port()
    sinks = [OtlpSink(port=sink_port).start()]
    text = collector_config(recv_port, sink_port, tmp / "queue")
    collector = start_collector(text, tmp / "collector")
    try:
        result: dict = {}
        load = threading.Thread(target=lambda: result.update(send_load(
            f"127.0.0.1:{recv_port}", load_s, rate_hz, spans_per_request, records_every)), daemon=True)
        t_start = time.monotonic()
        load.start()
        time.sleep(outage_at_s)
        sinks[0].stop()
        t_down = time.monotonic()
        time.sleep(outage_s)
        sinks.append(OtlpSink(port=sink_port).start())
        t_up = time.monotonic()
        load.join(load_s + 120)
        t_load_end = time.monotonic()

        def union(fn):
            return set().union(*(fn(s) for s in sinks))

        def complete(_s=None) -> bool:
            return (len(union(span_ids)) >= result.get("spans", 0)
                    and len(union(record_ids)) >= result.get("records", 0))

        sinks[-1].wait_for(complete, drain_timeout_s)
        t_done = time.monotonic()
        got_spans, got_records = union(span_ids), union(record_ids)
        total_spans = sum(s.span_count() for s in sinks)
        result.update({
            "outage_s": round(t_up - t_down, 2), "load_s": round(t_load_end - t_start, 2),
            "spans_sent": result["spans"], "records_sent": result["records"],
            "spans_received_unique": len(got_spans), "records_received_unique": len(got_records),
            "spans_lost": len(set(range(result["spans"])) - got_spans),
            "records_lost": len(set(range(result["records"])) - got_records),
            "span_duplicates": total_spans - len(got_spans),
            "drained_s_after_load": round(t_done - t_load_end, 2),
            "all_delivered_s_after_backend_returned": round(t_done - t_up, 2),
            "collector_alive": collector.alive,
        })
        return result
    finally:
        collector.stop()
        for s in sinks:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outage-s", type=float, default=60)
    ap.add_argument("--load-s", type=float, default=75)
    ap.add_argument("--outage-at-s", type=float, default=5)
    ap.add_argument("--rate-hz", type=float, default=50, help="trace requests per second")
    ap.add_argument("--spans-per-request", type=int, default=20)
    ap.add_argument("--records-every", type=int, default=5, help="one failure record per N trace requests")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = run_outage(tmp, outage_s=args.outage_s, load_s=args.load_s, outage_at_s=args.outage_at_s,
                         rate_hz=args.rate_hz, spans_per_request=args.spans_per_request,
                         records_every=args.records_every, drain_timeout_s=max(60.0, args.outage_s * 2))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k:42s} {v}")


if __name__ == "__main__":
    main()
