"""The xid receiver: follows the kernel log, turns each ``NVRM: Xid`` line into a ``gpu.xid`` log record.

``/dev/kmsg`` is read non-blocking with ``select`` (one record per read; EPIPE when records were overwritten is
skipped over); a plain file is followed like ``tail -F`` (truncation and rotation reopen it from the start).
"""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from typing import Any

from otel_gpu.collector import backends
from otel_gpu.component import ComponentHost, Receiver
from otel_gpu.otlp_build import LogsBuilder, attributes
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import gpu as G
from otel_gpu.schema.identity import (GPU_INDEX, GPU_PCI_BUS_ID, HOST_NAME, HW_ID, HW_MODEL, HW_TYPE, HW_VENDOR,
                                     PROCESS_PID)

from otel_gpu.receivers.xid.config import XidReceiverConfig
from otel_gpu.receivers.xid.parse import XidLine, parse_line, pci_key, pci_text

__all__ = ["XidReceiver"]

_logger = logging.getLogger(__name__)
_MAX_LINE_BYTES = 65536  # kernel log records are at most a few KiB
_SCOPE = "otel_gpu.receivers.xid"
_KMSG = "/dev/kmsg"


class XidReceiver(Receiver):
    def __init__(self, config: XidReceiverConfig, host: ComponentHost):
        super().__init__(config, host)
        self._resource = attributes({HOST_NAME: config.host_name or socket.gethostname()})
        self.gpus: dict[tuple[int, int, int], dict[str, Any]] = {}  # (domain, bus, device) -> identity
        self.path = ""
        self.backend: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml_up = False

    # -- lifecycle ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._map_gpus()
        self.path = self.config.path or _KMSG
        if not self.config.path and not os.access(_KMSG, os.R_OK):
            self.host.log_once("kmsg", logging.WARNING, "%s: cannot read /dev/kmsg (run as root or with CAP_SYSLOG, "
                               "or set receivers.%s.path to a kernel log file); the xid receiver stays idle",
                               self.host.component_id, self.host.component_id)
            return
        self._thread = threading.Thread(target=self._follow, name=f"otel-gpu-{self.host.component_id}", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._nvml_up:
            self._nvml_up = False
            try:
                self.backend.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def _map_gpus(self) -> None:
        """PCI bus id -> GPU identity, from NVML when available, then ``gpu_map``."""
        cfg, cid = self.config, self.host.component_id
        if cfg.backend != "none":
            nv = self._load_backend()
            if nv is not None:
                try:
                    nv.nvmlInit()
                    self._nvml_up = True
                    for index in range(nv.nvmlDeviceGetCount()):
                        h = nv.nvmlDeviceGetHandleByIndex(index)
                        pci = _text(nv.nvmlDeviceGetPciInfo(h).busId)
                        self.gpus[pci_key(pci)[:3]] = {
                            GPU_INDEX: index, HW_ID: _text(nv.nvmlDeviceGetUUID(h)),
                            GPU_PCI_BUS_ID: pci, HW_MODEL: _text(nv.nvmlDeviceGetName(h)),
                            HW_VENDOR: "NVIDIA", HW_TYPE: "gpu"}
                except Exception as exc:  # noqa: BLE001 - no driver here: PCI ids (and gpu_map) are what we have
                    self.host.log_once("nvml", logging.INFO, "%s: NVML not available (%s); GPUs are named by PCI bus "
                                       "id%s", cid, exc, " and gpu_map" if cfg.gpu_map else " only (set gpu_map to "
                                       "add indices)")
        for bus_id, index in cfg.gpu_map.items():
            key = pci_key(bus_id)
            ident = self.gpus.setdefault(key[:3], {GPU_PCI_BUS_ID: pci_text(key), HW_TYPE: "gpu"})
            ident[GPU_INDEX] = index

    def _load_backend(self) -> Any:
        self.backend = backends.load("nvml", self.config.backend, scenario=self.config.scenario or None)
        return self.backend

    # -- following the log ----------------------------------------------------------------------------------------------
    def _follow(self) -> None:
        try:
            if self.path == _KMSG or self.path.endswith("/kmsg"):
                self._follow_kmsg()
            else:
                self._follow_file()
        except Exception:  # noqa: BLE001 - the receiver never takes the collector down
            self.host.log_once("follow", logging.ERROR, "%s: following %s failed; the xid receiver stopped",
                               self.host.component_id, self.path, exc_info=True)

    def _follow_kmsg(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not self.config.from_beginning:
                os.lseek(fd, 0, os.SEEK_END)
            while not self._stop.is_set():
                ready, _, _ = select.select([fd], [], [], 0.5)
                if not ready:
                    continue
                while True:
                    try:
                        record = os.read(fd, 8192)
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if exc.errno == errno.EPIPE:  # records overwritten before we read them: go on
                            continue
                        raise
                    if not record:
                        break
                    self.handle_line(record.decode(errors="replace"))
        finally:
            os.close(fd)

    def _follow_file(self) -> None:
        f = None
        inode = None
        buffer = b""
        from_start = self.config.from_beginning
        while not self._stop.is_set():
            if f is None:
                try:
                    f = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
                except OSError as exc:
                    self.host.log_once(("open", exc.errno), logging.WARNING, "%s: cannot open %s (%s); retrying",
                                       self.host.component_id, self.path, exc.strerror)
                    from_start = True  # it did not exist yet: everything written to it will be new
                    self._stop.wait(min(1.0, self.config.poll_interval_s * 5))
                    continue
                if inode is None and not from_start:
                    f.seek(0, os.SEEK_END)
                inode = os.fstat(f.fileno()).st_ino
            chunk = f.read(65536)
            if chunk:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self.handle_line(line.decode(errors="replace"))
                if len(buffer) > _MAX_LINE_BYTES:
                    # No kernel log line is this long: not a log we can parse. Keep memory bounded.
                    self.host.log_once("longline", logging.WARNING, "%s: %s has a line over %d bytes without a "
                                       "newline; it is skipped", self.host.component_id, self.path, _MAX_LINE_BYTES)
                    buffer = b""
                continue
            try:
                st = os.stat(self.path)
                if st.st_ino != inode or st.st_size < f.tell():  # rotated or truncated: read the new file from 0
                    f.close()
                    f, buffer = open(self.path, "rb"), b""  # noqa: SIM115
                    inode = os.fstat(f.fileno()).st_ino
                    continue
            except OSError:
                pass
            self._stop.wait(self.config.poll_interval_s)
        if f is not None:
            f.close()

    def handle_line(self, line: str) -> bool:
        """Emits a ``gpu.xid`` record when ``line`` is an XID line; returns whether it was."""
        xid = parse_line(line)
        if xid is None:
            return False
        self.emit(xid)
        return True

    def emit(self, xid: XidLine) -> None:
        now_ns = time.time_ns()
        time_ns = now_ns
        if xid.monotonic_us is not None:  # kmsg time is since boot: place it on the wall clock
            time_ns = int((time.time() - time.monotonic()) * 1e9) + xid.monotonic_us * 1000
            if not 0 < now_ns - time_ns < 30 * 86400 * 10**9:
                time_ns = now_ns
        identity = dict(self.gpus.get(pci_key(xid.pci)[:3]) or {GPU_PCI_BUS_ID: xid.pci, HW_TYPE: "gpu"})
        extra: dict[str, Any] = {G.XID_CODE: xid.code, G.XID_SOURCE: "kmsg"}
        if xid.pid is not None:
            extra[PROCESS_PID] = xid.pid
        body = {"code": xid.code, "gpu_index": identity.get(GPU_INDEX), "uuid": identity.get(HW_ID),
                "pci_bus_id": identity[GPU_PCI_BUS_ID], "time_unix": time_ns / 1e9, "source": "kmsg",
                "pid": xid.pid, "message": xid.message or G.XID_MEANING.get(xid.code, "")}
        lb = LogsBuilder(self._resource, scope=_SCOPE)
        lb.event(G.XID_EVENT, body, identity, extra, time_ns=time_ns, observed_time_ns=now_ns,
                 severity=LogsBuilder.ERROR)
        _logger.warning("%s: XID %d on GPU %s (%s): %s", self.host.component_id, xid.code, body["gpu_index"],
                        body["pci_bus_id"], body["message"])
        try:
            self.host.consumer(Signal.LOGS).consume(Batch.from_message(Signal.LOGS, lb.build()))
        except Exception:  # noqa: BLE001
            self.host.log_once("consume", logging.ERROR, "%s: passing an XID record on failed (logged once)",
                               self.host.component_id, exc_info=True)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
