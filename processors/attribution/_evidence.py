"""Device state (GPUs, network ports) with baselines, and the rules that turn it into :class:`Fault` records.

A hardware or network fact counts only if it *began* inside the causal window of its cause around the symptom
(``WINDOWS``), and above the device's own baseline:

- a link counts when we saw it go from up to down (or its ``link_downed`` counter rise) inside the window; a port
  that was down at its first sample (never seen up), went down before the window, or was back up before the job
  started, is baseline;
- a clock-event reason counts when we saw it become active inside the window; one active at the GPU's first sample
  is baseline; ``sw_power_cap`` (a busy GPU has it most of the time) and the idle/application/display reasons never
  count;
- an error counter counts when its rise inside the window is at least ``_MIN_RISE`` and more than four times what
  the device's own background rate (learned from its history before the window) predicts;
- an XID counts when it happened inside the window, on the rank's GPU or with the rank's pid; application XIDs
  (13, 31, 43, 45) are software (the application restarts, the node stays), must carry the rank's pid when they
  carry one, and without a pid must not predate the rank's process (``process.creation.time``): an earlier
  program's error on the same GPU is not this rank's; the earliest XID of a burst is the cause (45 is cleanup after
  another).

Network evidence comes only from the ports the job uses when the ranks say which (``Identity.net_ifaces``), else
from ports that were up when the job started.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from otel_gpu.processors.attribution._observations import GpuSample, Identity, NicSample, XidSeen
from otel_gpu.processors.attribution._types import Evidence, Fault, Window
from otel_gpu.schema.failure import Action, Category, RootCause

__all__ = ["DeviceEvidence", "REVISE_FOR_S", "WINDOWS", "XidClass", "classify_xid", "strongest"]


class XidClass(str, enum.Enum):
    APPLICATION = "application"  # the application caused it: restart the application, the node stays
    HARDWARE = "hardware"  # the GPU, its memory, its links or its firmware failed: drain or reset
    UNKNOWN = "unknown"  # not in our table: reported, never a reason to drain a node


# NVIDIA's Xid catalog (https://docs.nvidia.com/deploy/xid-errors/, its resolution bucket); the classes are
# listed in processors/attribution/README.md (XIDs) and the root causes in docs/schema.md (failure.root_cause).
_XIDS: dict[int, tuple[XidClass, RootCause, str]] = {
    13: (XidClass.APPLICATION, RootCause.GPU_XID, "a graphics engine exception (XID 13, usually the application)"),
    31: (XidClass.APPLICATION, RootCause.GPU_XID, "a GPU memory page fault (XID 31, usually the application)"),
    43: (XidClass.APPLICATION, RootCause.GPU_XID, "the application's GPU channel was reset (XID 43)"),
    45: (XidClass.APPLICATION, RootCause.GPU_XID, "a preemptive cleanup (XID 45)"),
    46: (XidClass.HARDWARE, RootCause.GPU_XID, "the GPU stopped processing (XID 46)"),
    48: (XidClass.HARDWARE, RootCause.GPU_ECC_UNCORRECTABLE, "a double-bit ECC error (XID 48)"),
    61: (XidClass.HARDWARE, RootCause.GPU_XID, "an internal micro-controller breakpoint (XID 61)"),
    62: (XidClass.HARDWARE, RootCause.GPU_XID, "an internal micro-controller halt (XID 62)"),
    63: (XidClass.HARDWARE, RootCause.GPU_ECC_UNCORRECTABLE, "a page retirement / row remap (XID 63)"),
    64: (XidClass.HARDWARE, RootCause.GPU_ECC_UNCORRECTABLE, "a row remap failure (XID 64)"),
    74: (XidClass.HARDWARE, RootCause.NVLINK_ERROR, "an NVLink error (XID 74)"),
    79: (XidClass.HARDWARE, RootCause.GPU_FELL_OFF_BUS, "the GPU fell off the bus (XID 79)"),
    92: (XidClass.HARDWARE, RootCause.GPU_ECC_UNCORRECTABLE, "a high single-bit ECC error rate (XID 92)"),
    94: (XidClass.HARDWARE, RootCause.GPU_ECC_UNCORRECTABLE, "a contained uncorrectable ECC error (XID 94)"),
    95: (XidClass.HARDWARE, RootCause.GPU_ECC_UNCORRECTABLE, "an uncontained uncorrectable ECC error (XID 95)"),
    119: (XidClass.HARDWARE, RootCause.GPU_XID, "a GSP RPC timeout (XID 119)"),
    120: (XidClass.HARDWARE, RootCause.GPU_XID, "a GSP error (XID 120)"),
    154: (XidClass.HARDWARE, RootCause.GPU_XID, "the GPU needs a reset (XID 154)"),
}
_XID_CLEANUP = 45


def classify_xid(code: int) -> tuple[XidClass, RootCause, str]:
    """(class, root cause, what it means) of an XID code.

    >>> classify_xid(79)[:2]
    (<XidClass.HARDWARE: 'hardware'>, <RootCause.GPU_FELL_OFF_BUS: 'gpu_fell_off_bus'>)
    >>> classify_xid(13)[0].value, classify_xid(999)[0].value
    ('application', 'unknown')
    """
    return _XIDS.get(code, (XidClass.UNKNOWN, RootCause.GPU_XID, f"XID {code}"))


#: The causal window of each hardware or network cause, around the symptom (a crash's first failure, a hang's stall
#: start, a slowdown's first slow step): (seconds before, seconds after). After: evidence the devices report a little
#: late (poll intervals) or a fault that struck a collective already in flight.
WINDOWS: dict[RootCause, Window] = {
    RootCause.GPU_XID: Window(30.0, 10.0),
    RootCause.GPU_FELL_OFF_BUS: Window(30.0, 10.0),
    RootCause.GPU_ECC_UNCORRECTABLE: Window(30.0, 10.0),
    RootCause.NVLINK_ERROR: Window(60.0, 10.0),
    RootCause.PCIE_ERROR: Window(60.0, 10.0),
    RootCause.NIC_LINK_DOWN: Window(30.0, 10.0),
    RootCause.NIC_ERRORS: Window(60.0, 10.0),
    RootCause.GPU_THERMAL_THROTTLE: Window(60.0, 10.0),
    RootCause.GPU_POWER_THROTTLE: Window(60.0, 10.0),
    RootCause.GPU_HW_SLOWDOWN: Window(60.0, 10.0),
}
#: How long after a symptom late evidence can still revise a verdict: the longest "after" plus the time a device
#: sample needs to reach the collector (poll interval, batching, a sidecar hop).
REVISE_FOR_S = max(w.after_s for w in WINDOWS.values()) + 10.0

# Clock-event reasons (NVML) that point at hardware, when they begin inside the window. sw_power_cap is not here:
# a busy GPU sits at its power cap most of the time; sw_thermal_slowdown is the driver's own thermal management.
_THROTTLES = {"hw_thermal_slowdown": RootCause.GPU_THERMAL_THROTTLE,
              "hw_power_brake_slowdown": RootCause.GPU_POWER_THROTTLE,
              "hw_slowdown": RootCause.GPU_HW_SLOWDOWN}
_GPU_RATE_COUNTERS = {"nvlink_errors": RootCause.NVLINK_ERROR, "pcie_replay": RootCause.PCIE_ERROR}
_GPU_ECC_COUNTERS = ("ecc_uncorrected", "row_remap_failure")
NIC_ERROR_COUNTERS = ("symbol_error", "link_error_recovery", "port_rcv_errors", "local_link_integrity_errors",
                      "port_rcv_remote_physical_errors", "excessive_buffer_overrun_errors", "rx_errors",
                      "tx_errors", "rx_crc_errors")
NIC_READ_COUNTERS = frozenset(NIC_ERROR_COUNTERS + ("link_downed",))
# The smallest rise that counts, with no background: one uncorrectable error or one link drop is a fact; error
# counters need a few (a single replay or symbol error is noise on any link).
_MIN_RISE = {"ecc_uncorrected": 1.0, "row_remap_failure": 1.0, "link_downed": 1.0}
_MIN_RISE_DEFAULT = 3.0
_BACKGROUND_FACTOR = 4.0  # a rise must exceed this many times what the background rate predicts
_MIN_HISTORY_S = 30.0  # a background rate needs this much history before the window
_MIN_BURST_HISTORY_S = 10.0  # else: the rate from the first sample to where the rise began, with this much
#: A process's creation time (``process.creation.time``: /proc ticks since boot on the boot clock, 10 ms; never
#: later than the truth) against an XID's time on the same node (when the kernel logged it, or when NVML's event was
#: read: never earlier than the truth). An XID this much before the creation is another program's. It was 1 s, for
#: creation times from /proc/stat's btime, which is whole seconds: an XID 0.8 s before rank 0 started was blamed for
#: its slowdown in the adversarial suite (seed 20, runs 8 and 34).
_CLOCK_SLACK_S = 0.1
_XID_BURST_GAP_S = 5.0  # XIDs closer than this to the previous one belong to its burst
_BURST_STEP = 10.0  # with no background known, an error counter counts only when one poll adds this many
_EVICT_EVERY_S = 10.0
_JOB_START_SLACK_S = 5.0  # the collector hears of a job this long after it started, at most (its first heartbeat)


@dataclass(slots=True)
class Series:
    """Cumulative counter samples of one signal, bounded; only changes are kept (an unchanged sample adds nothing
    to a rise), so that a healthy counter costs one point. The first sample is the baseline, whatever its value."""

    #: (time, value) changes. A counter that never changes (most) holds its first sample in a tuple; a list is
    #: made at its first change (memory at scale: a node's 8 GPUs and 9 ports hold ~100 series).
    points: list | tuple = ()
    first_time: float | None = None

    def add(self, t: float, v: float) -> bool:
        """Adds a sample; True when the value changed."""
        if self.first_time is None:
            self.first_time = t
        points = self.points
        if points and points[-1][1] == v:
            return False
        if not points:
            self.points = ((t, 0.0 if v == 0 else v),)  # one shared 0.0 for the usual first value
            return True
        if type(points) is tuple:
            points = self.points = list(points)
        if len(points) >= 256:
            del points[0]
        points.append((t, v))  # type: ignore[union-attr]
        return True

    def rise(self, start: float, end: float, *, before_end: bool = False) -> tuple[float, float | None]:
        """(increase between samples taken in ``[start, end]``, or ``[start, end)`` with ``before_end``, when it
        began); a drop (reset) starts a new baseline. It began at the first increase of at least half the largest
        one in the window (a burst on top of a background trickle begins with the burst). ``before_end`` is how to
        say "strictly before": at unix times near 1.8e9 ``end - 1e-9 == end``."""
        total, prev, steps = 0.0, None, []
        for t, v in self.points:
            if prev is not None and start <= t and (t < end if before_end else t <= end):
                step = v - prev if v >= prev else v
                if step > 0:
                    total += step
                    steps.append((t, step))
            prev = v
        if not steps:
            return 0.0, None
        biggest = max(step for _, step in steps)
        return total, next(t for t, step in steps if step >= biggest / 2)

    def background_per_s(self, before: float) -> float | None:
        """The counter's own rate before ``before``; None with less than ``_MIN_HISTORY_S`` of history."""
        if self.first_time is None or before - self.first_time < _MIN_HISTORY_S:
            return None
        total, _ = self.rise(self.first_time, before)
        return total / (before - self.first_time)

    def biggest_step(self, start: float, end: float) -> float:
        out, prev = 0.0, None
        for t, v in self.points:
            if prev is not None and start <= t <= end:
                out = max(out, v - prev if v >= prev else v)
            prev = v
        return out

    def fault_rise(self, name: str, window_start: float, window_end: float) -> tuple[float, float] | None:
        """(rise, when it began) when the rise in the window is above the minimum and the background, else None.

        The background is the counter's rate before the window (30 s of history at least), else its rate from its
        first sample to where the rise began (10 s at least). With neither (a fresh collector, a node-agent restart,
        a trickle since the first sample), an error counter's rise counts only as a burst: one poll adding
        ``_BURST_STEP`` or more; a single uncorrectable ECC error or link drop is a fact at any time."""
        total, first = self.rise(window_start, window_end)
        minimum = _MIN_RISE.get(name, _MIN_RISE_DEFAULT)
        if first is None or total < minimum:
            return None
        background = self.background_per_s(window_start)
        if background is None and self.first_time is not None and first - self.first_time >= _MIN_BURST_HISTORY_S:
            # At least one event: a short quiet history does not prove a zero rate (the first ticks of a
            # trickle on a young collector are not a fault; a burst of 250 still is).
            before = max(self.rise(self.first_time, first, before_end=True)[0], 1.0)
            background = before / (first - self.first_time)
        if background is not None:
            if total <= _BACKGROUND_FACTOR * background * (window_end - window_start):
                return None
        elif name not in _MIN_RISE and self.biggest_step(window_start, window_end) < _BURST_STEP:
            return None
        return total, first


_FLAT: dict[tuple[float, float], Series] = {}  # (first time, value) -> one series shared by every counter at it
_FLAT_MAX = 4096


def _record(counters: dict, name: str, t: float, v: float) -> bool:
    """Adds a sample to ``counters[name]``; True when the value changed.

    A counter seen for the first time shares one :class:`Series` with every other counter first seen at the same
    time with the same value (a node's ~100 counters, nearly all 0, arrive in one poll), until its value changes:
    then it gets a series of its own. At 16,384 nodes a series per counter was most of the aggregator's memory."""
    series = counters.get(name)
    if series is None:
        key = (t, 0.0 if v == 0 else v)
        series = _FLAT.get(key)
        if series is None:
            if len(_FLAT) >= _FLAT_MAX:
                _FLAT.clear()
            series = _FLAT[key] = Series()
            series.add(t, v)
        counters[name] = series
        return True
    if type(series.points) is tuple and series.points[-1][1] != v:  # shared (or never changed): its own now
        series = counters[name] = Series(list(series.points), series.first_time)
    return series.add(t, v)


@dataclass(slots=True)
class GpuState:
    host: str
    gpu: str
    uuid: str | None = None
    #: active clock-event reason -> when we saw it begin; None when it was active at the first sample (baseline)
    reasons: dict = field(default_factory=dict)
    clock_sampled: bool = False
    counters: dict = field(default_factory=dict)  # name -> Series
    xids: deque | tuple = ()  # XidSeen (32 at most); made at the first
    pids: tuple = ()
    last_seen: float = 0.0

    @property
    def name(self) -> str:
        return self.uuid or self.gpu


@dataclass(slots=True)
class PortState:
    host: str
    port: str
    up: bool | None = None
    first_time: float | None = None
    first_up: bool | None = None  # the state at the first sample
    transitions: deque | tuple = ()  # (time, up) changes we saw (16 at most); made at the first
    counters: dict = field(default_factory=dict)
    last_seen: float = 0.0

    @property
    def device(self) -> str:
        return self.port.split("/", 1)[0]

    def up_at(self, t: float) -> bool | None:
        """The port's state at ``t`` as we know it; None before its first sample."""
        if self.first_time is None or t < self.first_time:
            return None
        state = self.first_up
        for when, up in self.transitions:
            if when > t:
                break
            state = up
        return state


class DeviceEvidence:
    """GPUs and ports of every host, and the questions the detectors ask of them."""

    def __init__(self) -> None:
        self.gpus: dict[str, dict[str, GpuState]] = {}  # host -> gpu index -> state
        self.ports: dict[str, dict[str, PortState]] = {}  # host -> port -> state
        self.host_last_seen: dict[str, float] = {}  # host -> newest device sample
        self.version = 0  # bumped whenever something that can become evidence changes
        self._evicted = float("-inf")  # the horizon of the last eviction walk

    # -- observations ----------------------------------------------------------------------------------------------
    def _gpu(self, host: str, gpu_id: str) -> GpuState:
        by_id = self.gpus.setdefault(host, {})
        gpu = by_id.get(gpu_id)
        if gpu is None:
            gpu = by_id[gpu_id] = GpuState(host, gpu_id)
        return gpu

    def seen(self, host: str, gpus: list[str], ports: list[str], t: float) -> None:
        """The node's ``gpus`` and ``ports`` reported at ``t`` what they reported before (an unchanged metric):
        what :meth:`observe_gpu` and :meth:`observe_nic` do with a sample that says nothing new, without one."""
        for key in gpus:
            gpu = self._gpu(host, key)
            if t > gpu.last_seen:
                gpu.last_seen = t
        by_port = self.ports.setdefault(host, {})
        for key in ports:
            port = by_port.get(key)
            if port is None:
                port = by_port[key] = PortState(host, key)
            if t > port.last_seen:
                port.last_seen = t
        if (gpus or ports) and t > self.host_last_seen.get(host, 0.0):
            self.host_last_seen[host] = t

    def observe_gpu(self, sample: GpuSample) -> None:
        gpu = self._gpu(sample.host, sample.gpu)
        gpu.uuid = sample.uuid or gpu.uuid
        gpu.last_seen = max(gpu.last_seen, sample.time)
        self.host_last_seen[sample.host] = max(self.host_last_seen.get(sample.host, 0.0), sample.time)
        if sample.clock_events is not None and sample.clock_events != gpu.reasons.keys():
            began = sample.time if gpu.clock_sampled else None
            gpu.reasons = {r: (gpu.reasons[r] if r in gpu.reasons else began) for r in sample.clock_events}
            self.version += 1
        if sample.clock_events is not None:
            gpu.clock_sampled = True
        for name, value in sample.counters.items():
            if _record(gpu.counters, name, sample.time, value):
                self.version += 1
        if sample.pids:
            gpu.pids = sample.pids

    def observe_xid(self, xid: XidSeen) -> None:
        gpu = self._gpu(xid.host, xid.gpu if xid.gpu is not None else "?")
        if not gpu.xids:
            gpu.xids = deque(maxlen=32)
        gpu.xids.append(xid)  # type: ignore[union-attr]
        self.version += 1

    def observe_nic(self, sample: NicSample) -> None:
        by_port = self.ports.setdefault(sample.host, {})
        port = by_port.get(sample.port)
        if port is None:
            port = by_port[sample.port] = PortState(sample.host, sample.port)
        port.last_seen = max(port.last_seen, sample.time)
        self.host_last_seen[sample.host] = max(self.host_last_seen.get(sample.host, 0.0), sample.time)
        if sample.up is not None:
            if port.first_time is None:
                port.first_time, port.first_up = sample.time, sample.up
            elif port.up is not None and sample.up != port.up:
                if not port.transitions:
                    port.transitions = deque(maxlen=16)
                port.transitions.append((sample.time, sample.up))  # type: ignore[union-attr]
                self.version += 1
            port.up = sample.up
        for name, value in sample.counters.items():
            if name in NIC_READ_COUNTERS:  # only the counters the rules read are kept (memory at scale)
                if _record(port.counters, name, sample.time, value):
                    self.version += 1

    def evict(self, horizon: float) -> None:
        """Forgets devices last seen before ``horizon``. A walk over every device; at most once per
        ``_EVICT_EVERY_S`` of ``horizon`` (ticks come twice a second, 280,000 devices at 16,384 nodes)."""
        if horizon < self._evicted + _EVICT_EVERY_S:
            return
        self._evicted = horizon
        for table in (self.gpus, self.ports):
            for host, devices in list(table.items()):
                for key in [k for k, v in devices.items() if v.last_seen and v.last_seen < horizon]:
                    del devices[key]
                if not devices:
                    del table[host]
        for host in [h for h, t in self.host_last_seen.items() if t < horizon]:
            del self.host_last_seen[host]

    # -- questions -------------------------------------------------------------------------------------------------
    def rank_gpu(self, who: Identity) -> GpuState | None:
        """The GPU a rank uses: by UUID, else by pid (NVML's process list), else CUDA index, else local rank."""
        if who.host is None:
            return None
        gpus = self.gpus.get(who.host)
        if not gpus:
            return None
        if who.gpu_uuid:
            for g in gpus.values():
                if g.uuid == who.gpu_uuid:
                    return g
        if who.pid is not None:
            for g in gpus.values():
                if who.pid in g.pids:
                    return g
        index = who.gpu if who.gpu is not None else (str(who.local_rank) if who.local_rank is not None else None)
        return gpus.get(index) if index is not None else None

    def gpu_faults(self, who: Identity, symptom: float, *, throttle: bool = False) -> list[Fault]:
        """Faults of the rank's GPU (XID, uncorrectable ECC; with ``throttle``: clock events, NVLink/PCIe rates)
        that began inside their windows around ``symptom``, plus XIDs anywhere on its host that carry its pid."""
        out: list[Fault] = []
        gpu = self.rank_gpu(who)
        xid = self._xid_fault(who, gpu, symptom)
        if xid is not None:
            out.append(xid)
        if gpu is None:
            return out
        for name in _GPU_ECC_COUNTERS:
            series = gpu.counters.get(name)
            w = WINDOWS[RootCause.GPU_ECC_UNCORRECTABLE]
            hit = series.fault_rise(name, symptom - w.before_s, symptom + w.after_s) if series else None
            if hit is not None:
                rise, t = hit
                out.append(Fault(RootCause.GPU_ECC_UNCORRECTABLE, t, [Evidence(f"gpu.{name}", f"+{rise:g}", t)],
                                 gpu.host, gpu.name, strength=0.9, details={"reason": name},
                                 why="its GPU reported an uncorrectable ECC error"))
        if throttle:
            out += self._throttle_faults(gpu, symptom)
        return out

    def _xid_fault(self, who: Identity, gpu: GpuState | None, symptom: float) -> Fault | None:
        candidates: list[tuple[XidSeen, bool]] = []  # (xid, matched by pid)
        sources = [gpu] if gpu is not None else []
        if who.pid is not None and who.host is not None:
            sources += [g for g in self.gpus.get(who.host, {}).values() if g is not gpu]
        for source in sources:
            for x in source.xids:
                by_pid = x.pid is not None and x.pid == who.pid
                if source is not gpu and not by_pid:
                    continue
                cls, cause, _ = classify_xid(x.code)
                if x.pid is not None and who.pid is not None and not by_pid and cls is not XidClass.HARDWARE:
                    continue  # another process's own error on a shared GPU
                if cls is not XidClass.HARDWARE and not by_pid and who.started is not None \
                        and x.time < who.started - _CLOCK_SLACK_S:
                    continue  # before the rank's process existed: an earlier program's own error, not this one's
                if WINDOWS[cause].contains(x.time, symptom):
                    candidates.append((x, by_pid))
        if not candidates:
            return None
        candidates.sort(key=lambda c: c[0].time)
        # The earliest XID of a burst is the cause; XIDs seconds apart are separate events, and the burst nearest
        # the symptom is the one that caused it (an earlier job's application XID 23 s before is no part of an
        # XID 48 burst at the symptom).
        bursts: list[list[tuple[XidSeen, bool]]] = []
        for c in candidates:
            if bursts and c[0].time - bursts[-1][-1][0].time <= _XID_BURST_GAP_S:
                bursts[-1].append(c)
            else:
                bursts.append([c])
        candidates = min(bursts, key=lambda b: (max(0.0, b[0][0].time - symptom, symptom - b[-1][0].time),
                                                -b[0][0].time))
        first, by_pid = candidates[0]
        if first.code == _XID_CLEANUP and len(candidates) > 1:
            first, by_pid = candidates[1]  # 45 cleans up after another XID: that one is the cause
        cls, cause, meaning = classify_xid(first.code)
        ev = [Evidence("gpu.xid", first.code, first.time)]
        if by_pid:
            ev.append(Evidence("gpu.xid.pid", first.pid))
        later = [c[0].code for c in candidates if c[0] is not first]
        if later:
            ev.append(Evidence("gpu.xid.later", ",".join(map(str, later[:6]))))
        gpu_name = gpu.name if gpu is not None else (first.gpu or first.pci_bus_id)
        if cls is XidClass.HARDWARE:
            return Fault(cause, first.time, ev, first.host, gpu_name, strength=0.95 if by_pid else 0.9,
                         details={"xid": first.code, "xid_class": cls.value}, why=f"its GPU reported {meaning}")
        action = Action.AUTO_RESTART if cls is XidClass.APPLICATION else Action.INVESTIGATE
        return Fault(cause, first.time, ev, first.host, gpu_name, strength=0.8 if by_pid else 0.6, hardware=False,
                     details={"xid": first.code, "xid_class": cls.value}, category=Category.SOFTWARE, action=action,
                     why=f"its GPU reported {meaning}; the node stays")

    def _throttle_faults(self, gpu: GpuState, symptom: float) -> list[Fault]:
        out = []
        for reason, began in gpu.reasons.items():
            cause = _THROTTLES.get(reason)
            if cause is None or began is None or not WINDOWS[cause].contains(began, symptom):
                continue
            what = {RootCause.GPU_THERMAL_THROTTLE: "thermally throttled", RootCause.GPU_POWER_THROTTLE:
                    "power-braked", RootCause.GPU_HW_SLOWDOWN: "in hardware slowdown"}[cause]
            out.append(Fault(cause, began, [Evidence("gpu.clock_event", reason, began)], gpu.host, gpu.name,
                             strength=0.85, details={"reason": reason}, why=f"its GPU is {what}"))
        for name, cause in _GPU_RATE_COUNTERS.items():
            series = gpu.counters.get(name)
            w = WINDOWS[cause]
            hit = series.fault_rise(name, symptom - w.before_s, symptom + w.after_s) if series else None
            if hit is not None:
                rise, t = hit
                what = "NVLink errors are rising" if cause is RootCause.NVLINK_ERROR else "PCIe replays are rising"
                out.append(Fault(cause, t, [Evidence(f"gpu.{name}", f"+{rise:g}", t)], gpu.host, gpu.name,
                                 strength=0.75, details={"reason": name}, why=f"{what} on its GPU"))
        return out

    def job_ports(self, host: str, ifaces: frozenset[str] | None, job_start: float) -> list[PortState]:
        """The ports of ``host`` the job uses: those named by the ranks (interface or HCA names), else the ports
        that were up when the job started (a port never seen up is not the job's)."""
        ports = list(self.ports.get(host, {}).values())
        if ifaces:
            # NCCL matches interface names by prefix ("eth" is eth0, eth1...; "=eth0" exactly, stripped here).
            named = [p for p in ports if p.port in ifaces or any(p.device.startswith(n) for n in ifaces)]
            if named:
                return named
        out = []
        for p in ports:
            state = p.up_at(job_start)
            if state is None:  # first seen after the job started: its first state stands in
                state = p.first_up
            if state:
                out.append(p)
        return out

    def nic_faults(self, host: str, symptom: float, *, ifaces: frozenset[str] | None = None,
                   job_start: float = 0.0) -> list[Fault]:
        """Link drops and error bursts on the job's ports of ``host`` that began inside their windows."""
        out: list[Fault] = []
        down_w, err_w = WINDOWS[RootCause.NIC_LINK_DOWN], WINDOWS[RootCause.NIC_ERRORS]
        # A job is first seen a few seconds after it starts (its first heartbeat): "up at job start" looks back that
        # far.
        for port in self.job_ports(host, ifaces, job_start - _JOB_START_SLACK_S):
            name = port.port
            # A drop the port recovered from before the job started is history, not this job's cause (a link
            # repaired, or cut and restored by an earlier fault, seconds before the next job starts).
            back_up = max((t for t, up in port.transitions if up and t <= job_start - _JOB_START_SLACK_S),
                          default=float("-inf"))
            went_down = [t for t, up in port.transitions if not up and t >= back_up and down_w.contains(t, symptom)]
            if went_down:
                t = went_down[0]
                out.append(Fault(RootCause.NIC_LINK_DOWN, t, [Evidence(f"nic.{name}.state", "down", t)], host,
                                 port=name, strength=0.9, details={"reason": "link_down", "port": name},
                                 why=f"its node's network link {name} went down"))
                continue
            downed = port.counters.get("link_downed")
            hit = downed.fault_rise("link_downed", symptom - down_w.before_s, symptom + down_w.after_s) \
                if downed else None
            if hit is not None:
                rise, t = hit
                out.append(Fault(RootCause.NIC_LINK_DOWN, t, [Evidence(f"nic.{name}.link_downed", f"+{rise:g}", t)],
                                 host, port=name, strength=0.85, details={"reason": "link_downed", "port": name},
                                 why=f"its node's network link {name} dropped"))
                continue
            for counter in NIC_ERROR_COUNTERS:
                series = port.counters.get(counter)
                hit = series.fault_rise(counter, symptom - err_w.before_s, symptom + err_w.after_s) \
                    if series else None
                if hit is not None:
                    rise, t = hit
                    out.append(Fault(RootCause.NIC_ERRORS, t, [Evidence(f"nic.{name}.{counter}", f"+{rise:g}", t)],
                                     host, port=name, strength=0.75, details={"reason": counter, "port": name},
                                     why=f"its node's NIC {name} is logging {counter}"))
                    break
        return out

    def host_silent_since(self, host: str) -> float | None:
        """When the host's device metrics were last seen; None when it never sent any."""
        return self.host_last_seen.get(host)


def strongest(faults: list[Fault]) -> Fault | None:
    """The fault that explains an incident: hardware before software XIDs, then the strongest evidence (a transition
    or a pid-matched XID before a rate rise: an error trickle that began earlier never outranks a link that went
    down), then the earliest."""
    if not faults:
        return None
    return min(faults, key=lambda f: (not f.hardware, -f.strength, f.onset))
