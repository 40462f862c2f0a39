"""Cost of the otlp receiver's trace/span id check (issue 13, item 8) next to what every request costs anyway.

Per request of N spans (10 attributes each), best of several rounds, in one run so that the ratio is fair:
parse (``Batch.from_bytes``, what the receiver always did) vs parse + ``check_ids``. Prints microseconds per span.

Usage: python benchmarks/otlp_id_check.py [--spans 1000] [--rounds 7]
"""
from __future__ import annotations

import argparse
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_gpu.pdata import Batch, Signal
from otel_gpu.receivers.otlp._ids import check_ids


def request(n: int) -> bytes:
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(n):
        sp = ss.spans.add(name="otel_gpu.collective", trace_id=(i + 1).to_bytes(16, "big"),
                          span_id=(i + 1).to_bytes(8, "big"), parent_span_id=b"\1" * 8)
        for k in range(10):
            sp.attributes.add(key=f"k{k}").value.string_value = "v" * 20
    return req.SerializeToString()


def best(fn, rounds: int, inner: int = 10) -> float:
    out = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out = min(out, (time.perf_counter() - t0) / inner)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    raw = request(args.spans)

    def parse():
        return Batch.from_bytes(Signal.TRACES, raw).message

    def parse_and_check():
        check_ids(Signal.TRACES, Batch.from_bytes(Signal.TRACES, raw).message)

    a, b = 0.0, 0.0
    for _ in range(3):  # interleaved, so that load on a shared machine hits both alike
        a_, b_ = best(parse, args.rounds), best(parse_and_check, args.rounds)
        a, b = (a_ if not a else min(a, a_)), (b_ if not b else min(b, b_))
    n = args.spans
    print(f"{n} spans/request: parse {a / n * 1e6:.2f} us/span, parse + id check {b / n * 1e6:.2f} us/span "
          f"(check adds {(b - a) / n * 1e6:.2f} us/span, x{b / a:.2f})")


if __name__ == "__main__":
    main()
