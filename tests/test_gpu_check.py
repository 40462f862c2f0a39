"""benchmarks/gpu_check.py without a GPU: it says so and exits 0 (no CUDA here: the CPU build of torch), and its NVML
part, run over the fake NVML through the same receiver, reads every GPU metric of the schema and flags an implausible
value. Its GPU parts (NCCL timing, bf16 load, a real OOM) need hardware: docs/gpu.md says what ran where."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_without_a_cuda_device_the_check_says_so_writes_it_down_and_exits_zero(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the no-device path does not apply")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["device"]["ok"] is False and "CPU build" in result["device"]["why"]
    assert "Not run: no CUDA device" in (tmp_path / "gpu_check.md").read_text()
    assert "nvml" not in result  # nothing pretends to have been checked


def _scenario(tmp_path, **defaults) -> str:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"gpu_count": 2, "defaults": {
        "gpu_util_pct": 97, "processes": [{"pid": 4100, "used_memory_mib": 6900}],
        "nvlink_errors": {"0": {"crc_flit": 3}}, **defaults}}))
    return str(path)


def test_the_nvml_check_reads_every_gpu_metric_of_the_schema_through_the_receiver(tmp_path):
    from otel_gpu.schema import gpu as G
    from otel_gpu.schema._model import Metric

    result = gpu_check.check_nvml(backend="fake", scenario=_scenario(tmp_path), interval_s=0.05)
    names = {m.name for m in vars(G).values() if isinstance(m, Metric)}
    assert {row["metric"] for row in result["metrics"]} == names  # every metric of the schema is accounted for
    assert result["ok"] and not result["problems"], result["problems"]
    assert result["not_read"] == ["gpu.xid.errors"]  # a count that exists only once an XID happened
    assert result["gpus"] == 2


def test_the_nvml_check_flags_an_implausible_value(tmp_path):
    result = gpu_check.check_nvml(backend="fake", scenario=_scenario(tmp_path, temperature_c=300), interval_s=0.05)
    assert not result["ok"]
    assert any("300" in p for p in result["problems"]), result["problems"]
