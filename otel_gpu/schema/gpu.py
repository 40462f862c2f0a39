"""GPU health metrics and XID events (receivers: nvml, xid). hw.* semantic conventions where they exist.

Every GPU data point carries the GPU's identity (:data:`GPU_ATTRS`: ``gpu.index``, ``hw.id`` = UUID,
``gpu.pci.bus_id``, ``hw.model`` = product name, ``hw.vendor``, ``hw.driver_version``, ``hw.type`` = ``gpu``);
``host.name`` is a resource attribute. Names marked ``semconv`` are the OpenTelemetry semantic conventions' (a test
checks name, instrument, unit and meaning against the installed ``opentelemetry-semantic-conventions``); the others
are otel-gpu's own ``gpu.*`` namespace, which the conventions do not use.

Example:
    >>> from otel_gpu.schema import gpu
    >>> gpu.UTILIZATION.name, gpu.UTILIZATION.unit, gpu.UTILIZATION.dcgm
    ('hw.gpu.utilization', '1', 'DCGM_FI_DEV_GPU_UTIL')
    >>> [r.value for r in gpu.ClockEventReason][:3]
    ['gpu_idle', 'applications_clocks_setting', 'sw_power_cap']
"""
from __future__ import annotations

import enum

from otel_gpu.schema._model import MetricType, attr, enumeration, event, metric
from otel_gpu.schema.identity import (GPU_INDEX, GPU_PCI_BUS_ID, HW_DRIVER_VERSION, HW_ID, HW_MODEL, HW_NAME,
                                     HW_TYPE, HW_VENDOR, PROCESS_PID)

_G = "GPU health"
_GA = "GPU health attributes"


@enumeration
class ClockEventReason(str, enum.Enum):
    """NVML clock-event (throttle) reason bits, decoded into names (nvmlClocksEventReason*)."""

    GPU_IDLE = "gpu_idle"  # 0x1
    APPLICATIONS_CLOCKS_SETTING = "applications_clocks_setting"  # 0x2
    SW_POWER_CAP = "sw_power_cap"  # 0x4
    HW_SLOWDOWN = "hw_slowdown"  # 0x8
    SYNC_BOOST = "sync_boost"  # 0x10
    SW_THERMAL_SLOWDOWN = "sw_thermal_slowdown"  # 0x20
    HW_THERMAL_SLOWDOWN = "hw_thermal_slowdown"  # 0x40
    HW_POWER_BRAKE_SLOWDOWN = "hw_power_brake_slowdown"  # 0x80
    DISPLAY_CLOCK_SETTING = "display_clock_setting"  # 0x100


#: bit -> reason, in NVML's order (nvmlClocksEventReason* constants).
CLOCK_EVENT_BITS: tuple[tuple[int, ClockEventReason], ...] = (
    (0x1, ClockEventReason.GPU_IDLE), (0x2, ClockEventReason.APPLICATIONS_CLOCKS_SETTING),
    (0x4, ClockEventReason.SW_POWER_CAP), (0x8, ClockEventReason.HW_SLOWDOWN), (0x10, ClockEventReason.SYNC_BOOST),
    (0x20, ClockEventReason.SW_THERMAL_SLOWDOWN), (0x40, ClockEventReason.HW_THERMAL_SLOWDOWN),
    (0x80, ClockEventReason.HW_POWER_BRAKE_SLOWDOWN), (0x100, ClockEventReason.DISPLAY_CLOCK_SETTING),
)


@enumeration
class HwState(str, enum.Enum):
    """Values of the semconv ``hw.state`` attribute of ``hw.status``."""

    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"


# -- attributes ---------------------------------------------------------------------------------------------------
SENSOR = attr("hw.sensor_location", "string", "Where a temperature is measured: gpu (die) or memory (HBM).",
              group=_GA, values=("gpu", "memory"), semconv=True)
ERROR_TYPE = attr("error.type", "string", "Kind of error counted by hw.errors (GPU: corrected, uncorrected; NIC: the "
                  "sysfs counter, e.g. symbol_error, rx_crc_errors), gpu.nvlink.errors and otel_gpu.nic.errors.rate.",
                  group=_GA, semconv=True)
HW_STATE = attr("hw.state", "string", "Hardware state of hw.status.", group=_GA, values=HwState, semconv=True)
CLOCK_DOMAIN = attr("gpu.clock.domain", "string", "Clock domain.", group=_GA, values=("sm", "memory"))
CLOCK_EVENT_REASON = attr("gpu.clock_event.reason", "string", "Clock-event (throttle) reason, decoded from NVML's "
                          "bitmask.", group=_GA, values=ClockEventReason)
ECC_COUNTER = attr("gpu.ecc.counter", "string", "volatile (since the last driver load) or aggregate (lifetime).",
                   group=_GA, values=("volatile", "aggregate"))
RETIREMENT_CAUSE = attr("gpu.retired_pages.cause", "string", "Why pages were retired.", group=_GA,
                        values=("multiple_single_bit_ecc", "double_bit_ecc"))
REMAP_KIND = attr("gpu.row_remap.kind", "string", "Rows remapped because of correctable or uncorrectable errors.",
                  group=_GA, values=("correctable", "uncorrectable"))
NVLINK_LINK = attr("gpu.nvlink.link", "int", "NVLink link number on the GPU.", group=_GA)
NETWORK_IO_DIRECTION = attr("network.io.direction", "string", "transmit or receive.", group=_GA,
                            values=("transmit", "receive"), semconv=True)
PROCESS_TYPE = attr("gpu.process.type", "string", "compute or graphics context.", group=_GA,
                    values=("compute", "graphics"))
XID_CODE = attr("gpu.xid.code", "int", "NVIDIA XID error code (e.g. 79: GPU fell off the bus).", group=_GA)
NIC_PORT = attr("nic.port", "int", "InfiniBand port number (1-based); absent on network interfaces.",
                group="NIC health attributes")
NIC_PORT_GUID = attr("nic.port.guid", "string", "The InfiniBand port GUID (the low 64 bits of GID 0, "
                      "ports/N/gids/0): the port's identity across reboots, renames and re-cabling, which the health "
                      "history is kept by; absent on network interfaces.", group="NIC health attributes")
NIC_KIND = attr("nic.kind", "string", "What the nic receiver read: an InfiniBand (or RoCE) HCA port under "
                "class/infiniband, or a network interface under class/net.", group="NIC health attributes",
                values=("infiniband", "ethernet"))
XID_SOURCE = attr("gpu.xid.source", "string", "Where the XID was seen: the NVML event set or the kernel log.",
                  group=_GA, values=("nvml", "kmsg"))

#: The identity attributes on every per-GPU data point and XID record.
GPU_ATTRS = (GPU_INDEX, HW_ID, GPU_PCI_BUS_ID, HW_MODEL, HW_VENDOR, HW_DRIVER_VERSION, HW_TYPE)

# -- metrics ------------------------------------------------------------------------------------------------------
UTILIZATION = metric("hw.gpu.utilization", MetricType.GAUGE, "1", "Fraction of time spent in a specific task: "
                     "here, of time a kernel was running (0..1; NVML utilization.gpu; no hw.gpu.task split).",
                     group=_G, attributes=GPU_ATTRS, semconv=True, dcgm="DCGM_FI_DEV_GPU_UTIL")
MEMORY_UTILIZATION = metric("hw.gpu.memory.utilization", MetricType.GAUGE, "1",
                            "Fraction of GPU memory used: hw.gpu.memory.usage / hw.gpu.memory.limit (0..1).",
                            group=_G, attributes=GPU_ATTRS, semconv=True,
                            dcgm="DCGM_FI_DEV_FB_USED (divided by DCGM_FI_DEV_FB_TOTAL)")
MEMORY_ACTIVITY = metric("gpu.memory.activity", MetricType.GAUGE, "1",
                         "Fraction of time device memory was being read or written (0..1; NVML utilization.memory): "
                         "memory-bandwidth activity, not how much memory is used (that is hw.gpu.memory.utilization).",
                         group=_G, attributes=GPU_ATTRS, dcgm="DCGM_FI_DEV_MEM_COPY_UTIL")
MEMORY_USAGE = metric("hw.gpu.memory.usage", MetricType.UPDOWN, "By", "GPU memory used.", group=_G,
                      attributes=GPU_ATTRS, semconv=True, dcgm="DCGM_FI_DEV_FB_USED")
MEMORY_LIMIT = metric("hw.gpu.memory.limit", MetricType.UPDOWN, "By", "Size of the GPU memory.", group=_G,
                      attributes=GPU_ATTRS, semconv=True, dcgm="DCGM_FI_DEV_FB_TOTAL")
MEMORY_FREE = metric("gpu.memory.free", MetricType.UPDOWN, "By", "Free device memory.", group=_G,
                     attributes=GPU_ATTRS, dcgm="DCGM_FI_DEV_FB_FREE")
TEMPERATURE = metric("hw.temperature", MetricType.GAUGE, "Cel", "Temperature in degrees Celsius: GPU die "
                     "(hw.sensor_location gpu) and HBM (memory).",
                     group=_G, attributes=GPU_ATTRS + (SENSOR,), semconv=True,
                     dcgm="DCGM_FI_DEV_GPU_TEMP, DCGM_FI_DEV_MEMORY_TEMP")
POWER = metric("hw.power", MetricType.GAUGE, "W", "Instantaneous power consumed by the component: the GPU board's "
               "power draw.", group=_G, attributes=GPU_ATTRS,
               semconv=True, dcgm="DCGM_FI_DEV_POWER_USAGE")
POWER_LIMIT = metric("gpu.power.limit", MetricType.GAUGE, "W", "Enforced power limit.", group=_G,
                     attributes=GPU_ATTRS, dcgm="DCGM_FI_DEV_ENFORCED_POWER_LIMIT")
ENERGY = metric("hw.energy", MetricType.COUNTER, "J", "Energy consumed by the component: the GPU's, since the "
                "driver was loaded.", group=_G,
                attributes=GPU_ATTRS, semconv=True, dcgm="DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)")
CLOCK = metric("gpu.clock.frequency", MetricType.GAUGE, "MHz", "Current clock frequency.", group=_G,
               attributes=GPU_ATTRS + (CLOCK_DOMAIN,), dcgm="DCGM_FI_DEV_SM_CLOCK, DCGM_FI_DEV_MEM_CLOCK")
CLOCK_MAX = metric("gpu.clock.frequency.max", MetricType.GAUGE, "MHz", "Maximum clock frequency.", group=_G,
                   attributes=GPU_ATTRS + (CLOCK_DOMAIN,), dcgm="DCGM_FI_DEV_MAX_SM_CLOCK, DCGM_FI_DEV_MAX_MEM_CLOCK")
CLOCK_EVENT_ACTIVE = metric("gpu.clock_event.active", MetricType.GAUGE, "{flag}",
                            "1 while the clock-event (throttle) reason holds clocks down, else 0; one series per "
                            "reason.", group=_G, attributes=GPU_ATTRS + (CLOCK_EVENT_REASON,),
                            dcgm="DCGM_FI_DEV_CLOCKS_EVENT_REASONS (bitmask)")
PSTATE = metric("gpu.performance_state", MetricType.GAUGE, "{pstate}", "Performance state (0 = P0, fastest .. 15).",
                group=_G, attributes=GPU_ATTRS, dcgm="DCGM_FI_DEV_PSTATE")
# hw.errors is one metric for every hardware type; the nic schema adds its network attributes (NIC_ERROR_ATTRS).
ECC_ERRORS = metric("hw.errors", MetricType.COUNTER, "{error}",
                    "Number of errors encountered by the component. GPU (hw.type gpu): ECC errors of device memory; "
                    "error.type corrected (single-bit) or uncorrected (double-bit); gpu.ecc.counter volatile or "
                    "aggregate (do not sum across it). NIC (hw.type network): InfiniBand port and network interface "
                    "error counters, error.type = the sysfs counter (symbol_error, link_downed, link_error_recovery, "
                    "port_rcv_errors, port_xmit_discards, port_xmit_wait, rx_crc_errors, rx_dropped, "
                    "carrier_changes, ...), counted through resets.", group=_G,
                    attributes=GPU_ATTRS + (ERROR_TYPE, ECC_COUNTER, HW_NAME, NIC_PORT, NIC_KIND, NIC_PORT_GUID),
                    semconv=True,
                    dcgm="DCGM_FI_DEV_ECC_SBE_VOL_TOTAL, DCGM_FI_DEV_ECC_DBE_VOL_TOTAL, "
                         "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL, DCGM_FI_DEV_ECC_DBE_AGG_TOTAL")
HW_ERRORS = ECC_ERRORS
RETIRED_PAGES = metric("gpu.retired_pages", MetricType.GAUGE, "{page}", "Pages retired, by cause (pre-Ampere).",
                       group=_G, attributes=GPU_ATTRS + (RETIREMENT_CAUSE,),
                       dcgm="DCGM_FI_DEV_RETIRED_SBE, DCGM_FI_DEV_RETIRED_DBE")
RETIRED_PENDING = metric("gpu.retired_pages.pending", MetricType.GAUGE, "{flag}",
                         "1 when a page retirement waits for a GPU reset.", group=_G, attributes=GPU_ATTRS,
                         dcgm="DCGM_FI_DEV_RETIRED_PENDING")
REMAPPED_ROWS = metric("gpu.row_remap.rows", MetricType.GAUGE, "{row}", "Rows remapped (Ampere and later).",
                       group=_G, attributes=GPU_ATTRS + (REMAP_KIND,),
                       dcgm="DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS, DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS")
REMAP_PENDING = metric("gpu.row_remap.pending", MetricType.GAUGE, "{flag}",
                       "1 when a row remap waits for a GPU reset (XID 63).", group=_G, attributes=GPU_ATTRS,
                       dcgm="DCGM_FI_DEV_ROW_REMAP_PENDING")
REMAP_FAILURE = metric("gpu.row_remap.failure", MetricType.GAUGE, "{flag}",
                       "1 when a row remap failed (XID 64): the GPU needs service.", group=_G, attributes=GPU_ATTRS,
                       dcgm="DCGM_FI_DEV_ROW_REMAP_FAILURE")
PCIE_REPLAY = metric("gpu.pcie.replay", MetricType.COUNTER, "{replay}",
                     "PCIe replays; rising means a bad link.", group=_G, attributes=GPU_ATTRS,
                     dcgm="DCGM_FI_DEV_PCIE_REPLAY_COUNTER")
PCIE_THROUGHPUT = metric("gpu.pcie.throughput", MetricType.GAUGE, "By/s", "PCIe throughput (NVML samples ~20 ms).",
                         group=_G, attributes=GPU_ATTRS + (NETWORK_IO_DIRECTION,),
                         dcgm="DCGM_FI_PROF_PCIE_TX_BYTES, DCGM_FI_PROF_PCIE_RX_BYTES")
NVLINK_STATE = metric("gpu.nvlink.state", MetricType.GAUGE, "{flag}", "1 when the NVLink link is active, 0 when "
                      "it is down; links are those that answered NVML when the receiver started.", group=_G,
                      attributes=GPU_ATTRS + (NVLINK_LINK,))
NVLINK_ERRORS = metric("gpu.nvlink.errors", MetricType.COUNTER, "{error}",
                       "NVLink data-link errors per link; error.type replay, recovery, crc_flit, crc_data, ecc_data.",
                       group=_G, attributes=GPU_ATTRS + (NVLINK_LINK, ERROR_TYPE),
                       dcgm="DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_"
                            "TOTAL, DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, "
                            "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL")
PROCESS_MEMORY = metric("gpu.process.memory.usage", MetricType.GAUGE, "By",
                        "Device memory a process uses on a GPU: ties a pid (a rank) to its GPU.", group=_G,
                        attributes=GPU_ATTRS + (PROCESS_PID, PROCESS_TYPE))
XID_ERRORS = metric("gpu.xid.errors", MetricType.COUNTER, "{xid}", "XID errors seen, by code.", group=_G,
                    attributes=GPU_ATTRS + (XID_CODE,), dcgm="DCGM_FI_DEV_XID_ERRORS (a gauge of the last XID)")
STATUS = metric("hw.status", MetricType.UPDOWN, "1",
                "Operational status: 1 (true) or 0 (false) for each of the possible states: 1 for the GPU's current "
                "hw.state, 0 for the others; failed when the GPU is lost or a row remap "
                "failed; degraded with a pending remap/retirement, uncorrected volatile ECC errors or a hardware "
                "slowdown (HW slowdown, HW thermal, HW power brake); ok otherwise.", group=_G,
                attributes=GPU_ATTRS + (HW_STATE,), semconv=True)

# -- events -------------------------------------------------------------------------------------------------------
XID_EVENT = event("gpu.xid", "An XID error, from the NVML event set (nvml receiver) or the kernel log (xid "
                  "receiver). Severity ERROR; time is when the XID happened.", group=_G,
                  attributes=GPU_ATTRS + (XID_CODE, XID_SOURCE, PROCESS_PID),
                  body="{code, gpu_index, uuid, pci_bus_id, time_unix, source, pid, message}")

#: What common XID codes mean (NVIDIA's XID catalog, abridged); the XID record's body carries it as ``message``.
XID_MEANING: dict[int, str] = {
    13: "graphics engine exception (often the application)",
    31: "GPU memory page fault (MMU fault)",
    43: "GPU stopped processing (channel reset by the application)",
    45: "preemptive cleanup, due to a previous error (look for an earlier XID)",
    46: "GPU stopped processing",
    48: "double-bit ECC error (drain the node)",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event (reset to apply)",
    64: "ECC page retirement or row remapper recording failure (RMA if repeated)",
    74: "NVLink error",
    79: "GPU has fallen off the bus (drain the node)",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (restart the application)",
    95: "uncontained ECC error (reset the GPU)",
    119: "GSP RPC timeout",
    120: "GSP error",
    154: "GPU recovery action changed (reset required)",
}

#: Every GPU metric, in declaration order (for docs and tests).
METRICS = (UTILIZATION, MEMORY_UTILIZATION, MEMORY_ACTIVITY, MEMORY_USAGE, MEMORY_LIMIT, MEMORY_FREE, TEMPERATURE,
           POWER, POWER_LIMIT,
           ENERGY, CLOCK, CLOCK_MAX, CLOCK_EVENT_ACTIVE, PSTATE, ECC_ERRORS, RETIRED_PAGES, RETIRED_PENDING,
           REMAPPED_ROWS, REMAP_PENDING, REMAP_FAILURE, PCIE_REPLAY, PCIE_THROUGHPUT, NVLINK_STATE, NVLINK_ERRORS,
           PROCESS_MEMORY, XID_ERRORS, STATUS)
