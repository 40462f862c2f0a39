"""The Dockerfile at the repository root, the image of the Helm chart: parsed with Docker's own parser (the
``dockerfile`` package wraps BuildKit's Go parser), since no Docker daemon runs here.

It must build the image the chart refers to (image.repository, tag = appVersion = the package version), from a slim
Python base, run as uid/gid 65534 (what the chart's securityContext sets), expose the chart's ports, start
``otel-gpu`` (the chart passes ``collector --config ...``), and install only the collector: no torch, no test extra.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

dockerfile = pytest.importorskip("dockerfile", reason="the dockerfile parser is in the test extra")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "otel-gpu"


@pytest.fixture(scope="module")
def commands():
    return dockerfile.parse_file(str(ROOT / "Dockerfile"))


def _stages(commands) -> list[list]:
    stages: list[list] = []
    for c in commands:
        if c.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(c)
    return stages


def _args(commands) -> dict[str, str]:
    out = {}
    for c in commands:
        if c.cmd == "ARG" and "=" in c.value[0]:
            k, v = c.value[0].split("=", 1)
            out[k] = v
    return out


def _one(stage, cmd: str):
    found = [c for c in stage if c.cmd == cmd]
    assert len(found) == 1, f"expected one {cmd} in the final stage, found {len(found)}"
    return found[0]


def test_slim_python_base_in_every_stage(commands):
    args = _args(commands)
    stages = _stages(commands)
    assert len(stages) >= 1
    for stage in stages:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage[0].value[0])
        assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", image), image


def test_runs_as_the_chart_s_non_root_user(commands):
    final = _stages(commands)[-1]
    user = _one(final, "USER").value[0]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for part in ("agent", "aggregator"):
        ctx = values[part]["podSecurityContext"]
        assert user == f"{ctx['runAsUser']}:{ctx['runAsGroup']}" == "65534:65534"
    # USER comes after every RUN of the final stage: nothing runs as root at run time
    assert max(i for i, c in enumerate(final) if c.cmd == "RUN") < final.index(_one(final, "USER"))


def test_exposes_the_chart_s_ports_and_starts_otel_gpu(commands):
    final = _stages(commands)[-1]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    exposed = {int(p.split("/")[0]) for c in final if c.cmd == "EXPOSE" for p in c.value}
    for part in ("agent", "aggregator"):
        assert set(values[part]["ports"].values()) == exposed
    entry = _one(final, "ENTRYPOINT")
    assert entry.json and entry.value == ("otel-gpu",)  # exec form: signals reach the collector (SIGTERM flush)
    assert _one(final, "CMD").value == ("collector",)
    template = (CHART / "templates" / "agent-daemonset.yaml").read_text()
    assert 'args: ["collector", "--config"' in template


def test_installs_only_what_the_collector_needs(commands):
    text = " ".join(c.original for c in commands if c.cmd in ("RUN", "COPY", "ADD"))
    assert "torch" not in text and "[test]" not in text and "[torch]" not in text
    assert not any(c.cmd == "ADD" for c in commands)  # nothing fetched from URLs
    copied = [c.value[0] for c in commands if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)]
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not src.startswith(("tests", "benchmarks", "dashboards", "docs", "helm")), src
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "torch" not in " ".join(pyproject["project"]["dependencies"])  # torch stays an extra
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"  # the build context is an allow-list: only what the COPY lines name
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert allowed == {src.rstrip("/") for src in " ".join(copied).split() if src != "./"} | {
        "pyproject.toml", "README.md"}


def test_the_chart_s_image_is_this_dockerfile_s(commands):
    """The chart's default image is ghcr.io/otel-gpu/otel-gpu:<appVersion>; the Dockerfile's build command tags that
    image, and appVersion is the package version the image installs."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version
    image = f"{values['image']['repository']}:{chart['appVersion']}"
    assert f"docker build -t {image} ." in (ROOT / "Dockerfile").read_text()
    assert "Dockerfile" in (CHART / "values.yaml").read_text()
