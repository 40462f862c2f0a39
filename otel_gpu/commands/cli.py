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


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: level, ts, logger, msg (and service.telemetry.logs.initial_fields)."""

    def __init__(self, fields: dict | None = None):
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        import json

        doc = {"level": record.levelname.lower(), "ts": record.created, "logger": record.name,
               "msg": record.getMessage(), **self.fields}
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def cmd_collector(args: argparse.Namespace) -> int:
    from otel_gpu.collector.config import load_default, load_file
    from otel_gpu.collector.runtime import Collector, StartError, tune_gc_for_service
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
    if config.telemetry.logs.encoding == "json":  # service.telemetry.logs.encoding, as the Collector's zap logger
        for handler in logging.getLogger().handlers:
            handler.setFormatter(_JsonFormatter(config.telemetry.logs.initial_fields))
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
    tune_gc_for_service()
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
    from otel_gpu.commands.report import main as report_main

    return report_main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from otel_gpu.commands.demo import main as demo_main

    logging.basicConfig(level=logging.ERROR)
    return demo_main(args)


def cmd_run(args: argparse.Namespace) -> int:
    from otel_gpu.instrumentation.launcher import run

    if args.restart == "never" and not args.policy and args.max_restarts is None and args.restart_window is None:
        return run(list(args.cmd), endpoint=args.endpoint, job_id=args.job_id)
    from otel_gpu.supervisor.cli import run_supervised

    return run_supervised(args)


_EXAMPLES = {
    "collector": """examples:
  otel-gpu collector                                  # built-in config: OTLP 127.0.0.1:4317/4318, Prometheus :9464,
                                                      # health check :13133, store ./otel-gpu-data
  otel-gpu collector --print-default-config > my.yaml
  otel-gpu collector --config my.yaml --validate      # check a config (OpenTelemetry Collector shape) and exit
  otel-gpu collector --config docs/examples/aggregator.yaml""",
    "report": """examples:
  otel-gpu report                                     # ./otel-gpu-data, text
  otel-gpu report --job job-3f2a --format json
  otel-gpu report --job job-3f2a --plot goodput.svg   # or goodput.png""",
    "run": """environment set for CMD (and every process it starts):
  OTEL_GPU_AUTO=1               instrument each Python process at start-up (through a sitecustomize on PYTHONPATH)
  PYTHONPATH                    the bootstrap folder first, then yours
  OTEL_GPU_JOB_ID               one job id for all processes (yours if set, else a new one; printed at start)
  OTEL_GPU_REGISTRY             a folder where processes note their pid, rank and how they ended
  OTEL_EXPORTER_OTLP_ENDPOINT   --endpoint, when given (other OTEL_* variables pass through unchanged)
  OTEL_GPU_RESTART_COUNT        with --restart: the restarts so far (each incarnation counts one higher)

examples:
  otel-gpu run -- torchrun --standalone --nproc-per-node 4 train.py --epochs 3
  otel-gpu run --endpoint http://collector.example:4317 -- python train.py
  otel-gpu run --restart auto --max-restarts 3 -- torchrun --nproc-per-node 8 --max-restarts 0 train.py
  otel-gpu report --job <the job id printed at start>""",
    "demo": """examples:
  otel-gpu demo                                       # a hang on a random rank
  otel-gpu demo --list
  otel-gpu demo --scenario crash --rank 0
  otel-gpu demo --scenario restart                    # killed once, restarted by otel-gpu run --restart auto
  otel-gpu demo --hosts 3 --scenario failover         # (root) node 1's link is cut; the spare node takes over""",
}


def build_parser() -> argparse.ArgumentParser:
    from otel_gpu import __version__

    parser = argparse.ArgumentParser(prog="otel-gpu", description="Why your GPU training job crashed, hung or "
                                     "slowed down, over OpenTelemetry.", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="examples:\n  otel-gpu collector &\n  otel-gpu run -- torchrun "
                                            "--standalone --nproc-per-node 4 train.py\n  otel-gpu report\n\n"
                                            "`otel-gpu COMMAND --help` shows each command's options and examples.")
    parser.add_argument("--version", action="version", version=f"otel-gpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("collector", help="run the collector (sidecar or aggregator)", formatter_class=fmt,
                       description="Run the collector: OTLP in, attribution and goodput, Prometheus and the\n"
                                   "embedded store out.",
                       epilog=_EXAMPLES["collector"])
    p.add_argument("--config", metavar="FILE", help="YAML config in the OpenTelemetry Collector's shape "
                   "(default: the built-in config; see `otel-gpu collector --print-default-config`)")
    p.add_argument("--validate", action="store_true", help="check the config and exit")
    p.add_argument("--print-default-config", action="store_true", help="print the built-in config and exit")
    p.add_argument("--shutdown-timeout-s", type=float, default=10.0, help="flush deadline on SIGTERM (default 10)")
    p.set_defaults(func=cmd_collector)

    p = sub.add_parser("report", help="failures with their attribution, and goodput, from the embedded store",
                       formatter_class=fmt, epilog=_EXAMPLES["report"],
                       description="Failures with their cause, culprit and evidence, then goodput (ETTR, badput)\n"
                                   "and a one-line timeline per job, read from the collector's embedded store.")
    p.add_argument("--store", metavar="DIR", default="./otel-gpu-data", help="store folder (default ./otel-gpu-data)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--job", metavar="JOB_ID", help="only this job")
    p.add_argument("--limit", type=int, default=50, help="most recent failures to show (default 50)")
    p.add_argument("--plot", metavar="FILE", help="also draw each job's goodput timeline (productive time and badput "
                   "buckets where the ledger counted them, one lane per incarnation, failures; ETTR in the title) "
                   "into FILE.svg, or FILE.png with matplotlib (pip install 'otel-gpu[plot]')")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("run", help="launch a training command with auto-instrumentation", formatter_class=fmt,
                       usage="otel-gpu run [--endpoint URL] [--restart {never,auto,always}] [--policy FILE] "
                             "-- CMD [ARG ...]",
                       description="Run CMD (e.g. torchrun ...) with every Python process it starts instrumented,\n"
                                   "and report how each of them ended. Put `--` before CMD so that its options are\n"
                                   "not read as otel-gpu's. With --restart auto, act on the collector's verdict\n"
                                   "(restart, exclude the culprit, or stop with the diagnosis): docs/restart.md.",
                       epilog=_EXAMPLES["run"])
    p.add_argument("--endpoint", metavar="URL",
                   help="OTLP endpoint of the collector (default: $OTEL_EXPORTER_OTLP_ENDPOINT if set, else "
                        "http://127.0.0.1:4317, the local `otel-gpu collector`)")
    p.add_argument("--restart", choices=("never", "auto", "always"), default="never",
                   help="act on the collector's verdict: auto restarts what a restart fixes, excludes the culprit "
                   "of hardware faults, stops with the diagnosis on user errors; always restarts on any failure; "
                   "never (default) runs once")
    p.add_argument("--max-restarts", type=int, metavar="N", help="restart budget per window (default 3)")
    p.add_argument("--restart-window", metavar="DURATION", help="window of the budget, e.g. 30m, 1h (default 1h)")
    p.add_argument("--policy", metavar="FILE", help="restart policy YAML (see docs/restart.md)")
    p.add_argument("--verdict-url", metavar="URL", help="the collector's verdict API (default: the OTLP "
                   "endpoint's host, port 4319; env OTEL_GPU_VERDICT_ENDPOINT). For a torchrun of many nodes, the "
                   "job's aggregator: every node runs the same command, spares too, and carries out the job's one "
                   "decision per failure (docs/restart.md, 'Many nodes')")
    p.add_argument("--job-id", metavar="ID", help="job id (default: OTEL_GPU_JOB_ID, else generated)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARG ...]", help="the training command")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("demo", help="start a collector and a small CPU training job, inject a fault, explain it",
                       formatter_class=fmt, epilog=_EXAMPLES["demo"])
    p.add_argument("--scenario", default="hang", help="fault to inject (default: hang; see --list)")
    p.add_argument("--rank", type=int, help="the faulty rank (default: a random one of 1-3)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--workdir", metavar="DIR", help="where the store and logs go (default: a new temp folder)")
    p.add_argument("--hang-timeout-s", type=float, default=8.0, help="hang timeout of the demo collector (8)")
    p.add_argument("--hosts", type=int, default=1, help="2-4: network-namespace hosts with a sidecar each and the "
                   "job's aggregator (root, iproute2); --scenario then is one of link_cut (default), node_lost, "
                   "degraded_link, agent_restart, exception, none, on host 1, or failover (3+ hosts: the last is a "
                   "spare)")
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
