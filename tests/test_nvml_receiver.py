"""The nvml receiver, driven through the fake NVML inside a real Collector: what it exports, XID records, degraded
modes and config errors."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pynvml
import pytest
import yaml

from otel_gpu import schema
from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.config import ConfigError
from otel_gpu.otlp_build import iter_points, to_python
from otel_gpu.schema import gpu as G
from otel_gpu.schema.dcgm import render as render_dcgm
from otel_gpu.pdata import Signal
from otel_gpu.testing.fake_nvml import FakeClock, FakeNvml

ROOT = Path(__file__).resolve().parents[1]
SCENARIO_8GPU = ROOT / "tests" / "testdata" / "fake_nvml_8gpu.yaml"
NOT_FOUND_LINE = "NVML library not found: is the NVIDIA driver installed? (nvidia-ml-py needs libnvidia-ml.so.1)"


pytestmark = pytest.mark.usefixtures("capture_exporter")


def _config(settings: dict, logs: bool = True) -> str:
    pipelines = {"metrics": {"receivers": ["nvml"], "exporters": ["capture"]}}
    if logs:
        pipelines["logs"] = {"receivers": ["nvml"], "exporters": ["capture"]}
    return yaml.safe_dump({"receivers": {"nvml": settings}, "exporters": {"capture": {}},
                           "service": {"pipelines": pipelines}})


def _scenario(tmp_path: Path, scenario: dict) -> str:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return str(path)


class _Running:
    def __init__(self, text: str):
        self.collector = Collector(load_text(text))

    def __enter__(self):
        self.collector.start()
        self.exporter = self.collector.component("exporter", "capture")
        self.receiver = self.collector.component("receiver", "nvml")
        return self

    def __exit__(self, *exc):
        self.collector.shutdown(5)


def _fake(tmp_path, scenario: dict, **settings) -> _Running:
    base = {"backend": "fake", "scenario": _scenario(tmp_path, scenario), "interval": "50ms",
            "nvlink_interval": "50ms", "host_name": "node-a"}
    return _Running(_config({**base, **settings}))


def _latest(run: _Running, name: str, **match) -> tuple:
    """The newest point of metric ``name`` whose attributes include ``match``. Newest batches first, decoding only
    until found: the receiver polls every 50 ms, and decoding every batch per lookup grew too slow on a busy machine."""
    for batch in reversed(run.exporter.of(Signal.METRICS)):
        found = None
        for rm in batch.message.resource_metrics:
            single = type(batch.message)()
            single.resource_metrics.add().CopyFrom(rm)
            for m, dp, attrs in iter_points(single):
                if m.name == name and all(attrs.get(k.replace("__", ".")) == v for k, v in match.items()):
                    found = (m, dp, attrs, {kv.key: to_python(kv.value) for kv in rm.resource.attributes})
        if found is not None:
            return found
    return None


def _value(dp):
    return dp.as_int if dp.WhichOneof("value") == "as_int" else dp.as_double


def test_exports_gpu_health_with_identity_units_and_schema_names(tmp_path):
    scenario = {"gpu_count": 2, "gpus": {1: {"gpu_util_pct": 42, "mem_util_pct": 7, "memory_used_mib": 1024,
                                             "memory_total_mib": 81559, "temperature_c": 66,
                                             "memory_temperature_c": 77, "power_w": 512.25, "power_limit_w": 700,
                                             "sm_clock_mhz": 1755, "pstate": 2, "ecc_corrected_aggregate": 5,
                                             "pcie_replay": 3, "pcie_tx_kbps": 10, "nvlink_links": 2,
                                             "nvlink_down": [1], "nvlink_errors": {0: {"crc_flit": 9}},
                                             "remapped_rows_correctable": 4,
                                             "processes": [{"pid": 4242, "used_memory_mib": 1000}]}}}
    with _fake(tmp_path, scenario) as run:
        run.exporter.wait_for(lambda e: _latest(run, "gpu.nvlink.errors", gpu__index=1))
        nv = run.receiver.backend
        uuid1 = nv.gpus[1]["uuid"]
        m, dp, attrs, resource = _latest(run, "hw.gpu.utilization", gpu__index=1)
        assert (m.unit, dp.as_double) == ("1", 0.42)
        assert attrs == {"gpu.index": 1, "hw.id": uuid1, "gpu.pci.bus_id": "00000000:2A:00.0",
                         "hw.model": "NVIDIA H100 80GB HBM3", "hw.vendor": "NVIDIA", "hw.driver_version": "550.54.15",
                         "hw.type": "gpu"}
        assert resource == {"host.name": "node-a"}
        # hw.gpu.memory.utilization is the fraction of memory used (semconv); NVML's utilization.memory (time the
        # memory was read or written) is gpu.memory.activity.
        checks = [("hw.gpu.memory.utilization", {}, "1", 1024 / 81559), ("gpu.memory.activity", {}, "1", 0.07),
                  ("hw.gpu.memory.usage", {}, "By", 1024 << 20),
                  ("hw.gpu.memory.limit", {}, "By", 81559 << 20),
                  ("gpu.memory.free", {}, "By", (81559 - 1024) << 20),
                  ("hw.temperature", {"hw.sensor_location": "gpu"}, "Cel", 66),
                  ("hw.temperature", {"hw.sensor_location": "memory"}, "Cel", 77),
                  ("hw.power", {}, "W", 512.25), ("gpu.power.limit", {}, "W", 700.0),
                  ("gpu.clock.frequency", {"gpu.clock.domain": "sm"}, "MHz", 1755),
                  ("gpu.clock.frequency.max", {"gpu.clock.domain": "sm"}, "MHz", 1980),
                  ("gpu.performance_state", {}, "{pstate}", 2),
                  ("hw.errors", {"error.type": "corrected", "gpu.ecc.counter": "aggregate"}, "{error}", 5),
                  ("hw.errors", {"error.type": "uncorrected", "gpu.ecc.counter": "volatile"}, "{error}", 0),
                  ("gpu.row_remap.rows", {"gpu.row_remap.kind": "correctable"}, "{row}", 4),
                  ("gpu.row_remap.failure", {}, "{flag}", 0),
                  ("gpu.pcie.replay", {}, "{replay}", 3),
                  ("gpu.pcie.throughput", {"network.io.direction": "transmit"}, "By/s", 10 * 1024),
                  ("gpu.nvlink.state", {"gpu.nvlink.link": 0}, "{flag}", 1),
                  ("gpu.nvlink.state", {"gpu.nvlink.link": 1}, "{flag}", 0),
                  ("gpu.nvlink.errors", {"gpu.nvlink.link": 0, "error.type": "crc_flit"}, "{error}", 9),
                  ("gpu.process.memory.usage", {"process.pid": 4242, "gpu.process.type": "compute"}, "By",
                   1000 << 20),
                  ("hw.status", {"hw.state": "ok"}, "1", 1), ("hw.status", {"hw.state": "failed"}, "1", 0)]
        for name, extra, unit, expected in checks:
            found = _latest(run, name, gpu__index=1, **{k.replace(".", "__"): v for k, v in extra.items()})
            assert found is not None, (name, extra)
            m, dp, attrs, _ = found
            assert m.unit == unit == schema.REGISTRY.metrics[name].unit, name
            assert _value(dp) == pytest.approx(expected), (name, extra, _value(dp))
            assert attrs["hw.id"] == uuid1
        # Sums are cumulative (counters monotonic) and carry a start time; links past nvlink_links are not reported.
        m, dp, _, _ = _latest(run, "hw.energy", gpu__index=1)
        assert m.sum.is_monotonic and m.sum.aggregation_temporality == 2 and 0 < dp.start_time_unix_nano
        assert dp.as_double >= 1_000_000.0
        assert not _latest(run, "gpu.nvlink.state", gpu__index=1, gpu__nvlink__link=2)
        assert not _latest(run, "gpu.process.memory.usage", gpu__index=0)
        # Every name exported is in the schema, with the schema's unit and type.
        for m, _, attrs, _ in run.exporter.points():
            definition = schema.REGISTRY.metrics[m.name]
            assert m.unit == definition.unit
            assert m.WhichOneof("data") == ("gauge" if definition.type.value == "gauge" else "sum")
            assert set(attrs) <= {a.name for a in definition.attributes}, m.name


def test_hw_thermal_slowdown_is_decoded_into_named_flags_and_degrades_status(tmp_path):
    scenario = {"gpu_count": 2, "timeline": [
        {"at_s": 0.2, "gpu": 1, "set": {"clocks_event_reasons": ["hw_thermal_slowdown", "sw_power_cap"],
                                        "sm_clock_mhz": 900}}]}
    with _fake(tmp_path, scenario) as run:
        def slowed(_):
            found = _latest(run, "gpu.clock_event.active", gpu__index=1,
                            gpu__clock_event__reason="hw_thermal_slowdown")
            return found if found and found[1].as_int == 1 else None
        run.exporter.wait_for(slowed)
        reasons = {attrs["gpu.clock_event.reason"]: dp.as_int
                   for _, dp, attrs, _ in run.exporter.points("gpu.clock_event.active")[-18:] if attrs["gpu.index"] == 1}
        assert reasons == {r.value: int(r.value in ("hw_thermal_slowdown", "sw_power_cap"))
                           for r in G.ClockEventReason}
        assert _value(_latest(run, "gpu.clock.frequency", gpu__index=1, gpu__clock__domain="sm")[1]) == 900
        assert _latest(run, "hw.status", gpu__index=1, hw__state="degraded")[1].as_int == 1
        assert _latest(run, "hw.status", gpu__index=0, hw__state="ok")[1].as_int == 1
        assert _latest(run, "gpu.clock_event.active", gpu__index=0,
                       gpu__clock_event__reason="hw_thermal_slowdown")[1].as_int == 0


def test_xid_event_arrives_as_a_record_within_one_second_and_is_counted(tmp_path):
    with _fake(tmp_path, {"gpu_count": 4}) as run:
        run.exporter.wait_for(lambda e: e.points("hw.status"))
        nv = run.receiver.backend
        injected = time.time()
        nv.inject({"gpu": 2, "xid": 79})
        records = run.exporter.wait_for(lambda e: e.log_records("gpu.xid"), timeout_s=2)
        arrived = time.time()
        assert arrived - injected < 1.0
        record, attrs, resource = records[0]
        assert record.severity_number == 17 and record.severity_text == "ERROR"  # SEVERITY_NUMBER_ERROR
        assert attrs == {"gpu.index": 2, "hw.id": nv.gpus[2]["uuid"], "gpu.pci.bus_id": "00000000:3A:00.0",
                         "hw.model": "NVIDIA H100 80GB HBM3", "hw.vendor": "NVIDIA", "hw.driver_version": "550.54.15",
                         "hw.type": "gpu", "gpu.xid.code": 79, "gpu.xid.source": "nvml"}
        assert resource == {"host.name": "node-a"}
        body = json.loads(record.body.string_value)
        assert body["code"] == 79 and body["gpu_index"] == 2 and body["source"] == "nvml"
        assert "fallen off the bus" in body["message"]
        assert injected - 0.01 <= record.time_unix_nano / 1e9 <= arrived
        found = run.exporter.wait_for(lambda e: _latest(run, "gpu.xid.errors", gpu__index=2, gpu__xid__code=79))
        assert found[1].as_int == 1 and found[0].sum.is_monotonic


def test_scenario_ecc_double_bit_error_xid_and_lost_gpu(tmp_path):
    scenario = {"gpu_count": 3, "timeline": [
        {"at_s": 0.2, "gpu": 1, "add": {"ecc_uncorrected_volatile": 1, "ecc_uncorrected_aggregate": 1}},
        {"at_s": 0.2, "gpu": 1, "xid": 48},
        {"at_s": 0.3, "gpu": 2, "set": {"remap_failure": 1}},
        {"at_s": 0.4, "gpu": 0, "xid": 79}, {"at_s": 0.45, "gpu": 0, "lost": True}]}
    with _fake(tmp_path, scenario) as run:
        def gpu0_failed(_):
            found = _latest(run, "hw.status", gpu__index=0, hw__state="failed")
            return found is not None and found[1].as_int == 1
        run.exporter.wait_for(gpu0_failed)
        codes = sorted((a["gpu.index"], a["gpu.xid.code"]) for _, a, _ in run.exporter.log_records("gpu.xid"))
        assert codes == [(0, 79), (1, 48)]
        assert _latest(run, "hw.errors", gpu__index=1, error__type="uncorrected",
                       gpu__ecc__counter="volatile")[1].as_int == 1
        assert _latest(run, "hw.status", gpu__index=1, hw__state="degraded")[1].as_int == 1
        assert _latest(run, "gpu.row_remap.failure", gpu__index=2)[1].as_int == 1
        assert _latest(run, "hw.status", gpu__index=2, hw__state="failed")[1].as_int == 1
        # The lost GPU reports only its status; the others keep reporting.
        n = len(run.exporter.batches)
        run.exporter.wait_for(lambda e: len(e.batches) >= n + 2)
        last = run.exporter.of(Signal.METRICS)[-1]
        names0 = {m.name for rm in last.message.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                  for dp in (m.gauge.data_points if m.HasField("gauge") else m.sum.data_points)
                  if any(kv.key == "gpu.index" and kv.value.int_value == 0 for kv in dp.attributes)}
        assert names0 == {"hw.status", "gpu.xid.errors"}
        assert _latest(run, "hw.gpu.utilization", gpu__index=1) is not None


def test_unsupported_field_on_one_gpu_is_skipped_and_logged_once(tmp_path, caplog):
    scenario = {"gpu_count": 2, "gpus": {1: {"not_supported": ["power", "memory_temperature", "nvlink"]}}}
    with caplog.at_level(logging.INFO, logger="otel_gpu.component.nvml"):
        with _fake(tmp_path, scenario) as run:
            run.exporter.wait_for(lambda e: len(e.of(Signal.METRICS)) >= 5)
            assert _latest(run, "hw.power", gpu__index=0) and not _latest(run, "hw.power", gpu__index=1)
            assert _latest(run, "hw.temperature", gpu__index=1, hw__sensor_location="gpu")
            assert not _latest(run, "hw.temperature", gpu__index=1, hw__sensor_location="memory")
            assert not _latest(run, "gpu.nvlink.state", gpu__index=1)
            assert _latest(run, "gpu.nvlink.state", gpu__index=0)
            assert _latest(run, "hw.gpu.utilization", gpu__index=1)
    messages = [r.getMessage() for r in caplog.records if "not available" in r.getMessage()]
    assert sum("GPU 1" in m and "power not available" in m for m in messages) == 1, messages
    assert sum("memory_temperature not available" in m for m in messages) == 1, messages
    assert sum("NVLink not available" in m for m in messages) == 1, messages
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)


def test_library_not_found_is_said_once_and_the_collector_runs_on(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        with _fake(tmp_path, {"library": "missing"}) as run:
            time.sleep(0.3)
            assert run.exporter.batches == []
            assert run.receiver.poll() is None
    lines = [r.getMessage() for r in caplog.records if "NVML library not found" in r.getMessage()]
    assert len(lines) == 1 and NOT_FOUND_LINE in lines[0] and "\n" not in lines[0]


def test_backend_auto_without_a_driver_degrades_the_same_way(caplog):
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver: the degraded mode is tested with the fake")
    with caplog.at_level(logging.INFO):
        with _Running(_config({"interval": "50ms"})) as run:  # backend: auto is the default
            time.sleep(0.2)
            assert run.exporter.batches == []
    assert sum(NOT_FOUND_LINE in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("settings, message", [
    ({"interval": "0s"}, "receivers.nvml.interval must be > 0 (got 0.0)"),
    ({"interval": "-1s"}, "receivers.nvml.interval must be > 0 (got -1.0)"),
    ({"interval": "fast"}, "receivers.nvml.interval: not a duration"),
    ({"interval": 2}, "receivers.nvml.interval: expected a duration such as 5s"),
    ({"interval_s": 2}, "receivers.nvml.interval_s was renamed: write interval: 2s"),
    ({"backend": "dcgm"}, "receivers.nvml.backend must be one of auto, nvml, fake (got 'dcgm')"),
    ({"backend": "fake"}, "receivers.nvml.scenario: required with backend: fake"),
    ({"backend": "fake", "scenario": "/nonexistent.yaml"}, "receivers.nvml.scenario: no such file"),
    ({"nvlink_interval": "-2s"}, "receivers.nvml.nvlink_interval must be >= 0"),
    ({"devices": [0, -1]}, "receivers.nvml.devices[1] must be an NVML index >= 0"),
    ({"intervall": "1s"}, "receivers.nvml.intervall: unknown setting (did you mean 'interval'?"),
])
def test_config_errors_name_the_key(settings, message):
    with pytest.raises(ConfigError) as info:
        load_text(_config(settings))
    assert message in str(info.value)


def test_fake_nvml_is_faithful_to_pynvml_types_and_errors():
    nv = FakeNvml({"gpu_count": 1, "gpus": {0: {"not_supported": ["ecc"]}}})
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(nv.nvmlDeviceGetUtilizationRates(h), pynvml.c_nvmlUtilization_t)
    assert isinstance(nv.nvmlDeviceGetMemoryInfo(h), pynvml.c_nvmlMemory_t)
    assert isinstance(nv.nvmlDeviceGetPciInfo(h), pynvml.nvmlPciInfo_t)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(5)
    es = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(es, 10)
    nv.inject({"gpu": 0, "xid": 31})
    data = nv.nvmlEventSetWait_v2(es, 10)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 31)
    assert nv.nvmlDeviceGetUUID(data.device) == nv.nvmlDeviceGetUUID(h)
    with pytest.raises(AttributeError, match="does not implement nvmlDeviceGetBAR1MemoryInfo"):
        nv.nvmlDeviceGetBAR1MemoryInfo(h)
    # Every function the fake implements exists in pynvml with the same parameter names.
    import inspect
    for name in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetRetiredPages",
                 "nvmlDeviceGetPcieThroughput", "nvmlEventSetWait_v2", "nvmlDeviceRegisterEvents",
                 "nvmlDeviceGetFieldValues", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMemoryInfo"):
        real = list(inspect.signature(getattr(pynvml, name)).parameters)
        fake = list(inspect.signature(getattr(nv, name)).parameters)
        assert fake == real, name


def test_example_scenario_file_plays_out(tmp_path):
    clock = FakeClock()
    nv = FakeNvml(SCENARIO_8GPU, clock=clock)
    nv.nvmlInit()
    h1, h2 = nv.nvmlDeviceGetHandleByIndex(1), nv.nvmlDeviceGetHandleByIndex(2)
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h1) == 0
    clock.advance(2.0)
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h1) == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert nv.nvmlDeviceGetClockInfo(h1, pynvml.NVML_CLOCK_SM) == 900
    clock.advance(4.0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetUtilizationRates(h2)


def test_docs_metrics_dcgm_md_is_generated_from_the_schema():
    committed = (ROOT / "docs" / "metrics-dcgm.md").read_text()
    assert committed == render_dcgm(), ("docs/metrics-dcgm.md is stale: run "
                                        "python -m otel_gpu.schema.dcgm > docs/metrics-dcgm.md")
    for name in ("hw.gpu.utilization", "gpu.xid.errors", "gpu.row_remap.failure", "gpu.pcie.replay"):
        assert schema.REGISTRY.metrics[name].dcgm.startswith("DCGM_FI_")
