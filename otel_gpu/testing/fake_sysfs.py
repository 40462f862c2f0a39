"""A fake ``/sys`` tree for the nic receiver: InfiniBand ports and network interfaces laid out as the kernel does,
with counters that a scenario (or a test) moves.

Layout written (only what the nic receiver reads)::

    class/infiniband/<dev>/ports/<n>/{state,phys_state,rate}
    class/infiniband/<dev>/ports/<n>/counters/<name>      # port_xmit_data etc. count 4-byte words
    class/infiniband/<dev>/ports/<n>/hw_counters/<name>
    class/net/<iface>/{operstate,carrier,speed,carrier_changes}
    class/net/<iface>/statistics/<name>

Every write replaces the file atomically (write a temp file, rename), so a reader never sees half a number.

Scenario (YAML/JSON or a mapping; all keys optional)::

    infiniband:
      mlx5_0:
        ports:
          1: {rate: "400 Gb/sec (4X NDR)", counters: {symbol_error: 0}, rates: {port_xmit_data: 1.0e9},
              hw_counters: {out_of_buffer: 0}}
    net:
      eth0: {speed: 100000, statistics: {rx_bytes: 0}, rates: {rx_bytes: 1.25e9}}
    timeline:                        # applied by advance() when its clock reaches at_s
      - {at_s: 2, ib: mlx5_0/1, add: {symbol_error: 250}}
      - {at_s: 3, ib: mlx5_0/1, link: down}      # state DOWN, phys_state Disabled, link_downed + 1
      - {at_s: 4, ib: mlx5_0/1, reset: true}     # every counter back to 0 (a driver reload)
      - {at_s: 2, net: eth0, link: down}         # operstate down, carrier 0, carrier_changes + 1
      - {at_s: 5, net: eth0, set: {rx_crc_errors: 7}}

``rates`` are per second (bytes for port_*_data are converted to 4-byte words for you when written via ``rates``:
give bytes/s).

Example:
    >>> import tempfile
    >>> fs = FakeSysfs(tempfile.mkdtemp(), {"infiniband": {"mlx5_0": {"ports": {1: {}}}}})
    >>> fs.add_ib("mlx5_0", 1, "symbol_error", 3)
    >>> fs.ib_counter("mlx5_0", 1, "symbol_error")
    3
"""
from __future__ import annotations

import copy
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["FakeSysfs", "IB_COUNTERS", "NET_STATISTICS"]

#: The counters a mlx5 port exposes under counters/.
IB_COUNTERS = ("excessive_buffer_overrun_errors", "link_downed", "link_error_recovery", "local_link_integrity_errors",
               "multicast_rcv_packets", "multicast_xmit_packets", "port_rcv_constraint_errors", "port_rcv_data",
               "port_rcv_errors", "port_rcv_packets", "port_rcv_remote_physical_errors",
               "port_rcv_switch_relay_errors", "port_xmit_constraint_errors", "port_xmit_data", "port_xmit_discards",
               "port_xmit_packets", "port_xmit_wait", "symbol_error", "unicast_rcv_packets", "unicast_xmit_packets",
               "VL15_dropped")
#: A mlx5 port's hw_counters/ (a subset).
IB_HW_COUNTERS = ("duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "out_of_buffer",
                  "out_of_sequence", "packet_seq_err", "req_cqe_error", "resp_cqe_error", "rnr_nak_retry_err",
                  "rx_atomic_requests", "rx_read_requests", "rx_write_requests")
#: class/net/<iface>/statistics/.
NET_STATISTICS = ("collisions", "multicast", "rx_bytes", "rx_compressed", "rx_crc_errors", "rx_dropped", "rx_errors",
                  "rx_fifo_errors", "rx_frame_errors", "rx_length_errors", "rx_missed_errors", "rx_nohandler",
                  "rx_over_errors", "rx_packets", "tx_aborted_errors", "tx_bytes", "tx_carrier_errors",
                  "tx_compressed", "tx_dropped", "tx_errors", "tx_fifo_errors", "tx_heartbeat_errors", "tx_packets",
                  "tx_window_errors")
_WORDS = {"port_xmit_data", "port_rcv_data"}


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class FakeSysfs:
    """Writes and updates a fake sysfs tree under ``root`` (point ``receivers.nic.sysfs_root`` at it)."""

    def __init__(self, root: str | os.PathLike, scenario: str | os.PathLike | Mapping[str, Any] | None = None, *,
                 clock: Callable[[], float] | None = None):
        self.root = Path(root)
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._lock = threading.RLock()
        sc = _load(scenario)
        self._ib: dict[tuple[str, int], dict[str, Any]] = {}
        self._net: dict[str, dict[str, Any]] = {}
        for dev, spec in (sc.get("infiniband") or {}).items():
            for port, pspec in ((spec or {}).get("ports") or {1: {}}).items():
                self.add_ib_port(str(dev), int(port), **(pspec or {}))
        for iface, spec in (sc.get("net") or {}).items():
            self.add_net(str(iface), **(spec or {}))
        self._timeline = sorted((dict(e) for e in sc.get("timeline") or []), key=lambda e: float(e.get("at_s", 0)))
        self._next = 0
        self._last_t = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- building -----------------------------------------------------------------------------------------------------
    def add_ib_port(self, device: str, port: int = 1, *, state: str = "4: ACTIVE", phys_state: str = "5: LinkUp",
                    rate: str = "400 Gb/sec (4X NDR)", counters: Mapping[str, int] | None = None,
                    hw_counters: Mapping[str, int] | None = None, rates: Mapping[str, float] | None = None,
                    guid: str | None = None) -> None:
        """Adds an InfiniBand port with every standard counter (0 unless given), mlx5-like hw_counters and GID 0
        (link-local prefix + the port GUID; by default one derived from the device name and port)."""
        with self._lock:
            d = self._port_dir(device, port)
            (d / "counters").mkdir(parents=True, exist_ok=True)
            (d / "hw_counters").mkdir(parents=True, exist_ok=True)
            p = self._ib[(device, port)] = {"counters": {n: 0 for n in IB_COUNTERS},
                                            "hw": {n: 0 for n in IB_HW_COUNTERS}, "rates": dict(rates or {}),
                                            "carry": {}}
            p["counters"].update(counters or {})
            p["hw"].update(hw_counters or {})
            for name, value in p["counters"].items():
                _write(d / "counters" / name, f"{int(value)}\n")
            for name, value in p["hw"].items():
                _write(d / "hw_counters" / name, f"{int(value)}\n")
            _write(d / "state", f"{state}\n")
            _write(d / "phys_state", f"{phys_state}\n")
            _write(d / "rate", f"{rate}\n")
            if guid is None:
                h = zlib.crc32(f"{device}/{port}".encode())
                guid = f"0c42:a103:{h >> 16:04x}:{h & 0xffff:04x}"
            (d / "gids").mkdir(exist_ok=True)
            _write(d / "gids" / "0", f"fe80:0000:0000:0000:{guid}\n")

    def add_net(self, iface: str, *, operstate: str = "up", carrier: int = 1, speed: int = 100000,
                statistics: Mapping[str, int] | None = None, carrier_changes: int = 1,
                rates: Mapping[str, float] | None = None) -> None:
        """Adds a network interface with every statistics file (0 unless given)."""
        with self._lock:
            d = self.root / "class" / "net" / iface
            (d / "statistics").mkdir(parents=True, exist_ok=True)
            n = self._net[iface] = {"stats": {s: 0 for s in NET_STATISTICS}, "rates": dict(rates or {}), "carry": {},
                                    "carrier_changes": carrier_changes}
            n["stats"].update(statistics or {})
            for name, value in n["stats"].items():
                _write(d / "statistics" / name, f"{int(value)}\n")
            _write(d / "carrier_changes", f"{carrier_changes}\n")
            self.set_net_link(iface, operstate == "up" and carrier == 1, speed=speed, count_change=False)

    def _port_dir(self, device: str, port: int) -> Path:
        return self.root / "class" / "infiniband" / device / "ports" / str(port)

    # -- reading and moving counters ------------------------------------------------------------------------------------
    def ib_counter(self, device: str, port: int, name: str) -> int:
        with self._lock:
            p = self._ib[(device, port)]
            return int(p["hw"][name] if name in p["hw"] and name not in p["counters"] else p["counters"][name])

    def set_ib(self, device: str, port: int, name: str, value: int) -> None:
        """Sets a counters/ (or hw_counters/) file of a port."""
        with self._lock:
            p = self._ib[(device, port)]
            table, sub = (p["counters"], "counters") if name in p["counters"] or name not in p["hw"] else (p["hw"],
                                                                                                       "hw_counters")
            table[name] = int(value)
            _write(self._port_dir(device, port) / sub / name, f"{int(value)}\n")

    def add_ib(self, device: str, port: int, name: str, delta: int) -> None:
        with self._lock:
            self.set_ib(device, port, name, self.ib_counter(device, port, name) + int(delta))

    def set_ib_link(self, device: str, port: int, up: bool, *, count_down: bool = True) -> None:
        """Port up (ACTIVE / LinkUp) or down (DOWN / Disabled; link_downed + 1 when ``count_down``)."""
        with self._lock:
            d = self._port_dir(device, port)
            _write(d / "state", "4: ACTIVE\n" if up else "1: DOWN\n")
            _write(d / "phys_state", "5: LinkUp\n" if up else "3: Disabled\n")
            if not up and count_down:
                self.add_ib(device, port, "link_downed", 1)

    def reset_ib(self, device: str, port: int) -> None:
        """Every counter of the port back to 0, as after a driver reload."""
        with self._lock:
            p = self._ib[(device, port)]
            for name in list(p["counters"]):
                self.set_ib(device, port, name, 0)
            for name in list(p["hw"]):
                self.set_ib(device, port, name, 0)
            p["carry"].clear()

    def net_stat(self, iface: str, name: str) -> int:
        with self._lock:
            if name == "carrier_changes":
                return int(self._net[iface]["carrier_changes"])
            return int(self._net[iface]["stats"][name])

    def set_net(self, iface: str, name: str, value: int) -> None:
        with self._lock:
            d = self.root / "class" / "net" / iface
            if name == "carrier_changes":
                self._net[iface]["carrier_changes"] = int(value)
                _write(d / "carrier_changes", f"{int(value)}\n")
                return
            self._net[iface]["stats"][name] = int(value)
            _write(d / "statistics" / name, f"{int(value)}\n")

    def add_net_stat(self, iface: str, name: str, delta: int) -> None:
        with self._lock:
            self.set_net(iface, name, self.net_stat(iface, name) + int(delta))

    def set_net_link(self, iface: str, up: bool, *, speed: int | None = None, count_change: bool = True) -> None:
        """operstate up/down and carrier 1/0 (carrier_changes + 1 when ``count_change``)."""
        with self._lock:
            d = self.root / "class" / "net" / iface
            _write(d / "operstate", "up\n" if up else "down\n")
            _write(d / "carrier", "1\n" if up else "0\n")
            if speed is not None:
                _write(d / "speed", f"{int(speed)}\n")
            if count_change:
                self.set_net(iface, "carrier_changes", self.net_stat(iface, "carrier_changes") + 1)

    # -- time ---------------------------------------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock() - self._t0

    def advance(self) -> None:
        """Moves counters by their rates up to now and applies the timeline entries that came due."""
        with self._lock:
            t = self.now()
            dt = t - self._last_t
            if dt > 0:
                self._last_t = t
                for (dev, port), p in self._ib.items():
                    for name, per_s in p["rates"].items():
                        self._grow(p["carry"], name, per_s / (4 if name in _WORDS else 1) * dt,
                                   lambda n, v, dev=dev, port=port: self.add_ib(dev, port, n, v))
                for iface, n in self._net.items():
                    for name, per_s in n["rates"].items():
                        self._grow(n["carry"], name, per_s * dt,
                                   lambda k, v, iface=iface: self.add_net_stat(iface, k, v))
            while self._next < len(self._timeline) and float(self._timeline[self._next].get("at_s", 0)) <= t:
                self.apply(self._timeline[self._next])
                self._next += 1

    @staticmethod
    def _grow(carry: dict[str, float], name: str, amount: float, add: Callable[[str, int], None]) -> None:
        total = carry.get(name, 0.0) + amount
        whole = int(total)
        carry[name] = total - whole
        if whole:
            add(name, whole)

    def apply(self, entry: Mapping[str, Any]) -> None:
        """Applies one timeline entry now (see the module docstring)."""
        with self._lock:
            if "ib" in entry:
                dev, _, port_s = str(entry["ib"]).partition("/")
                port = int(port_s or 1)
                if entry.get("reset"):
                    self.reset_ib(dev, port)
                for name, value in (entry.get("set") or {}).items():
                    self.set_ib(dev, port, name, value)
                for name, value in (entry.get("add") or {}).items():
                    self.add_ib(dev, port, name, value)
                if "rates" in entry:
                    self._ib[(dev, port)]["rates"].update(entry["rates"])
                if "link" in entry:
                    self.set_ib_link(dev, port, entry["link"] == "up")
            if "net" in entry:
                iface = str(entry["net"])
                for name, value in (entry.get("set") or {}).items():
                    self.set_net(iface, name, value)
                for name, value in (entry.get("add") or {}).items():
                    self.add_net_stat(iface, name, value)
                if "rates" in entry:
                    self._net[iface]["rates"].update(entry["rates"])
                if "link" in entry:
                    self.set_net_link(iface, entry["link"] == "up")

    def start(self, interval_s: float = 0.1) -> FakeSysfs:
        """Calls :meth:`advance` every ``interval_s`` on a daemon thread until :meth:`stop`."""
        def run() -> None:
            while not self._stop.wait(interval_s):
                self.advance()
        self._thread = threading.Thread(target=run, name="fake-sysfs", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)


def _load(source: str | os.PathLike | Mapping[str, Any] | None) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    import json

    import yaml

    path = Path(source)
    text = path.read_text(encoding="utf-8")
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return data or {}
