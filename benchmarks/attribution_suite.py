"""The adversarial attribution suite: randomized real jobs, a confusion matrix of kind, root cause and culprit, latency
per kind, false alarms on healthy runs, and how soon a crash is in the store after the first rank's exit.

    .venv/bin/python benchmarks/attribution_suite.py --runs 60 --seed S [--only NAME ...] [--json out.json]
    .venv/bin/python benchmarks/attribution_suite.py --launchers --runs 20    # only launcher and frozen-rank scenarios
    .venv/bin/python benchmarks/attribution_suite.py --digests --runs 60 --seed S  # through a node sidecar with digests

Each run is a real 4-rank gloo job under ``otel-gpu run -- torchrun`` (the ``lightning_*`` and ``spawn_*`` scenarios:
ranks started by Lightning's own launcher or ``torch.multiprocessing.spawn``; ``*frozen``: a rank stopped by SIGSTOP)
against an in-process collector with the fake
NVML / fake sysfs (otel_gpu.testing.scenarios): the culprit is drawn from every rank (0 included), the fake hardware
starts dirty (ports down since boot, a power cap on, background error counts, an old application XID; each drawn per
run), and hardware evidence lands before, with or after the symptom (up to 5 s late; a late fact must revise the
verdict). About a fifth of the runs are healthy ones (a plain run, a 40 s rank-0 checkpoint, a node-agent restart
mid-job, a background-thread exception): any verdict there is a false alarm. What is scored is what a user sees: the
latest version of each failure in the store; withdrawn verdicts are not failures.

``--digests`` (issue 20) puts the node sidecar of docs/examples/sidecar.yaml in front of attribution: the job's
telemetry and the fake hardware go to a second in-process collector whose ``compact`` processor (``digests: true``,
``batch_interval`` 1 s) folds the ranks' heartbeats and step spans into node digests, and on over OTLP on loopback
to the attributing collector; a node-agent restart restarts that sidecar. ``--sidecar`` is the same stage with
digests off (to tell what digests change from what the sidecar's filtering and batching change).

Floors (issue 10): precision and recall 1.0 on kind, root cause and culprit; no false alarm; a hang within
hang_timeout + 5 s of its start; a crash in the store within 1 s of the first rank's exit.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import time
from pathlib import Path

from otel_gpu.testing.scenarios import SCENARIOS
from otel_gpu.testing.scenarios.runner import Case, ScenarioResult, draw_cases, run_case

NONE = "(none)"


def _pairs(r: ScenarioResult) -> list[tuple[dict, dict | None]]:
    """(expected, found) per verdict of a run: matched ones, then each missing one against a leftover (a wrong
    verdict), then leftovers against nothing (false alarms)."""
    missing, extra = r.unmatched
    expected = [{"kind": e.kind, "root_cause": e.root_cause, "rank": r._rank_for(e.who), "expect": e}
                for e in r.scenario.expected]
    extra = list(extra)
    out: list[tuple[dict, dict | None]] = []
    matched = [f for f in r.records if f not in extra and f not in r.tolerated]
    for e in expected:
        if e["expect"] in missing:
            continue
        hit = next(f for f in matched if r._matches(f, e["expect"], e is expected[0]))
        matched.remove(hit)
        out.append((e, hit))
    for e in expected:
        if e["expect"] in missing:
            out.append((e, extra.pop(0) if extra else None))
    out.extend(({"kind": NONE, "root_cause": NONE, "rank": None}, f) for f in extra)
    return out


def _found_view(f: dict | None) -> dict:
    if f is None:
        return {"kind": NONE, "root_cause": NONE, "rank": None}
    return {"kind": f.get("kind"), "root_cause": f.get("root_cause"), "rank": (f.get("culprit") or {}).get("rank")}


def _matrix(title: str, cells: collections.Counter, labels: list[str]) -> list[str]:
    width = max([len(title), *(len(x) for x in labels)]) + 1
    col = max(7, *(len(x) + 1 for x in labels)) if len(labels) < 6 else 7
    heads = [x[:col - 1] for x in labels]
    lines = [f"{title:<{width}}" + "".join(f"{h:>{col}}" for h in heads) + "   (rows: expected, columns: found)"]
    for row in labels:
        lines.append(f"{row:<{width}}" + "".join(f"{cells.get((row, c), 0) or '.':>{col}}" for c in labels))
    return lines


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return (f"n={len(values)} min {min(values):.2f} s, median {statistics.median(values):.2f} s, "
            f"max {max(values):.2f} s")


def row(case: Case, r: ScenarioResult) -> dict:
    """Everything the summary needs from one run, as JSON (one line per run in --json, so a cut-short run still
    summarizes with --summarize)."""
    pairs = []
    for exp, found in _pairs(r):
        got = _found_view(found)
        node_ok = bool(case.scenario.culprit_is_node and found is not None and (found.get("culprit") or {}).get("host"))
        pairs.append({"expected": {k: exp[k] for k in ("kind", "root_cause", "rank")}, "found": got,
                      "found_any": found is not None, "culprit_ok": got["rank"] == exp["rank"] or node_ok})
    return {"scenario": case.scenario.name, "kind": case.scenario.kind, "kinds": list(case.scenario.kinds),
            "culprit_rank": case.culprit_rank, "second_rank": case.second_rank, "dirt": str(case.dirt),
            "evidence_lag_s": case.evidence_lag_s if case.scenario.hardware else None, "ok": r.ok, "pairs": pairs,
            "false_alarms": len(r.unmatched[1]) if case.scenario.kind is None else 0,
            "tolerated": len(r.tolerated), "latency_s": r.latency_s,
            "store_latency_s": r.store_latency_s if case.scenario.kind == "crash" else None,
            "records": r.records, "withdrawn": len(r.withdrawn), "wall_s": round(r.wall_s, 1)}


def summarize(rows: list[dict], total_s: float | None = None) -> None:
    kinds: collections.Counter = collections.Counter()
    causes: collections.Counter = collections.Counter()
    culprits: collections.Counter = collections.Counter()
    right = {"kind": 0, "root_cause": 0, "culprit": 0}
    n_expected = n_found = false_alarms = healthy_runs = tolerated = 0
    latency: dict[str, list[float]] = collections.defaultdict(list)
    store_after_exit: list[float] = []
    for rw in rows:
        if rw["kind"] is None:
            healthy_runs += 1
            false_alarms += rw["false_alarms"]
            tolerated += rw["tolerated"]
        for p in rw["pairs"]:
            exp, got = p["expected"], p["found"]
            kinds[(exp["kind"], got["kind"])] += 1
            causes[(exp["root_cause"], got["root_cause"])] += 1
            culprits[(str(exp["rank"]) if exp["kind"] != NONE else NONE,
                      str(got["rank"]) if p["found_any"] else NONE)] += 1
            n_expected += exp["kind"] != NONE
            n_found += p["found_any"]
            if exp["kind"] != NONE and p["found_any"]:
                right["kind"] += got["kind"] == exp["kind"] or got["kind"] in rw["kinds"]
                right["root_cause"] += got["root_cause"] == exp["root_cause"]
                right["culprit"] += p["culprit_ok"]
        if rw["ok"] and rw["latency_s"] is not None:
            latency[rw["kind"] or NONE].append(rw["latency_s"])
        if rw["store_latency_s"] is not None:
            store_after_exit.append(rw["store_latency_s"])
    print()
    for title, cells in (("kind", kinds), ("culprit rank", culprits), ("root cause", causes)):
        labels = sorted({k for pair in cells for k in pair}, key=lambda x: (x == NONE, x))
        print("\n".join(_matrix(title, cells, labels)))
        print()
    print(f"{'':14} {'precision':>9} {'recall':>7}")
    for key in ("kind", "root_cause", "culprit"):
        precision = right[key] / n_found if n_found else 1.0
        recall = right[key] / n_expected if n_expected else 1.0
        print(f"{key:14} {precision:9.2f} {recall:7.2f}")
    print()
    for kind in ("crash", "hang", "slowdown"):
        print(f"latency {kind:8} (fault start -> verdict, right verdicts): {_stats(latency.get(kind, []))}")
    print(f"crash record in the store after the first rank's exit: {_stats(store_after_exit)}")
    print(f"false alarms: {false_alarms} on {healthy_runs} healthy runs (dirty hardware, long checkpoints, "
          f"agent restarts, thread exceptions)" + (f"; {tolerated} tolerated checkpoint_stall report(s) of a long "
                                                      "save (true, no hang or crash)" if tolerated else ""))
    print(f"right: {sum(rw['ok'] for rw in rows)}/{len(rows)}" + (f"; total {total_s:.0f} s" if total_s else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    parser.add_argument("--only", nargs="*", help="scenario names (default: all)")
    parser.add_argument("--launchers", action="store_true",
                        help="only the launcher (lightning_*, spawn_*) and frozen-rank scenarios (issue 22)")
    parser.add_argument("--healthy-share", type=float, default=0.2, help="share of healthy-type runs (default 0.2)")
    parser.add_argument("--hang-timeout", type=float, default=8.0)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--digests", action="store_true",
                      help="through a node sidecar whose compact processor sends node digests (issue 20)")
    mode.add_argument("--sidecar", action="store_true", help="through a node sidecar, digests off")
    parser.add_argument("--json", help="append one JSON line per run here (as it finishes)")
    parser.add_argument("--summarize", help="print the summary of a --json file (e.g. of a run cut short) and exit")
    args = parser.parse_args()
    if args.summarize:
        rows = [json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line.strip()]
        summarize(rows)
        return 0 if all(rw["ok"] for rw in rows) else 1
    if args.launchers:
        args.only = [n for n, s in SCENARIOS.items() if s.launcher != "torchrun" or s.fault == "sigstop"]
    unknown = [n for n in args.only or () if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    rng = random.Random(args.seed)
    cases = draw_cases(rng, args.runs, args.only, healthy_share=args.healthy_share)
    sidecar = {"digests": True} if args.digests else {} if args.sidecar else None
    path = "job -> sidecar (compact, digests) -> OTLP -> attribution" if args.digests else \
        "job -> sidecar (compact) -> OTLP -> attribution" if args.sidecar else "job -> attribution"
    print(f"seed {args.seed}; {len(cases)} runs; hang timeout {args.hang_timeout} s; {path}", flush=True)
    print(f"{'#':>3} {'scenario':23} {'k':>3} {'dirt':26} {'lag':>5} {'expected':40} {'found':40} {'det':>6} "
          f"{'store':>6} {'ok':>3}", flush=True)
    rows: list[dict] = []
    start = time.time()
    for i, case in enumerate(cases, 1):
        r = run_case(case, hang_timeout_s=args.hang_timeout, seed=rng.randrange(1 << 30), sidecar=sidecar)
        rows.append(row(case, r))
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(rows[-1]) + "\n")
        exp = "; ".join(f"{e.kind}/{e.root_cause}@{r._rank_for(e.who)}" for e in case.scenario.expected) or NONE
        found = "; ".join(f"{f['kind']}/{f['root_cause']}@{(f.get('culprit') or {}).get('rank')}"
                          + (f" v{f['version']}" if (f.get("version") or 1) > 1 else "") for f in r.records) or NONE
        k = f"{case.culprit_rank}" + (f",{case.second_rank}" if case.second_rank is not None else "")
        lag = f"{case.evidence_lag_s:+.1f}" if case.scenario.hardware else "-"
        det = f"{r.latency_s:.1f}" if r.latency_s is not None else "-"
        store = f"{r.store_latency_s:.2f}" if r.store_latency_s is not None and case.scenario.kind == "crash" else "-"
        print(f"{i:>3} {case.scenario.name:23} {k:>3} {str(case.dirt):26} {lag:>5} {exp[:40]:40} {found[:40]:40} "
              f"{det:>6} {store:>6} {'yes' if r.ok else 'NO':>3}", flush=True)
        if not r.ok:
            for f in r.records:
                print(f"      found {f['kind']}/{f['root_cause']} rank {(f.get('culprit') or {}).get('rank')}: "
                      f"{'; '.join(map(str, f.get('evidence') or []))[:240]}", flush=True)
    summarize(rows, time.time() - start)
    return 0 if all(rw["ok"] for rw in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
