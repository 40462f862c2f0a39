"""Grafana dashboards (dashboards/grafana/*.json) are generated from the schema: the committed JSON equals a fresh
generation, every query names only metrics the schema defines, every schema metric of a dashboard's groups is shown,
and renaming a metric in the schema changes the generated queries.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is in the test extra")

from otel_gpu import schema
from otel_gpu.schema import MetricType

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "dashboards" / "grafana"


def load_generator():
    spec = importlib.util.spec_from_file_location("otel_gpu_dashboards_generate", ROOT / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


gen = load_generator()

# -- a small PromQL reader: which metric names does an expression select? -----------------------------------------
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$")


def metric_names(expr: str) -> set[str]:
    text = _LABEL_VALUES.sub(r"\1", expr.strip())
    text = _STRING.sub('""', text)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        token = m.group(0)
        if text[m.end():].lstrip().startswith("(") or token.lower() in _KEYWORDS:
            continue  # a function or an operator keyword
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # the exponent or suffix of a number literal
        names.add(token)
    return names


def label_names(expr: str) -> set[str]:
    found = set()
    for block in _MATCHERS.findall(_STRING.sub('""', expr)):
        found |= {m.group(1) for m in re.finditer(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)", block)}
    for group in _GROUPING.finditer(expr):
        found |= set(_IDENT.findall(group.group(0).split("(", 1)[1]))
    m = _LABEL_VALUES.match(expr.strip())
    if m:
        found.add(m.group(2))
    return found - {"le"}


def schema_series_names() -> dict[str, str]:
    """Prometheus series name -> schema metric name, histograms with their _bucket/_sum/_count series."""
    names = {}
    for m in schema.REGISTRY.metrics.values():
        if m.type is MetricType.HISTOGRAM:
            for suffix in ("_bucket", "_sum", "_count"):
                names[m.prometheus_name + suffix] = m.name
        else:
            names[m.prometheus_name] = m.name
    return names


def schema_label_names() -> set[str]:
    return {gen.label(a) for a in schema.REGISTRY.attributes.values()}


def committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(GRAFANA.glob("*.json"))}


def expressions(model: dict) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every query variable of a dashboard JSON."""
    out = []
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            out.append((f"{model['uid']}/{panel['title']}", target["expr"]))
    for var in model.get("templating", {}).get("list", []):
        if var["type"] == "query":
            out.append((f"{model['uid']}/${var['name']}", var["query"]))
    return out


# -- tests --------------------------------------------------------------------------------------------------------
def test_metric_reader_reads_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le, collective_op) (rate(a_bucket{x=~"$job"}[5m])))') \
        == {"a_bucket"}
    assert metric_names('max by (j, r) (a{r="x"}) / on (j) group_left () quantile by (j) (0.5, b)') == {"a", "b"}
    assert metric_names("count (a == 1) or vector(0)") == {"a"}
    assert metric_names('label_values(a{host_name=~"$host"}, gpu_index)') == {"a"}
    assert metric_names("sum(rate(x_total[$__rate_interval])) > 1e3") == {"x_total"}
    assert label_names('sum by (le, collective_op) (rate(a{training_rank=~"$rank"}[1m]))') \
        == {"collective_op", "training_rank"}


def test_committed_json_is_what_the_schema_generates():
    generated = {name: json.loads(gen.render_text(model)) for name, model in gen.build_all().items()}
    on_disk = committed()
    assert sorted(on_disk) == sorted(generated), "run: python dashboards/generate.py"
    for name in generated:
        assert on_disk[name] == generated[name], f"{name} is stale: run python dashboards/generate.py"
    assert gen.main(["--check"]) == 0


def test_every_query_names_only_schema_metrics_and_labels():
    known = schema_series_names()
    labels = schema_label_names()
    checked = 0
    for name, model in committed().items():
        for where, expr in expressions(model):
            used = metric_names(expr)
            assert used, f"{where}: no metric found in {expr!r}"
            unknown = used - set(known)
            assert not unknown, f"{where}: {sorted(unknown)} not defined in otel_gpu.schema ({expr})"
            bad_labels = label_names(expr) - labels
            assert not bad_labels, f"{where}: labels {sorted(bad_labels)} are no schema attribute ({expr})"
            checked += 1
    assert checked >= 60


def test_a_query_for_an_undefined_metric_is_caught(tmp_path):
    """The check above can fail: a dashboard naming a metric the schema lacks (dcgm's name) is reported."""
    known = schema_series_names()
    model = {"uid": "x", "panels": [{"title": "t", "targets": [{"expr": 'DCGM_FI_DEV_GPU_UTIL{gpu="0"}'}]}],
             "templating": {"list": []}}
    (_, expr), = expressions(model)
    assert metric_names(expr) - set(known) == {"DCGM_FI_DEV_GPU_UTIL"}


def test_every_schema_metric_has_a_panel():
    shown = {m.name for _, _, q in gen.all_queries() for m in q.metrics}
    by_expr = {known for model in committed().values() for _, e in expressions(model)
               for n in metric_names(e) if (known := schema_series_names().get(n))}
    groups = {g for d in gen.specs() for g in d.groups}
    # Every metric of every group a dashboard covers (GPU, NIC, training, failures, goodput, collector).
    expected = {m.name for m in schema.REGISTRY.metrics.values() if m.group in groups}
    assert expected - shown == set()
    assert expected - by_expr == set()
    # Groups of metrics no dashboard covers would be invisible: there are none.
    assert {m.group for m in schema.REGISTRY.metrics.values()} <= groups
    for required in ("GPU health", "NIC health", "Training", "Failures", "Goodput"):
        assert required in groups


def test_dashboards_are_provisioning_ready():
    uids = set()
    for name, model in committed().items():
        assert model["uid"] not in uids and len(model["uid"]) <= 40
        uids.add(model["uid"])
        assert "otel-gpu" in model["tags"] and model["title"].startswith("otel-gpu / ")
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        for var in variables.values():
            if var["type"] == "query":
                assert var["includeAll"] and var["multi"] and var["allValue"] == ".*"
                assert var["datasource"]["uid"] == "${datasource}"
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids))
        for panel in model["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"] and panel.get("description"), panel["title"]
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(set(ref_ids)) == len(ref_ids) and all(ref_ids)
            for target in panel["targets"]:
                for used in re.findall(r"\$(\w+)", target["expr"]):
                    assert used.startswith("__") or used in variables, f"{name}/{panel['title']}: ${used}"
    assert {"job", "host", "rank"} <= set(next(m for m in committed().values()
                                                if m["uid"] == "otel-gpu-training")["templating"]["list"][i]["name"]
                                           for i in range(4))
    gpu = next(m for m in committed().values() if m["uid"] == "otel-gpu-gpu-health")
    assert {v["name"] for v in gpu["templating"]["list"]} == {"datasource", "host", "gpu"}


def test_dcgm_users_find_their_counters_in_descriptions():
    gpu = next(m for m in committed().values() if m["uid"] == "otel-gpu-gpu-health")
    text = json.dumps(gpu)
    for field in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE",
                  "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_XID_ERRORS"):
        assert field in text


def test_renaming_a_metric_regenerates_its_queries(monkeypatch):
    from otel_gpu.schema import gpu, training

    old_gpu = gpu.UTILIZATION.prometheus_name
    old_step = training.STEP_DURATION.prometheus_name
    # A copy of the table, so that undoing the rename also keeps the declaration order the generated docs follow.
    monkeypatch.setattr(schema.REGISTRY, "metrics", dict(schema.REGISTRY.metrics))
    for module, const, new_name in ((gpu, "UTILIZATION", "hw.gpu.busy"), (training, "STEP_DURATION", "train.step.time")):
        old = getattr(module, const)
        renamed = dataclasses.replace(old, name=new_name)
        monkeypatch.setattr(module, const, renamed)  # what a rename in the schema module does
        monkeypatch.delitem(schema.REGISTRY.metrics, old.name)
        monkeypatch.setitem(schema.REGISTRY.metrics, new_name, renamed)
    text = json.dumps(gen.build_all())
    assert "hw_gpu_busy_ratio" in text and old_gpu not in text
    assert "train_step_time_seconds" in text and old_step not in text


def test_helpers_refuse_the_wrong_instrument_type():
    from otel_gpu.schema import gpu, training

    with pytest.raises(TypeError, match="counter"):
        gen.rate_q(gpu.UTILIZATION, ("host",))
    with pytest.raises(TypeError, match="histogram"):
        gen.quantile_q(training.STEP_DURATION, 0.5, (), (), "")


def test_a_new_schema_metric_gets_a_panel_without_touching_the_generator(monkeypatch):
    from otel_gpu.schema import Metric

    new = Metric("hw.gpu.fan.speed", MetricType.GAUGE, "1", "Fan speed.", group="GPU health")
    monkeypatch.setattr(schema.REGISTRY, "metrics", dict(schema.REGISTRY.metrics))
    monkeypatch.setitem(schema.REGISTRY.metrics, new.name, new)
    gpu = gen.build_all()["otel-gpu-gpu-health.json"]
    panels = [p for p in gpu["panels"] if p["title"] == new.name]
    assert panels and panels[0]["targets"][0]["expr"].startswith("hw_gpu_fan_speed_ratio{")
    assert any(p["type"] == "row" and p["title"] == "Other signals" for p in gpu["panels"])
