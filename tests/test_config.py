"""Config errors name the key and the fix; the collector refuses to start on them, with exit status 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from otel_gpu.collector.config import load_default, load_file, load_text
from otel_gpu.config import ConfigError

DATA = Path(__file__).parent / "testdata"


def problems_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_file(path)
    return info.value.problems


def test_good_config_loads_with_env_substitution_and_named_components(monkeypatch):
    monkeypatch.setenv("OTEL_GPU_TEST_PORT", "5555")
    cfg = load_file(DATA / "good.yaml")
    assert [p.name for p in cfg.pipelines] == ["traces", "logs/main"]
    assert cfg.component("receiver", "otlp").config.grpc.endpoint == "127.0.0.1:5555"
    assert cfg.component("receiver", "otlp").config.http is None
    assert cfg.telemetry.log_level == "warning"


def test_unknown_component_type_suggests_the_right_one():
    (problem,) = problems_of(DATA / "bad_unknown_type.yaml")
    assert "receivers.otlpp" in problem and "unknown receiver type 'otlpp'" in problem and "did you mean 'otlp'" in problem


def test_every_problem_is_reported_at_once_with_its_key():
    problems = "\n".join(problems_of(DATA / "bad_types.yaml"))
    assert "exporters.debug.colour: unknown setting" in problems
    assert "service.pipelines.logs.exporters: 'missing' is not defined under exporters" in problems
    assert "service.pipelines.spans: unknown signal 'spans'" in problems


@pytest.mark.parametrize("text, expected", [
    ("receivers: [otlp]\nservice: {}", "receivers: expected a mapping"),
    ("- a\n- b", "the top level must be a mapping"),
    ("receivers: {otlp: {grpc: {endpoint: 4317, max_recv_msg_size_mib: many}}}", "max_recv_msg_size_mib"),
    ("receivers: {otlp: {}}\nexporters: {debug: {}}\nservice: {pipelines: {traces: {receivers: [otlp]}}}",
     "service.pipelines.traces.exporters: a pipeline needs at least one exporter"),
    ("receivers: {otlp: {}\n", "not valid YAML at line"),
    ("foo: 1\nservice: {pipelines: {}}", "foo: unknown top-level section"),
    ("exporters: {debug: {verbosity: '${env:OTEL_GPU_SURELY_UNSET_VAR}'}}", "OTEL_GPU_SURELY_UNSET_VAR is not set"),
])
def test_bad_config_messages(text, expected):
    with pytest.raises(ConfigError) as info:
        load_text(text, "my.yaml")
    assert expected in str(info.value)
    assert all(p.startswith("my.yaml: ") for p in info.value.problems)


def test_yaml_is_safe_loaded():
    with pytest.raises(ConfigError) as info:
        load_text("receivers: !!python/object/apply:os.system ['echo pwned']\n")
    assert "not valid YAML" in str(info.value)


def test_built_in_default_config_is_valid():
    cfg = load_default()
    assert {p.signal.value for p in cfg.pipelines} == {"traces", "metrics", "logs"}


def test_collector_cli_exits_2_before_starting_on_a_bad_config(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "otel_gpu", "collector", "--config", str(DATA / "bad_types.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "invalid configuration" in proc.stderr and "exporters.debug.colour" in proc.stderr
    assert "collector ready" not in proc.stderr


def test_collector_cli_validate_and_missing_file(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "otel_gpu", "collector", "--validate"], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0 and "configuration is valid" in ok.stdout
    missing = subprocess.run([sys.executable, "-m", "otel_gpu", "collector", "--config", str(tmp_path / "nope.yaml")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "cannot read the file" in missing.stderr
