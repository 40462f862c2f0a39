"""Grafana dashboards as code, built from the otel-gpu schema with Grafana's grafana-foundation-sdk.

Every query names its metrics through the schema's ``Metric`` objects (``Metric.prometheus_name``) and its labels
through the schema's ``Attr`` objects, so a renamed metric or attribute regenerates the JSON instead of leaving a stale
panel behind. Metrics of a dashboard's schema groups that no curated panel shows get an automatic panel in an
"Other signals" row, so a metric added to the schema is never invisible.

Example:
    python dashboards/generate.py           # writes dashboards/grafana/*.json
    python dashboards/generate.py --check   # exits 1 when the committed JSON differs from the schema's

    >>> import importlib.util, pathlib, sys
    >>> spec = importlib.util.spec_from_file_location("gen", pathlib.Path("dashboards/generate.py"))
    >>> gen = sys.modules["gen"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(gen)
    >>> sorted(gen.build_all())[:2]
    ['otel-gpu-collector.json', 'otel-gpu-failures-goodput.json']
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, dashboard as gdash, piechart, prometheus as gprom, stat
from grafana_foundation_sdk.builders import statetimeline, table, text, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (DashboardCursorSync, DataSourceRef, Threshold, ThresholdsMode,
                                                     VariableRefresh, VariableSort)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from otel_gpu import schema
from otel_gpu.schema import Attr, Metric, MetricType
from otel_gpu.schema import collector as s_collector
from otel_gpu.schema import failure as s_failure
from otel_gpu.schema import gpu as s_gpu
from otel_gpu.schema import health as s_health
from otel_gpu.schema import identity as s_id
from otel_gpu.schema import nic as s_nic
from otel_gpu.schema import training as s_training
from otel_gpu.schema.prom import sanitize

__all__ = ["Query", "PanelSpec", "DashboardSpec", "specs", "build_all", "all_queries", "OUT_DIR", "main"]

OUT_DIR = Path(__file__).resolve().parent / "grafana"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
TAGS = ["otel-gpu"]


def label(a: Attr) -> str:
    """The Prometheus label of an attribute (the exporter sanitizes keys: training.rank -> training_rank)."""
    return sanitize(a.name)


# Dashboard variables: name -> (label, the attribute it filters on).
VARIABLES = {"job": ("Job", s_id.JOB_ID), "host": ("Host", s_id.HOST_NAME), "rank": ("Rank", s_id.RANK),
             "gpu": ("GPU", s_id.GPU_INDEX)}


@dataclass(frozen=True)
class Query:
    """One PromQL target. ``metrics`` are the schema metrics it reads; ``may_be_empty`` marks queries that return
    nothing on a healthy system (a filter for bad states, failures), which the real-Prometheus test allows."""

    expr: str
    legend: str = ""
    metrics: tuple[Metric, ...] = ()
    instant: bool = False
    may_be_empty: bool = False


@dataclass
class PanelSpec:
    title: str
    queries: list[Query]
    kind: str = "timeseries"  # timeseries | stat | table | bargauge | piechart | statetimeline | text
    unit: str = ""
    description: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    thresholds: tuple[tuple[float | None, str], ...] = ()
    content: str = ""  # text panels


@dataclass
class DashboardSpec:
    uid: str
    title: str
    description: str
    filename: str
    variables: tuple[str, ...]
    rows: list[tuple[str, list[PanelSpec]]] = field(default_factory=list)
    groups: tuple[str, ...] = ()  # schema groups whose metrics this dashboard must cover
    anchor: Metric | None = None  # the metric whose label values fill the variables

    def panels(self) -> Iterable[PanelSpec]:
        for _, panels in self.rows:
            yield from panels


# -- PromQL helpers: each takes schema objects and records which metrics a query reads ----------------------------
_VAR_FILTERS = {"job": s_id.JOB_ID, "host": s_id.HOST_NAME, "rank": s_id.RANK, "gpu": s_id.GPU_INDEX}


def sel(m: Metric, variables: Sequence[str], *matchers: tuple[Attr, str, str], suffix: str = "") -> str:
    """``name{variable filters, extra matchers}``; a matcher is ``(attr, op, value)``, e.g. ``(HW_STATE, "!=", "ok")``."""
    parts = [f'{label(_VAR_FILTERS[v])}=~"${v}"' for v in variables]
    for a, op, value in matchers:
        if op not in ("=", "!=", "=~", "!~"):
            raise ValueError(f"bad matcher operator {op!r}")
        parts.append(f'{label(a)}{op}"{value}"')
    return f"{m.prometheus_name}{suffix}{{{','.join(parts)}}}"


def _need(m: Metric, *types: MetricType) -> None:
    if m.type not in types:
        raise TypeError(f"{m.name} is a {m.type.value}; this panel needs {', '.join(t.value for t in types)}")


def by(*attrs: Attr | str) -> str:
    return ", ".join(label(a) if isinstance(a, Attr) else a for a in attrs)


def L(a: Attr) -> str:  # legend placeholder
    return "{{" + label(a) + "}}"


GPU_LEGEND = f"{L(s_id.HOST_NAME)} gpu {L(s_id.GPU_INDEX)}"
RANK_LEGEND = f"rank {L(s_id.RANK)}"


def gauge_q(m: Metric, v: Sequence[str], legend: str = "", agg: str = "", *matchers: tuple[Attr, str, str]
            ) -> Query:
    _need(m, MetricType.GAUGE, MetricType.UPDOWN)
    expr = sel(m, v, *matchers)
    if agg:
        expr = f"{agg} ({expr})"
    return Query(expr, legend, (m,))


def rate_q(m: Metric, v: Sequence[str], legend: str = "", agg: str = "", *matchers: tuple[Attr, str, str]
           ) -> Query:
    _need(m, MetricType.COUNTER)
    expr = f"rate({sel(m, v, *matchers)}[$__rate_interval])"
    if agg:
        expr = f"{agg} ({expr})"
    return Query(expr, legend, (m,))


def increase_q(m: Metric, v: Sequence[str], agg: str, legend: str = "", may_be_empty: bool = False) -> Query:
    _need(m, MetricType.COUNTER)
    expr = f"{agg} (increase({sel(m, v)}[$__range]))"
    return Query(expr, legend, (m,), instant=True, may_be_empty=may_be_empty)


def total_q(m: Metric, v: Sequence[str], agg: str, legend: str = "", may_be_empty: bool = False,
            window: str = "$__range") -> Query:
    """The highest value a cumulative counter reached in the window. For counters whose series is born at its first
    event (failures, XIDs, a job's goodput ledger), where ``increase()`` would miss that first event."""
    _need(m, MetricType.COUNTER)
    expr = f"{agg} (max_over_time({sel(m, v)}[{window}]))"
    return Query(expr, legend, (m,), instant=window == "$__range", may_be_empty=may_be_empty)


def quantile_q(m: Metric, q: float, v: Sequence[str], by_attrs: Sequence[Attr], legend: str) -> Query:
    _need(m, MetricType.HISTOGRAM)
    groups = by("le", *by_attrs)
    expr = (f"histogram_quantile({q}, sum by ({groups}) "
            f"(rate({sel(m, v, suffix='_bucket')}[$__rate_interval])))")
    return Query(expr, legend, (m,))


def _dcgm(*metrics: Metric) -> str:
    names = [m.dcgm for m in metrics if m.dcgm]
    return f" dcgm-exporter: {'; '.join(names)}." if names else ""


def _desc(*metrics: Metric, extra: str = "") -> str:
    text_ = " ".join(f"`{m.prometheus_name}` ({m.name}): {m.description}" for m in metrics)
    return (extra + " " if extra else "") + text_ + _dcgm(*metrics)


def P(title: str, metrics: Sequence[Metric], queries: list[Query], extra: str = "", **kw) -> PanelSpec:
    return PanelSpec(title, queries, description=_desc(*metrics, extra=extra), **kw)


# -- dashboards ---------------------------------------------------------------------------------------------------
def gpu_dashboard() -> DashboardSpec:
    g = s_gpu
    v = ("host", "gpu")
    VOLATILE = (g.ECC_COUNTER, "=", "volatile")
    HW_REASONS = "|".join(r.value for r in (g.ClockEventReason.HW_SLOWDOWN, g.ClockEventReason.HW_THERMAL_SLOWDOWN,
                                            g.ClockEventReason.HW_POWER_BRAKE_SLOWDOWN))
    SM = (g.CLOCK_DOMAIN, "=", "sm")
    d = DashboardSpec("otel-gpu-gpu-health", "otel-gpu / GPU health",
                      "Per-GPU health from the nvml and xid receivers (hw.* semantic conventions; dcgm-exporter "
                      "equivalents in each panel's description).", "otel-gpu-gpu-health.json",
                      ("datasource", "host", "gpu"), groups=(g._G,), anchor=g.UTILIZATION)
    d.rows.append(("Overview", [
        P("GPUs not ok", [g.STATUS],
          [Query(f'count ({sel(g.STATUS, v, (g.HW_STATE, "!=", g.HwState.OK.value))} == 1) or vector(0)', "",
                 (g.STATUS,), instant=True)], kind="stat", width=6, height=4, thresholds=((None, "green"), (1, "red"))),
        P("XIDs seen", [g.XID_ERRORS], [Query(f"sum (max_over_time({sel(g.XID_ERRORS, v)}[$__range])) or vector(0)",
                                             "", (g.XID_ERRORS,), instant=True)],
          kind="stat", width=6, height=4, thresholds=((None, "green"), (1, "red"))),
        P("Uncorrected ECC errors in range", [g.ECC_ERRORS],
          [Query(f'sum (increase({sel(g.ECC_ERRORS, v, (g.ERROR_TYPE, "=", "uncorrected"), VOLATILE)}'
                 f'[$__range])) or vector(0)', "", (g.ECC_ERRORS,), instant=True)],
          kind="stat", width=6, height=4, thresholds=((None, "green"), (1, "red"))),
        P("Clocks held down by hardware", [g.CLOCK_EVENT_ACTIVE],
          [Query(f'count ({sel(g.CLOCK_EVENT_ACTIVE, v, (g.CLOCK_EVENT_REASON, "=~", HW_REASONS))} == 1) '
                 f'or vector(0)', "", (g.CLOCK_EVENT_ACTIVE,), instant=True)],
          kind="stat", width=6, height=4, thresholds=((None, "green"), (1, "orange")),
          extra="Count of GPUs with HW slowdown, HW thermal or HW power brake active."),
        P("GPU state", [g.STATUS], [Query(f"{sel(g.STATUS, v)} == 1", f"{GPU_LEGEND} {L(g.HW_STATE)}", (g.STATUS,))],
          kind="table", width=24, height=6,
          extra="One row per GPU with its current hw.state (ok, degraded, failed)."),
    ]))
    d.rows.append(("Utilization and memory", [
        P("GPU utilization", [g.UTILIZATION], [gauge_q(g.UTILIZATION, v, GPU_LEGEND)], unit="percentunit",
          min=0, max=1),
        P("Memory used (fraction)", [g.MEMORY_UTILIZATION], [gauge_q(g.MEMORY_UTILIZATION, v, GPU_LEGEND)],
          unit="percentunit", min=0, max=1),
        P("Memory bandwidth activity", [g.MEMORY_ACTIVITY], [gauge_q(g.MEMORY_ACTIVITY, v, GPU_LEGEND)],
          unit="percentunit", min=0, max=1),
        P("Device memory used / total", [g.MEMORY_USAGE, g.MEMORY_LIMIT, g.MEMORY_FREE],
          [gauge_q(g.MEMORY_USAGE, v, f"used {GPU_LEGEND}"), gauge_q(g.MEMORY_LIMIT, v, f"total {GPU_LEGEND}"),
           gauge_q(g.MEMORY_FREE, v, f"free {GPU_LEGEND}")], unit="bytes"),
        P("Device memory per process", [g.PROCESS_MEMORY],
          [gauge_q(g.PROCESS_MEMORY, v, f"{GPU_LEGEND} pid {L(s_id.PROCESS_PID)}")], unit="bytes",
          extra="Ties a process (a rank) to its GPU."),
    ]))
    d.rows.append(("Temperature and power", [
        P("Temperature", [g.TEMPERATURE], [gauge_q(g.TEMPERATURE, v, f"{GPU_LEGEND} {L(g.SENSOR)}")],
          unit="celsius"),
        P("Power draw and limit", [g.POWER, g.POWER_LIMIT],
          [gauge_q(g.POWER, v, f"draw {GPU_LEGEND}"), gauge_q(g.POWER_LIMIT, v, f"limit {GPU_LEGEND}")],
          unit="watt"),
        P("Energy (average power over the interval)", [g.ENERGY], [rate_q(g.ENERGY, v, GPU_LEGEND)], unit="watt"),
        P("Performance state", [g.PSTATE], [gauge_q(g.PSTATE, v, GPU_LEGEND)], unit="none",
          extra="0 = P0 (fastest) .. 15; a training GPU should sit at P0."),
    ]))
    d.rows.append(("Clocks and throttle reasons", [
        P("Clock frequency", [g.CLOCK, g.CLOCK_MAX],
          [gauge_q(g.CLOCK, v, f"{GPU_LEGEND} {L(g.CLOCK_DOMAIN)}"),
           gauge_q(g.CLOCK_MAX, v, f"max {GPU_LEGEND} {L(g.CLOCK_DOMAIN)}")], unit="rotmhz"),
        P("Clock ratio to maximum (SM)", [g.CLOCK, g.CLOCK_MAX],
          [Query(f"{sel(g.CLOCK, v, SM)} / ignoring ({label(g.CLOCK_DOMAIN)}) {sel(g.CLOCK_MAX, v, SM)}",
                 GPU_LEGEND, (g.CLOCK, g.CLOCK_MAX))], unit="percentunit", min=0, max=1),
        P("Throttle reasons active", [g.CLOCK_EVENT_ACTIVE],
          [Query(f"{sel(g.CLOCK_EVENT_ACTIVE, v)} == 1", f"{GPU_LEGEND} {L(g.CLOCK_EVENT_REASON)}",
                 (g.CLOCK_EVENT_ACTIVE,), may_be_empty=True)], kind="statetimeline", width=24,
          extra="HW slowdown, HW thermal and HW power brake point at hardware; SW power cap and idle are normal."),
    ]))
    d.rows.append(("ECC, retired pages, row remapping", [
        P("ECC errors per second (volatile)", [g.ECC_ERRORS],
          [rate_q(g.ECC_ERRORS, v, f"{GPU_LEGEND} {L(g.ERROR_TYPE)}", "", VOLATILE)], unit="short"),
        P("ECC errors (aggregate, lifetime)", [g.ECC_ERRORS],
          [Query(sel(g.ECC_ERRORS, v, (g.ECC_COUNTER, "=", "aggregate")), f"{GPU_LEGEND} {L(g.ERROR_TYPE)}",
                 (g.ECC_ERRORS,), instant=True)], kind="table"),
        P("Remapped rows", [g.REMAPPED_ROWS, g.REMAP_PENDING, g.REMAP_FAILURE],
          [gauge_q(g.REMAPPED_ROWS, v, f"{GPU_LEGEND} {L(g.REMAP_KIND)}"),
           gauge_q(g.REMAP_PENDING, v, f"pending {GPU_LEGEND}"),
           gauge_q(g.REMAP_FAILURE, v, f"failure {GPU_LEGEND}")], unit="short",
          extra="A pending remap needs a GPU reset (XID 63); a failure (XID 64) needs service."),
        P("Retired pages", [g.RETIRED_PAGES, g.RETIRED_PENDING],
          [gauge_q(g.RETIRED_PAGES, v, f"{GPU_LEGEND} {L(g.RETIREMENT_CAUSE)}"),
           gauge_q(g.RETIRED_PENDING, v, f"pending {GPU_LEGEND}")], unit="short"),
    ]))
    d.rows.append(("XID errors", [
        P("XIDs by code", [g.XID_ERRORS],
          [total_q(g.XID_ERRORS, v, f"sum by ({by(s_id.HOST_NAME, s_id.GPU_INDEX, g.XID_CODE)})",
                   may_be_empty=True)], kind="table",
          extra="XIDs the collector counted, per GPU and code. 79: fell off the bus; 48/94/95: ECC; 63/64: row remap; 74: NVLink; 119/120: GSP."),
        P("XIDs per second", [g.XID_ERRORS], [rate_q(g.XID_ERRORS, v, f"{GPU_LEGEND} xid {L(g.XID_CODE)}")],
          unit="short"),
    ]))
    d.rows.append(("NVLink and PCIe", [
        P("NVLink links down", [g.NVLINK_STATE],
          [Query(f"{sel(g.NVLINK_STATE, v)} == 0", f"{GPU_LEGEND} link {L(g.NVLINK_LINK)}", (g.NVLINK_STATE,),
                 may_be_empty=True), gauge_q(g.NVLINK_STATE, v, f"{GPU_LEGEND} link {L(g.NVLINK_LINK)}",
                                             agg=f"count by ({by(s_id.HOST_NAME, s_id.GPU_INDEX)})")],
          unit="short", extra="First query: links that are down; second: links reported per GPU."),
        P("NVLink errors per second", [g.NVLINK_ERRORS],
          [rate_q(g.NVLINK_ERRORS, v, f"{GPU_LEGEND} link {L(g.NVLINK_LINK)} {L(g.ERROR_TYPE)}")], unit="short"),
        P("PCIe replays per second", [g.PCIE_REPLAY], [rate_q(g.PCIE_REPLAY, v, GPU_LEGEND)], unit="short"),
        P("PCIe throughput", [g.PCIE_THROUGHPUT],
          [gauge_q(g.PCIE_THROUGHPUT, v, f"{GPU_LEGEND} {L(g.NETWORK_IO_DIRECTION)}")], unit="Bps"),
    ]))
    h = s_health
    d.groups = d.groups + (h._G,)
    dev = f"{L(h.DEVICE_ID)}"
    d.rows.append(("Device health (health processor)", [
        P("Devices to drain / to watch", [h.HEALTH],
          [Query(f"max by ({by(h.DEVICE_ID, h.DEVICE_KIND, s_id.HOST_NAME, h.DEVICE_STATE)}) "
                 f"({sel(h.HEALTH, ('host',), (h.DEVICE_STATE, '!=', 'healthy'))} == 1)", "", (h.HEALTH,),
                 instant=True, may_be_empty=True)],
          kind="table", width=12,
          extra="GPUs, NIC ports and nodes the health processor marks drain or watch now; the evidence and since "
                "when are in `otel-gpu report` and the otel_gpu.device.state_change events."),
        P("Device health score", [h.HEALTH_SCORE],
          [gauge_q(h.HEALTH_SCORE, ("host",), dev)],
          unit="short", width=12, min=0, max=100,
          extra="0 healthy; the sum of the weights of the rules that hold (processors/health/README.md)."),
    ]))
    return d


def nic_dashboard() -> DashboardSpec:
    n = s_nic
    v = ("host",)
    IB = (n.KIND, "=", "infiniband")
    ETH = (n.KIND, "=", "ethernet")
    NET = (s_id.HW_TYPE, "=", "network")
    ib = f"{L(s_id.HOST_NAME)} {L(n.DEVICE)}/{L(n.PORT)}"
    eth = f"{L(s_id.HOST_NAME)} {L(n.DEVICE)}"
    dir_ = L(s_gpu.NETWORK_IO_DIRECTION)
    d = DashboardSpec("otel-gpu-nic-health", "otel-gpu / NIC health",
                      "InfiniBand port counters and Ethernet/RoCE interfaces from the nic receiver (sysfs), on the "
                      "hw.network.* semantic conventions (nic.kind tells ports and interfaces apart). Rising "
                      "symbol errors or link-error recoveries suggest optics or cables; any link_downed increase is a "
                      "flap; xmit discards / xmit_wait suggest congestion.", "otel-gpu-nic-health.json",
                      ("datasource", "host"), groups=(n._G,), anchor=n.UP)
    d.rows.append(("InfiniBand", [
        P("Ports down", [n.UP], [Query(f"{sel(n.UP, v, IB)} == 0", ib, (n.UP,), may_be_empty=True)],
          kind="table", width=8, extra="Ports that are not ACTIVE and LinkUp."),
        P("Port state", [n.IB_STATE, n.IB_PHYS_STATE, n.UP],
          [gauge_q(n.IB_STATE, v, f"state {ib}"), gauge_q(n.IB_PHYS_STATE, v, f"phys {ib}"),
           gauge_q(n.UP, v, f"up {ib}", "", IB)], kind="table", width=8),
        P("Link rate", [n.BANDWIDTH_LIMIT], [gauge_q(n.BANDWIDTH_LIMIT, v, ib, "", IB)], unit="Bps", kind="stat",
          width=8),
        P("Throughput", [n.IO_RATE], [gauge_q(n.IO_RATE, v, f"{ib} {dir_}", "", IB)], unit="Bps"),
        P("Packets per second", [n.PACKETS_RATE], [gauge_q(n.PACKETS_RATE, v, f"{ib} {dir_}", "", IB)], unit="pps"),
        P("Error counters per second", [n.ERRORS_RATE],
          [gauge_q(n.ERRORS_RATE, v, f"{ib} {L(s_gpu.ERROR_TYPE)}", "", IB)], unit="short"),
        P("Vendor hw_counters per second", [n.IB_HW_COUNTERS_RATE],
          [gauge_q(n.IB_HW_COUNTERS_RATE, v, f"{ib} {L(n.COUNTER)}")], unit="short"),
        P("Errors in range", [n.ERRORS, n.IB_HW_COUNTERS],
          [Query(f"sum by ({by(s_id.HOST_NAME, n.DEVICE, n.PORT, s_gpu.ERROR_TYPE)}) "
                 f"(increase({sel(n.ERRORS, v, NET, IB)}[$__range]))", "", (n.ERRORS,), instant=True),
           increase_q(n.IB_HW_COUNTERS, v, f"sum by ({by(s_id.HOST_NAME, n.DEVICE, n.PORT, n.COUNTER)})")],
          kind="table"),
        P("Traffic in range", [n.IO, n.PACKETS],
          [Query(f"sum by ({by(s_id.HOST_NAME, n.DEVICE, n.PORT, s_gpu.NETWORK_IO_DIRECTION)}) "
                 f"(increase({sel(m, v, IB)}[$__range]))", "", (m,), instant=True) for m in (n.IO, n.PACKETS)],
          kind="table"),
    ]))
    d.rows.append(("Ethernet / RoCE", [
        P("Interfaces down", [n.UP], [Query(f"{sel(n.UP, v, ETH)} == 0", eth, (n.UP,), may_be_empty=True)],
          kind="table", width=8),
        P("Link speed", [n.BANDWIDTH_LIMIT], [gauge_q(n.BANDWIDTH_LIMIT, v, eth, "", ETH)], unit="Bps", kind="stat",
          width=8),
        P("Interface up", [n.UP], [gauge_q(n.UP, v, eth, "", ETH)], kind="statetimeline", width=8),
        P("Throughput", [n.IO_RATE], [gauge_q(n.IO_RATE, v, f"{eth} {dir_}", "", ETH)], unit="Bps"),
        P("Packets per second", [n.PACKETS_RATE], [gauge_q(n.PACKETS_RATE, v, f"{eth} {dir_}", "", ETH)],
          unit="pps"),
        P("Errors and drops per second", [n.ERRORS_RATE],
          [gauge_q(n.ERRORS_RATE, v, f"{eth} {L(s_gpu.ERROR_TYPE)}", "", ETH)], unit="short"),
        P("Traffic and errors in range", [n.IO, n.PACKETS, n.ERRORS],
          [Query(f"sum by ({by(s_id.HOST_NAME, n.DEVICE, s_gpu.NETWORK_IO_DIRECTION)}) "
                 f"(increase({sel(m, v, ETH)}[$__range]))", "", (m,), instant=True) for m in (n.IO, n.PACKETS)]
          + [Query(f"sum by ({by(s_id.HOST_NAME, n.DEVICE, s_gpu.ERROR_TYPE)}) "
                   f"(increase({sel(n.ERRORS, v, NET, ETH)}[$__range]))", "", (n.ERRORS,), instant=True)],
          kind="table"),
    ]))
    return d


def training_dashboard() -> DashboardSpec:
    t = s_training
    v = ("job", "host", "rank")
    jr = by(s_id.JOB_ID, s_id.RANK)
    d = DashboardSpec("otel-gpu-training", "otel-gpu / Training",
                      "Steps and collectives from the otel-gpu instrumentation, per job and rank: step time, "
                      "collective time by op, the straggler view and collectives that stopped completing.",
                      "otel-gpu-training.json", ("datasource", "job", "host", "rank"), groups=(t._G,), anchor=t.STEP_DURATION)
    step = sel(t.STEP_DURATION, v)
    job = label(s_id.JOB_ID)
    d.rows.append(("Steps", [
        P("Step time per rank", [t.STEP_DURATION], [gauge_q(t.STEP_DURATION, v, RANK_LEGEND)], unit="s",
          width=24),
        P("Step time relative to the job median (straggler view)", [t.STEP_DURATION],
          [Query(f"max by ({jr}) ({step}) / on ({job}) group_left () "
                 f"quantile by ({job}) (0.5, {sel(t.STEP_DURATION, ('job',))})",
                 RANK_LEGEND, (t.STEP_DURATION,))], unit="percentunit",
          extra="1.0 = the job's median rank. DDP ranks share one step time, so a compute straggler shows as the "
                "others' time inside collectives (next row); a rank well above 1.0 here is slow on its own."),
        P("Slowest ranks now", [t.STEP_DURATION],
          [Query(f"topk(5, max by ({jr}) ({step}))", RANK_LEGEND, (t.STEP_DURATION,), instant=True)],
          kind="bargauge", unit="s"),
    ]))
    cd = t.COLLECTIVE_DURATION
    d.rows.append(("Collectives", [
        P("Collective time p50 by op", [cd], [quantile_q(cd, 0.5, v, (t.COLL_OP,), L(t.COLL_OP))], unit="s"),
        P("Collective time p99 by op", [cd], [quantile_q(cd, 0.99, v, (t.COLL_OP,), L(t.COLL_OP))], unit="s"),
        P("Time inside collectives per rank (s/s)", [cd],
          [Query(f"sum by ({jr}) (rate({sel(cd, v, suffix='_sum')}[$__rate_interval]))", RANK_LEGEND, (cd,))],
          unit="percentunit",
          extra="Fraction of wall time a rank spends in collectives. The straggler is the rank with the *lowest* "
                "share: its peers wait for it inside the collective."),
        P("Collectives completed per second by op", [cd],
          [Query(f"sum by ({by(t.COLL_OP)}) (rate({sel(cd, v, suffix='_count')}[$__rate_interval]))",
                 L(t.COLL_OP), (cd,))], unit="ops"),
    ]))
    d.rows.append(("Stuck collectives", [
        P("Ranks that completed no collective in the last 2 minutes", [cd],
          [Query(f"sum by ({jr}) (increase({sel(cd, v, suffix='_count')}[2m])) == 0", RANK_LEGEND, (cd,),
                 instant=True, may_be_empty=True)], kind="table",
          extra="A rank listed here while its job runs is stuck (or waiting for a rank that is). The hang's "
                "attribution names the culprit: see the Failures dashboard and the otel_gpu.failure spans."),
        P("Collectives completed per second per rank", [cd],
          [Query(f"sum by ({jr}) (rate({sel(cd, v, suffix='_count')}[$__rate_interval]))", RANK_LEGEND, (cd,))],
          unit="ops", extra="Drops to zero when a collective stops progressing."),
        P("Records dropped by the in-process buffer", [t.INSTR_DROPPED],
          [rate_q(t.INSTR_DROPPED, v, RANK_LEGEND, agg=f"sum by ({jr})")], unit="short"),
    ]))
    return d


def failures_dashboard() -> DashboardSpec:
    f = s_failure
    v = ("job",)
    job = by(s_id.JOB_ID)
    d = DashboardSpec("otel-gpu-failures-goodput", "otel-gpu / Failures and goodput",
                      "Failures attributed by otel-gpu (kind, root cause, category) and goodput (ETTR with the badput "
                      "breakdown). The full failure record (culprit rank/host/GPU, evidence, action) is on the "
                      "otel_gpu.failure span: see docs/queries.md for Jaeger and Tempo searches.",
                      "otel-gpu-failures-goodput.json", ("datasource", "job"), groups=(f._G, f._GG), anchor=f.ETTR)
    fc = f.FAILURES
    d.rows.append(("Failures", [
        P("Failures", [fc], [Query(f"sum (max_over_time({sel(fc, v)}[$__range])) or vector(0)", "", (fc,),
                                   instant=True)], kind="stat", width=6, height=6,
          thresholds=((None, "green"), (1, "red"))),
        P("Attribution table", [fc],
          [total_q(fc, v, f"sum by ({by(s_id.JOB_ID, f.KIND, f.ROOT_CAUSE, f.CATEGORY)})", may_be_empty=True)],
          kind="table", width=18, height=6,
          extra="One row per job, kind, root cause and category, with the number of failure records."),
        P("Failures by root cause", [fc],
          [total_q(fc, v, f"sum by ({by(f.ROOT_CAUSE)})", L(f.ROOT_CAUSE), may_be_empty=True)],
          kind="piechart"),
        P("Failures over time by kind (cumulative)", [fc],
          [total_q(fc, v, f"sum by ({by(f.KIND)})", L(f.KIND), may_be_empty=True, window="$__rate_interval")],
          unit="short"),
    ]))
    d.rows.append(("Goodput", [
        P("ETTR (goodput)", [f.ETTR], [gauge_q(f.ETTR, v, L(s_id.JOB_ID))], kind="stat", unit="percentunit",
          width=6, min=0, max=1, thresholds=((None, "red"), (0.8, "orange"), (0.9, "green"))),
        P("ETTR over time", [f.ETTR], [gauge_q(f.ETTR, v, L(s_id.JOB_ID))], unit="percentunit", width=18,
          min=0, max=1),
        P("Badput breakdown", [f.BADPUT],
          [total_q(f.BADPUT, v, f"sum by ({by(f.BADPUT_BUCKET)})", L(f.BADPUT_BUCKET))], kind="bargauge",
          unit="s", extra="Seconds lost per bucket, summed over the selected jobs."),
        P("Productive vs wall time", [f.PRODUCTIVE_TIME, f.WALL_TIME],
          [total_q(f.PRODUCTIVE_TIME, v, f"sum by ({job})", f"productive {L(s_id.JOB_ID)}"),
           total_q(f.WALL_TIME, v, f"sum by ({job})", f"wall {L(s_id.JOB_ID)}")], kind="bargauge", unit="s"),
        P("Badput over time by bucket", [f.BADPUT],
          [rate_q(f.BADPUT, v, L(f.BADPUT_BUCKET), agg=f"sum by ({by(f.BADPUT_BUCKET)})")], unit="percentunit",
          width=24, extra="Seconds lost per second of wall time, stacked by bucket."),
    ]))
    return d


def collector_dashboard() -> DashboardSpec:
    c = s_collector
    v = ("host",)
    comp = f"{L(s_id.COMPONENT)} {L(s_id.SIGNAL)}"
    d = DashboardSpec("otel-gpu-collector", "otel-gpu / Collector",
                      "The collector's own telemetry: what each component received, refused, exported and dropped.",
                      "otel-gpu-collector.json", ("datasource", "host"), groups=(c._G,), anchor=c.RECEIVED)
    agg = f"sum by ({by(s_id.HOST_NAME, s_id.COMPONENT, s_id.SIGNAL)})"
    d.rows.append(("Pipelines", [
        P("Received per second", [c.RECEIVED], [rate_q(c.RECEIVED, v, comp, agg=agg)], unit="short"),
        P("Exported per second", [c.EXPORTED], [rate_q(c.EXPORTED, v, comp, agg=agg)], unit="short"),
        P("Refused per second", [c.REFUSED], [rate_q(c.REFUSED, v, comp, agg=agg)], unit="short"),
        P("Dropped per second", [c.DROPPED], [rate_q(c.DROPPED, v, comp, agg=agg)], unit="short"),
        P("Exporter queue fill", [c.QUEUE_SIZE, c.QUEUE_CAPACITY],
          [gauge_q(c.QUEUE_SIZE, v, f"size {L(s_id.COMPONENT)}"),
           gauge_q(c.QUEUE_CAPACITY, v, f"capacity {L(s_id.COMPONENT)}")], unit="short", width=24),
    ]))
    by_comp = f"sum by ({by(s_id.HOST_NAME, s_id.COMPONENT)})"
    d.rows.append(("Faults", [
        P("Degraded components", [c.DEGRADED], [gauge_q(c.DEGRADED, v, L(s_id.COMPONENT))], unit="short"),
        P("Poison records dropped per second", [c.POISON_RECORDS],
          [rate_q(c.POISON_RECORDS, v, L(s_id.COMPONENT), agg=by_comp)], unit="short"),
        P("Timestamps outside the window per second", [c.OUT_OF_WINDOW],
          [rate_q(c.OUT_OF_WINDOW, v, L(s_id.COMPONENT), agg=by_comp)], unit="short"),
    ]))
    return d


def _auto_panel(m: Metric, variables: Sequence[str]) -> PanelSpec:
    """A panel for a schema metric that no curated panel shows yet."""
    v = [x for x in variables if x != "datasource"]
    if m.type is MetricType.COUNTER:
        q = rate_q(m, v, "", agg="sum by (host_name)")
    elif m.type is MetricType.HISTOGRAM:
        q = quantile_q(m, 0.5, v, (), "p50")
    else:
        q = gauge_q(m, v)
    return P(m.name, [m], [q])


def specs() -> list[DashboardSpec]:
    dashboards = [gpu_dashboard(), nic_dashboard(), training_dashboard(), failures_dashboard(), collector_dashboard()]
    for d in dashboards:
        shown = {m.name for p in d.panels() for q in p.queries for m in q.metrics}
        missing = [m for m in schema.REGISTRY.metrics.values() if m.group in d.groups and m.name not in shown]
        if missing:
            d.rows.append(("Other signals", [_auto_panel(m, d.variables) for m in missing]))
    return dashboards


# -- rendering with the SDK's builders ----------------------------------------------------------------------------
def _variable(name: str, d: DashboardSpec) -> gdash.QueryVariable | gdash.DatasourceVariable:
    if name == "datasource":
        return gdash.DatasourceVariable("datasource").label("Data source").type("prometheus")
    title, attr_ = VARIABLES[name]
    # Scope the values to a metric of the dashboard that carries the label, narrowed by the variables before it.
    anchor = d.anchor or next(q.metrics[0] for p in d.panels() for q in p.queries if q.metrics)
    before = [x for x in d.variables[:d.variables.index(name)] if x != "datasource"]
    metric_sel = sel(anchor, before, suffix="_count" if anchor.type is MetricType.HISTOGRAM else "")
    return (gdash.QueryVariable(name).label(title).datasource(DS)
            .query(f"label_values({metric_sel}, {label(attr_)})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NUMERICAL_ASC if name in ("rank", "gpu") else VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def _panel(p: PanelSpec):
    builders = {"timeseries": timeseries.Panel, "stat": stat.Panel, "table": table.Panel, "bargauge": bargauge.Panel,
                "piechart": piechart.Panel, "statetimeline": statetimeline.Panel, "text": text.Panel}
    b = builders[p.kind]().title(p.title).datasource(DS).span(p.width).height(p.height)
    if p.description:
        b = b.description(p.description)
    if p.unit:
        b = b.unit(p.unit)
    if p.min is not None:
        b = b.min(p.min)
    if p.max is not None:
        b = b.max(p.max)
    if p.thresholds:
        b = b.thresholds(gdash.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
            [Threshold(value=val, color=color) for val, color in p.thresholds]))
    for i, q in enumerate(p.queries):
        target = gprom.Dataquery().expr(q.expr).ref_id(chr(ord("A") + i))
        if q.legend:
            target = target.legend_format(q.legend)
        if q.instant or p.kind in ("table", "stat", "bargauge", "piechart"):
            target = target.instant()
            if p.kind == "table":
                target = target.format(PromQueryFormat.TABLE)
        else:
            target = target.range()
        b = b.with_target(target)
    return b


def _prune(node):
    """Drops nulls and the SDK's placeholder ids, so the JSON is what Grafana itself would save."""
    if isinstance(node, dict):
        return {k: _prune(v) for k, v in node.items()
                if v is not None and not (k == "id" and v in ("00000000-0000-0000-0000-000000000000",))}
    if isinstance(node, list):
        return [_prune(v) for v in node]
    return node


def build(d: DashboardSpec) -> dict:
    b = (gdash.Dashboard(d.title).uid(d.uid).description(d.description).tags(TAGS).refresh("30s")
         .time("now-1h", "now").timezone("browser").tooltip(DashboardCursorSync.CROSSHAIR).editable())
    for name in d.variables:
        b = b.with_variable(_variable(name, d))
    for row_title, panels in d.rows:
        b = b.with_row(gdash.Row(row_title))
        for p in panels:
            b = b.with_panel(_panel(p))
    model = json.loads(JSONEncoder(sort_keys=True).encode(b.build()))
    model = _prune(model)
    for i, panel in enumerate(model["panels"], start=1):  # stable, unique panel ids
        panel["id"] = i
    return model


def build_all() -> dict[str, dict]:
    return {d.filename: build(d) for d in specs()}


def all_queries() -> list[tuple[str, str, Query]]:
    """(dashboard uid, panel title, query) for every target of every panel."""
    return [(d.uid, p.title, q) for d in specs() for p in d.panels() for q in p.queries]


def render_text(model: dict) -> str:
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed JSON; exit 1 on difference")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    models = build_all()
    differ = False
    if not args.check:
        args.out.mkdir(parents=True, exist_ok=True)
    for name, model in models.items():
        path = args.out / name
        new = render_text(model)
        if args.check:
            old = path.read_text(encoding="utf-8") if path.exists() else ""
            if old != new:
                differ = True
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                           str(path), "generated", n=2))
        else:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {path}")
    if args.check:
        stale = sorted(p.name for p in args.out.glob("*.json") if p.name not in models)
        if stale:
            differ = True
            print(f"not generated any more (delete them): {', '.join(stale)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
