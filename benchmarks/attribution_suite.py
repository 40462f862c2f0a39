"""Runs the whole fault-injection suite and prints, per scenario, expected vs found (kind, root_cause, culprit) and the
time to attribution, then precision and recall.

    .venv/bin/python benchmarks/attribution_suite.py [--only NAME ...] [--seed N]

Each scenario is a real 4-rank gloo job under `otel-gpu run` (about 25-40 s each here); the culprit rank is drawn
from 1-3 per scenario.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from otel_gpu.testing.scenarios import SCENARIOS, run_scenario


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="scenario names (default: all)")
    parser.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    names = args.only or list(SCENARIOS)
    print(f"seed {args.seed}; {len(names)} scenarios")
    print(f"{'scenario':18} {'k':>2} {'expected':38} {'found':38} {'culprit':>7} {'latency':>8} {'ok':>4}")
    tp = fp = fn = 0
    rows = []
    start = time.time()
    for name in names:
        s = SCENARIOS[name]
        rank = rng.randrange(1, 4)
        r = run_scenario(s, rank)
        f = r.found
        expected = f"{s.kind}/{s.root_cause}" if s.kind else "(none)"
        found = f"{f['kind']}/{f['root_cause']}" if f else "(none)"
        culprit = f["culprit"]["rank"] if f else "-"
        latency = f"{r.latency_s:.1f}s" if r.latency_s is not None else "-"
        print(f"{name:18} {rank:>2} {expected:38} {found:38} {str(culprit):>7} {latency:>8} "
              f"{'yes' if r.ok else 'NO':>4}", flush=True)
        if s.kind is None:
            fp += len(r.records)
        else:
            if r.ok:
                tp += 1
            else:
                fn += 1
                fp += len(r.records)
        rows.append(r)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    print(f"\nright: {sum(r.ok for r in rows)}/{len(rows)}; precision {precision:.2f}; recall {recall:.2f}; "
          f"false alarms {fp}; total {time.time() - start:.0f} s")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
