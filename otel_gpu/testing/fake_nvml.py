"""A fake NVML: the nvidia-ml-py (``pynvml``) functions the nvml and xid receivers call, scriptable from a scenario.

:class:`FakeNvml` is used where the ``pynvml`` module would be: same function names and signatures, the same return
types (pynvml's own ctypes structures, e.g. ``c_nvmlUtilization_t``, ``c_nvmlMemory_t``, ``nvmlPciInfo_t``,
``c_nvmlFieldValue_t``; process lists and event data as pynvml's ``nvmlFriendlyObject``) and pynvml's own exception
classes (``pynvml.NVMLError_NotSupported``, ``NVMLError_LibraryNotFound``, ``NVMLError_GpuIsLost``,
``NVMLError_Timeout``, ...), so that ``except pynvml.NVMLError_NotSupported`` works on both. Constants
(``NVML_CLOCK_SM``, ``nvmlEventTypeXidCriticalError``, ...) and exception classes are read from pynvml itself.
Only the functions listed in :data:`IMPLEMENTED` exist; any other raises AttributeError, so a receiver cannot
silently depend on an unfaked call.

Scenario (YAML or JSON; every key optional)::

    library: ok                # ok | missing (nvmlInit raises NVMLError_LibraryNotFound) | driver_not_loaded
    driver_version: "550.54.15"
    gpu_count: 8               # GPUs built from the defaults (H100 SXM values) plus `defaults`
    defaults: {power_w: 300}   # any GPU field below, for every GPU
    gpus:                      # per-index overrides
      3: {not_supported: [memory_temperature, retired_pages], processes: [{pid: 4242, used_memory_mib: 1024}]}
    timeline:                  # applied when the fake's clock (seconds since creation) reaches at_s
      - {at_s: 5, gpu: 2, xid: 79}                                    # XID event (NVML event set)
      - {at_s: 5, gpu: 1, set: {clocks_event_reasons: [hw_thermal_slowdown], sm_clock_mhz: 900}}
      - {at_s: 6, gpu: 3, add: {ecc_uncorrected_volatile: 1, ecc_uncorrected_aggregate: 1}}  # ECC double-bit
      - {at_s: 9, gpu: 2, lost: true}                                  # every call on it: NVMLError_GpuIsLost

GPU fields (defaults in :data:`GPU_DEFAULTS`): name, uuid, pci_bus_id, memory_total_mib, memory_used_mib,
gpu_util_pct, mem_util_pct, temperature_c, memory_temperature_c, power_w, power_limit_w, energy_j (grows with
power_w over time), sm_clock_mhz, mem_clock_mhz, graphics_clock_mhz, max_sm_clock_mhz, max_mem_clock_mhz,
max_graphics_clock_mhz, clocks_event_reasons (names from ``schema.gpu.ClockEventReason`` or an int mask), pstate,
ecc_{corrected,uncorrected}_{volatile,aggregate}, retired_pages_sbe, retired_pages_dbe, retired_pending,
remapped_rows_correctable, remapped_rows_uncorrectable, remap_pending, remap_failure, pcie_replay, pcie_tx_kbps,
pcie_rx_kbps, nvlink_links (count), nvlink_down (list of links), nvlink_errors ({link: {replay|recovery|crc_flit|
crc_data|ecc_data: n}}), processes ([{pid, used_memory_mib}]), not_supported (names of :data:`FEATURES`), lost.

Example:
    >>> nv = FakeNvml({"gpu_count": 2, "gpus": {1: {"not_supported": ["power"]}}})
    >>> nv.nvmlInit()
    >>> h = nv.nvmlDeviceGetHandleByIndex(1)
    >>> nv.nvmlDeviceGetUtilizationRates(h).gpu
    0
    >>> try:
    ...     nv.nvmlDeviceGetPowerUsage(h)
    ... except nv.NVMLError_NotSupported as exc:
    ...     print(exc)
    Not Supported
    >>> nv.inject({"gpu": 0, "xid": 79}); nv.nvmlShutdown()
"""
from __future__ import annotations

import collections
import copy
import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pynvml

__all__ = ["FEATURES", "GPU_DEFAULTS", "IMPLEMENTED", "FakeClock", "FakeNvml", "load_scenario"]

_REASON_BITS = {
    "gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
    "sync_boost": 0x10, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
_NVLINK_COUNTERS = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
                    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
                    pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA: "ecc_data"}
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

#: What ``not_supported`` may name, and the calls each one makes raise NVMLError_NotSupported.
FEATURES = {
    "utilization": ("nvmlDeviceGetUtilizationRates",),
    "memory": ("nvmlDeviceGetMemoryInfo",),
    "temperature": ("nvmlDeviceGetTemperature",),
    "memory_temperature": (),  # a per-field NOT_SUPPORTED in nvmlDeviceGetFieldValues
    "power": ("nvmlDeviceGetPowerUsage",),
    "power_limit": ("nvmlDeviceGetEnforcedPowerLimit",),
    "energy": ("nvmlDeviceGetTotalEnergyConsumption",),
    "clocks": ("nvmlDeviceGetClockInfo",),
    "max_clocks": ("nvmlDeviceGetMaxClockInfo",),
    "clocks_event_reasons": ("nvmlDeviceGetCurrentClocksEventReasons",),
    "pstate": ("nvmlDeviceGetPerformanceState",),
    "ecc": ("nvmlDeviceGetTotalEccErrors",),
    "retired_pages": ("nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus"),
    "remapped_rows": ("nvmlDeviceGetRemappedRows",),
    "pcie_replay": ("nvmlDeviceGetPcieReplayCounter",),
    "pcie_throughput": ("nvmlDeviceGetPcieThroughput",),
    "nvlink": ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter"),
    "processes": ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"),
    "events": ("nvmlDeviceRegisterEvents",),
}

GPU_DEFAULTS: dict[str, Any] = {
    "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "memory_used_mib": 512, "gpu_util_pct": 0,
    "mem_util_pct": 0, "temperature_c": 34, "memory_temperature_c": 41, "power_w": 70.0, "power_limit_w": 700.0,
    "energy_j": 1_000_000.0, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "graphics_clock_mhz": 1980,
    "max_sm_clock_mhz": 1980, "max_mem_clock_mhz": 2619, "max_graphics_clock_mhz": 1980, "clocks_event_reasons": [],
    "pstate": 0, "ecc_corrected_volatile": 0, "ecc_uncorrected_volatile": 0, "ecc_corrected_aggregate": 0,
    "ecc_uncorrected_aggregate": 0, "retired_pages_sbe": 0, "retired_pages_dbe": 0, "retired_pending": 0,
    "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0, "remap_pending": 0, "remap_failure": 0,
    "pcie_replay": 0, "pcie_tx_kbps": 0, "pcie_rx_kbps": 0, "nvlink_links": 18, "nvlink_down": [],
    "nvlink_errors": {}, "processes": [], "not_supported": [], "lost": False,
}

IMPLEMENTED = (
    "nvmlInit", "nvmlInitWithFlags", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetIndex",
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature", "nvmlDeviceGetFieldValues", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetPerformanceState", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetWait", "nvmlEventSetFree",
)


def load_scenario(source: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    """A scenario from a mapping, a YAML/JSON file path, or None (one default GPU)."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    path = Path(source)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a fake NVML scenario is a mapping (got {type(data).__name__})")
    return data


class FakeClock:
    """A manual clock for deterministic tests: ``FakeNvml(scenario, clock=clk)``; ``clk.advance(5)``."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Handle:
    """A device handle (the real one is an opaque ctypes pointer)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<fake nvmlDevice_t {self.index}>"


class _EventSet:
    __slots__ = ("registered", "queue", "freed")

    def __init__(self):
        self.registered: dict[int, int] = {}  # gpu index -> event type mask
        self.queue: collections.deque = collections.deque()
        self.freed = False


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass, e.g. NVMLError_NotSupported


class FakeNvml:
    """A scriptable stand-in for the ``pynvml`` module (see the module docstring for the scenario)."""

    def __init__(self, scenario: str | Path | Mapping[str, Any] | None = None, *,
                 clock: Callable[[], float] | None = None):
        self.scenario = load_scenario(scenario)
        self._manual_clock = clock is not None
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._cond = threading.Condition(threading.RLock())
        self._initialized = 0
        self.calls: collections.Counter[str] = collections.Counter()  # per function, for tests
        sc = self.scenario
        self._library = str(sc.get("library", "ok"))
        self._driver = str(sc.get("driver_version", "550.54.15"))
        count = int(sc.get("gpu_count", 1))
        defaults = {**GPU_DEFAULTS, **(sc.get("defaults") or {})}
        overrides = {int(k): v for k, v in (sc.get("gpus") or {}).items()}
        self.gpus: list[dict[str, Any]] = []
        for i in range(max(count, max(overrides, default=-1) + 1)):
            gpu = copy.deepcopy(defaults)
            gpu.setdefault("uuid", f"GPU-{i:08x}-fa6e-4a11-8000-{0xC0FFEE000 + i:012x}")
            gpu.setdefault("pci_bus_id", f"00000000:{_HGX_BUSES[i % 8] + 0x100 * (i // 8):02X}:00.0")
            gpu.update(copy.deepcopy(overrides.get(i, {})))
            self.gpus.append(gpu)
        self._last_t = 0.0
        self._timeline = sorted((dict(e) for e in sc.get("timeline") or []), key=lambda e: float(e.get("at_s", 0)))
        self._next = 0
        self._event_sets: list[_EventSet] = []

    # -- pynvml's constants and exception classes ---------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)  # AttributeError when pynvml lacks it, too
        if callable(value) and not isinstance(value, type):
            raise AttributeError(f"fake NVML does not implement {name} (implemented: see fake_nvml.IMPLEMENTED)")
        return value

    # -- scripting ----------------------------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the fake was created, on its clock."""
        return self._clock() - self._t0

    def inject(self, entry: Mapping[str, Any]) -> None:
        """Applies one timeline entry now (``{"gpu": 2, "xid": 79}``, ``{"gpu": 1, "set": {...}}``, ...)."""
        with self._cond:
            self._apply(dict(entry))
            self._cond.notify_all()

    def _apply(self, entry: dict[str, Any]) -> None:
        gpus = range(len(self.gpus)) if entry.get("gpu", "all") == "all" else [int(entry["gpu"])]
        for i in gpus:
            gpu = self.gpus[i]
            for key, value in (entry.get("set") or {}).items():
                gpu[key] = value
            for key, value in (entry.get("add") or {}).items():
                gpu[key] = gpu.get(key, 0) + value
            if "lost" in entry:
                gpu["lost"] = bool(entry["lost"])
            if "xid" in entry:
                for es in self._event_sets:
                    if es.registered.get(i, 0) & pynvml.nvmlEventTypeXidCriticalError:
                        es.queue.append(pynvml.nvmlFriendlyObject({
                            "device": _Handle(i), "eventType": pynvml.nvmlEventTypeXidCriticalError,
                            "eventData": int(entry["xid"]), "gpuInstanceId": 0xFFFFFFFF,
                            "computeInstanceId": 0xFFFFFFFF}))

    def _advance(self) -> None:
        """Applies due timeline entries and integrates energy; caller holds the lock."""
        t = self.now()
        dt = t - self._last_t
        if dt > 0:
            for gpu in self.gpus:
                gpu["energy_j"] = gpu["energy_j"] + float(gpu["power_w"]) * dt
            self._last_t = t
        fired = False
        while self._next < len(self._timeline) and float(self._timeline[self._next].get("at_s", 0)) <= t:
            self._apply(self._timeline[self._next])
            self._next += 1
            fired = True
        if fired:
            self._cond.notify_all()

    def _gpu(self, handle: Any, fn: str) -> dict[str, Any]:
        self.calls[fn] += 1
        if not self._initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._cond:
            self._advance()
        gpu = self.gpus[handle.index]
        if gpu["lost"]:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        for feature in gpu["not_supported"]:
            if fn in FEATURES.get(feature, ()):
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # -- library ------------------------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.calls["nvmlInit"] += 1
        if self._library == "missing":
            raise _err(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if self._library == "driver_not_loaded":
            raise _err(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        with self._cond:
            self._initialized += 1

    def nvmlShutdown(self) -> None:
        with self._cond:
            if not self._initialized:
                raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
            self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        if not self._initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        return self._driver

    def nvmlDeviceGetCount(self) -> int:
        if not self._initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not self._initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        if not 0 <= int(index) < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(int(index))

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> _Handle:
        if not self._initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        want = pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId
        for i, gpu in enumerate(self.gpus):
            if _pci_key(gpu["pci_bus_id"]) == _pci_key(want):
                return _Handle(i)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        if not self._initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        want = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, gpu in enumerate(self.gpus):
            if gpu["uuid"] == want:
                return _Handle(i)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    # -- identity -----------------------------------------------------------------------------------------------------
    def nvmlDeviceGetIndex(self, handle) -> int:
        self._gpu(handle, "nvmlDeviceGetIndex")
        return handle.index

    def nvmlDeviceGetName(self, handle) -> str:
        return str(self._gpu(handle, "nvmlDeviceGetName")["name"])

    def nvmlDeviceGetUUID(self, handle) -> str:
        return str(self._gpu(handle, "nvmlDeviceGetUUID")["uuid"])

    def nvmlDeviceGetPciInfo(self, handle) -> pynvml.nvmlPciInfo_t:
        bus_id = str(self._gpu(handle, "nvmlDeviceGetPciInfo")["pci_bus_id"])
        domain, bus, dev = _pci_key(bus_id)[:3]
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id[4:].encode()
        info.domain, info.bus, info.device = domain, bus, dev
        info.pciDeviceId = 0x233010DE
        return info

    # -- gauges -------------------------------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle) -> pynvml.c_nvmlUtilization_t:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return pynvml.c_nvmlUtilization_t(int(gpu["gpu_util_pct"]), int(gpu["mem_util_pct"]))

    def nvmlDeviceGetMemoryInfo(self, handle, version=None) -> pynvml.c_nvmlMemory_t:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        total = int(gpu["memory_total_mib"]) << 20
        used = min(total, int(gpu["memory_used_mib"]) << 20)
        if version:
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.version, mem.total, mem.reserved, mem.free, mem.used = version, total, 0, total - used, used
            return mem
        return pynvml.c_nvmlMemory_t(total, total - used, used)

    def nvmlDeviceGetTemperature(self, handle, sensor: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(gpu["temperature_c"])

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        now_us = int(time.time() * 1e6)
        for i, field in enumerate(fieldIds):
            fid, scope = (field if isinstance(field, (tuple, list)) else (field, 0))
            v = values[i]
            v.fieldId, v.scopeId, v.timestamp = fid, scope, now_us
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP and "memory_temperature" not in gpu["not_supported"]:
                v.valueType, v.nvmlReturn = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, pynvml.NVML_SUCCESS
                v.value.uiVal = int(gpu["memory_temperature_c"])
            elif fid == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER and "pcie_replay" not in gpu["not_supported"]:
                v.valueType, v.nvmlReturn = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, pynvml.NVML_SUCCESS
                v.value.ullVal = int(gpu["pcie_replay"])
            else:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        return int(float(self._gpu(handle, "nvmlDeviceGetPowerUsage")["power_w"]) * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle) -> int:
        return int(float(self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit")["power_limit_w"]) * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle) -> int:
        return int(float(self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")["energy_j"]) * 1000)

    _CLOCKS = {pynvml.NVML_CLOCK_SM: "sm", pynvml.NVML_CLOCK_MEM: "mem", pynvml.NVML_CLOCK_GRAPHICS: "graphics"}

    def nvmlDeviceGetClockInfo(self, handle, type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
        if type not in self._CLOCKS:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(gpu[f"{self._CLOCKS[type]}_clock_mhz"])

    def nvmlDeviceGetMaxClockInfo(self, handle, type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetMaxClockInfo")
        if type not in self._CLOCKS:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(gpu[f"max_{self._CLOCKS[type]}_clock_mhz"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle) -> int:
        reasons = self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")["clocks_event_reasons"]
        if isinstance(reasons, int):
            return reasons
        mask = 0
        for name in reasons:
            mask |= _REASON_BITS[str(name)]
        return mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle) -> int:
        return self.nvmlDeviceGetCurrentClocksEventReasons(handle)

    def nvmlDeviceGetPerformanceState(self, handle) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetPerformanceState")["pstate"])

    # -- errors and health ------------------------------------------------------------------------------------------
    def nvmlDeviceGetTotalEccErrors(self, handle, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        kind = {pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected"}.get(errorType)
        scope = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}.get(counterType)
        if kind is None or scope is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(gpu[f"ecc_{kind}_{scope}"])

    def nvmlDeviceGetRetiredPages(self, device, sourceFilter: int) -> list[int]:
        gpu = self._gpu(device, "nvmlDeviceGetRetiredPages")
        if sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
            n, base = int(gpu["retired_pages_sbe"]), 0x1000
        elif sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            n, base = int(gpu["retired_pages_dbe"]), 0x8000
        else:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return [base + k for k in range(n)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device) -> int:
        return int(self._gpu(device, "nvmlDeviceGetRetiredPagesPendingStatus")["retired_pending"])

    def nvmlDeviceGetRemappedRows(self, device) -> tuple[int, int, int, int]:
        gpu = self._gpu(device, "nvmlDeviceGetRemappedRows")
        return (int(gpu["remapped_rows_correctable"]), int(gpu["remapped_rows_uncorrectable"]),
                int(gpu["remap_pending"]), int(gpu["remap_failure"]))

    def nvmlDeviceGetPcieReplayCounter(self, handle) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetPcieReplayCounter")["pcie_replay"])

    def nvmlDeviceGetPcieThroughput(self, device, counter: int) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetPcieThroughput")
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return int(gpu["pcie_tx_kbps"])
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return int(gpu["pcie_rx_kbps"])
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _link(self, gpu: dict[str, Any], link: int) -> int:
        link = int(link)
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if link >= int(gpu["nvlink_links"]):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return link

    def nvmlDeviceGetNvLinkState(self, device, link: int) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetNvLinkState")
        link = self._link(gpu, link)
        return 0 if link in {int(x) for x in gpu["nvlink_down"]} else 1

    def nvmlDeviceGetNvLinkErrorCounter(self, device, link: int, counter: int) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetNvLinkErrorCounter")
        link = self._link(gpu, link)
        if counter not in _NVLINK_COUNTERS:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        errors = gpu["nvlink_errors"].get(link) or gpu["nvlink_errors"].get(str(link)) or {}
        return int(errors.get(_NVLINK_COUNTERS[counter], 0))

    def nvmlDeviceGetComputeRunningProcesses(self, handle) -> list:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [pynvml.nvmlFriendlyObject({"pid": int(p["pid"]),
                                           "usedGpuMemory": int(p.get("used_memory_mib", 0)) << 20,
                                           "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF})
                for p in gpu["processes"]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle) -> list:
        self._gpu(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return []

    # -- events -------------------------------------------------------------------------------------------------------
    def nvmlDeviceGetSupportedEventTypes(self, handle) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetSupportedEventTypes")
        if "events" in gpu["not_supported"]:
            return 0
        return (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError
                | pynvml.nvmlEventTypeDoubleBitEccError)

    def nvmlEventSetCreate(self) -> _EventSet:
        if not self._initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        es = _EventSet()
        with self._cond:
            self._event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, handle, eventTypes: int, eventSet: _EventSet) -> None:
        with self._cond:
            self._gpu(handle, "nvmlDeviceRegisterEvents")
            eventSet.registered[handle.index] = eventSet.registered.get(handle.index, 0) | int(eventTypes)

    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int):
        """Returns the next event, or raises NVMLError_Timeout after ``timeoutms``, like NVML."""
        self.calls["nvmlEventSetWait_v2"] += 1
        deadline = time.monotonic() + max(0, int(timeoutms)) / 1000.0
        with self._cond:
            while True:
                if eventSet.freed or not self._initialized:
                    raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
                self._advance()
                if eventSet.queue:
                    return eventSet.queue.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _err(pynvml.NVML_ERROR_TIMEOUT)
                wait = remaining
                if self._next < len(self._timeline):
                    if self._manual_clock:
                        wait = min(wait, 0.02)  # a manual clock moves without notifying us
                    else:
                        due = float(self._timeline[self._next].get("at_s", 0)) - self.now()
                        wait = min(wait, max(due, 0.0) + 0.001)
                self._cond.wait(wait)

    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int):
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        with self._cond:
            eventSet.freed = True
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)
            self._cond.notify_all()


def _pci_key(bus_id: str) -> tuple[int, int, int, int]:
    """'00000000:3B:00.0', '0000:3b:00.0' or '0000:3b:00' -> (domain, bus, device, function)."""
    parts = bus_id.strip().split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    domain, bus, rest = parts[-3], parts[-2], parts[-1]
    dev, _, fn = rest.partition(".")
    return int(domain, 16), int(bus, 16), int(dev, 16), int(fn or "0", 16)
