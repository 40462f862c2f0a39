"""``otel-gpu run --restart ...``: builds the policy from the file and the flags (exit 2 before anything starts when
either is wrong), then runs the :class:`~otel_gpu.supervisor.Supervisor`."""
from __future__ import annotations

import argparse
import sys

from otel_gpu.config import ConfigError

__all__ = ["run_supervised"]


def _problems(prefix: str, problems: list[str]) -> int:
    print(f"otel-gpu run: {prefix}:", file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    return 2


def run_supervised(args: argparse.Namespace) -> int:
    from otel_gpu.instrumentation.launcher import resolve_job_id, run
    from otel_gpu.supervisor import Supervisor, load_policy
    from otel_gpu.supervisor._verdict import default_url
    from otel_gpu.supervisor.policy import parse_duration

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        policy = load_policy(args.policy)
    except ConfigError as exc:
        return _problems(f"invalid restart policy {args.policy}", exc.problems)
    problems = []
    if args.max_restarts is not None:
        if args.max_restarts < 0:
            problems.append(f"--max-restarts must be >= 0 (got {args.max_restarts}); 0 never restarts")
        else:
            policy.budget.max_restarts = args.max_restarts
    if args.restart_window is not None:
        try:
            policy.budget.window_s = parse_duration(args.restart_window, "--restart-window")
            if policy.budget.window_s <= 0:
                raise ValueError(f"--restart-window must be > 0 (got {args.restart_window!r}), e.g. 1h")
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        return _problems("invalid arguments", problems)
    if not cmd:
        print("otel-gpu run: no command given (usage: otel-gpu run [--restart auto] -- CMD ...)", file=sys.stderr)
        return 2
    if args.restart == "never":  # run() finds the job id itself, or lets the ranks agree on one (otel_gpu.instrumentation.jobid)
        return run(cmd, endpoint=args.endpoint, job_id=getattr(args, "job_id", None))
    job_id = resolve_job_id(getattr(args, "job_id", None), cmd)
    url = args.verdict_url or policy.verdict.url or default_url(args.endpoint)
    if "://" in url and not url.startswith(("http://", "https://")):
        return _problems("invalid arguments", [f"--verdict-url must be an http:// or https:// URL (got {url!r})"])
    return Supervisor(cmd, args.restart, policy, args.endpoint, job_id, url).run()
