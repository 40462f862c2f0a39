"""The nvml receiver: polls GPU health through an NVML backend and reports XID errors from NVML's event set.

The backend is the ``pynvml`` module (nvidia-ml-py) or the fake NVML, chosen by ``backend:`` through
:mod:`otel_gpu.collector.backends`; this code calls the same functions on either. Every read goes through
:meth:`NvmlReceiver._call`, which turns NVML errors into "not available" for that field on that GPU (logged once), so
one unsupported field never costs the others.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from otel_gpu.collector import backends
from otel_gpu.component import ComponentHost, Receiver, run_polling
from otel_gpu.otlp_build import LogsBuilder, MetricsBuilder, Series, attributes
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import gpu as G
from otel_gpu.schema.identity import (GPU_INDEX, GPU_PCI_BUS_ID, HOST_NAME, HW_DRIVER_VERSION, HW_ID, HW_MODEL,
                                     HW_TYPE, HW_VENDOR, PROCESS_PID)

from otel_gpu.receivers.nvml.config import NvmlReceiverConfig

__all__ = ["NvmlReceiver", "LIBRARY_NOT_FOUND"]

_logger = logging.getLogger(__name__)
_SCOPE = "otel_gpu.receivers.nvml"

LIBRARY_NOT_FOUND = ("NVML library not found: is the NVIDIA driver installed? (nvidia-ml-py needs libnvidia-ml.so.1); "
                     "the nvml receiver stays idle and the collector runs on")
_HW_REASONS = (G.ClockEventReason.HW_SLOWDOWN, G.ClockEventReason.HW_THERMAL_SLOWDOWN,
               G.ClockEventReason.HW_POWER_BRAKE_SLOWDOWN)
_HW_MASK = sum(bit for bit, reason in G.CLOCK_EVENT_BITS if reason in _HW_REASONS)
_NVLINK_ERROR_TYPES = (("replay", "NVML_NVLINK_ERROR_DL_REPLAY"), ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"),
                       ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"), ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
                       ("ecc_data", "NVML_NVLINK_ERROR_DL_ECC_DATA"))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Gpu:
    """One watched GPU: identity, pre-built series, and what is known not to work on it."""

    def __init__(self, index: int, handle: Any, uuid: str, pci: str, name: str, start_ns: int, driver: str = ""):
        self.index, self.handle, self.uuid, self.pci, self.name = index, handle, uuid, pci, name
        self.identity = {GPU_INDEX: index, HW_ID: uuid, GPU_PCI_BUS_ID: pci, HW_MODEL: name,
                         HW_VENDOR: "NVIDIA", HW_TYPE: "gpu"}
        if driver:
            self.identity[HW_DRIVER_VERSION] = driver
        self.attrs = attributes(self.identity)
        self.start_ns = start_ns
        self.skip: set[str] = set()
        self.lost = False
        self.remap_failure = False
        self.max_clocks: dict[str, int] = {}
        self.nvlinks: list[int] = []
        self.xid_counts: dict[int, int] = {}
        self._series: dict[Any, Series] = {}

    def series(self, key: Any, metric: Any, extra: dict[str, Any] | None = None) -> Series:
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = Series(metric, self.attrs, extra, start_time_ns=self.start_ns)
        return s


class NvmlReceiver(Receiver):
    """Polls every ``interval_s``; XIDs arrive on their own thread within one NVML wait (0.5 s) of the event."""

    def __init__(self, config: NvmlReceiverConfig, host: ComponentHost):
        super().__init__(config, host)
        self.backend: Any = None
        self.gpus: list[_Gpu] = []
        self._start_ns = time.time_ns()
        self._resource = attributes({HOST_NAME: config.host_name or socket.gethostname()})
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # guards xid_counts
        self._initialized = False
        self._errors: dict[str, type] = {}
        self._last_nvlink = float("-inf")

    # -- lifecycle ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.backend = self._load_backend()
        if self.backend is None or not self._init():
            return
        self._discover()
        if not self.gpus:
            return
        t = threading.Thread(target=self._poll_loop, name=f"otel-gpu-{self.host.component_id}-poll", daemon=True)
        self._threads.append(t)
        if self.config.xid_events:
            self._threads.append(threading.Thread(target=self._event_loop, daemon=True,
                                                  name=f"otel-gpu-{self.host.component_id}-xid"))
        for t in self._threads:
            t.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads.clear()
        if self._initialized:
            self._initialized = False
            try:
                self.backend.nvmlShutdown()
            except Exception:  # noqa: BLE001 - nothing to do about it at shutdown
                pass

    def _load_backend(self) -> Any:
        backend = backends.load("nvml", self.config.backend, scenario=self.config.scenario or None)
        if backend is None:
            self.host.log_once("no-pynvml", logging.WARNING, "%s: nvidia-ml-py is not installed (pip install "
                               "nvidia-ml-py); the nvml receiver stays idle", self.host.component_id)
        return backend

    def _init(self) -> bool:
        nv = self.backend
        self._errors = {name: getattr(nv, f"NVMLError_{name}") for name in (
            "NotSupported", "FunctionNotFound", "InvalidArgument", "NoPermission", "GpuIsLost", "Timeout",
            "LibraryNotFound", "DriverNotLoaded")}
        try:
            nv.nvmlInit()
        except self._errors["LibraryNotFound"]:
            self.host.log_once("init", logging.WARNING, "%s: %s", self.host.component_id, LIBRARY_NOT_FOUND)
            return False
        except self._errors["DriverNotLoaded"]:
            self.host.log_once("init", logging.WARNING, "%s: NVIDIA driver not loaded: is the nvidia kernel module "
                               "loaded (lsmod | grep nvidia)? the nvml receiver stays idle", self.host.component_id)
            return False
        except nv.NVMLError as exc:
            self.host.log_once("init", logging.WARNING, "%s: NVML could not start (%s); the nvml receiver stays "
                               "idle", self.host.component_id, exc)
            return False
        self._initialized = True
        return True

    def _discover(self) -> None:
        nv = self.backend
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            self.host.log_once("count", logging.WARNING, "%s: NVML cannot count GPUs (%s); idle",
                               self.host.component_id, exc)
            return
        try:
            driver = _text(nv.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001 - the version is a label, not a reason to stop
            driver = ""
        wanted = list(range(count)) if not self.config.devices else list(self.config.devices)
        for index in wanted:
            if index >= count:
                self.host.log_once(("missing", index), logging.WARNING, "%s: devices lists GPU %d but NVML sees "
                                   "%d GPU(s); ignoring it", self.host.component_id, index, count)
                continue
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
                pci = _text(nv.nvmlDeviceGetPciInfo(handle).busId)
                name = _text(nv.nvmlDeviceGetName(handle))
            except nv.NVMLError as exc:
                self.host.log_once(("handle", index), logging.WARNING, "%s: GPU %d is not usable (%s); skipping it",
                                   self.host.component_id, index, exc)
                continue
            gpu = _Gpu(index, handle, uuid, pci, name, self._start_ns, driver)
            self._discover_static(gpu)
            self.gpus.append(gpu)
        if not self.gpus:
            self.host.log_once("nogpu", logging.WARNING, "%s: no GPU found by NVML; the nvml receiver stays idle",
                               self.host.component_id)
        else:
            _logger.info("%s: watching %d GPU(s): %s", self.host.component_id, len(self.gpus),
                         ", ".join(f"{g.index}={g.name} {g.pci}" for g in self.gpus))

    def _discover_static(self, gpu: _Gpu) -> None:
        nv = self.backend
        for domain, clock in (("sm", nv.NVML_CLOCK_SM), ("memory", nv.NVML_CLOCK_MEM)):
            value = self._call(gpu, "max_clocks", nv.nvmlDeviceGetMaxClockInfo, clock)
            if value is not None:
                gpu.max_clocks[domain] = value
        if self.config.nvlink_interval_s > 0:
            for link in range(nv.NVML_NVLINK_MAX_LINKS):
                try:
                    nv.nvmlDeviceGetNvLinkState(gpu.handle, link)
                except nv.NVMLError:
                    continue  # no such link on this GPU
                gpu.nvlinks.append(link)
            if not gpu.nvlinks:
                self.host.log_once(("nvlink", gpu.index), logging.INFO, "%s: GPU %d: NVLink not available (no link "
                                   "answers); NVLink metrics skipped", self.host.component_id, gpu.index)

    # -- reading ------------------------------------------------------------------------------------------------------
    def _call(self, gpu: _Gpu, feature: str, fn: Any, *args: Any) -> Any:
        """``fn(gpu.handle, *args)``, or None when the field is not available (logged once per GPU and field)."""
        if gpu.lost or feature in gpu.skip:
            return None
        try:
            return fn(gpu.handle, *args)
        except Exception as exc:  # noqa: BLE001 - NVMLError subclasses, or a backend bug: never crash the poll
            self._failed(gpu, feature, exc)
            return None

    def _failed(self, gpu: _Gpu, feature: str, exc: BaseException) -> None:
        e = self._errors
        cid = self.host.component_id
        if isinstance(exc, (e["NotSupported"], e["FunctionNotFound"], e["InvalidArgument"], e["NoPermission"])):
            gpu.skip.add(feature)
            self.host.log_once(("na", gpu.index, feature), logging.INFO, "%s: GPU %d (%s): %s not available (%s); "
                               "skipping it", cid, gpu.index, gpu.name, feature, exc)
        elif isinstance(exc, e["GpuIsLost"]):
            gpu.lost = True
            self.host.log_once(("lost", gpu.index), logging.ERROR, "%s: GPU %d (%s, %s) is lost (NVML: %s): "
                               "hw.status reports it failed; its other metrics stop", cid, gpu.index, gpu.uuid,
                               gpu.pci, exc)
        else:
            self.host.log_once(("err", gpu.index, feature, type(exc)), logging.WARNING, "%s: GPU %d: reading %s "
                               "failed (%s: %s); retried every poll, logged once", cid, gpu.index, feature,
                               type(exc).__name__, exc)

    def poll(self) -> Any:
        """Reads every watched GPU once; returns an ExportMetricsServiceRequest (None when there is nothing)."""
        if not self.gpus:
            return None
        mb = MetricsBuilder(self._resource, scope=_SCOPE, start_time_ns=self._start_ns)
        now = time.monotonic()
        nvlink = bool(self.config.nvlink_interval_s) and now - self._last_nvlink >= self.config.nvlink_interval_s
        if nvlink:
            self._last_nvlink = now
        for gpu in self.gpus:
            try:
                self._poll_gpu(gpu, mb, nvlink)
            except Exception:  # noqa: BLE001 - one GPU's surprise must not cost the others
                self.host.log_once(("poll", gpu.index), logging.ERROR, "%s: GPU %d: poll failed (logged once)",
                                   self.host.component_id, gpu.index, exc_info=True)
        return mb.build() if mb.point_count() else None

    def _poll_gpu(self, gpu: _Gpu, mb: MetricsBuilder, nvlink: bool) -> None:
        degraded = False
        if not gpu.lost:
            degraded = self._read_gpu(gpu, mb, nvlink)
        s = gpu.series
        with self._lock:
            xids = list(gpu.xid_counts.items())
        for code, n in xids:
            mb.add(s(("xid", code), G.XID_ERRORS, {G.XID_CODE: code}), n)
        failed = gpu.lost or gpu.remap_failure
        state = G.HwState.FAILED if failed else G.HwState.DEGRADED if degraded else G.HwState.OK
        for hw_state in G.HwState:
            mb.add(s(("status", hw_state), G.STATUS, {G.HW_STATE: hw_state.value}),
                   1 if hw_state is state else 0)

    def _read_gpu(self, gpu: _Gpu, mb: MetricsBuilder, nvlink: bool) -> bool:
        """Reads one GPU's fields into ``mb``; returns whether they show it degraded."""
        nv, call, s = self.backend, self._call, gpu.series
        degraded = False
        util = call(gpu, "utilization", nv.nvmlDeviceGetUtilizationRates)
        if util is not None:
            mb.add(s("util", G.UTILIZATION), util.gpu / 100.0)
            mb.add(s("mactivity", G.MEMORY_ACTIVITY), util.memory / 100.0)  # bandwidth activity, not memory used
        mem = call(gpu, "memory", nv.nvmlDeviceGetMemoryInfo)
        if mem is not None:
            mb.add(s("mused", G.MEMORY_USAGE), int(mem.used))
            mb.add(s("mtotal", G.MEMORY_LIMIT), int(mem.total))
            mb.add(s("mfree", G.MEMORY_FREE), int(mem.free))
            if mem.total:
                mb.add(s("mutil", G.MEMORY_UTILIZATION), int(mem.used) / int(mem.total))
        temp = call(gpu, "temperature", nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        if temp is not None:
            mb.add(s("tgpu", G.TEMPERATURE, {G.SENSOR: "gpu"}), temp)
        fields = call(gpu, "memory_temperature", nv.nvmlDeviceGetFieldValues, [nv.NVML_FI_DEV_MEMORY_TEMP])
        if fields is not None:
            if fields[0].nvmlReturn == nv.NVML_SUCCESS:
                mb.add(s("tmem", G.TEMPERATURE, {G.SENSOR: "memory"}), int(fields[0].value.uiVal))
            else:
                self._failed(gpu, "memory_temperature", nv.NVMLError(fields[0].nvmlReturn))
        power = call(gpu, "power", nv.nvmlDeviceGetPowerUsage)
        if power is not None:
            mb.add(s("power", G.POWER), power / 1000.0)
        limit = call(gpu, "power_limit", nv.nvmlDeviceGetEnforcedPowerLimit)
        if limit is not None:
            mb.add(s("plimit", G.POWER_LIMIT), limit / 1000.0)
        energy = call(gpu, "energy", nv.nvmlDeviceGetTotalEnergyConsumption)
        if energy is not None:
            mb.add(s("energy", G.ENERGY), energy / 1000.0)
        for domain, clock in (("sm", nv.NVML_CLOCK_SM), ("memory", nv.NVML_CLOCK_MEM)):
            mhz = call(gpu, "clocks", nv.nvmlDeviceGetClockInfo, clock)
            if mhz is not None:
                mb.add(s(("clk", domain), G.CLOCK, {G.CLOCK_DOMAIN: domain}), mhz)
            if domain in gpu.max_clocks:
                mb.add(s(("maxclk", domain), G.CLOCK_MAX, {G.CLOCK_DOMAIN: domain}), gpu.max_clocks[domain])
        reasons = call(gpu, "clocks_event_reasons", nv.nvmlDeviceGetCurrentClocksEventReasons)
        if reasons is not None:
            for bit, reason in G.CLOCK_EVENT_BITS:
                mb.add(s(("cer", bit), G.CLOCK_EVENT_ACTIVE, {G.CLOCK_EVENT_REASON: reason.value}),
                       1 if reasons & bit else 0)
            degraded |= bool(reasons & _HW_MASK)
        pstate = call(gpu, "pstate", nv.nvmlDeviceGetPerformanceState)
        if pstate is not None:
            mb.add(s("pstate", G.PSTATE), pstate)
        for etype, code in (("corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                            ("uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            for counter, ctype in (("volatile", nv.NVML_VOLATILE_ECC), ("aggregate", nv.NVML_AGGREGATE_ECC)):
                n = call(gpu, "ecc", nv.nvmlDeviceGetTotalEccErrors, code, ctype)
                if n is not None:
                    mb.add(s(("ecc", etype, counter), G.ECC_ERRORS, {G.ERROR_TYPE: etype,
                                                                       G.ECC_COUNTER: counter}), n)
                    if etype == "uncorrected" and counter == "volatile" and n > 0:
                        degraded = True
        for cause, code in (("multiple_single_bit_ecc", nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
                            ("double_bit_ecc", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)):
            pages = call(gpu, "retired_pages", nv.nvmlDeviceGetRetiredPages, code)
            if pages is not None:
                mb.add(s(("retired", cause), G.RETIRED_PAGES, {G.RETIREMENT_CAUSE: cause}), len(pages))
        pending = call(gpu, "retired_pages", nv.nvmlDeviceGetRetiredPagesPendingStatus)
        if pending is not None:
            mb.add(s("rpending", G.RETIRED_PENDING), int(pending))
            degraded |= bool(pending)
        rows = call(gpu, "remapped_rows", nv.nvmlDeviceGetRemappedRows)
        if rows is not None:
            corr, unc, rpending, rfailure = rows
            mb.add(s(("rows", "c"), G.REMAPPED_ROWS, {G.REMAP_KIND: "correctable"}), int(corr))
            mb.add(s(("rows", "u"), G.REMAPPED_ROWS, {G.REMAP_KIND: "uncorrectable"}), int(unc))
            mb.add(s("rmpending", G.REMAP_PENDING), int(rpending))
            mb.add(s("rmfailure", G.REMAP_FAILURE), int(rfailure))
            degraded |= bool(rpending)
            gpu.remap_failure = bool(rfailure)
        replay = call(gpu, "pcie_replay", nv.nvmlDeviceGetPcieReplayCounter)
        if replay is not None:
            mb.add(s("replay", G.PCIE_REPLAY), int(replay))
        if self.config.pcie_throughput:
            for direction, counter in (("transmit", nv.NVML_PCIE_UTIL_TX_BYTES),
                                       ("receive", nv.NVML_PCIE_UTIL_RX_BYTES)):
                kbps = call(gpu, "pcie_throughput", nv.nvmlDeviceGetPcieThroughput, counter)
                if kbps is not None:
                    mb.add(s(("pcie", direction), G.PCIE_THROUGHPUT, {G.NETWORK_IO_DIRECTION: direction}),
                           int(kbps) * 1024)
        if nvlink and gpu.nvlinks:
            self._poll_nvlink(gpu, mb)
        if self.config.processes:
            self._poll_processes(gpu, mb)
        return degraded

    def _poll_nvlink(self, gpu: _Gpu, mb: MetricsBuilder) -> None:
        nv, s = self.backend, gpu.series
        types = [(name, getattr(nv, const)) for name, const in _NVLINK_ERROR_TYPES]
        for link in gpu.nvlinks:
            state = self._call(gpu, "nvlink", nv.nvmlDeviceGetNvLinkState, link)
            if state is None:
                return  # lost, or NVLink stopped answering (logged once)
            mb.add(s(("nvl", link), G.NVLINK_STATE, {G.NVLINK_LINK: link}), int(state))
            for name, counter in types:
                n = self._call(gpu, f"nvlink {name} errors", nv.nvmlDeviceGetNvLinkErrorCounter, link, counter)
                if n is not None:
                    mb.add(s(("nvle", link, name), G.NVLINK_ERRORS, {G.NVLINK_LINK: link,
                                                                     G.ERROR_TYPE: name}), int(n))

    def _poll_processes(self, gpu: _Gpu, mb: MetricsBuilder) -> None:
        nv = self.backend
        for ptype, fn in (("compute", nv.nvmlDeviceGetComputeRunningProcesses),
                          ("graphics", nv.nvmlDeviceGetGraphicsRunningProcesses)):
            procs = self._call(gpu, "processes", fn)
            for p in procs or ():
                used = p.usedGpuMemory
                mb.record(G.PROCESS_MEMORY, int(used) if used is not None else 0, gpu.attrs,
                          {PROCESS_PID: int(p.pid), G.PROCESS_TYPE: ptype})

    def _poll_loop(self) -> None:
        run_polling(self.host, self.config.interval_s, self._stop, self.poll)

    # -- XID events ---------------------------------------------------------------------------------------------------
    def _event_loop(self) -> None:
        nv, cid = self.backend, self.host.component_id
        try:
            event_set = nv.nvmlEventSetCreate()
        except Exception as exc:  # noqa: BLE001
            self.host.log_once("evset", logging.WARNING, "%s: NVML event set not available (%s); XID events are not "
                               "watched (the xid receiver reads them from the kernel log)", cid, exc)
            return
        by_uuid: dict[str, _Gpu] = {}
        for gpu in self.gpus:
            try:
                nv.nvmlDeviceRegisterEvents(gpu.handle, nv.nvmlEventTypeXidCriticalError, event_set)
                by_uuid[gpu.uuid] = gpu
            except Exception as exc:  # noqa: BLE001
                self.host.log_once(("evreg", gpu.index), logging.INFO, "%s: GPU %d: XID events not available (%s)",
                                   cid, gpu.index, exc)
        try:
            while by_uuid and not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, 500)
                except self._errors["Timeout"]:
                    continue
                except Exception as exc:  # noqa: BLE001
                    self.host.log_once(("evwait", type(exc)), logging.WARNING, "%s: waiting for NVML events failed "
                                       "(%s); retrying every second", cid, exc)
                    self._stop.wait(1.0)
                    continue
                if data.eventType & nv.nvmlEventTypeXidCriticalError:
                    self._on_xid(data, by_uuid)
        finally:
            try:
                nv.nvmlEventSetFree(event_set)
            except Exception:  # noqa: BLE001
                pass

    def _on_xid(self, data: Any, by_uuid: dict[str, _Gpu]) -> None:
        time_ns = time.time_ns()
        code = int(data.eventData)
        try:
            gpu = by_uuid.get(_text(self.backend.nvmlDeviceGetUUID(data.device)))
        except Exception:  # noqa: BLE001 - e.g. XID 79: the GPU may already be unreachable
            gpu = None
        if gpu is None and len(by_uuid) == 1:
            gpu = next(iter(by_uuid.values()))
        identity = gpu.identity if gpu is not None else {HW_TYPE: "gpu"}
        if gpu is not None:
            with self._lock:
                gpu.xid_counts[code] = gpu.xid_counts.get(code, 0) + 1
        lb = LogsBuilder(self._resource, scope=_SCOPE)
        body = {"code": code, "gpu_index": identity.get(GPU_INDEX), "uuid": identity.get(HW_ID),
                "pci_bus_id": identity.get(GPU_PCI_BUS_ID), "time_unix": time_ns / 1e9, "source": "nvml",
                "pid": None, "message": G.XID_MEANING.get(code, "")}
        lb.event(G.XID_EVENT, body, identity, {G.XID_CODE: code, G.XID_SOURCE: "nvml"}, time_ns=time_ns,
                 severity=LogsBuilder.ERROR)
        _logger.warning("%s: XID %d on GPU %s (%s)%s", self.host.component_id, code, body["gpu_index"],
                        body["pci_bus_id"], f": {body['message']}" if body["message"] else "")
        try:
            self.host.consumer(Signal.LOGS).consume(Batch.from_message(Signal.LOGS, lb.build()))
        except Exception:  # noqa: BLE001
            self.host.log_once("xid-consume", logging.ERROR, "%s: passing an XID record on failed (logged once)",
                               self.host.component_id, exc_info=True)
