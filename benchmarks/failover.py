"""Failover across nodes: ``otel-gpu run --restart auto`` on every node versus plain elastic torchrun, on the same three
network-namespace hosts (two nodes run the job, the third is a spare), one fault each.

Each case is a real 4-rank gloo DDP job (``otel_gpu.testing.restart_train``: 250 steps of ~0.05 s, a checkpoint every
10 steps in a directory every host sees, resumed from on a restart) over the hosts' data links, each host with its
sidecar (docs/examples/sidecar.yaml) and the job's aggregator (docs/examples/aggregator.yaml, verdict and jobs API with
a token). Faults, 3 s into training:

- ``link_cut``: node1's data link goes down (``ip link set data0 down``);
- ``node_lost``: every process of node1 is killed at once (its sidecar and ``otel-gpu run`` too);
- ``sigkill``: rank 3 (on node1) is SIGKILLed once at step 60 (transient: the next start runs clean);
- ``exception``: rank 3 raises ValueError at step 60 on every start (a user bug: no restart can fix it).

Sides:

- torchrun: every host runs ``otel-gpu run -- torchrun --nnodes 2 ... --max-restarts 3`` (``otel-gpu run`` only
  observes, for the same goodput accounting); the spare host's torchrun starts once the others train, as torchrun's
  own spare;
- otel-gpu: every host runs ``otel-gpu run --restart auto --verdict-url http://agg:4319 -- torchrun --nnodes 2 ...
  --max-restarts 0`` (docs/restart.md, "Many nodes").

Per case: outcome (completed / stopped / still running at the time limit), wall time from the first launch to the
end, restarts (incarnations that started training after the first), time from the fault to the first step of the
next incarnation, ETTR (the aggregator's goodput processor). ``--gloo-timeout-s`` (default 120) stands in for
PyTorch's 1800 s gloo timeout, which a benchmark cannot wait for: with the default, torchrun's link-cut case waits
~30 min in the dead collective first.

Needs root and iproute2 (the network-namespace bed of tests/test_multihost.py).

Usage::

    sudo python benchmarks/failover.py --hosts 3                       # all four faults, both sides (~15 min)
    sudo python benchmarks/failover.py --hosts 3 --faults link_cut --sides otel-gpu --json
    sudo python benchmarks/failover.py --hosts 3 --sides torchrun --torchrun-spare no   # torchrun on 2 hosts only
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from otel_gpu.testing.multinode import FAILOVER_POLICY, Bed

FAULTS = ("link_cut", "node_lost", "sigkill", "exception")
SIDES = ("torchrun", "otel-gpu")


def run_case(bed: Bed, fault: str, side: str, limit_s: float, gloo_timeout_s: float, n: int,
             spare: bool = True) -> dict:
    env = {"OTEL_GPU_GLOO_TIMEOUT_S": str(gloo_timeout_s)}
    if fault in ("sigkill", "exception"):
        env.update(OTEL_GPU_FAULT=fault, OTEL_GPU_FAULT_RANK="3", OTEL_GPU_FAULT_STEP="60",
                   OTEL_GPU_FAULT_ONCE="1" if fault == "sigkill" else "0")
    job_id = f"bench-{n}-{fault}-{side}"
    supervised = side == "otel-gpu"
    t0 = time.time()
    job = bed.launch_failover(steps=250, policy=FAILOVER_POLICY, rdzv_id=job_id, env=env, supervised=supervised,
                              torchrun_restarts=0 if supervised else 3, spares=None if spare else 0)
    node1 = bed.hosts[1]
    t_fault = None
    try:
        bed.wait_first_step()
        time.sleep(3.0)
        if fault == "link_cut":
            t_fault = bed.cut_link(node1)
        elif fault == "node_lost":
            t_fault = bed.lose_node(node1)
        rcs = job.wait(max(1.0, limit_s - (time.time() - t0)))
        t_end = time.time()
    finally:
        job.stop()
        if fault == "link_cut":
            node1.set_link("data0", up=True)
        if fault == "node_lost":
            bed.start_sidecar(node1)
    progress = bed.progress()
    if t_fault is None:
        t_fault = next((p["t"] for p in progress if p.get("event") == "fault"), None)
    starts = [p for p in progress if p.get("event") == "start"]
    firsts = [p for p in progress if p.get("event") == "first_step"]
    done = any(p.get("event") == "done" for p in progress)
    after = [p["t"] for p in firsts[1:] if t_fault is not None and p["t"] > t_fault]
    running = [h for h, rc in rcs.items() if rc is None]
    time.sleep(3.0)  # the last spans and decisions reach the aggregator's store
    report = bed.report(job_id=job_id)
    goodput = next((j.get("goodput") for j in report.get("jobs", []) if j.get("job_id") == job_id), None) or {}
    ettr = goodput.get("ettr") if isinstance(goodput, dict) else None
    return {"fault": fault, "side": side if spare else f"{side} (no spare)",
            "outcome": "completed" if done else (f"still running at {limit_s:.0f} s" if running else "stopped"),
            "exit": rcs, "wall_s": round(t_end - t0, 1), "restarts": max(0, len(starts) - 1),
            "hosts": [s.get("hosts") for s in starts],
            "fault_to_first_new_step_s": round(after[0] - t_fault, 1) if after else None,
            "ettr": round(ettr, 3) if isinstance(ettr, (int, float)) else None,
            "decisions": [(d.get("decision"), d.get("root_cause"), d.get("decided_by"))
                          for d in report.get("restarts", []) if d.get("job_id") == job_id]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=3, help="node hosts (3: two run the job, one spare)")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--limit-s", type=float, default=240.0, help="per case: stop waiting after this (240)")
    ap.add_argument("--gloo-timeout-s", type=float, default=120.0, help="the training script's gloo timeout (120)")
    ap.add_argument("--torchrun-spare", choices=["yes", "no"], default="yes",
                    help="whether the torchrun side runs an agent on the spare host too (yes: the same 3 hosts)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case")
    args = ap.parse_args(argv)
    if args.hosts != 3:
        ap.error("--hosts must be 3 (two nodes and a spare)")
    faults = [f for f in args.faults.split(",") if f]
    sides = [s for s in args.sides.split(",") if s]
    bad = [f for f in faults if f not in FAULTS] + [s for s in sides if s not in SIDES]
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    rows = []
    with Bed(args.hosts, acting=True, attribution={"hang_timeout": "6s", "heartbeat_timeout": "5s"}) as bed:
        for n, fault in enumerate(faults):
            for side in sides:
                row = run_case(bed, fault, side, args.limit_s, args.gloo_timeout_s, n,
                               spare=side != "torchrun" or args.torchrun_spare == "yes")
                rows.append(row)
                print(json.dumps(row) if args.json else
                      f"{fault:10} {side:9} {row['outcome']:24} wall {row['wall_s']:6.1f} s  restarts "
                      f"{row['restarts']}  fault->first new step {row['fault_to_first_new_step_s']} s  ETTR "
                      f"{row['ettr']}  hosts {row['hosts']}  decisions {row['decisions']}  exit {row['exit']}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
