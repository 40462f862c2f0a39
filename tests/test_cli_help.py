"""CLI friendliness: every subcommand's help has examples; ``run --help`` shows the ``--`` form, the endpoint's default
and the environment it sets; ``run`` says which job it ran, where telemetry went and which report to read."""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from otel_gpu.commands.cli import build_parser, main


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return out.getvalue()


def _commands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(sub.choices)


@pytest.mark.parametrize("command", _commands())
def test_every_subcommand_help_has_an_example_that_uses_it(command):
    text = _help(command)
    assert "examples:" in text
    examples = text.split("examples:", 1)[1]
    assert re.search(rf"^\s+otel-gpu {command}\b", examples, re.M), examples


def test_top_level_help_has_examples():
    assert "examples:" in _help() and "otel-gpu run -- torchrun" in _help()


def test_run_help_shows_the_double_dash_form_the_default_endpoint_and_the_environment():
    text = _help("run")
    assert re.search(r"usage: otel-gpu run \[--endpoint URL\].* -- CMD \[ARG \.\.\.\]", text), text
    assert "http://127.0.0.1:4317" in " ".join(text.split())
    for var in ("OTEL_GPU_AUTO", "OTEL_GPU_JOB_ID", "OTEL_GPU_REGISTRY", "OTEL_EXPORTER_OTLP_ENDPOINT", "PYTHONPATH"):
        assert var in text


def test_report_help_offers_the_plot():
    assert "--plot FILE" in _help("report")


def test_run_prints_the_job_id_the_endpoint_and_the_report_command(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_GPU_JOB_ID"] = "job-cli-test"
    proc = subprocess.run([sys.executable, "-m", "otel_gpu", "run", "--endpoint", "http://127.0.0.1:9", "--",
                           sys.executable, "-c", "print('trained')"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "trained"  # our lines go to stderr, never into the job's output
    assert "otel-gpu run: job job-cli-test; telemetry to http://127.0.0.1:9 (grpc)" in proc.stderr
    assert "otel-gpu run: job job-cli-test ended with status 0; what happened: otel-gpu report --job job-cli-test" \
        in proc.stderr
