"""Remediation: the same faults under ``torchrun --max-restarts 3`` alone versus ``otel-gpu run --restart auto``.

Each case is a real 2-rank gloo DDP job (``otel_gpu.testing.restart_train``: 40 steps, checkpoint every 10, resumes
from it) with one fault at step 15:

- ``sigkill``: rank 1 is SIGKILLed once (a transient fault: the next start runs clean);
- ``exception``: rank 1 raises ValueError at step 15 on every start (a user bug: no restart can fix it);
- ``hang``: rank 1 sleeps once before a collective (a transient hang; its peer waits in all_reduce).

Both sides run under ``otel-gpu run`` against the same in-process collector, so that goodput (ETTR, from the goodput
processor) is measured the same way; only the restart logic differs:

- baseline: ``otel-gpu run -- torchrun --max-restarts 3 ...`` (torchrun restarts on any failure; a hang lasts until
  gloo's timeout fires);
- otel-gpu: ``otel-gpu run --restart auto --policy P -- torchrun --max-restarts 0 ...`` with
  ``P = {hang: {decision: restart}, budget: {max_restarts: 3}}`` (a hung job is stopped and restarted; the
  collector's hang timeout is 15 s, its default).

The gloo timeout (``--gloo-timeout-s``, default 120 s) stands in for PyTorch's default (1800 s for gloo, 600 s for
NCCL), which a benchmark cannot wait for: with the default the baseline's hang case takes ~30 min longer.

Usage::

    python benchmarks/remediation.py                       # all three faults, both sides (~10 min on 2 busy cores)
    python benchmarks/remediation.py --faults hang --gloo-timeout-s 300
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from otel_gpu.exporters.store import db
from otel_gpu.testing.restart_rig import RestartRig

POLICY = "hang: {decision: restart}\nbudget: {max_restarts: 3}\n"


def run_case(rig: RestartRig, fault: str, side: str, workdir: Path, gloo_timeout_s: float,
             timeout_s: float) -> dict:
    job_id = f"remediation-{fault}-{side}-{uuid.uuid4().hex[:6]}"
    job_dir = workdir / job_id
    env = rig.job_env(fault=fault, rank=1, step=15, once=fault != "exception", steps=40, job_id=job_id,
                      job_dir=job_dir, OTEL_GPU_GLOO_TIMEOUT_S=str(gloo_timeout_s))
    if side == "torchrun":
        argv = [sys.executable, "-m", "otel_gpu", "run", "--endpoint", rig.endpoint, "--job-id", job_id, "--",
                *rig.torchrun_argv(2, torchrun_args=("--max-restarts=3",))]
    else:
        policy = workdir / "policy.yaml"
        policy.write_text(POLICY)
        argv = rig.run_argv(["--restart", "auto", "--job-id", job_id, "--policy", str(policy)],
                            torchrun_args=("--max-restarts=0",))
    t0 = time.time()
    with open(workdir / f"{job_id}.log", "w") as log:
        try:
            rc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.time() - t0
    progress = rig.progress(job_dir)
    starts = sum(p["event"] == "launch" for p in progress)  # every start, one that failed in rendezvous too
    done = any(p["event"] == "done" for p in progress)
    time.sleep(2.5)  # the goodput processor reports every second; let the last summary reach the store
    with db.open_reader(rig.store) as conn:
        goodput = db.goodput(conn, job_id) or {}
        decisions = db.restarts(conn, job_id)
    return {"fault": fault, "side": side, "rc": rc, "completed": done, "wall_s": round(wall, 1),
            "restarts": max(0, starts - 1), "ettr": goodput.get("ettr"),
            "productive_s": goodput.get("productive_time_s"),
            "wasted_s": (goodput.get("badput_s") or {}).get("wasted_progress"),
            "decisions": [d["decision"] for d in decisions]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default="sigkill,exception,hang")
    parser.add_argument("--gloo-timeout-s", type=float, default=120.0)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per case")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="otel-gpu-remediation-"))
    rows = []
    with RestartRig(workdir / "rig", hang_timeout_s=15.0) as rig:
        for fault in args.faults.split(","):
            for side in ("torchrun", "otel-gpu"):
                row = run_case(rig, fault, side, workdir, args.gloo_timeout_s, args.timeout_s)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"\n2-rank gloo job, 40 steps, fault at step 15, gloo timeout {args.gloo_timeout_s:.0f} s; logs in "
          f"{workdir}\n")
    print("| fault | side | outcome | wall time | restarts spent | ETTR | wasted progress |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        outcome = "completed" if r["completed"] else f"gave up (exit {r['rc']})"
        ettr = f"{r['ettr'] * 100:.1f}%" if r["ettr"] is not None else "-"
        wasted = f"{r['wasted_s']:.1f} s" if r["wasted_s"] is not None else "-"
        side = "torchrun --max-restarts 3" if r["side"] == "torchrun" else "otel-gpu run --restart auto"
        print(f"| {r['fault']} | {side} | {outcome} | {r['wall_s']:.1f} s | {r['restarts']} | {ettr} | {wasted} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
