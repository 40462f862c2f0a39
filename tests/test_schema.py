"""The schema is the one source of names: docs are generated from it, and names follow the conventions."""
from __future__ import annotations

import re
from pathlib import Path

from otel_gpu import schema
from otel_gpu.schema.prom import prometheus_name

ROOT = Path(__file__).resolve().parents[1]


def test_docs_schema_md_is_generated_from_the_schema():
    committed = (ROOT / "docs" / "schema.md").read_text()
    assert committed == schema.render_markdown(), "docs/schema.md is stale: run python -m otel_gpu.schema > docs/schema.md"


def test_every_name_is_dotted_lowercase_and_unique_across_kinds():
    pattern = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)*$")
    reg = schema.REGISTRY
    for table in (reg.attributes, reg.metrics, reg.spans, reg.events):
        for name in table:
            assert pattern.match(name), name
    for metric in reg.metrics.values():
        assert metric.description and metric.unit, metric.name
        for a in metric.attributes:
            assert reg.attributes[a.name] is a, f"{metric.name}: attribute {a.name} is not registered"


def test_failure_record_keys_match_design_contract():
    assert schema.failure.RECORD_KEYS == ("kind", "root_cause", "category", "action", "auto_remediable", "culprit",
                                          "job_id", "onset_time", "detected_time", "confidence", "evidence",
                                          "signature", "recurrence")
    assert schema.failure.REVISION_KEYS == ("failure_id", "version")
    taxonomy = {r.value for r in schema.failure.RootCause}
    for cause in ("gpu_xid", "gpu_fell_off_bus", "gpu_ecc_uncorrectable", "gpu_thermal_throttle", "gpu_power_throttle",
                  "gpu_hw_slowdown", "nvlink_error", "pcie_error", "nic_link_down", "nic_errors",
                  "rank_not_in_collective", "collective_mismatch", "rank_process_died", "cuda_oom", "python_exception",
                  "straggler_compute", "dataloader_stall", "checkpoint_stall", "rank_exited_early", "node_lost",
                  "unknown"):
        assert cause in taxonomy
    span_attrs = {a.name for a in schema.failure.FAILURE_SPAN.attributes}
    for key in schema.failure.RECORD_KEYS + schema.failure.REVISION_KEYS:
        prefix = f"failure.{key}"
        assert any(a == prefix or a.startswith(prefix + ".") for a in span_attrs), key


def test_prometheus_names_follow_otel_compatibility_rules():
    assert prometheus_name("hw.temperature", "Cel", "gauge") == "hw_temperature_celsius"
    assert prometheus_name("hw.gpu.utilization", "1", "gauge") == "hw_gpu_utilization_ratio"
    assert prometheus_name("hw.energy", "J", "counter") == "hw_energy_joules_total"
    assert prometheus_name("otel_gpu.failures", "{failure}", "counter") == "otel_gpu_failures_total"
    assert prometheus_name("nic.rate", "By/s", "gauge") == "nic_rate_bytes_per_second"
