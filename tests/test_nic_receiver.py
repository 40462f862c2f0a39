"""The nic receiver, driven through the fake sysfs inside a real Collector: InfiniBand and Ethernet counters as
cumulative sums and rates, resets and wraps, link state, degraded modes and config errors."""
from __future__ import annotations

import logging
import time

import pytest
import yaml

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.component import ComponentHost
from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.config import ConfigError, build
from otel_gpu.otlp_build import iter_points
from otel_gpu.pdata import Signal
from otel_gpu.receivers.nic import CounterTracker, NicReceiver, NicReceiverConfig
from otel_gpu.schema import REGISTRY
from otel_gpu.testing.fake_sysfs import FakeSysfs


pytestmark = pytest.mark.usefixtures("capture_exporter")


def _yaml(settings: dict) -> str:
    return yaml.safe_dump({"receivers": {"nic": settings}, "exporters": {"capture": {}},
                           "service": {"pipelines": {"metrics": {"receivers": ["nic"], "exporters": ["capture"]}}}})


@pytest.fixture
def fs(tmp_path):
    return FakeSysfs(tmp_path / "sys", {"infiniband": {"mlx5_0": {"ports": {1: {}}}, "mlx5_1": {"ports": {1: {}}}},
                                        "net": {"eth0": {"speed": 100000}, "lo": {}, "veth1234": {}}})


class _Run:
    def __init__(self, settings: dict):
        self.collector = Collector(load_text(_yaml(settings)))

    def __enter__(self):
        self.collector.start()
        self.exporter = self.collector.component("exporter", "capture")
        return self

    def __exit__(self, *exc):
        self.collector.shutdown(5)

    def latest(self, name: str, **match):
        for m, dp, attrs, resource in reversed(self.exporter.points(name)):
            if all(attrs.get(k) == v for k, v in match.items()):
                return m, dp, attrs, resource
        return None

    def value(self, name: str, **match):
        found = self.latest(name, **match)
        if found is None:
            return None
        dp = found[1]
        return dp.as_int if dp.WhichOneof("value") == "as_int" else dp.as_double


def _run(fs: FakeSysfs, **settings) -> _Run:
    return _Run({"sysfs_root": str(fs.root), "interval": "50ms", "host_name": "node-a", **settings})


def test_ib_and_ethernet_counters_are_exported_in_bytes_with_attributes(fs):
    gid = (fs.root / "class/infiniband/mlx5_0/ports/1/gids/0").read_text().split(":")
    ib = {"hw.id": "mlx5_0:1", "hw.name": "mlx5_0", "nic.port": 1, "nic.kind": "infiniband", "hw.type": "network",
          "nic.port.guid": ":".join(g.strip() for g in gid[4:])}
    with _run(fs) as run:
        run.exporter.wait_for(lambda e: run.latest("otel_gpu.nic.io.rate", **ib))
        fs.add_ib("mlx5_0", 1, "port_xmit_data", 1000)  # 1000 four-byte words
        fs.add_ib("mlx5_0", 1, "symbol_error", 7)
        fs.add_ib("mlx5_0", 1, "out_of_buffer", 2)
        fs.add_net_stat("eth0", "rx_bytes", 5000)
        run.exporter.wait_for(lambda e: run.value("hw.network.io", **ib, **{"network.io.direction": "transmit"}) == 4000
                              and run.value("hw.network.io", **{"hw.name": "eth0", "network.io.direction": "receive"})
                              == 5000)
        m, dp, attrs, resource = run.latest("hw.network.io", **ib, **{"network.io.direction": "transmit"})
        assert (m.unit, m.sum.is_monotonic, resource) == ("By", True, {"host.name": "node-a"})
        assert attrs == {**ib, "network.io.direction": "transmit"}
        assert run.value("hw.errors", **ib, **{"error.type": "symbol_error"}) == 7
        assert run.value("hw.errors", **ib, **{"error.type": "link_downed"}) == 0
        assert run.value("otel_gpu.nic.ib.hw_counters", **ib, **{"nic.counter": "out_of_buffer"}) == 2
        # Only the chosen hw_counters; packet-type counters are not errors.
        assert run.latest("otel_gpu.nic.ib.hw_counters", **{"nic.counter": "rx_read_requests"}) is None
        assert run.latest("hw.errors", **{"error.type": "unicast_xmit_packets"}) is None
        assert run.value("otel_gpu.nic.ib.port.state", **ib) == 4
        assert run.value("otel_gpu.nic.ib.port.phys_state", **ib) == 5
        assert run.value("hw.network.up", **ib) == 1
        assert run.value("hw.network.bandwidth.limit", **ib) == 400e9 / 8
        eth = {"hw.id": "eth0", "hw.name": "eth0", "nic.kind": "ethernet", "hw.type": "network"}
        assert run.value("hw.network.up", **eth) == 1
        assert run.value("hw.network.bandwidth.limit", **eth) == 100000 * 1e6 / 8
        assert run.latest("hw.network.up", **{"hw.name": "lo"}) is None
        assert run.latest("hw.network.up", **{"hw.name": "veth1234"}) is None
        # A rate was seen for the 4000 bytes, and it is in bytes per second.
        rates = [dp.as_double for _, dp, a, _ in run.exporter.points("otel_gpu.nic.io.rate")
                 if a["hw.name"] == "mlx5_0" and a["network.io.direction"] == "transmit"]
        assert max(rates) > 4000 and all(r >= 0 for r in rates)
        for m, _, attrs, _ in run.exporter.points():
            assert m.unit == REGISTRY.metrics[m.name].unit
            assert set(attrs) <= {a.name for a in REGISTRY.metrics[m.name].attributes}, m.name


def test_rates_are_exact_per_second_and_survive_a_reset_and_a_32_bit_wrap(fs):
    cfg = build(NicReceiverConfig, {"sysfs_root": str(fs.root), "ethernet": False}, "receivers.nic")
    receiver = NicReceiver(cfg, ComponentHost("nic", PrometheusSelfTelemetry()))
    t = [100.0]
    receiver.clock = lambda: t[0]

    def poll(advance_s: float):
        t[0] += advance_s
        out = {}
        for m, dp, attrs in iter_points(receiver.poll()):
            if attrs.get("hw.name") == "mlx5_0" and attrs.get("network.io.direction", "") in ("transmit", ""):
                key = (m.name, attrs.get("error.type", attrs.get("nic.counter")))
                out[key] = (dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int,
                            dp.start_time_unix_nano)
        return out

    fs.set_ib("mlx5_0", 1, "port_xmit_data", 1_000_000)
    first = poll(0)
    assert ("otel_gpu.nic.io.rate", None) not in first  # no rate from a single reading
    fs.add_ib("mlx5_0", 1, "port_xmit_data", 250_000)  # 1 MB in 2 s
    fs.add_ib("mlx5_0", 1, "link_error_recovery", 3)
    second = poll(2.0)
    assert second[("otel_gpu.nic.io.rate", None)][0] == 500_000.0
    assert second[("otel_gpu.nic.errors.rate", "link_error_recovery")][0] == 1.5
    assert second[("hw.network.io", None)][0] == 5_000_000
    start = second[("hw.network.io", None)][1]
    # Driver reload: every counter back to 0, then some traffic. No negative rate; a new baseline and start time.
    fs.reset_ib("mlx5_0", 1)
    fs.set_ib("mlx5_0", 1, "port_xmit_data", 100)
    third = poll(1.0)
    assert ("otel_gpu.nic.io.rate", None) not in third
    assert ("otel_gpu.nic.errors.rate", "link_error_recovery") not in third
    assert third[("hw.network.io", None)][0] == 400 and third[("hw.network.io", None)][1] > start
    fs.add_ib("mlx5_0", 1, "port_xmit_data", 1000)
    fourth = poll(1.0)
    assert fourth[("otel_gpu.nic.io.rate", None)][0] == 4000.0
    # A 32-bit counter wrapping: the increment is counted through the wrap, cumulative keeps growing.
    fs.set_ib("mlx5_0", 1, "symbol_error", (1 << 32) - 10)
    poll(1.0)
    fs.set_ib("mlx5_0", 1, "symbol_error", 5)
    wrapped = poll(1.0)
    assert wrapped[("otel_gpu.nic.errors.rate", "symbol_error")][0] == 15.0
    assert wrapped[("hw.errors", "symbol_error")][0] == (1 << 32) + 5


def test_counter_tracker_never_gives_a_negative_rate():
    c = CounterTracker(start_ns=1)
    rates = [c.update(v, float(i), i) for i, v in enumerate([10, 20, 5, 7, 3_000_000_000, 100, 2**63 + 5, 4])]
    assert rates[1] == 10.0 and rates[2] is None and rates[3] == 2.0
    assert all(r is None or r >= 0 for r in rates)
    assert rates[5] == 2**32 - 3_000_000_000 + 100  # 32-bit wrap
    assert rates[7] == pytest.approx(2**64 - (2**63 + 5) + 4)  # 64-bit wrap


def test_link_down_is_reported_and_logged_once_per_transition(fs, caplog):
    ib = {"hw.name": "mlx5_1", "nic.port": 1}
    with caplog.at_level(logging.INFO, logger="otel_gpu.receivers.nic.receiver"):
        with _run(fs) as run:
            run.exporter.wait_for(lambda e: run.value("hw.network.up", **ib) == 1)
            fs.set_ib_link("mlx5_1", 1, False)
            fs.set_net_link("eth0", False)
            run.exporter.wait_for(lambda e: run.value("hw.network.up", **ib) == 0
                                  and run.value("hw.network.up", **{"hw.name": "eth0"}) == 0)
            assert run.value("otel_gpu.nic.ib.port.state", **ib) == 1
            assert run.value("otel_gpu.nic.ib.port.phys_state", **ib) == 3
            run.exporter.wait_for(lambda e: run.value("hw.errors", **ib, **{"error.type": "link_downed"}) == 1)
            run.exporter.wait_for(lambda e: run.value("hw.errors", **{"hw.name": "eth0",
                                                                           "error.type": "carrier_changes"}) == 2)
            n = len(run.exporter.batches)
            run.exporter.wait_for(lambda e: len(e.batches) >= n + 3)
            assert run.value("hw.network.up", **{"hw.name": "mlx5_0", "nic.port": 1}) == 1
    downs = [r.getMessage() for r in caplog.records if "is DOWN" in r.getMessage()]
    assert len(downs) == 2 and any("mlx5_1 port 1 is DOWN (state 1: DOWN, phys_state 3: Disabled)" in d
                                   for d in downs), downs


def test_scenario_timeline_drives_symbol_errors_and_rates(tmp_path):
    fs = FakeSysfs(tmp_path / "sys", {
        "infiniband": {"mlx5_0": {"ports": {1: {"rates": {"port_rcv_data": 4.0e6}}}}},
        "timeline": [{"at_s": 0.2, "ib": "mlx5_0/1", "add": {"symbol_error": 250}}]}).start(0.02)
    try:
        ib = {"hw.name": "mlx5_0", "nic.port": 1}
        with _run(fs, ethernet=False) as run:
            run.exporter.wait_for(lambda e: run.value("hw.errors", **ib, **{"error.type": "symbol_error"})
                                  == 250, timeout_s=5)
            rates = [dp.as_double for _, dp, a, _ in run.exporter.points("otel_gpu.nic.io.rate")
                     if a.get("network.io.direction") == "receive"][-5:]
            assert rates and all(1.0e6 < r < 1.6e7 for r in rates), rates  # ~4 MB/s, sampled every 0.05 s
    finally:
        fs.stop()


def test_missing_sysfs_root_is_said_once_and_the_collector_runs_on(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        with _Run({"sysfs_root": str(tmp_path / "nope"), "interval": "50ms", "rescan_interval": "50ms"}) as run:
            time.sleep(0.3)
            assert run.exporter.of(Signal.METRICS) == []
    assert sum("does not exist" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("settings, message", [
    ({"interval": "0s"}, "receivers.nic.interval must be > 0 (got 0.0)"),
    ({"rescan_interval": "-1s"}, "receivers.nic.rescan_interval must be > 0"),
    ({"sysfs_root": ""}, "receivers.nic.sysfs_root must not be empty"),
    ({"infiniband": False, "ethernet": False}, "receivers.nic.infiniband: and ethernet: are both false"),
    ({"hw_counters": "out_of_buffer"}, "receivers.nic.hw_counters: expected a list"),
    ({"sysfs": "/sys"}, "receivers.nic.sysfs: unknown setting (did you mean 'sysfs_root'?"),
])
def test_config_errors_name_the_key(settings, message):
    with pytest.raises(ConfigError) as info:
        load_text(_yaml(settings))
    assert message in str(info.value)


def test_attribution_reads_the_nic_names_hw_errors_split_by_hw_type(fs):
    """NIC errors share hw.errors with the GPUs' ECC errors (semconv): the attribution processor still gets each port's
    error counters (by error.type) and link state, and no GPU point becomes a port."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from otel_gpu.processors.attribution import AttributionProcessor
    from otel_gpu.processors.attribution.config import AttributionConfig
    from otel_gpu.schema import gpu as G

    cfg = build(NicReceiverConfig, {"sysfs_root": str(fs.root), "host_name": "node-a"}, "receivers.nic")
    receiver = NicReceiver(cfg, ComponentHost("nic", PrometheusSelfTelemetry()))
    fs.add_ib("mlx5_0", 1, "symbol_error", 7)
    fs.set_ib_link("mlx5_1", 1, False)
    request = receiver.poll()
    gpu = request.resource_metrics[0].scope_metrics[0].metrics.add(name=G.HW_ERRORS.name, unit="{error}")
    gpu.sum.is_monotonic = True
    dp = gpu.sum.data_points.add(as_int=3, time_unix_nano=time.time_ns())
    for key, value in ((str(G.GPU_ATTRS[0]), 0), ("error.type", "uncorrected"), ("hw.type", "gpu")):
        kv = dp.attributes.add(key=key)
        if isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
    proc = AttributionProcessor(build(AttributionConfig, {}, "processors.attribution"),
                                ComponentHost("attribution", PrometheusSelfTelemetry()))
    seen_nic, seen_gpu = [], []
    proc.engine.observe_nic = seen_nic.append
    proc.engine.observe_gpu = seen_gpu.append
    proc.decoder.metrics(ExportMetricsServiceRequest.FromString(request.SerializeToString()), time.time())
    ports = {s.port: s for s in seen_nic}
    assert ports["mlx5_0/1"].up is True and ports["mlx5_0/1"].counters["symbol_error"] == 7
    assert ports["mlx5_1/1"].up is False and ports["eth0"].up is True
    assert all(p.host == "node-a" for p in seen_nic) and set(ports) == {"mlx5_0/1", "mlx5_1/1", "eth0"}
    assert [s.counters for s in seen_gpu] == [{"ecc_uncorrected": 3.0}]
