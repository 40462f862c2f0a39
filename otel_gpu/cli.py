"""The ``otel-gpu`` command: collector, run, report, demo.

Example:
    otel-gpu collector                      # built-in default config: OTLP 4317/4318, Prometheus 9464, store
    otel-gpu collector --config my.yaml
    otel-gpu report --format json
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

__all__ = ["main"]

_logger = logging.getLogger("otel_gpu")


def _setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def cmd_collector(args: argparse.Namespace) -> int:
    from otel_gpu.collector.config import load_default, load_file
    from otel_gpu.collector.runtime import Collector, StartError
    from otel_gpu.config import ConfigError

    _setup_logging()
    try:
        config = load_file(args.config) if args.config else load_default()
    except ConfigError as exc:
        print("otel-gpu collector: invalid configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(config.telemetry.log_level.upper())
    if args.validate:
        print(f"{config.source}: configuration is valid "
              f"({len(config.pipelines)} pipelines, {len(config.components)} components)")
        return 0
    collector = Collector(config)
    try:
        collector.start()
    except StartError as exc:
        print(f"otel-gpu collector: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def _on_signal(signum, _frame):
        _logger.info("received %s: flushing pipelines and stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print("otel-gpu collector ready", file=sys.stderr, flush=True)
    while not stop.wait(0.5):
        pass
    collector.shutdown(timeout_s=args.shutdown_timeout_s)
    _logger.info("otel-gpu collector stopped")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from otel_gpu.report import main as report_main

    return report_main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from otel_gpu.demo import main as demo_main

    logging.basicConfig(level=logging.ERROR)
    return demo_main(args)


def cmd_run(args: argparse.Namespace) -> int:
    from otel_gpu.launcher import run

    return run(list(args.cmd), endpoint=args.endpoint)


def _not_yet(name: str, issue: str):
    def run(_args: argparse.Namespace) -> int:
        print(f"otel-gpu {name}: not yet available in this version ({issue}).", file=sys.stderr)
        return 3

    return run


def build_parser() -> argparse.ArgumentParser:
    from otel_gpu import __version__

    parser = argparse.ArgumentParser(prog="otel-gpu", description="Why your GPU training job crashed, hung or "
                                     "slowed down, over OpenTelemetry.")
    parser.add_argument("--version", action="version", version=f"otel-gpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("collector", help="run the collector (sidecar or aggregator)")
    p.add_argument("--config", metavar="FILE", help="YAML config in the OpenTelemetry Collector's shape "
                   "(default: the built-in config; see `otel-gpu collector --print-default-config`)")
    p.add_argument("--validate", action="store_true", help="check the config and exit")
    p.add_argument("--print-default-config", action="store_true", help="print the built-in config and exit")
    p.add_argument("--shutdown-timeout-s", type=float, default=10.0, help="flush deadline on SIGTERM (default 10)")
    p.set_defaults(func=cmd_collector)

    p = sub.add_parser("report", help="failures with their attribution, and goodput, from the embedded store")
    p.add_argument("--store", metavar="DIR", default="./otel-gpu-data", help="store folder (default ./otel-gpu-data)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--job", metavar="JOB_ID", help="only this job")
    p.add_argument("--limit", type=int, default=50, help="most recent failures to show (default 50)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("run", help="launch a training command with auto-instrumentation")
    p.add_argument("--endpoint", metavar="URL")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("demo", help="start a collector and a small CPU training job, inject a fault, explain it")
    p.add_argument("--scenario", default="hang", help="fault to inject (default: hang; see --list)")
    p.add_argument("--rank", type=int, help="the faulty rank (default: a random one of 1-3)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--workdir", metavar="DIR", help="where the store and logs go (default: a new temp folder)")
    p.add_argument("--hang-timeout-s", type=float, default=8.0, help="hang timeout of the demo collector (8)")
    p.add_argument("--hosts", type=int, default=1, help="2-4: network-namespace hosts with a sidecar each and the "
                   "job's aggregator (root, iproute2); --scenario then is one of link_cut (default), node_lost, "
                   "degraded_link, agent_restart, exception, none, on host 1")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "collector" and args.print_default_config:
        from otel_gpu.collector.config import DEFAULT_CONFIG_TEXT

        sys.stdout.write(DEFAULT_CONFIG_TEXT)
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
