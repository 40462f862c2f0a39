"""CPU cost of the health receivers: polling 8 fake GPUs (nvml receiver) and 8 InfiniBand ports (nic receiver).

Each poll is what the receiver's thread does every interval: read every field through the backend, build the OTLP
request, and serialize it (as an exporter would). CPU time (``time.process_time``) is measured over N polls and
reported as the percentage of one core at a 1 Hz poll rate; the floor is 1%.

    python benchmarks/receiver_cost.py [--polls 200] [--nvlink-every-poll]

The GPUs are H100 SXM-like (18 NVLink links each); by default NVLink is read every 10 s (``nvlink_interval_s``), as
the receiver does; ``--nvlink-every-poll`` reads it on every poll too. The fake NVML's own Python cost is included,
so the figure for the nvml receiver is an upper bound of the receiver's part (real NVML calls are C).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.config import build
from otel_gpu.receivers.nic import NicReceiver, NicReceiverConfig
from otel_gpu.receivers.nvml import NvmlReceiver, NvmlReceiverConfig
from otel_gpu.testing.fake_sysfs import FakeSysfs

FLOOR_PCT = 1.0


def _measure(poll, n: int) -> tuple[float, int]:
    points = 0
    poll()  # warm-up: series and caches built
    t0 = time.process_time()
    for _ in range(n):
        request = poll()
        points = len(request.SerializeToString()) if request is not None else 0
    return (time.process_time() - t0) / n, points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--polls", type=int, default=200)
    ap.add_argument("--nvlink-every-poll", action="store_true")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="otel-gpu-bench-"))
    scenario = tmp / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 8, "defaults": {
        "gpu_util_pct": 97, "processes": [{"pid": 4100, "used_memory_mib": 69000}],
        "nvlink_errors": {0: {"crc_flit": 3}}}}))
    host = ComponentHost("nvml", PrometheusSelfTelemetry())
    nvml_cfg = build(NvmlReceiverConfig, {"backend": "fake", "scenario": str(scenario), "xid_events": False},
                     "receivers.nvml")
    nvml = NvmlReceiver(nvml_cfg, host)
    nvml.backend = nvml._load_backend()
    nvml._init()
    nvml._discover()

    results = {}
    # 1 Hz with NVLink every 10 s: 9 polls without NVLink for each poll with it.
    nvml.config.nvlink_interval_s = 1e-9
    with_nvlink, size_nvlink = _measure(nvml.poll, max(1, args.polls // 4))
    nvml.config.nvlink_interval_s = 1e9
    nvml._last_nvlink = time.monotonic()
    without_nvlink, size_plain = _measure(nvml.poll, args.polls)
    per_s = with_nvlink if args.nvlink_every_poll else (with_nvlink + 9 * without_nvlink) / 10
    results["nvml (8 GPUs, 18 NVLinks each)"] = (per_s, {"poll without NVLink ms": without_nvlink * 1e3,
                                                        "poll with NVLink ms": with_nvlink * 1e3,
                                                        "request bytes (with NVLink)": size_nvlink,
                                                        "request bytes (without)": size_plain})

    fs = FakeSysfs(tmp / "sys")
    for i in range(8):
        fs.add_ib_port(f"mlx5_{i}", 1, rates={"port_xmit_data": 2.0e10, "port_rcv_data": 2.0e10})
    fs.add_net("eth0")
    nic_cfg = build(NicReceiverConfig, {"sysfs_root": str(fs.root)}, "receivers.nic")
    nic = NicReceiver(nic_cfg, ComponentHost("nic", PrometheusSelfTelemetry()))
    nic._scan()
    clock = [0.0]
    nic.clock = lambda: clock[0]

    def nic_poll():
        clock[0] += 1.0
        fs.add_ib("mlx5_0", 1, "port_xmit_data", 1000)
        return nic.poll()

    nic_cost, nic_size = _measure(nic_poll, args.polls)
    results["nic (8 IB ports + eth0)"] = (nic_cost, {"request bytes": nic_size})

    total = 0.0
    print(f"receiver CPU cost per poll (time.process_time over {args.polls} polls; python {sys.version.split()[0]})")
    for name, (cost, extra) in results.items():
        total += cost
        detail = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items())
        print(f"  {name:34s} {cost * 1e3:7.3f} ms/poll = {cost * 100:6.3f}% of a core at 1 Hz  ({detail})")
    print(f"  {'total':34s} {total * 1e3:7.3f} ms/poll = {total * 100:6.3f}% of a core at 1 Hz "
          f"(floor {FLOOR_PCT}%: {'OK' if total * 100 <= FLOOR_PCT else 'OVER'})")
    return 0 if total * 100 <= FLOOR_PCT else 1


if __name__ == "__main__":
    sys.exit(main())
