"""Device health (issue 15): the health processor driven through the real nvml and nic receivers over the fake NVML
and fake sysfs in compressed time, the store's device history across jobs and restarts, the report's devices
section, and attribution using the history."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import DEVICE_HISTORY, ComponentHost, Services
from otel_gpu.config import ConfigError, build
from otel_gpu.exporters.store import StoreExporter, StoreExporterConfig, db
from otel_gpu.otlp_build import iter_points
from otel_gpu.pdata import Batch, Signal
from otel_gpu.processors.attribution import AttributionConfig, AttributionProcessor
from otel_gpu.failure import Culprit, FailureRecord
from otel_gpu.processors.health import HealthConfig, HealthProcessor
from otel_gpu.receivers.nic import NicReceiver
from otel_gpu.receivers.nic.config import NicReceiverConfig
from otel_gpu.receivers.nvml import NvmlReceiver
from otel_gpu.receivers.nvml.config import NvmlReceiverConfig
from otel_gpu.commands.report import build_report, format_text
from otel_gpu.schema import failure as F
from otel_gpu.schema import health as H
from otel_gpu.testing.fake_nvml import FakeClock, FakeNvml
from otel_gpu.testing.fake_sysfs import FakeSysfs

HOST = "node-a"


class _Sink:
    """Keeps what a component emits; forwards to ``then`` (e.g. a store exporter) when given."""

    def __init__(self, then=None):
        self.batches: list[Batch] = []
        self.then = then

    def consume(self, batch: Batch) -> None:
        self.batches.append(batch)
        if self.then is not None:
            self.then.export(batch)


class _Into:
    """A receiver's consumer: the health processor, then a sink."""

    def __init__(self, proc, sink):
        self.proc, self.sink = proc, sink

    def consume(self, batch: Batch) -> None:
        out = self.proc.process(batch)
        if out is not None:
            self.sink.consume(out)


def _yaml(settings: dict) -> dict:
    """Python field names (``warmup_s=0``) as the YAML keys users write (``warmup: 0s``)."""
    return {(k[:-2] if k.endswith("_s") else k): (f"{v}s" if k.endswith("_s") else v) for k, v in settings.items()}


def _health(clock, services=None, store=None, **settings) -> tuple[HealthProcessor, _Sink]:
    sink = _Sink(store)
    host = ComponentHost("health", PrometheusSelfTelemetry(), {Signal.METRICS: sink, Signal.LOGS: sink},
                         services if services is not None else {})
    proc = HealthProcessor(build(HealthConfig, _yaml(settings), "processors.health"), host)
    proc._clock = clock
    return proc, sink


def _states(proc) -> dict[str, str]:
    return {d["device_id"]: d["state"] for d in proc.service.states()}


# -- 1. climbing correctable ECC until an uncorrectable error ------------------------------------------------------
def test_climbing_ecc_is_drained_before_the_uncorrectable_error_and_a_dirty_stable_gpu_stays_healthy(monkeypatch,
                                                                                                   tmp_path):
    rng = random.Random(15)
    clock = FakeClock(1_000_000.0)
    # GPU 1 starts dirty: thousands of lifetime correctable errors and a steady ~3/min; GPU 0 is clean, then degrades.
    fake = FakeNvml({"gpu_count": 2, "gpus": {1: {"ecc_corrected_aggregate": 48_000, "ecc_corrected_volatile": 5_000,
                                                  "remapped_rows_correctable": 6, "retired_pages_sbe": 2}}},
                    clock=clock)
    monkeypatch.setattr(NvmlReceiver, "_load_backend", lambda self: fake)
    proc, sink = _health(clock)
    rx_host = ComponentHost("nvml", PrometheusSelfTelemetry(), {Signal.METRICS: _Into(proc, sink),
                                                                Signal.LOGS: _Into(proc, sink)})
    (tmp_path / "scenario.yaml").write_text("gpu_count: 2\n")  # the config needs one; the fake above has the clock
    settings = {"backend": "fake", "scenario": str(tmp_path / "scenario.yaml"), "interval": "1h",
                "nvlink_interval": "0s", "host_name": HOST}
    rx = NvmlReceiver(build(NvmlReceiverConfig, settings, "receivers.nvml"), rx_host)
    rx.start()  # real poll thread (one poll, then an hour of real time) and the real XID event thread
    try:
        deadline = time.monotonic() + 10
        while fake.calls["nvmlDeviceGetUtilizationRates"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        uuid0, uuid1 = fake.gpus[0]["uuid"], fake.gpus[1]["uuid"]
        gpu0, gpu1 = f"gpu:{uuid0}", f"gpu:{uuid1}"
        start = clock.now
        climb_at = start + 40 * 60  # 40 quiet minutes, then an hour of climbing correctable errors
        fail_at = climb_at + 60 * 60
        drained_at = None
        while clock.now < fail_at + 120:
            clock.advance(10.0)
            minutes = (clock.now - climb_at) / 60.0
            rate0 = 0.3 if minutes < 0 else 0.3 * 2 ** (minutes / 7.0)  # per minute: doubles every 7 minutes
            fake.inject({"gpu": 0, "add": {"ecc_corrected_volatile": _poisson(rng, rate0 / 6)}})
            fake.inject({"gpu": 1, "add": {"ecc_corrected_volatile": _poisson(rng, 3.0 / 6)}})
            if clock.now >= fail_at and not fake.gpus[0]["ecc_uncorrected_volatile"]:
                fake.inject({"gpu": 0, "add": {"ecc_uncorrected_volatile": 1}, "xid": 48})
            request = rx.poll()
            rx_host.consumer(Signal.METRICS).consume(Batch.from_message(Signal.METRICS, request))
            proc.evaluate()
            states = _states(proc)
            assert states.get(gpu1, "healthy") == "healthy", f"the dirty-but-stable GPU was flagged at " \
                                                            f"{clock.now - start:.0f} s: {proc.service.states()}"
            if drained_at is None and states.get(gpu0) == "drain":
                drained_at = clock.now
        assert drained_at is not None and drained_at < fail_at, proc.changes
        lead_min = (fail_at - drained_at) / 60
        assert lead_min >= 5, f"drained only {lead_min:.1f} min before the failure"
        dev0 = next(d for d in proc.service.states() if d["device_id"] == gpu0)
        assert dev0["rules"][0] in ("ecc_uncorrected", "ecc_corrected_rate", "xid_drain")
        assert any("correctable ECC errors" in e for e in dev0["evidence"]) or \
            any(c["device_id"] == gpu0 and "correctable ECC" in " ".join(c["evidence"]) for c in proc.changes)
        # the XID 48 came through the real event thread of the receiver and counts as a drain XID
        wait_until(lambda: (proc.evaluate() or True) and any(
            "XID 48" in e for d in proc.service.states() if d["device_id"] == gpu0 for e in d["evidence"]))
        assert _states(proc)[f"node:{HOST}"] == "drain"
        # The state change went out as an event; the health metric carries the state per device.
        events = [json.loads(r.body.string_value) for b in sink.batches if b.signal is Signal.LOGS
                  for rl in b.message.resource_logs for sl in rl.scope_logs for r in sl.log_records
                  if r.event_name == H.STATE_CHANGE_EVENT.name]
        to_drain = [e for e in events if e["device_id"] == gpu0 and e["state"] == "drain"]
        assert to_drain and to_drain[0]["previous"] in ("healthy", "watch") and to_drain[0]["since"] == drained_at
        last = [b for b in sink.batches if b.signal is Signal.METRICS and any(
            m.name == H.HEALTH.name for rm in b.message.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics)][-1]
        points = {(a[str(H.DEVICE_ID)], a[str(H.DEVICE_STATE)]): p.as_int
                  for m, p, a in iter_points(last.message) if m.name == H.HEALTH.name}
        assert points[(gpu0, "drain")] == 1 and points[(gpu0, "healthy")] == 0
        assert points[(gpu1, "healthy")] == 1
    finally:
        rx.shutdown(2)


def _poisson(rng: random.Random, lam: float) -> int:
    n, p, limit = 0, 1.0, pow(2.718281828, -min(lam, 500.0))
    if lam > 30:  # normal approximation keeps the loop short
        return max(0, int(rng.gauss(lam, lam ** 0.5) + 0.5))
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# -- 2. a NIC that flaps every few minutes -------------------------------------------------------------------------
def test_nic_port_flapping_every_few_minutes_goes_watch_then_drain_and_the_quiet_port_stays_healthy(tmp_path):
    t = [500_000.0]
    clock = lambda: t[0]  # noqa: E731
    fs = FakeSysfs(tmp_path, {"infiniband": {"mlx5_0": {"ports": {1: {"counters": {"symbol_error": 12}}}},
                                             "mlx5_1": {"ports": {1: {"counters": {"symbol_error": 40_000,
                                                                                    "link_downed": 3}}}}}},
                   clock=clock)
    proc, sink = _health(clock)
    rx = NicReceiver(build(NicReceiverConfig, {"sysfs_root": str(tmp_path), "host_name": HOST, "ethernet": False},
                           "receivers.nic"), ComponentHost("nic", PrometheusSelfTelemetry(), {}))
    rx.clock = clock
    rx._scan()
    flappy, quiet = f"nic:{HOST}/mlx5_0/1", f"nic:{HOST}/mlx5_1/1"
    seen: dict[str, float] = {}
    start = t[0]
    for step in range(6 * 60):  # one hour in 10 s polls
        t[0] += 10.0
        minute = (t[0] - start) / 60
        if minute >= 10 and step % 24 == 0:  # every 4 minutes from minute 10: down and back up
            fs.set_ib_link("mlx5_0", 1, False)
            fs.set_ib_link("mlx5_0", 1, True)
        fs.add_ib("mlx5_1", 1, "symbol_error", 2)  # dirty but steady
        request = rx.poll()
        if request is not None:
            proc.process(Batch.from_message(Signal.METRICS, request))
        proc.evaluate()
        for did, state in _states(proc).items():
            seen.setdefault(f"{did}:{state}", t[0] - start)
    assert f"{flappy}:watch" in seen and f"{flappy}:drain" in seen
    assert seen[f"{flappy}:watch"] < seen[f"{flappy}:drain"] <= 30 * 60, seen
    assert f"{quiet}:watch" not in seen and f"{quiet}:drain" not in seen
    dev = next(d for d in proc.service.states() if d["device_id"] == flappy)
    assert dev["rules"][0] == "nic_link_flaps" and "link went down" in dev["evidence"][0]
    assert _states(proc)[f"node:{HOST}"] == "drain"
    # the port is known by its GUID (GID 0's low 64 bits), as a re-cabled or renamed port would be recognised
    gid = (tmp_path / "class/infiniband/mlx5_0/ports/1/gids/0").read_text().strip()
    assert dev["guid"] == ":".join(gid.split(":")[4:]) and dev["guid"] != "0000:0000:0000:0000"


# -- 3. the same GPU, culprit of three jobs in a row; history in the store, attribution uses it ---------------------
def _store(tmp_path, services):
    host = ComponentHost("store", PrometheusSelfTelemetry(), {}, services)
    store = StoreExporter(build(StoreExporterConfig, {"path": str(tmp_path / "store")}, "exporters.store"), host)
    store.start()
    return store


def _attribution(services, store) -> AttributionProcessor:
    sink = _Sink(store)
    host = ComponentHost("attribution", PrometheusSelfTelemetry(), {Signal.LOGS: sink}, services)
    return AttributionProcessor(AttributionConfig(), host)


@pytest.fixture
def history(tmp_path):
    """A store, a health processor on a clock the test moves (``now[0]``) and an attribution processor that publishes
    into both, sharing their services."""
    from types import SimpleNamespace

    services = Services()
    store = _store(tmp_path, services)
    try:
        now = [time.time()]
        proc, _ = _health(lambda: now[0], services=services, store=store)
        yield SimpleNamespace(services=services, store=store, now=now, proc=proc,
                              attribution=_attribution(services, store))
    finally:
        store.shutdown(5)


def _failure(job: str, onset: float, uuid: str, host: str = HOST, cause=F.RootCause.GPU_XID) -> FailureRecord:
    return FailureRecord(kind=F.Kind.CRASH, root_cause=cause, job_id=job, onset_time=onset, detected_time=onset + 2,
                         confidence=0.8, culprit=Culprit(rank=0, host=host, gpu=uuid), details={"xid": 79},
                         evidence=[f"gpu.xid=79 @{onset:.3f}"], summary="GPU fell off the bus")


def test_gpu_culprit_of_three_jobs_in_a_row_is_a_recurring_culprit_and_drained(tmp_path):
    services = Services()
    store = _store(tmp_path, services)
    try:
        now = [time.time()]
        proc, _ = _health(lambda: now[0], services=services, store=store)
        proc.start()
        proc.shutdown()  # no background evaluation: the test calls evaluate()
        attribution = _attribution(services, store)
        uuid, other = "GPU-00000003-fa6e-4a11-8000-00000000c0ff", "GPU-00000007-fa6e-4a11-8000-00000000c0ff"
        proc.engine.gpu(HOST, uuid, now[0], index=3)
        proc.engine.gpu(HOST, other, now[0], index=7)
        proc.evaluate()
        records = []
        for n, job in enumerate(("job-1", "job-2", "job-3")):
            now[0] += 3600
            record = _failure(job, now[0], uuid)
            attribution._publish(record)
            records.append(record)
            assert store.force_flush(5)
        first, second, third = records
        assert "recurring_culprit" not in first.details and "recurring_culprit" not in second.details
        rec = third.details["recurring_culprit"]
        assert rec["device_id"] == f"gpu:{uuid}" and rec["failures"] == 3 and rec["jobs"] == ["job-1", "job-2", "job-3"]
        assert any(e.startswith(f"recurring culprit: gpu:{uuid}") for e in third.evidence)
        assert "recurring culprit" in third.summary
        assert third.details["devices"] == [f"gpu:{uuid}", f"node:{HOST}"]
        # The store answers per device: this GPU, three failures, which jobs, over what period.
        with db.open_reader(tmp_path / "store") as conn:
            counts = db.culprit_counts(conn)
        assert counts[f"gpu:{uuid}"]["failures"] == 3 and counts[f"gpu:{uuid}"]["jobs"] == ["job-1", "job-2", "job-3"]
        assert counts[f"gpu:{uuid}"]["last"] - counts[f"gpu:{uuid}"]["first"] == pytest.approx(7200, abs=1)
        assert f"gpu:{other}" not in counts
        # The health processor reads the same history: the GPU is drained as a recurring culprit.
        now[0] += 61
        proc.evaluate()
        states = _states(proc)
        assert states[f"gpu:{uuid}"] == "drain" and states[f"gpu:{other}"] == "healthy"
        dev = next(d for d in proc.service.states() if d["device_id"] == f"gpu:{uuid}")
        assert dev["rules"][0] == "recurring_culprit" and "job-1, job-2, job-3" in dev["evidence"][0]
        # A fourth failure on a device already in drain: its history is evidence, hardware confidence goes up.
        now[0] += 3600
        fourth = _failure("job-4", now[0], uuid)
        attribution._publish(fourth)
        assert fourth.confidence == pytest.approx(0.95)
        assert any(f"device gpu:{uuid} was drain since" in e for e in fourth.evidence)
        # ... but a user error on that node is not made more "hardware" by it.
        fifth = _failure("job-5", now[0] + 10, uuid, cause=F.RootCause.PYTHON_EXCEPTION)
        attribution._publish(fifth)
        assert fifth.confidence == pytest.approx(0.8)
        assert store.force_flush(5)
    finally:
        store.shutdown(5)


# -- 4. history across collector restarts, the report's devices section, the verdict query -------------------------
def test_device_states_survive_a_collector_restart_and_show_in_the_report(tmp_path):
    services = Services()
    store = _store(tmp_path, services)
    now = [time.time()]
    try:
        proc, _ = _health(lambda: now[0], services=services, store=store, warmup_s=0)
        gpu = proc.engine.gpu(HOST, "GPU-dead", now[0], index=5)
        proc.engine.gpu(HOST, "GPU-fine", now[0], index=6)
        proc.engine.flag(gpu, "remap_failure", 1, now[0])
        proc.evaluate()
        attribution = _attribution(services, store)
        attribution._publish(_failure("job-9", now[0] + 5, "5"))  # culprit by index: resolved to its UUID
        assert store.force_flush(5)
    finally:
        store.shutdown(5)
    report = build_report(str(tmp_path / "store"))
    devices = {d["device_id"]: d for d in report["devices"]}
    assert set(devices) == {"gpu:GPU-dead", f"node:{HOST}"}  # drain and watch only; the healthy GPU is not listed
    dead = devices["gpu:GPU-dead"]
    assert dead["state"] == "drain" and dead["gpu_index"] == 5 and dead["rules"] == ["row_remap_failure"]
    assert dead["failures"]["failures"] == 1 and dead["failures"]["jobs"] == ["job-9"]
    text = format_text(report)
    assert "devices to drain (2):" in text and "gpu:GPU-dead on node-a (GPU 5): drain since" in text
    assert "row remap failure" in text and "jobs hurt: job-9" in text
    # A new collector on the same store: the drain is remembered (not announced again), and served as the verdict.
    services2 = Services()
    store2 = _store(tmp_path, services2)
    try:
        proc2, sink2 = _health(lambda: now[0] + 60, services=services2, store=store2)
        proc2.start()
        proc2.shutdown()
        assert _states(proc2)["gpu:GPU-dead"] == "drain"
        assert _states(proc2)[f"node:{HOST}"] == "drain"
        with db.open_reader(tmp_path / "store") as conn:
            verdict = db.device_states(conn, ("drain",))
        assert [d["device_id"] for d in verdict] == ["gpu:GPU-dead", f"node:{HOST}"]
    finally:
        store2.shutdown(5)


# -- rules and config ------------------------------------------------------------------------------------------------
def test_a_noisy_device_is_judged_against_its_own_baseline():
    proc, _ = _health(lambda: 0.0, warmup_s=1800)
    eng = proc.engine
    rng = random.Random(3)
    noisy = eng.gpu("n", "GPU-noisy", 0.0)
    value = 1_000_000.0
    t = 0.0
    for _ in range(6 * 60 * 8):  # 8 hours at 10 s: ~40 PCIe replays a minute, far above watch_min_count per window
        t += 10.0
        value += _poisson(rng, 40 / 6)
        eng.counter(noisy, "pcie_replay", value, t)
        assert not eng.evaluate(t) or noisy.state is H.DeviceState.HEALTHY
    assert noisy.state is H.DeviceState.HEALTHY
    for _ in range(6 * 15):  # then 10x its usual rate for 15 minutes
        t += 10.0
        value += _poisson(rng, 400 / 6)
        eng.counter(noisy, "pcie_replay", value, t)
        eng.evaluate(t)
    assert noisy.state is H.DeviceState.WATCH and noisy.hits[0].rule == "pcie_replay_rate"
    assert "baseline" in noisy.hits[0].evidence


def test_memory_stays_bounded_by_max_devices():
    proc, _ = _health(lambda: 0.0, max_devices=50)
    for i in range(500):
        proc.engine.gpu(f"n{i}", f"GPU-{i}", float(i))
    assert len(proc.engine.devices) == 50 and proc.engine.forgotten > 0


@pytest.mark.parametrize("settings, key", [
    ({"sample_interval": "0s"}, "sample_interval"), ({"drain_factor": 2, "watch_factor": 4}, "drain_factor"),
    ({"short_window": "30s"}, "short_window"), ({"flaps_drain": 1}, "flaps_drain"),
    ({"throttle_watch_fraction": 1.5}, "throttle_watch_fraction"), ({"max_devices": 0}, "max_devices"),
])
def test_config_errors_name_the_key(settings, key):
    with pytest.raises(ConfigError) as info:
        build(HealthConfig, settings, "processors.health")
    assert f"processors.health.{key}" in str(info.value) or key in str(info.value)


def test_health_processor_in_a_collector_config_loads():
    from otel_gpu.collector.config import load_text

    text = """
receivers: {otlp: {}}
processors: {health: {sample_interval: 5s}}
exporters: {debug: {}}
service:
  pipelines:
    metrics: {receivers: [otlp], processors: [health], exporters: [debug]}
    logs: {receivers: [otlp], processors: [health], exporters: [debug]}
"""
    cfg = load_text(text)
    assert cfg.component("processor", "health").config.sample_interval_s == 5.0


def test_evaluation_thread_runs_and_stops():
    proc, sink = _health(time.time, evaluate_interval_s=0.05)
    proc.engine.gpu("n", "GPU-x", time.time())
    proc.start()
    try:
        wait_until(lambda: any(b.signal is Signal.METRICS for b in sink.batches), 5)
    finally:
        proc.shutdown(2)
    assert proc._thread is None and not any(t.name == "otel-gpu-health" for t in threading.enumerate())


def test_a_gpu_reset_clears_a_drain_fault_after_the_quiet_period():
    proc, _ = _health(lambda: 0.0, clear_after_s=600)
    eng = proc.engine
    gpu = eng.gpu("n", "GPU-r", 0.0)
    t = 0.0
    for value in (0, 0, 1):  # an uncorrectable error
        t += 30
        eng.counter(gpu, "ecc_uncorrected", value, t)
        eng.counter(gpu, "ecc_corrected", 100 + t, t)
    eng.xid(gpu, 48, t)
    eng.evaluate(t)
    assert gpu.state is H.DeviceState.DRAIN and {h.rule for h in gpu.hits} == {"ecc_uncorrected", "xid_drain"}
    t += 4 * 3600  # hours later, no reset: the fault still holds (fault_hold_s)
    eng.counter(gpu, "ecc_uncorrected", 1, t)
    eng.evaluate(t)
    assert gpu.state is H.DeviceState.DRAIN
    t += 30  # the GPU was reset: volatile counters back to 0
    eng.counter(gpu, "ecc_uncorrected", 0, t)
    eng.counter(gpu, "ecc_corrected", 0, t)
    eng.evaluate(t)
    assert gpu.state is H.DeviceState.DRAIN  # steps down only after clear_after_s without a drain rule
    t += 601
    eng.evaluate(t)
    assert gpu.state is H.DeviceState.HEALTHY and gpu.score == 0


def test_store_links_a_failure_once_across_revisions_and_survives_hostile_bodies(tmp_path):
    from otel_gpu.exporters.store import devices as dstore
    from otel_gpu.otlp_build import LogsBuilder

    services = Services()
    store = _store(tmp_path, services)
    try:
        lb = LogsBuilder()
        record = {"failure_id": "f-1", "version": 1, "kind": "crash", "root_cause": "gpu_xid", "job_id": "j",
                  "onset_time": 100.0, "culprit": {"rank": 1, "host": "h", "gpu": "GPU-9"}}
        lb.event(F.FAILURE_EVENT, record)
        lb.event(F.FAILURE_EVENT, {**record, "version": 2})  # a revision keeps the failure id
        for hostile in ({"device_id": ["x"], "kind": "gpu", "state": "drain"}, {"device_id": "gpu:x", "kind": "gpu",
                        "state": "on fire"}, {"device_id": "gpu:y", "kind": "gpu", "state": "watch",
                                              "gpu_index": 10 ** 30, "score": "NaN", "evidence": {"a": 1}}):
            lb.event(H.STATE_CHANGE_EVENT, hostile)
        store.export(Batch.from_message(Signal.LOGS, lb.build()))
        counts = services[DEVICE_HISTORY].culprit_counts(device_ids=["gpu:GPU-9", "node:h"])
        assert counts["gpu:GPU-9"]["failures"] == 1 and counts["node:h"]["failures"] == 1  # queued, counted once
        assert store.force_flush(5)
        counts = services[DEVICE_HISTORY].culprit_counts(device_ids=["gpu:GPU-9", "node:h"])
        assert counts["gpu:GPU-9"]["failures"] == 1 and counts["node:h"]["jobs"] == ["j"]
        with db.open_reader(tmp_path / "store") as conn:
            states = {d["device_id"]: d for d in dstore.device_states(conn)}
            assert set(states) == {"gpu:y"} and states["gpu:y"]["gpu_index"] is None
            assert states["gpu:y"]["evidence"] == ['{"a": 1}']
    finally:
        store.shutdown(5)


def test_in_a_real_collector_a_failed_remap_reaches_the_store_the_report_and_the_metrics(tmp_path, monkeypatch):
    """The YAML a user writes: nvml (fake) -> health -> store + capture; the row-remap failure at 1 s is a drain,
    kept in the store (shared services wire health and store together), and shown by otel-gpu report."""
    from otel_gpu.collector import registry
    from otel_gpu.collector.config import load_text
    from otel_gpu.collector.runtime import Collector

    monkeypatch.setitem(registry.BUILTIN["exporter"], "capture", "otel_gpu.testing.capture")
    scenario = tmp_path / "nvml.yaml"
    scenario.write_text("gpu_count: 2\ntimeline:\n  - {at_s: 1, gpu: 1, set: {remap_failure: 1}}\n")
    store_dir = tmp_path / "store"
    text = f"""
receivers:
  nvml: {{backend: fake, scenario: "{scenario}", interval: 200ms, host_name: rack1-node7}}
processors:
  health: {{sample_interval: 200ms, evaluate_interval: 200ms}}
exporters:
  store: {{path: "{store_dir}"}}
  capture: {{}}
service:
  pipelines:
    metrics: {{receivers: [nvml], processors: [health], exporters: [capture]}}
    logs: {{receivers: [nvml], processors: [health], exporters: [store, capture]}}
"""
    collector = Collector(load_text(text))
    collector.start()
    try:
        capture = collector.component("exporter", "capture")
        health = collector.component("processor", "health")
        wait_until(lambda: any(d["state"] == "drain" and d["kind"] == "gpu" for d in health.service.states()), 60)
        uuid = next(d["uuid"] for d in health.service.states() if d["state"] == "drain" and d["kind"] == "gpu")
        wait_until(lambda: any(m.name == H.HEALTH.name and a[str(H.DEVICE_ID)] == f"gpu:{uuid}" and
                               a[str(H.DEVICE_STATE)] == "drain" and p.as_int == 1
                               for b in list(capture.batches) if b.signal is Signal.METRICS
                               for m, p, a in iter_points(b.message)), 60)
        assert collector.component("exporter", "store").force_flush(10)
    finally:
        collector.shutdown(10)
    report = build_report(str(store_dir))
    drained = {d["device_id"]: d for d in report["devices"] if d["state"] == "drain"}
    assert set(drained) == {f"gpu:{uuid}", "node:rack1-node7"}
    assert drained[f"gpu:{uuid}"]["gpu_index"] == 1 and drained[f"gpu:{uuid}"]["rules"] == ["row_remap_failure"]
    with db.open_reader(store_dir) as conn:
        from otel_gpu.exporters.store.devices import device_events

        events = device_events(conn, f"gpu:{uuid}")
    assert [e["state"] for e in reversed(events)] == ["healthy", "drain"]


def test_a_withdrawn_verdict_no_longer_counts_against_its_devices(tmp_path):
    from otel_gpu.otlp_build import LogsBuilder

    services = Services()
    store = _store(tmp_path, services)
    try:
        record = {"failure_id": "f-2", "version": 1, "kind": "hang", "root_cause": "nic_link_down", "job_id": "j",
                  "onset_time": 100.0, "culprit": {"rank": 0, "host": "h2", "gpu": None}}
        for body in (record, {**record, "version": 2, "status": "withdrawn"}):
            lb = LogsBuilder()
            lb.event(F.FAILURE_EVENT, body)
            store.export(Batch.from_message(Signal.LOGS, lb.build()))
            assert store.force_flush(5)
            counts = services[DEVICE_HISTORY].culprit_counts(device_ids=["node:h2"])
            if body is record:
                assert counts["node:h2"]["failures"] == 1
        assert counts == {}
    finally:
        store.shutdown(5)


def test_a_node_failing_for_the_third_time_with_different_gpus_is_the_recurring_culprit(history):
    store, now, proc, attribution = history.store, history.now, history.proc, history.attribution
    records = []
    for n, (job, gpu) in enumerate((("a", "GPU-a"), ("b", "GPU-b"), ("c", None))):
        now[0] += 600
        record = _failure(f"job-{job}", now[0], gpu, host="node-z", cause=F.RootCause.NIC_LINK_DOWN)
        attribution._publish(record)
        records.append(record)
        assert store.force_flush(5)
    assert [("recurring_culprit" in r.details) for r in records] == [False, False, True]
    rec = records[-1].details["recurring_culprit"]
    assert rec["device_id"] == "node:node-z" and rec["failures"] == 3
    assert rec["jobs"] == ["job-a", "job-b", "job-c"]
    assert records[-1].confidence == pytest.approx(0.9)  # infrastructure cause, recurring: +0.1
    now[0] += 61
    proc.engine.device(H.DeviceKind.NODE, "node-z", now[0])
    proc.evaluate()
    assert _states(proc)["node:node-z"] == "drain"


def test_a_users_bug_failing_on_the_same_node_every_attempt_never_drains_it(history):
    """A rank-0-only bug (rank 0 logs and checkpoints) raises on the same node in job after job, and the job also
    hangs there in user code: the node is not a recurring culprit for it, never watched or drained, and does not
    follow the job to the next node. Hardware and infrastructure failures on that node still count, interleaved
    with the user's ones, and a failure revised from infrastructure to user before it is stored stops counting."""
    services, store, now, proc, attribution = (history.services, history.store, history.now, history.proc,
                                               history.attribution)
    proc.engine.device(H.DeviceKind.NODE, "node-0", now[0])
    user = [(F.RootCause.PYTHON_EXCEPTION, F.Kind.CRASH), (F.RootCause.RANK_NOT_IN_COLLECTIVE, F.Kind.HANG),
            (F.RootCause.COLLECTIVE_MISMATCH, F.Kind.HANG), (F.RootCause.STRAGGLER_COMPUTE, F.Kind.SLOWDOWN),
            (F.RootCause.PYTHON_EXCEPTION, F.Kind.CRASH)]
    records = []
    for n, (cause, kind) in enumerate(user):
        now[0] += 600
        category = F.Category.USER if cause is not F.RootCause.STRAGGLER_COMPUTE else F.Category.SOFTWARE
        record = FailureRecord(kind=kind, root_cause=cause, job_id=f"job-{n}", onset_time=now[0],
                               detected_time=now[0] + 1, confidence=0.9, category=category,
                               culprit=Culprit(rank=0, host="node-0"), summary="rank 0 raised ValueError")
        attribution._publish(record)
        records.append(record)
        assert store.force_flush(5)
    assert not any("recurring_culprit" in r.details for r in records), [r.summary for r in records]
    assert not any("recurring culprit" in r.summary for r in records)
    assert services[DEVICE_HISTORY].culprit_counts(device_ids=["node:node-0"]) == {}
    now[0] += 61
    proc.evaluate()
    assert _states(proc)["node:node-0"] == "healthy"
    # Two infrastructure failures, a user failure between them, a third one revised to user before the store
    # commits it: two count, the node is watched, not drained.
    for n, cause in enumerate((F.RootCause.NODE_LOST, F.RootCause.PYTHON_EXCEPTION, F.RootCause.NODE_LOST)):
        now[0] += 600
        record = _failure(f"job-i{n}", now[0], None, host="node-0", cause=cause)
        attribution._publish(record)
        assert "recurring_culprit" not in record.details
        assert store.force_flush(5)
    history = services[DEVICE_HISTORY]
    revised = _failure("job-r", now[0] + 5, None, host="node-0", cause=F.RootCause.RANK_PROCESS_DIED).to_dict()
    history.add_pending(revised)
    assert history.culprit_counts(device_ids=["node:node-0"])["node:node-0"]["failures"] == 3
    history.add_pending({**revised, "category": "user", "version": 2})
    assert history.culprit_counts(device_ids=["node:node-0"])["node:node-0"]["failures"] == 2
    now[0] += 61
    proc.evaluate()
    assert _states(proc)["node:node-0"] == "watch"
    # The third infrastructure failure makes it the recurring culprit: drained.
    now[0] += 600
    third = _failure("job-i3", now[0], None, host="node-0", cause=F.RootCause.NODE_LOST)
    attribution._publish(third)
    assert store.force_flush(5)
    assert third.details["recurring_culprit"]["failures"] == 3
    assert third.details["recurring_culprit"]["jobs"] == ["job-i0", "job-i2", "job-i3"]
    now[0] += 61
    proc.evaluate()
    assert _states(proc)["node:node-0"] == "drain"
