"""``otel-gpu demo``: a collector (embedded store, fake GPUs and NIC), a 4-rank CPU training job under ``otel-gpu run``
with one injected fault, and the attribution a person reads, in under a minute.

Example:
    otel-gpu demo                       # default: a hang (rank 2 sleeps before a collective)
    otel-gpu demo --scenario xid79      # rank 1's GPU falls off the bus
    otel-gpu demo --list
    otel-gpu demo --hosts 2             # network-namespace hosts (root): host 1 loses its data link
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]


def main(args: argparse.Namespace) -> int:
    from otel_gpu.report import build_report, format_text
    from otel_gpu.testing.scenarios import SCENARIOS, run_scenario

    if getattr(args, "hosts", 1) > 1:
        from otel_gpu.testing import multinode

        fault = args.scenario if args.scenario in multinode.FAULTS else "link_cut"
        return multinode.main(["--hosts", str(args.hosts), "--fault", fault])
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name:18} {s.description}  -> expect {s.kind or 'no failure'} / {s.root_cause or '-'}")
        return 0
    scenario = SCENARIOS.get(args.scenario)
    if scenario is None:
        print(f"otel-gpu demo: unknown scenario {args.scenario!r} (see otel-gpu demo --list)", file=sys.stderr)
        return 2
    rank = args.rank if args.rank is not None else random.Random().randrange(1, 4)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="otel-gpu-demo-"))
    t0 = time.time()

    def say(msg: str) -> None:
        print(f"{time.time() - t0:5.1f}s  {msg}", flush=True)

    say(f"collector on loopback with fake GPUs/NIC; store in {workdir / 'store'}")
    result = run_scenario(scenario, rank, workdir=workdir, progress=say, hang_timeout_s=args.hang_timeout_s)
    found = result.found
    if found is None:
        say("the job ended and nothing was attributed" + (" (as expected: a healthy run)" if scenario.kind is None
                                                          else " (unexpected)"))
    else:
        latency = f"{result.latency_s:.1f} s after the fault began" if result.latency_s is not None else ""
        say(f"attributed {latency}")
    print()
    time.sleep(0.2)
    print(format_text(build_report(str(workdir / "store"), limit=5)))
    print(f"\n(store kept in {workdir / 'store'}: otel-gpu report --store {workdir / 'store'} --format json)")
    expected = f"{scenario.kind}/{scenario.root_cause} on rank {rank}" if scenario.kind else "no failure"
    print(f"expected: {expected}; verdict: {'RIGHT' if result.ok else 'WRONG'}; demo took {time.time() - t0:.0f} s")
    if not result.ok:
        print(result.job_output[-3000:], file=sys.stderr)
    return 0 if result.ok else 1
