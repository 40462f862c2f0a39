"""``otel-gpu demo``: a collector (embedded store, fake GPUs and NIC), a 4-rank CPU training job under ``otel-gpu run``
with one injected fault, and the attribution a person reads, in under a minute.

Example:
    otel-gpu demo                       # default: a hang (rank 2 sleeps before a collective)
    otel-gpu demo --scenario xid79      # rank 1's GPU falls off the bus
    otel-gpu demo --scenario restart    # rank k is killed once; otel-gpu run --restart auto restarts the job
    otel-gpu demo --list
    otel-gpu demo --hosts 2             # network-namespace hosts (root): host 1 loses its data link
    otel-gpu demo --hosts 3 --scenario failover   # two nodes and a spare: node 1's link is cut, the spare takes over
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
    from otel_gpu.commands.report import build_report, format_text
    from otel_gpu.testing.scenarios import SCENARIOS, run_scenario

    if getattr(args, "hosts", 1) > 1:
        from otel_gpu.testing import multinode

        fault = args.scenario if args.scenario in multinode.FAULTS else "link_cut"
        return multinode.main(["--hosts", str(args.hosts), "--fault", fault])
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name:18} {s.description}  -> expect {s.kind or 'no failure'} / {s.root_cause or '-'}")
        print(f"{'restart':18} rank k is killed once; `otel-gpu run --restart auto` restarts the job, which resumes "
              "from its checkpoint  -> expect one restart, then done")
        return 0
    if args.scenario == "restart":
        return restart_demo(args)
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


def restart_demo(args: argparse.Namespace) -> int:
    """A 4-rank job under ``otel-gpu run --restart auto``: rank k is SIGKILLed once (a transient fault), the
    collector names it (rank_process_died -> auto_restart), ``run`` restarts the job, it resumes from its checkpoint
    and finishes. Prints the decision trail, then the report (incarnations on one timeline, goodput)."""
    import subprocess
    import uuid

    from otel_gpu.commands.report import build_report, format_text
    from otel_gpu.testing.restart_rig import RestartRig

    rank = args.rank if args.rank is not None else random.Random().randrange(0, 4)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="otel-gpu-demo-"))
    job_id = f"demo-restart-{uuid.uuid4().hex[:6]}"
    t0 = time.time()

    def say(msg: str) -> None:
        print(f"{time.time() - t0:5.1f}s  {msg}", flush=True)

    with RestartRig(workdir, hang_timeout_s=args.hang_timeout_s) as rig:
        say(f"collector on loopback (verdict API {rig.verdict_url}); store in {rig.store}")
        say(f"starting: otel-gpu run --restart auto -- torchrun --nproc-per-node 4 (rank {rank} is killed once at "
            "step 15; checkpoints every 10 steps)")
        argv = rig.run_argv(["--restart", "auto", "--job-id", job_id], nproc=4)
        env = rig.job_env(fault="sigkill", rank=rank, step=15, steps=40, job_id=job_id)
        log = workdir / "job-output.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE,
                                    text=True, errors="replace")
            assert proc.stderr is not None
            for line in proc.stderr:
                out.write(line)
                if line.startswith("otel-gpu run:"):
                    say(line.rstrip()[len("otel-gpu run: "):])
            rc = proc.wait()
        for p in rig.progress():
            if p["event"] in ("start", "fault", "done"):
                what = {"start": f"job started, resumed from step {p.get('resumed_from')}",
                        "fault": f"fault: rank {p.get('rank')} killed (SIGKILL) at step {p.get('step')}",
                        "done": "job finished all its steps"}[p["event"]]
                print(f"       job: {what} ({p['t'] - t0:.1f} s)")
        time.sleep(1.5)  # the last goodput summary reaches the store
    print()
    report = build_report(rig.store, job_id)
    print(format_text(report))
    decisions = report["restarts"]
    restarts = sum(d["decision"] in ("restart", "exclude_and_restart") for d in decisions)
    ok = rc == 0 and restarts == 1 and decisions and decisions[-1]["decision"] == "done"
    print(f"(store kept in {rig.store}: otel-gpu report --store {rig.store} --job {job_id}; job output in {log})")
    print(f"expected: one restart, then the job completes; got {restarts} restart(s), exit {rc}: "
          f"{'RIGHT' if ok else 'WRONG'}; demo took {time.time() - t0:.0f} s")
    return 0 if ok else 1
