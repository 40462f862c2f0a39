"""The xid receiver, following a fake kernel log inside a real Collector: XID records with the GPU mapped from the
PCI bus id (through the fake NVML, or gpu_map), rotation, degraded modes and config errors."""
from __future__ import annotations

import json
import logging
import os
import time

import pytest
import yaml

from otel_gpu.collector.config import load_text
from otel_gpu.collector.runtime import Collector
from otel_gpu.config import ConfigError
from otel_gpu.receivers.xid import parse_line
from otel_gpu.schema import REGISTRY
from otel_gpu.testing.fake_kmsg import FakeKernelLog


pytestmark = pytest.mark.usefixtures("capture_exporter")


def _yaml(settings: dict, receivers: dict | None = None) -> str:
    receivers = {"xid": settings, **(receivers or {})}
    return yaml.safe_dump({"receivers": receivers, "exporters": {"capture": {}},
                           "service": {"pipelines": {"logs": {"receivers": list(receivers), "exporters": ["capture"]}}}})


class _Run:
    def __init__(self, text: str):
        self.collector = Collector(load_text(text))

    def __enter__(self):
        self.collector.start()
        self.exporter = self.collector.component("exporter", "capture")
        return self

    def __exit__(self, *exc):
        self.collector.shutdown(5)


@pytest.fixture
def scenario(tmp_path):
    path = tmp_path / "nvml.yaml"
    path.write_text(yaml.safe_dump({"gpu_count": 8}))
    return str(path)


def test_xid_line_becomes_the_same_record_as_the_nvml_receivers(tmp_path, scenario):
    log = FakeKernelLog(tmp_path / "kmsg")
    log.line("NVRM: loading NVIDIA UNIX x86_64 Kernel Module 550.54.15")
    log.xid("0000:5d:00", 13, pid=1)  # already in the log at start: not reported (from_beginning is false)
    with _Run(_yaml({"path": str(log.path), "backend": "fake", "scenario": scenario, "poll_interval": "20ms",
                     "host_name": "node-a"})) as run:
        time.sleep(0.15)
        written = time.time()
        log.line("random kernel noise")
        log.xid("0000:3a:00", 79, pid=4242)
        records = run.exporter.wait_for(lambda e: e.log_records("gpu.xid"), timeout_s=3)
        assert time.time() - written < 1.0
        time.sleep(0.1)
        records = run.exporter.log_records("gpu.xid")
        assert len(records) == 1
        record, attrs, resource = records[0]
        nv = run.collector.component("receiver", "xid").backend
        assert attrs == {"gpu.index": 2, "hw.id": nv.gpus[2]["uuid"], "gpu.pci.bus_id": "00000000:3A:00.0",
                         "hw.model": "NVIDIA H100 80GB HBM3", "hw.vendor": "NVIDIA", "hw.type": "gpu",
                         "gpu.xid.code": 79,
                         "gpu.xid.source": "kmsg", "process.pid": 4242}
        assert resource == {"host.name": "node-a"}
        assert record.event_name == "gpu.xid" and record.severity_text == "ERROR"
        body = json.loads(record.body.string_value)
        assert body == {"code": 79, "gpu_index": 2, "uuid": nv.gpus[2]["uuid"], "pci_bus_id": "00000000:3A:00.0",
                        "time_unix": body["time_unix"], "source": "kmsg", "pid": 4242,
                        "message": "pid=4242, name=python, GPU has fallen off the bus."}
        assert abs(body["time_unix"] - written) < 1.0  # placed on the wall clock from the kmsg timestamp
        # Same event name, same attribute keys as the schema's gpu.xid event.
        assert set(attrs) <= {a.name for a in REGISTRY.events["gpu.xid"].attributes}


def test_gpu_map_without_nvml_and_syslog_lines_and_rotation(tmp_path):
    log = FakeKernelLog(tmp_path / "kern.log", syslog=True)
    with _Run(_yaml({"path": str(log.path), "backend": "none", "gpu_map": {"0000:07:00": 5},
                     "poll_interval": "20ms"})) as run:
        time.sleep(0.1)
        log.xid("0000:07:00", 48)
        log.xid("0000:99:00", 94, pid=77)
        run.exporter.wait_for(lambda e: len(e.log_records("gpu.xid")) == 2, timeout_s=3)
        log.rotate()
        log.xid("0000:07:00", 63)
        run.exporter.wait_for(lambda e: len(e.log_records("gpu.xid")) == 3, timeout_s=3)
        got = [(a.get("gpu.index"), a["gpu.pci.bus_id"], a["gpu.xid.code"], a.get("process.pid"))
               for _, a, _ in run.exporter.log_records("gpu.xid")]
        assert got == [(5, "00000000:07:00.0", 48, None), (None, "00000000:99:00.0", 94, 77),
                       (5, "00000000:07:00.0", 63, None)]


def test_a_log_file_that_appears_later_is_read_from_its_start(tmp_path, caplog):
    path = tmp_path / "later.log"
    with caplog.at_level(logging.WARNING):
        with _Run(_yaml({"path": str(path), "backend": "none", "poll_interval": "20ms"})) as run:
            time.sleep(0.1)
            FakeKernelLog(path).xid("0000:3b:00", 31)
            run.exporter.wait_for(lambda e: e.log_records("gpu.xid"), timeout_s=3)
    assert sum("cannot open" in r.getMessage() for r in caplog.records) == 1


def test_from_beginning_reports_xids_already_in_the_log(tmp_path):
    log = FakeKernelLog(tmp_path / "kmsg")
    log.xid("0000:3b:00", 119)
    with _Run(_yaml({"path": str(log.path), "backend": "none", "from_beginning": True})) as run:
        run.exporter.wait_for(lambda e: e.log_records("gpu.xid"), timeout_s=3)


def test_dev_kmsg_not_readable_is_said_once_and_the_collector_runs_on(caplog):
    if os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is readable here; the unreadable case cannot be shown")
    with caplog.at_level(logging.INFO):
        with _Run(_yaml({"backend": "none"})) as run:
            time.sleep(0.1)
            assert run.exporter.batches == []
    lines = [r.getMessage() for r in caplog.records if "cannot read /dev/kmsg" in r.getMessage()]
    assert len(lines) == 1 and "receivers.xid.path" in lines[0]


def test_parse_line_variants():
    x = parse_line("4,881,123456789,-;NVRM: Xid (PCI:0000:b1:00): 95, pid=2211, name=pt_main_thread, "
                   "Uncontained: FBHUB. RST: Yes, D-RST: No")
    assert (x.code, x.pci, x.pid, x.monotonic_us) == (95, "00000000:B1:00.0", 2211, 123456789)
    assert parse_line("[  402.1] NVRM: Xid (PCI:0000:07:00.0): 74, NVLink: fatal error").pci == "00000000:07:00.0"
    assert parse_line("NVRM: GPU at PCI:0000:07:00: GPU-1234") is None
    assert parse_line("NVRM: Xid (PCI:zz): 1, x") is None


@pytest.mark.parametrize("settings, message", [
    ({"backend": "dcgm"}, "receivers.xid.backend must be one of auto, nvml, fake, none (got 'dcgm')"),
    ({"backend": "fake"}, "receivers.xid.scenario: required with backend: fake"),
    ({"gpu_map": {"nonsense": 1}}, "receivers.xid.gpu_map.nonsense: not a PCI bus id"),
    ({"gpu_map": {"0000:3b:00": -1}}, "receivers.xid.gpu_map.0000:3b:00 must be a GPU index >= 0"),
    ({"poll_interval": "0s"}, "receivers.xid.poll_interval must be > 0"),
    ({"pth": "/x"}, "receivers.xid.pth: unknown setting (did you mean 'path'?"),
])
def test_config_errors_name_the_key(settings, message):
    with pytest.raises(ConfigError) as info:
        load_text(_yaml(settings))
    assert message in str(info.value)


def test_an_endless_line_without_newline_is_skipped_and_memory_stays_bounded(tmp_path, caplog):
    """A file that is not a kernel log (one huge line, no newline) must not grow the follower's buffer forever; XID
    lines after it are still read."""
    import yaml

    from otel_gpu.collector.config import load_text
    from otel_gpu.collector.runtime import Collector

    log = tmp_path / "kern.log"
    log.write_bytes(b"x" * 300_000)
    config = {"receivers": {"xid": {"path": str(log), "from_beginning": True, "backend": "nvml",
                                    "gpu_map": {"0000:3b:00.0": 2}, "poll_interval": "50ms"}},
              "exporters": {"capture": {}},
              "service": {"pipelines": {"logs": {"receivers": ["xid"], "exporters": ["capture"]}}}}
    collector = Collector(load_text(yaml.safe_dump(config)))
    collector.start()
    try:
        with log.open("ab") as f:
            f.write(b"\nNVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n")
        capture = collector.component("exporter", "capture")
        assert capture.wait_for(lambda e: e.log_records(), timeout_s=5)
    finally:
        collector.shutdown()
    assert "without a newline; it is skipped" in caplog.text  # the partial line was dropped, not kept growing
