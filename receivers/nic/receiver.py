"""The nic receiver: reads InfiniBand and Ethernet counters from sysfs, turns them into rates.

Files are read with one ``os.open``/``os.read``/``os.close`` each (about 2.5 us); a file that vanishes or does not
parse is skipped for that poll. Devices are rediscovered every ``rescan_interval_s``.
"""
from __future__ import annotations

import fnmatch
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.component import ComponentHost, Receiver, run_polling
from otel_gpu.otlp_build import MetricsBuilder, Series, attributes
from otel_gpu.schema import nic as N
from otel_gpu.schema.gpu import ERROR_TYPE, NETWORK_IO_DIRECTION
from otel_gpu.schema.identity import HOST_NAME, HW_ID, HW_TYPE

from otel_gpu.receivers.nic.config import NicReceiverConfig

__all__ = ["CounterTracker", "NicReceiver", "port_guid"]

_logger = logging.getLogger(__name__)
_SCOPE = "otel_gpu.receivers.nic"
_U32, _U64, _I64 = 1 << 32, 1 << 64, 1 << 63

# IB counters that are traffic, not errors: (file, metric kind, direction, scale to the metric's unit).
_IB_TRAFFIC = {"port_xmit_data": ("io", "transmit", 4), "port_rcv_data": ("io", "receive", 4),
               "port_xmit_packets": ("packets", "transmit", 1), "port_rcv_packets": ("packets", "receive", 1)}
_IB_IGNORED = {"unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets"}
_ETH_TRAFFIC = {"tx_bytes": ("io", "transmit"), "rx_bytes": ("io", "receive"), "tx_packets": ("packets", "transmit"),
                "rx_packets": ("packets", "receive")}
_ETH_ERRORS = ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped", "rx_crc_errors", "rx_frame_errors",
               "rx_fifo_errors", "rx_missed_errors", "rx_over_errors", "rx_length_errors", "tx_carrier_errors",
               "tx_fifo_errors", "tx_aborted_errors", "collisions")
# counter group -> (cumulative metric, rate metric); InfiniBand ports and interfaces share the names (nic.kind)
_METRICS = {"io": (N.IO, N.IO_RATE), "packets": (N.PACKETS, N.PACKETS_RATE), "errors": (N.ERRORS, N.ERRORS_RATE),
            "hw": (N.IB_HW_COUNTERS, N.IB_HW_COUNTERS_RATE)}
_KIND = {"ib": "infiniband", "eth": "ethernet"}


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 256)
    except OSError:  # e.g. EINVAL reading carrier/speed of a down interface
        return None
    finally:
        os.close(fd)


def _read_int(path: str) -> int | None:
    raw = _read(path)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _state_id(raw: bytes | None) -> int | None:
    """b'4: ACTIVE\\n' -> 4."""
    if not raw:
        return None
    head = raw.split(b":", 1)[0].strip()
    return int(head) if head.isdigit() and len(head) <= 9 else None  # state ids are small; no int64 overflow


def _ib_rate_bytes(raw: bytes | None) -> float | None:
    """b'400 Gb/sec (4X NDR)\\n' -> 5e10 (bytes per second)."""
    if not raw:
        return None
    parts = raw.split()
    try:
        value = float(parts[0])
    except (IndexError, ValueError):
        return None
    unit = parts[1] if len(parts) > 1 else b"Gb/sec"
    if not 0 <= value < 1e6:  # nan, inf, negative or absurd: not a link rate
        return None
    scale = {b"Gb/sec": 1e9, b"Mb/sec": 1e6, b"Tb/sec": 1e12}.get(unit, 1e9)
    return value * scale / 8


class CounterTracker:
    """Turns successive readings of one kernel counter into a reset-proof cumulative value and a rate.

    A reading lower than the previous one is a wrap when the previous one was in the top half of the 32- or 64-bit
    range (the increment is counted through the wrap); otherwise it is a reset: the reading becomes a new baseline,
    no rate is given for that interval (never a negative one), and the cumulative series restarts with a new start
    time, which is how OTLP marks a counter reset.

    Example:
        >>> c = CounterTracker(start_ns=0)
        >>> c.update(100, 0.0, 1), c.update(300, 2.0, 2)
        (None, 100.0)
        >>> c.update(50, 3.0, 3), c.cumulative, c.start_ns   # reset: no rate, new start
        (None, 50, 3)
        >>> _ = c.update((1 << 32) - 10, 4.0, 4)
        >>> c.update(5, 5.0, 5)  # a 32-bit wrap: 15 counted through it
        15.0
    """

    __slots__ = ("last", "last_t", "offset", "start_ns", "cumulative")

    def __init__(self, start_ns: int):
        self.last: int | None = None
        self.last_t = 0.0
        self.offset = 0
        self.start_ns = start_ns
        self.cumulative = 0

    def update(self, raw: int, t: float, now_ns: int) -> float | None:
        """Takes a reading at monotonic time ``t``; returns the rate per second since the last one, or None."""
        last, last_t = self.last, self.last_t
        self.last, self.last_t = raw, t
        if last is None:
            self.cumulative = raw
            return None
        delta = raw - last
        if delta < 0:
            width = _U32 if last < _U32 else _U64
            if last >= width >> 1 and raw < width >> 1:
                delta += width
                self.offset += width
            else:
                self.offset = 0
                self.start_ns = now_ns
                self.cumulative = raw
                return None
        self.cumulative = raw + self.offset
        dt = t - last_t
        if dt <= 0:
            return None
        rate = delta / dt
        return rate if math.isfinite(rate) else None  # a vanishing step (dt ~ 1e-300) is no reading of a rate


@dataclass
class _Port:
    """One InfiniBand port or Ethernet interface: its files, trackers and pre-built series."""

    kind: str  # "ib" | "eth"
    device: str
    port: int | None
    path: str
    attrs: list
    counters: dict[str, tuple[str, str, str | None, int]] = field(default_factory=dict)  # name -> (path, group, dir, scale)
    trackers: dict[str, CounterTracker] = field(default_factory=dict)
    series: dict[Any, Series] = field(default_factory=dict)
    up: int | None = None

    @property
    def label(self) -> str:
        return f"{self.device} port {self.port}" if self.kind == "ib" else self.device


class NicReceiver(Receiver):
    def __init__(self, config: NicReceiverConfig, host: ComponentHost):
        super().__init__(config, host)
        self._start_ns = time.time_ns()
        self._resource = attributes({HOST_NAME: config.host_name or socket.gethostname()})
        self.ports: dict[str, _Port] = {}
        self._last_scan = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.clock = time.monotonic  # the time base of rates (tests drive it)

    def start(self) -> None:
        self._scan()
        self._thread = threading.Thread(target=self._loop, name=f"otel-gpu-{self.host.component_id}-poll",
                                        daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- discovery ----------------------------------------------------------------------------------------------------
    def _scan(self) -> None:
        self._last_scan = self.clock()
        root, cfg, seen = self.config.sysfs_root, self.config, set()
        if not os.path.isdir(root):
            self.host.log_once("noroot", logging.WARNING, "%s: sysfs_root %s does not exist; nothing to read (looked "
                               "again every %gs)", self.host.component_id, root, cfg.rescan_interval_s)
            return
        if cfg.infiniband:
            ib = os.path.join(root, "class", "infiniband")
            for dev in sorted(_listdir(ib)):
                if cfg.ib_devices and not any(fnmatch.fnmatchcase(dev, p) for p in cfg.ib_devices):
                    continue
                for port in sorted(_listdir(os.path.join(ib, dev, "ports")), key=lambda p: (len(p), p)):
                    if not port.isdigit():
                        continue
                    key = f"ib:{dev}:{port}"
                    seen.add(key)
                    if key not in self.ports:
                        self.ports[key] = self._ib_port(os.path.join(ib, dev, "ports", port), dev, int(port))
        if cfg.ethernet:
            net = os.path.join(root, "class", "net")
            for iface in sorted(_listdir(net)):
                if any(fnmatch.fnmatchcase(iface, p) for p in cfg.exclude_interfaces):
                    continue
                if cfg.interfaces and not any(fnmatch.fnmatchcase(iface, p) for p in cfg.interfaces):
                    continue
                path = os.path.join(net, iface)
                if not os.path.isdir(os.path.join(path, "statistics")):
                    continue
                key = f"eth:{iface}"
                seen.add(key)
                if key not in self.ports:
                    self.ports[key] = self._eth_port(path, iface)
        for key in set(self.ports) - seen:
            _logger.info("%s: %s is gone", self.host.component_id, self.ports.pop(key).label)
        if not self.ports:
            self.host.log_once("noports", logging.INFO, "%s: no InfiniBand port or network interface under %s",
                               self.host.component_id, root)

    def _ib_port(self, path: str, dev: str, port: int) -> _Port:
        attrs = {HW_ID: f"{dev}:{port}", N.DEVICE: dev, N.PORT: port, N.KIND: _KIND["ib"],
                 HW_TYPE: "network"}
        guid = port_guid(path)
        if guid:
            attrs[N.PORT_GUID] = guid
        p = _Port("ib", dev, port, path, attributes(attrs))
        cdir = os.path.join(path, "counters")
        for name in sorted(_listdir(cdir)):
            if name in _IB_IGNORED:
                continue
            group, direction, scale = _IB_TRAFFIC.get(name, ("errors", None, 1))
            p.counters[name] = (os.path.join(cdir, name), group, direction, scale)
        wanted = self.config.hw_counters
        hdir = os.path.join(path, "hw_counters")
        for name in sorted(_listdir(hdir)):
            if any(fnmatch.fnmatchcase(name, w) for w in wanted):
                p.counters[f"hw:{name}"] = (os.path.join(hdir, name), "hw", None, 1)
        return p

    def _eth_port(self, path: str, iface: str) -> _Port:
        p = _Port("eth", iface, None, path, attributes({HW_ID: iface, N.DEVICE: iface,
                                                        N.KIND: _KIND["eth"], HW_TYPE: "network"}))
        sdir = os.path.join(path, "statistics")
        present = set(_listdir(sdir))
        for name, (group, direction) in _ETH_TRAFFIC.items():
            if name in present:
                p.counters[name] = (os.path.join(sdir, name), group, direction, 1)
        for name in _ETH_ERRORS:
            if name in present:
                p.counters[name] = (os.path.join(sdir, name), "errors", None, 1)
        if os.path.exists(os.path.join(path, "carrier_changes")):
            p.counters["carrier_changes"] = (os.path.join(path, "carrier_changes"), "errors", None, 1)
        return p

    # -- polling ------------------------------------------------------------------------------------------------------
    def poll(self) -> Any:
        """Reads every port once; returns an ExportMetricsServiceRequest (None when there is nothing to report)."""
        now = self.clock()
        if now - self._last_scan >= self.config.rescan_interval_s:
            self._scan()
        if not self.ports:
            return None
        now_ns = time.time_ns()
        mb = MetricsBuilder(self._resource, scope=_SCOPE, time_ns=now_ns, start_time_ns=self._start_ns)
        for port in list(self.ports.values()):
            try:
                self._poll_port(port, mb, now, now_ns)
            except Exception:  # noqa: BLE001 - one odd device must not cost the others
                self.host.log_once(("poll", port.label), logging.ERROR, "%s: reading %s failed (logged once)",
                                   self.host.component_id, port.label, exc_info=True)
        return mb.build() if mb.point_count() else None

    def _poll_port(self, port: _Port, mb: MetricsBuilder, now: float, now_ns: int) -> None:
        s = port.series
        for name, (path, group, direction, scale) in port.counters.items():
            raw = _read_int(path)
            if raw is None or not 0 <= raw < _U64:  # kernel counters are u64: anything else is garbage, skipped
                continue
            tracker = port.trackers.get(name)
            if tracker is None:
                tracker = port.trackers[name] = CounterTracker(self._start_ns)
            start_before = tracker.start_ns
            rate = tracker.update(raw, now, now_ns)
            total_metric, rate_metric = _METRICS[group]
            extra = ({NETWORK_IO_DIRECTION: direction} if direction
                     else {N.COUNTER: name.removeprefix("hw:")} if group == "hw"
                     else {ERROR_TYPE: name})
            key = ("total", name)
            series = s.get(key)
            if series is None or tracker.start_ns != start_before:
                series = s[key] = Series(total_metric, port.attrs, extra, start_time_ns=tracker.start_ns)
                if tracker.start_ns != start_before:
                    _logger.info("%s: %s counter %s reset (now %d); rate restarts from this baseline",
                                 self.host.component_id, port.label, name, raw)
            total = tracker.cumulative * scale
            mb.add(series, total if total < _I64 else float(total))  # past int64 (wrapped u64 counters): a double
            if rate is not None:
                rseries = s.get(("rate", name))
                if rseries is None:
                    rseries = s[("rate", name)] = Series(rate_metric, port.attrs, extra)
                mb.add(rseries, rate * scale)
        if port.kind == "ib":
            self._ib_state(port, mb)
        else:
            self._eth_state(port, mb)

    def _gauge(self, port: _Port, metric: Any, mb: MetricsBuilder, value: int | float) -> None:
        series = port.series.get(metric.name)
        if series is None:
            series = port.series[metric.name] = Series(metric, port.attrs)
        mb.add(series, value)

    def _ib_state(self, port: _Port, mb: MetricsBuilder) -> None:
        state_raw, phys_raw = _read(os.path.join(port.path, "state")), _read(os.path.join(port.path, "phys_state"))
        state, phys = _state_id(state_raw), _state_id(phys_raw)
        if state is not None:
            self._gauge(port, N.IB_STATE, mb, state)
        if phys is not None:
            self._gauge(port, N.IB_PHYS_STATE, mb, phys)
        if state is not None:
            up = int(state == 4 and (phys is None or phys == 5))
            self._gauge(port, N.UP, mb, up)
            self._transition(port, up, f"state {_text(state_raw)}, phys_state {_text(phys_raw)}")
        rate = _ib_rate_bytes(_read(os.path.join(port.path, "rate")))
        if rate is not None:
            self._gauge(port, N.BANDWIDTH_LIMIT, mb, rate)

    def _eth_state(self, port: _Port, mb: MetricsBuilder) -> None:
        oper = _read(os.path.join(port.path, "operstate"))
        carrier = _read_int(os.path.join(port.path, "carrier"))  # EINVAL while down: None
        if oper is not None:
            up = int(oper.strip() == b"up" and carrier == 1)
            self._gauge(port, N.UP, mb, up)
            self._transition(port, up, f"operstate {_text(oper)}, carrier {carrier}")
        speed = _read_int(os.path.join(port.path, "speed"))
        if speed is not None and speed > 0:
            self._gauge(port, N.BANDWIDTH_LIMIT, mb, speed * 1_000_000 / 8)

    def _transition(self, port: _Port, up: int, detail: str) -> None:
        if port.up is not None and up != port.up:
            level = logging.INFO if up else logging.WARNING
            _logger.log(level, "%s: %s is %s (%s)", self.host.component_id, port.label, "up" if up else "DOWN",
                        detail)
        port.up = up

    def _loop(self) -> None:
        run_polling(self.host, self.config.interval_s, self._stop, self.poll)


def port_guid(port_dir: str) -> str | None:
    """The InfiniBand port GUID: the low 64 bits of GID 0 (``ports/N/gids/0``, e.g.
    ``fe80:0000:0000:0000:0c42:a103:0001:0203`` -> ``0c42:a103:0001:0203``); None when unreadable or zero.

    >>> import os, tempfile
    >>> d = tempfile.mkdtemp(); os.mkdir(os.path.join(d, "gids"))
    >>> _ = open(os.path.join(d, "gids", "0"), "w").write("fe80:0000:0000:0000:0c42:a103:0001:0203\\n")
    >>> port_guid(d), port_guid(os.path.join(d, "nowhere"))
    ('0c42:a103:0001:0203', None)
    """
    try:
        with open(os.path.join(port_dir, "gids", "0")) as fh:
            groups = fh.read().strip().split(":")
    except OSError:
        return None
    if len(groups) != 8 or all(g.strip("0") == "" for g in groups[4:]):
        return None
    return ":".join(groups[4:])


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _text(raw: bytes | None) -> str:
    return raw.decode(errors="replace").strip() if raw else "?"
