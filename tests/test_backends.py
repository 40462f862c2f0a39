"""The backend seam: receivers get their NVML from otel_gpu.collector.backends by the config's name and never import the
testing package; a backend registered under a new name (or through the entry-point group) is usable from config."""
from __future__ import annotations

import ast
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from otel_gpu.collector import backends
from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.config import ConfigError
from otel_gpu.schema import gpu as G
from otel_gpu.testing.fake_nvml import FakeNvml

ROOT = Path(__file__).resolve().parents[1]
# Product code that must not import the testing package (otel_gpu/commands/demo.py runs the scenario suite by design).
PRODUCT = [ROOT / "receivers", ROOT / "processors", ROOT / "otel_gpu" / "exporters", ROOT / "otel_gpu" / "collector",
           ROOT / "otel_gpu" / "instrumentation", ROOT / "otel_gpu" / "schema"]


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


def test_no_product_module_imports_the_testing_package():
    offenders = [f"{p.relative_to(ROOT)}: {m}" for d in PRODUCT for p in sorted(d.rglob("*.py"))
                 for m in _imports(p) if m == "otel_gpu.testing" or m.startswith("otel_gpu.testing.")]
    assert offenders == []
    # the receivers do not even name it: the fake is resolved in one place
    named = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "receivers").rglob("*.py"))
             if "otel_gpu.testing" in p.read_text()]
    assert named == []


def test_fake_is_resolved_by_dotted_path_only_when_asked():
    nv = backends.load("nvml", "fake", scenario={"gpu_count": 3})
    assert isinstance(nv, FakeNvml)
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 3
    import pynvml

    assert backends.load("nvml", "auto") is pynvml and backends.load("nvml", "nvml") is pynvml


def test_unknown_kind_or_name_lists_what_is_registered():
    with pytest.raises(KeyError, match="no backend 'dcgm' of kind 'nvml'; registered: nvml: auto, nvml, fake"):
        backends.load("nvml", "dcgm")


class _Counting(FakeNvml):
    calls = 0

    def nvmlDeviceGetUtilizationRates(self, handle):
        type(self).calls += 1
        return super().nvmlDeviceGetUtilizationRates(handle)


@pytest.fixture
def counting_backend():
    backends.register("nvml", "counting", _Counting)
    _Counting.calls = 0
    yield
    backends._REGISTRY.pop(("nvml", "counting"), None)


def test_a_registered_backend_is_chosen_by_config_in_a_real_collector(capture_exporter, counting_backend):
    text = yaml.safe_dump({
        "receivers": {"nvml": {"backend": "counting", "interval": "100ms", "xid_events": False}},
        "exporters": {"capture": {}},
        "service": {"pipelines": {"metrics": {"receivers": ["nvml"], "exporters": ["capture"]}}}})
    c = Collector(load_text(text))
    c.start()
    try:
        exp = c.component("exporter", "capture")
        exp.wait_for(lambda e: e.points(G.UTILIZATION.name), timeout_s=20)
        assert _Counting.calls >= 1
    finally:
        c.shutdown(5)


def test_unregistered_backend_in_config_names_the_key_and_the_choices():
    text = yaml.safe_dump({"receivers": {"nvml": {"backend": "dcgm"}, "xid": {"backend": "dcgm"}},
                           "exporters": {"debug": {}},
                           "service": {"pipelines": {"metrics": {"receivers": ["nvml"], "exporters": ["debug"]},
                                                     "logs": {"receivers": ["xid"], "exporters": ["debug"]}}}})
    with pytest.raises(ConfigError) as err:
        load_text(text)
    assert "receivers.nvml.backend must be one of auto, nvml, fake (got 'dcgm')" in str(err.value)
    assert "receivers.xid.backend must be one of auto, nvml, fake, none (got 'dcgm')" in str(err.value)


def test_entry_point_group_adds_backends(monkeypatch):
    ep = metadata.EntryPoint(name="nvml.plugin", value="otel_gpu.testing.fake_nvml:FakeNvml",
                             group=backends.ENTRY_POINT_GROUP)
    bad = metadata.EntryPoint(name="nodot", value="x:y", group=backends.ENTRY_POINT_GROUP)
    monkeypatch.setattr(backends.metadata, "entry_points", lambda group: [ep, bad] if group == ep.group else [])
    monkeypatch.setattr(backends, "_entry_points_loaded", False)
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    assert backends.names("nvml") == ["auto", "nvml", "fake", "plugin"]
    assert isinstance(backends.load("nvml", "plugin", scenario={"gpu_count": 1}), FakeNvml)


def test_backend_fake_through_the_cli_collector_reaches_an_otlp_backend(collector_process, otlp_sink):
    """The product path: `otel-gpu collector` with `backend: fake` in its YAML, metrics exported over OTLP."""
    scenario = ROOT / "tests" / "testdata" / "fake_nvml_8gpu.yaml"
    text = yaml.safe_dump({
        "receivers": {"nvml": {"backend": "fake", "scenario": str(scenario), "interval": "200ms", "xid_events": False}},
        "exporters": {"otlp": {"endpoint": otlp_sink.endpoint, "compression": "none"}},
        "service": {"pipelines": {"metrics": {"receivers": ["nvml"], "exporters": ["otlp"]}}}})
    collector = collector_process(text)
    assert otlp_sink.wait_for(lambda s: G.UTILIZATION.name in s.metric_names(), timeout_s=30)
    assert collector.stop() == 0
