"""Failure records answered 200, then SIGKILL: how many the store still holds, and at what rate they were answered.

A real ``otel-gpu collector`` (otlp -> goodput -> store, verdict; the config of tests/test_store_faults.py) takes
``--senders`` x ``--requests`` OTLP/gRPC log requests of ``--records`` failure records each; once every one is
answered OK the collector is SIGKILLed and the store reopened. Prints one JSON line per ``durable_timeout`` given.
Floor (issue 21): 0 acknowledged failure records lost with the default ``durable_timeout`` (2s).

Example:
    .venv/bin/python benchmarks/store_durability.py 0 2s     # the old behaviour (no wait), then the default
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests"))  # collector_proc and the store-fault tests' config

LOGS_EXPORT = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"


def run(durable: str, senders: int = 8, requests: int = 40, records: int = 50) -> dict:
    import grpc
    from collector_proc import start_collector
    from test_store_faults import AS_FORWARDER, Ports, config, failures_request

    from otel_gpu.exporters.store import db

    tmp = Path(tempfile.mkdtemp(prefix="otel-gpu-durability-"))
    store, ports = tmp / "store", Ports()
    proc = start_collector(config(ports, store, durable_timeout=durable), tmp / "c")
    acked, lock = [0], threading.Lock()
    payloads = [[failures_request("job-k", records, start=(k * requests + i) * records).SerializeToString()
                 for i in range(requests)] for k in range(senders)]

    def sender(k: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
            export = channel.unary_unary(LOGS_EXPORT)
            for raw in payloads[k]:
                export(raw, timeout=30, metadata=AS_FORWARDER)
                with lock:
                    acked[0] += records

    t0 = time.perf_counter()
    threads = [threading.Thread(target=sender, args=(k,)) for k in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    os.kill(proc.pid, signal.SIGKILL)
    proc.proc.wait(10)
    with closing(db.open_reader(store)) as conn:
        stored = conn.execute("SELECT count(*) FROM failures WHERE job_id = 'job-k'").fetchone()[0]
    return {"durable_timeout": durable, "acknowledged": acked[0], "stored_after_sigkill": stored,
            "lost": acked[0] - stored, "seconds": round(seconds, 2), "acknowledged_per_s": round(acked[0] / seconds)}


def main(argv: list[str]) -> int:
    for durable in argv or ["2s"]:
        print(json.dumps(run(durable)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
