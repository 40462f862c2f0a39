"""A collector for restart runs (OTLP in, attribution, goodput, store, verdict API) on free loopback ports, shared
by ``otel-gpu demo --scenario restart``, tests/test_restart*.py and benchmarks/remediation.py.

Example::

    from otel_gpu.testing.restart_rig import RestartRig
    with RestartRig(workdir, hang_timeout_s=5) as rig:
        subprocess.run(rig.run_argv(["--restart", "auto"], nproc=2), env=rig.job_env(fault="sigkill"))
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector

__all__ = ["RestartRig", "free_port", "rig_config"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rig_config(workdir: Path, grpc_port: int, verdict_port: int, hang_timeout_s: float = 5.0,
               forwarder_token: str = "") -> str:
    """``forwarder_token``: the trusted-forwarder token ``otel-gpu run`` presents with its restart decisions
    (``OTEL_GPU_FORWARDER_TOKEN``), so that the store keeps them; empty: none is trusted."""
    otlp: dict[str, Any] = {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}, "http": None}
    if forwarder_token:
        otlp["trusted_forwarders"] = {"bearer_token": forwarder_token}
    config: dict[str, Any] = {
        "receivers": {"otlp": otlp},
        "processors": {"attribution": {"hang_timeout": f"{hang_timeout_s:g}s", "heartbeat_timeout": "6s"},
                       "goodput": {"report_interval": "1s"}},
        "exporters": {"store": {"path": str(workdir / "store")},
                      "verdict": {"endpoint": f"127.0.0.1:{verdict_port}"}},
        "service": {"telemetry": {"logs": {"level": "warning"}}, "pipelines": {
            "traces": {"receivers": ["otlp"], "processors": ["attribution", "goodput"], "exporters": ["store"]},
            "metrics": {"receivers": ["otlp"], "processors": ["attribution", "goodput"], "exporters": ["store"]},
            "logs": {"receivers": ["otlp"], "processors": ["attribution", "goodput"],
                     "exporters": ["store", "verdict"]},
        }},
    }
    return json.dumps(config, indent=2)


class RestartRig:
    """An in-process collector; ``endpoint`` / ``verdict_url`` for ``otel-gpu run``; stops on exit."""

    def __init__(self, workdir: Path | str, hang_timeout_s: float = 5.0, start_collector: bool = True):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "job").mkdir(exist_ok=True)
        self.grpc_port, self.verdict_port = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{self.grpc_port}"
        self.verdict_url = f"http://127.0.0.1:{self.verdict_port}"
        self.collector: Collector | None = None
        self.forwarder_token = secrets.token_hex(16)
        if start_collector:
            text = rig_config(self.workdir, self.grpc_port, self.verdict_port, hang_timeout_s, self.forwarder_token)
            self.collector = Collector(load_text(text, "restart-rig"))
            self.collector.start()

    @property
    def store(self) -> str:
        return str(self.workdir / "store")

    def run_argv(self, run_args: list[str], nproc: int = 2, module: str = "otel_gpu.testing.restart_train",
                 torchrun_args: tuple[str, ...] = ()) -> list[str]:
        return [sys.executable, "-m", "otel_gpu", "run", "--endpoint", self.endpoint, "--verdict-url",
                self.verdict_url, *run_args, "--", *self.torchrun_argv(nproc, module, torchrun_args)]

    @staticmethod
    def torchrun_argv(nproc: int = 2, module: str = "otel_gpu.testing.restart_train",
                      torchrun_args: tuple[str, ...] = ()) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--monitor-interval=0.2", *torchrun_args, "-m", module]

    def job_env(self, fault: str = "none", rank: int = 1, step: int = 15, once: bool = True, steps: int = 40,
                job_id: str | None = None, job_dir: Path | str | None = None, **extra: str) -> dict[str, str]:
        """The job's environment; ``job_dir`` (default ``<workdir>/job``) holds its checkpoint and markers."""
        job_dir = Path(job_dir or self.workdir / "job")
        job_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update({"OTEL_GPU_WORKDIR": str(job_dir), "OTEL_GPU_FAULT": fault,
                    "OTEL_GPU_FAULT_RANK": str(rank), "OTEL_GPU_FAULT_STEP": str(step),
                    "OTEL_GPU_FAULT_ONCE": "1" if once else "0", "OTEL_GPU_STEPS": str(steps),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    "OTEL_GPU_FORWARDER_TOKEN": self.forwarder_token})
        if job_id:
            env["OTEL_GPU_JOB_ID"] = job_id
        env.update(extra)
        return env

    def progress(self, job_dir: Path | str | None = None) -> list[dict[str, Any]]:
        """The job's ``progress.jsonl``: one line per start (``resumed_from``), fault and completion."""
        path = Path(job_dir or self.workdir / "job") / "progress.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.collector is not None:
            self.collector.shutdown(timeout_s=5.0)
            self.collector = None

    def __enter__(self) -> RestartRig:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
