"""The ``health`` processor: reads the GPU and NIC counters that flow through the collector, keeps per-device rates
against each device's own baseline, marks devices healthy / watch / drain by the rules of README.md, and shows it:

- metrics ``otel_gpu.device.health`` (1 for the current state) and ``otel_gpu.device.health.score``, every
  ``evaluate_interval_s``, into the metrics pipelines after this processor;
- an ``otel_gpu.device.state_change`` event when a device changes state (or is first seen), which the store keeps;
- ``host.services.get(DEVICE_HEALTH)`` (:class:`DeviceHealthService`) for other components: the attribution processor
  asks it about the devices of a failure (``failure_context``); anything may read ``states()``.

Batches pass through unchanged. A node's metrics are read once per ``sample_interval_s``; the batches in between
cost one dictionary lookup.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from otel_gpu.component import DEVICE_HEALTH, DEVICE_HISTORY, IdentityCache, Processor
from otel_gpu.otlp_build import LogsBuilder, MetricsBuilder, Series, attributes
from otel_gpu.pdata import Batch, Signal, attribute, attributes_dict, number_points, point_value
from otel_gpu.processors.health._engine import HealthEngine, StateChange
from otel_gpu.schema import gpu as G
from otel_gpu.schema import health as H
from otel_gpu.schema import identity as I
from otel_gpu.schema import nic as N
from otel_gpu.schema.failure import counts_against_device

__all__ = ["DeviceHealthService", "HealthProcessor"]

_logger = logging.getLogger(__name__)
_SCOPE = "otel_gpu.processors.health"

_HOST, _UUID, _INDEX, _PCI = I.HOST_NAME, I.HW_ID, I.GPU_INDEX, I.GPU_PCI_BUS_ID
# A serial number attribute, where the schema has one (semconv hw.serial_number); read when present.
_SERIAL = next((str(a) for a in vars(I).values() if getattr(a, "name", None) == "hw.serial_number"), None)
_ERROR_TYPE, _ECC_COUNTER, _REMAP_KIND = G.ERROR_TYPE, G.ECC_COUNTER, G.REMAP_KIND
_LINK, _REASON, _XID_CODE = G.NVLINK_LINK, G.CLOCK_EVENT_REASON, G.XID_CODE
_NIC_DEVICE, _NIC_PORT, _NIC_COUNTER, _NIC_GUID = N.DEVICE, N.PORT, N.COUNTER, N.PORT_GUID
_HW_TYPE = I.HW_TYPE

_HW_THROTTLE = frozenset(r.value for r in (G.ClockEventReason.HW_SLOWDOWN, G.ClockEventReason.HW_THERMAL_SLOWDOWN,
                                            G.ClockEventReason.HW_POWER_BRAKE_SLOWDOWN))
_NVLINK_ERROR_TYPES = frozenset({"crc_flit", "crc_data", "replay", "recovery"})
#: IB / Ethernet counters that point at optics, cables or the link (not congestion).
_NIC_ERROR_COUNTERS = frozenset({"symbol_error", "link_error_recovery", "port_rcv_errors", "local_link_integrity_errors",
                                 "port_rcv_remote_physical_errors", "excessive_buffer_overrun_errors",
                                 "rx_crc_errors", "rx_errors", "rx_frame_errors", "tx_errors", "tx_carrier_errors"})
_FLAPS = "link_downed"

_GPU_METRICS = frozenset(m.name for m in (G.ECC_ERRORS, G.RETIRED_PAGES, G.RETIRED_PENDING, G.REMAPPED_ROWS,
                                          G.REMAP_PENDING, G.REMAP_FAILURE, G.PCIE_REPLAY, G.NVLINK_ERRORS,
                                          G.NVLINK_STATE, G.CLOCK_EVENT_ACTIVE))
_NIC_METRICS = frozenset(m.name for m in (N.IB_ERRORS, N.ETH_ERRORS, N.ETH_UP))
_WANTED = _GPU_METRICS | _NIC_METRICS
_NVLINK_METRICS = frozenset((G.NVLINK_ERRORS.name, G.NVLINK_STATE.name))
_SEVERITY = {H.DeviceState.HEALTHY: LogsBuilder.INFO, H.DeviceState.WATCH: LogsBuilder.WARN,
             H.DeviceState.DRAIN: LogsBuilder.ERROR}
_VIEW_CACHE_MAX = 4096


def _str(value: Any) -> str:
    """A string attribute's value; "" for an attribute of another type (a device is named by strings)."""
    return value if isinstance(value, str) else ""


def _int(value: Any) -> int | None:
    """An int attribute's value; None for an attribute of another type."""
    return value if type(value) is int else None


class _GpuAcc:
    """What one sampled batch says about one GPU, summed over its points before the engine sees it."""

    __slots__ = ("uuid", "index", "pci", "serial", "counters", "flags", "links", "throttled", "sampled")

    def __init__(self, uuid: str):
        self.uuid = uuid
        self.index: int | None = None
        self.pci: str | None = None
        self.serial: str | None = None
        self.counters: dict[str, float] = {}
        self.flags: dict[str, float] = {}
        self.links: dict[int, float] = {}
        self.throttled = False
        self.sampled = False


class DeviceHealthService:
    """``host.services.get(DEVICE_HEALTH)``: the health processor's verdicts for other components. Thread-safe.

    Returns plain data only, so that callers never depend on this package's types.
    """

    def __init__(self, processor: "HealthProcessor"):
        self._p = processor

    def states(self, states: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        """Devices as dicts (``device_id``, ``kind``, ``host``, ``uuid``, ``state``, ``since``, ``score``,
        ``evidence``, ...), optionally only those in ``states``."""
        with self._p._lock:
            return [d.describe() for d in self._p.engine.devices.values()
                    if states is None or d.state.value in states]

    def failure_context(self, *, host: str | None, gpu: str | None = None, job_id: str | None = None,
                        category: str | None = None, time_s: float | None = None) -> dict[str, Any]:
        """What device history says about a failure whose culprit is ``host`` / ``gpu`` (UUID or index).

        Returns ``{"devices": [ids], "evidence": [text], "confidence_boost": float, "recurring": {...} | None,
        "states": {id: state}}``; the failure being decided is not in the store yet, so this failure is number
        ``failures + 1`` on its device.
        """
        return self._p.failure_context(host, gpu, job_id, category, time_s)


class HealthProcessor(Processor):
    """See the package docstring and README.md."""

    def __init__(self, config, host):
        super().__init__(config, host)
        self.engine = HealthEngine(config)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock = time.time
        self._last_sample: dict[tuple[bytes, str], float] = {}
        self._last_nvlink: dict[tuple[bytes, str], float] = {}
        #: host name per resource, keyed by a hash of the resource (16 bytes), LRU-bounded: a flood of distinct
        #: hostile resources evicts its own entries and pins no resource bytes.
        self._hosts = IdentityCache(_VIEW_CACHE_MAX)
        self._series: dict[tuple[str, str], Series] = {}
        self._last_recurrence = float("-inf")
        self.changes: list[dict[str, Any]] = []  # recent state changes, newest last (bounded; tests, debugging)
        self.service = DeviceHealthService(self)
        if DEVICE_HEALTH in host.services:
            _logger.warning("more than one health processor: device_health now serves %s", host.component_id)
        host.services.publish(DEVICE_HEALTH, self.service)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        history = self.host.services.get(DEVICE_HISTORY)
        if history is not None:
            try:
                rows = history.device_states()
                with self._lock:
                    n = self.engine.restore(rows, self._clock())
                if n:
                    _logger.info("health: restored the state of %d device(s) from the store", n)
            except Exception:  # noqa: BLE001 - a missing or busy store must not stop the collector
                self.host.log_once("restore", logging.WARNING, "health: could not read device states from the store "
                                   "(logged once)", exc_info=True)
        self._thread = threading.Thread(target=self._run, name=f"otel-gpu-{self.host.component_id}", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.config.evaluate_interval_s):
            try:
                self.evaluate()
            except Exception:  # noqa: BLE001 - the clock keeps running
                self.host.log_once("evaluate", logging.ERROR, "health: evaluation failed (logged once)",
                                   exc_info=True)

    # -- input -----------------------------------------------------------------------------------------------------
    def process(self, batch: Batch) -> Batch | None:
        if batch.signal is Signal.METRICS:
            self._metrics(batch.message)
        elif batch.signal is Signal.LOGS:
            self._logs(batch.message)
        return batch

    def _host(self, resource: Any) -> tuple[bytes, str]:
        key = self._hosts.key(resource)
        name = self._hosts.get(key)
        if name is None:
            name = attribute(resource.attributes, _HOST)
            # a scalar of any type names the host; a list, a map or bytes does not
            name = "" if name is None or isinstance(name, (list, dict, bytes)) else str(name)
            name = name or "unknown"
            self._hosts.put(key, name)
        return key, name

    def _metrics(self, request: Any) -> None:
        now = self._clock()
        interval = self.config.sample_interval_s
        for rm in request.resource_metrics:
            key = None
            for sm in rm.scope_metrics:
                if key is None:
                    key, host = self._host(rm.resource)
                skey = (key, sm.scope.name[:256])  # a hostile scope name is not kept whole
                last = self._last_sample.get(skey)
                if last is not None and now - last < interval:
                    continue
                if not any(m.name in _WANTED for m in sm.metrics):
                    continue
                self._last_sample[skey] = now
                last_nvlink = self._last_nvlink.get(skey)
                nvlink = last_nvlink is None or now - last_nvlink >= self.config.nvlink_sample_interval_s
                if nvlink and any(m.name in _NVLINK_METRICS for m in sm.metrics):
                    self._last_nvlink[skey] = now
                else:
                    nvlink = False
                if len(self._last_sample) > 4 * self.config.max_devices:
                    self._last_sample.clear()
                    self._last_nvlink.clear()
                self._sample(host, sm.metrics, now, nvlink)

    def _sample(self, host: str, metrics: Any, now: float, nvlink: bool = True) -> None:
        gpus: dict[str, _GpuAcc] = {}
        ports: dict[str, dict[str, float]] = {}
        ups: dict[str, float] = {}
        guids: dict[str, str] = {}  # port -> InfiniBand port GUID, the port's identity in the device history
        for m in metrics:
            name = m.name
            if name not in _WANTED or (not nvlink and name in _NVLINK_METRICS):
                continue
            points = number_points(m)
            if name in _GPU_METRICS:
                nic_points = []
                for p in points:
                    a = attributes_dict(p.attributes)
                    if a.get(_HW_TYPE) == "network":  # hw.errors is the NICs' too
                        nic_points.append(p)
                        continue
                    uuid = a.get(_UUID)
                    if not isinstance(uuid, str) or not uuid:
                        continue
                    acc = gpus.get(uuid)
                    if acc is None:
                        acc = gpus[uuid] = _GpuAcc(uuid)
                        acc.index = _int(a.get(_INDEX))
                        pci = a.get(_PCI)
                        acc.pci = pci if isinstance(pci, str) else None
                        if _SERIAL is not None:
                            acc.serial = _str(a.get(_SERIAL)) or None
                    self._gpu_point(name, p, a, acc)
                points = nic_points
            if name in _NIC_METRICS:
                for p in points:
                    a = attributes_dict(p.attributes)
                    dev = a.get(_NIC_DEVICE)
                    if not isinstance(dev, str) or not dev:
                        continue
                    port_no = _int(a.get(_NIC_PORT))
                    port = dev if port_no is None else f"{dev}/{port_no}"
                    guid = _str(a.get(_NIC_GUID))
                    if guid:
                        guids[port] = guid
                    if name == N.ETH_UP.name:  # hw.network.up: InfiniBand ports count flaps in link_downed
                        if port_no is None:
                            ups[port] = point_value(p)
                        continue
                    counter = _str(a.get(_ERROR_TYPE)) or _str(a.get(_NIC_COUNTER))
                    if counter == _FLAPS or counter in _NIC_ERROR_COUNTERS:
                        c = ports.setdefault(port, {})
                        key = _FLAPS if counter == _FLAPS else "nic_errors"
                        c[key] = c.get(key, 0.0) + point_value(p)
        if not (gpus or ports or ups):
            return
        with self._lock:
            eng = self.engine
            for acc in gpus.values():
                dev = eng.gpu(host, acc.uuid, now, acc.index, acc.pci, acc.serial)
                for cname, value in acc.counters.items():
                    eng.counter(dev, cname, value, now)
                for fname, value in acc.flags.items():
                    eng.flag(dev, fname, value, now)
                if acc.links:
                    seen_up = dev.flags.setdefault("_links_up", 0.0)
                    up = sum(1 for v in acc.links.values() if v >= 1)
                    if up > seen_up:
                        dev.flags["_links_up"] = float(up)
                    eng.flag(dev, "nvlink_down", max(0.0, dev.flags["_links_up"] - up), now)
                if acc.sampled:
                    eng.count(dev, "samples", 1, now)
                    eng.count(dev, "hw_throttle", 1 if acc.throttled else 0, now)
            for port, counters in ports.items():
                dev = eng.device(H.DeviceKind.NIC_PORT, host, now, port=port)
                dev.guid = guids.get(port, dev.guid)
                for cname, value in counters.items():
                    eng.counter(dev, cname, value, now, hour=cname == _FLAPS)
            for port, value in ups.items():  # Ethernet has no link_downed counter: count up -> down transitions
                dev = eng.device(H.DeviceKind.NIC_PORT, host, now, port=port)
                if dev.flags.get("_up", value) >= 1 and value < 1:
                    eng.count(dev, _FLAPS, 1, now, hour=True)
                dev.flags["_up"] = value

    @staticmethod
    def _gpu_point(name: str, p: Any, a: dict[str, Any], acc: _GpuAcc) -> None:
        v = point_value(p)
        if name == G.ECC_ERRORS.name:
            if _ECC_COUNTER in a and a[_ECC_COUNTER] != "volatile":
                return
            key = "ecc_uncorrected" if a.get(_ERROR_TYPE) == "uncorrected" else "ecc_corrected"
            acc.counters[key] = acc.counters.get(key, 0.0) + v
        elif name == G.CLOCK_EVENT_ACTIVE.name:
            acc.sampled = True
            if v >= 1 and _str(a.get(_REASON)) in _HW_THROTTLE:
                acc.throttled = True
        elif name == G.PCIE_REPLAY.name:
            acc.counters["pcie_replay"] = v
        elif name == G.NVLINK_ERRORS.name:
            if _str(a.get(_ERROR_TYPE)) in _NVLINK_ERROR_TYPES:
                acc.counters["nvlink_errors"] = acc.counters.get("nvlink_errors", 0.0) + v
        elif name == G.NVLINK_STATE.name:
            link = _int(a.get(_LINK))
            if link is not None:
                acc.links[link] = v
        elif name == G.RETIRED_PAGES.name:
            acc.counters["retired_pages"] = acc.counters.get("retired_pages", 0.0) + v
        elif name == G.REMAPPED_ROWS.name:
            if a.get(_REMAP_KIND) == "uncorrectable":
                acc.counters["remapped_rows_uncorrectable"] = v
        elif name == G.REMAP_FAILURE.name:
            acc.flags["remap_failure"] = v
        elif name == G.REMAP_PENDING.name:
            acc.flags["remap_pending"] = v
        elif name == G.RETIRED_PENDING.name:
            acc.flags["retired_pending"] = v

    def _logs(self, request: Any) -> None:
        xid = G.XID_EVENT.name
        for rl in request.resource_logs:
            host = None
            for sl in rl.scope_logs:
                for record in sl.log_records:
                    if record.event_name != xid:
                        continue
                    if host is None:
                        host = self._host(rl.resource)[1]
                    a = attributes_dict(record.attributes)
                    code, uuid = _int(a.get(_XID_CODE)), _str(a.get(_UUID))
                    if code is None or not uuid:
                        continue  # an XID whose GPU (or code) is unknown names no device
                    t = record.time_unix_nano / 1e9 if record.time_unix_nano else self._clock()
                    t = min(t, self._clock())
                    idx = a.get(_INDEX)
                    with self._lock:
                        dev = self.engine.gpu(host, uuid, self._clock(), _int(idx))
                        self.engine.xid(dev, code, t)

    # -- evaluation and output -------------------------------------------------------------------------------------
    def evaluate(self, now: float | None = None) -> list[StateChange]:
        """Refreshes recurrence from the store (every minute), applies the rules, emits metrics and events."""
        now = self._clock() if now is None else now
        self._refresh_recurrence(now)
        with self._lock:
            changes = self.engine.evaluate(now)
            described = [(c, c.device.describe()) for c in changes]
            metrics = self._health_metrics(now) if self.host.has_consumer(Signal.METRICS) else None
        for change, body in described:
            body["previous"] = change.previous.value if change.previous is not None else None
            body["time"] = round(change.time, 3)
            self.changes.append(body)
            if change.state is not H.DeviceState.HEALTHY or change.previous is not None:
                _logger.warning("device %s: %s -> %s (%s)", body["device_id"], body["previous"], body["state"],
                                "; ".join(body["evidence"][:3]) or "quiet")
        del self.changes[:-1000]
        if described and self.host.has_consumer(Signal.LOGS):
            lb = LogsBuilder({I.SERVICE_NAME: "otel-gpu"}, scope=_SCOPE)
            for change, body in described:
                rules = body["rules"]
                lb.event(H.STATE_CHANGE_EVENT, body, {H.DEVICE_ID: body["device_id"],
                                                      H.DEVICE_KIND: body["kind"], _HOST: body["host"],
                                                      H.DEVICE_STATE: body["state"],
                                                      H.DEVICE_RULE: rules[0] if rules else ""},
                         time_ns=int(change.time * 1e9), severity=_SEVERITY[change.state])
            self.host.emit(Batch.from_message(Signal.LOGS, lb.build()))
        if metrics is not None:
            self.host.emit(Batch.from_message(Signal.METRICS, metrics))
        return changes

    def _health_metrics(self, now: float) -> Any:
        mb = MetricsBuilder({I.SERVICE_NAME: "otel-gpu"}, scope=_SCOPE, time_ns=int(now * 1e9))
        series = self._series
        if len(series) > 8 * self.config.max_devices:
            series.clear()
        for dev in self.engine.devices.values():
            for state in H.DeviceState:
                key = (dev.id, state.value)
                s = series.get(key)
                if s is None:
                    s = series[key] = Series(H.HEALTH, attributes({H.DEVICE_ID: dev.id, H.DEVICE_KIND:
                                                                   dev.kind.value, _HOST: dev.host,
                                                                   H.DEVICE_STATE: state.value}))
                mb.add(s, 1 if dev.state is state else 0)
            key = (dev.id, "score")
            s = series.get(key)
            if s is None:
                s = series[key] = Series(H.HEALTH_SCORE, attributes({H.DEVICE_ID: dev.id, H.DEVICE_KIND:
                                                                     dev.kind.value, _HOST: dev.host}))
            mb.add(s, dev.score)
        return mb.build()

    def _refresh_recurrence(self, now: float) -> None:
        history = self.host.services.get(DEVICE_HISTORY)
        if history is None or now - self._last_recurrence < 60.0:
            return
        self._last_recurrence = now
        try:
            counts = history.culprit_counts(self.config.recurrence_window_s, now=now)
        except Exception:  # noqa: BLE001
            self.host.log_once("recurrence", logging.WARNING, "health: device history unavailable (logged once)",
                               exc_info=True)
            return
        with self._lock:
            for dev in self.engine.devices.values():
                dev.recurrence = counts.get(dev.id)

    # -- attribution's question ------------------------------------------------------------------------------------
    def failure_context(self, host: str | None, gpu: str | None, job_id: str | None, category: str | None,
                        time_s: float | None) -> dict[str, Any]:
        now = self._clock() if time_s is None else time_s
        ids: list[str] = []
        with self._lock:
            eng = self.engine
            if gpu not in (None, ""):
                gpu = str(gpu)
                match = eng.devices.get(H.device_id(H.DeviceKind.GPU, uuid=gpu))
                if match is None and host:
                    match = next((d for d in eng.devices.values() if d.kind is H.DeviceKind.GPU and d.host == host
                                  and str(d.gpu_index) == gpu), None)
                if match is not None:
                    ids.append(match.id)
                elif not gpu.isdigit():  # a UUID the health processor has not seen yet
                    ids.append(H.device_id(H.DeviceKind.GPU, uuid=gpu))
            if host:
                ids.append(H.device_id(H.DeviceKind.NODE, host=host))
            known = {i: eng.devices[i] for i in ids if i in eng.devices}
            states = {i: d.state.value for i, d in known.items()}
            evidence = []
            boost = 0.0
            for did, dev in known.items():
                if dev.state is H.DeviceState.HEALTHY:
                    continue
                why = dev.hits[0].evidence if dev.hits else ""
                evidence.append(f"device {did} was {dev.state.value} since @{dev.since:.0f} ({why})")
                boost = max(boost, 0.15 if dev.state is H.DeviceState.DRAIN else 0.1)
        history = self.host.services.get(DEVICE_HISTORY)
        recurring = None
        # A user's or a software failure is not held against the device (the store does not count it either): no
        # recurring culprit is named for it, however often the device failed before.
        if history is not None and ids and counts_against_device(category):
            try:
                counts = history.culprit_counts(self.config.recurrence_window_s, now=now, device_ids=ids)
            except Exception:  # noqa: BLE001
                counts = {}
            for did in ids:
                info = counts.get(did)
                n = int(info["failures"]) + 1 if info else 1  # this failure is not stored yet
                if n >= self.config.recurrence_drain:
                    jobs = list(info.get("jobs") or [])
                    if job_id and job_id not in jobs:
                        jobs.append(job_id)
                    recurring = {"device_id": did, "failures": n, "jobs": jobs, "first": info.get("first")}
                    evidence.append(f"recurring culprit: {did}, failure #{n} in {len(jobs)} job(s) since "
                                    f"@{float(info.get('first') or now):.0f}")
                    boost = max(boost, 0.1)
                    break
        if category not in ("hardware", "infrastructure"):
            boost = 0.0  # history raises confidence in a hardware cause only; for others it is shown, not counted
        return {"devices": ids, "evidence": evidence, "confidence_boost": boost, "recurring": recurring,
                "states": states}
