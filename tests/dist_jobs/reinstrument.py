"""One gloo rank: instrument, uninstrument, re-instrument; prints a JSON line of what it saw at each stage.

Usage: python reinstrument.py PORT   (OTEL_EXPORTER_OTLP_ENDPOINT points at the test's sink)
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import otel_gpu
from otel_gpu.instrumentation import _hot, flush

ORIGINAL = dist.all_reduce


def stage(name: str, n: int) -> dict:
    t = torch.ones(8)
    w0 = _hot.NS["_w"]
    for _ in range(n):
        dist.all_reduce(t)
    return {"stage": name, "wrapped": dist.all_reduce is not ORIGINAL, "records": _hot.NS["_w"] - w0,
            "flushed": flush(3.0)}


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    out = []
    otel_gpu.instrument()
    dist.init_process_group("gloo", rank=0, world_size=1)
    out.append(stage("instrumented", 3))
    otel_gpu.uninstrument()
    out.append(stage("uninstrumented", 5))
    out.append({"stage": "restored", "all_reduce": dist.all_reduce is ORIGINAL,
                "save": getattr(torch.save, "_otel_gpu_wrapper", False) is False,
                "wait": not getattr(dist.distributed_c10d.Work.wait, "_otel_gpu_wrapper", False),
                # torch chains its own excepthook over ours in init_process_group: ours must then pass through
                "excepthook": not getattr(getattr(sys.excepthook, "__self__", None), "_otel_gpu", False)})
    otel_gpu.instrument()
    out.append(stage("reinstrumented", 4))
    with otel_gpu.step(41):
        dist.all_reduce(torch.ones(2))
        time.sleep(0.01)
    with otel_gpu.checkpoint("/nonexistent/explicit.pt"):
        pass
    out.append({"stage": "explicit", "flushed": flush(3.0)})
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
