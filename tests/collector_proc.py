"""Start an ``otel-gpu collector`` subprocess from a YAML text, for tests and benchmarks.

API (kept small on purpose):

- ``free_port() -> int``: a loopback TCP port that was free a moment ago (format it into the config text).
- ``start_collector(config_text, tmp_path, *, wait=True, timeout_s=30, env=None, args=()) -> CollectorProcess``:
  writes ``tmp_path/collector.yaml``, runs ``python -m otel_gpu collector --config it`` (same interpreter as the
  tests), and by default waits until it prints ``otel-gpu collector ready`` on stderr.
- ``CollectorProcess``: ``.wait_ready(timeout_s)``, ``.stop(timeout_s) -> exit code`` (SIGTERM, then SIGKILL past
  the timeout), ``.kill()``, ``.alive``, ``.pid``, ``.stderr_text()`` (what it logged so far); also a context
  manager that stops it on exit.

Example::

    from collector_proc import free_port, start_collector   # tests/ is on sys.path under pytest

    def test_it(tmp_path):
        port = free_port()
        text = f"receivers: {{otlp: {{grpc: {{endpoint: 127.0.0.1:{port}}}, http: null}}}}\\n..."
        with start_collector(text, tmp_path) as collector:
            ...                                    # send to 127.0.0.1:port
            assert collector.stop() == 0
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["CollectorProcess", "free_port", "start_collector"]

READY_LINE = "otel-gpu collector ready"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CollectorProcess:
    def __init__(self, proc: subprocess.Popen, stderr_path: Path, config_path: Path):
        self.proc = proc
        self.pid = proc.pid
        self.stderr_path = stderr_path
        self.config_path = config_path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 30.0) -> CollectorProcess:
        """Blocks until the ready line; raises RuntimeError with the collector's log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if READY_LINE in self.stderr_text():
                return self
            if not self.alive:
                raise RuntimeError(f"collector exited with {self.proc.returncode} before it was ready:\n"
                                   f"{self.stderr_text()[-4000:]}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"collector not ready after {timeout_s}s:\n{self.stderr_text()[-4000:]}")

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (the collector flushes its pipelines), SIGKILL past ``timeout_s``; returns the exit code."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait()

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> CollectorProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_collector(config_text: str, tmp_path: Path | str, *, wait: bool = True, timeout_s: float = 30.0,
                    env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> CollectorProcess:
    tmp = Path(tmp_path)
    tmp.mkdir(parents=True, exist_ok=True)
    config_path = tmp / "collector.yaml"
    config_path.write_text(config_text, encoding="utf-8")
    stderr_path = tmp / "collector.stderr"
    with open(stderr_path, "wb") as err:  # a file, not a pipe: a chatty collector can never block on a full pipe
        proc = subprocess.Popen([sys.executable, "-m", "otel_gpu", "collector", "--config", str(config_path), *args],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err, cwd=tmp,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    handle = CollectorProcess(proc, stderr_path, config_path)
    if wait:
        handle.wait_ready(timeout_s)
    return handle
