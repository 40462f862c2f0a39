"""One prepared check on a real NVIDIA GPU, under 8 minutes: what only hardware can show.

    .venv/bin/python benchmarks/gpu_check.py [--out DIR] [--load-s 90] [--budget-s 450]

1. **NVML.** The real ``nvml`` receiver (``backend: auto``, nvidia-ml-py over the driver) polls every GPU three times;
   every GPU metric of the schema (``otel_gpu.schema.gpu``) is reported as read, unsupported on this GPU (the
   receiver's own "not available": NVML said NotSupported / NoPermission), or missing, and each value read is checked
   for plausibility (fractions in 0..1, temperatures 5..110 C, power under 1.5 x its limit, memory used under its
   size, clocks at most their maximum, energy and error counters not decreasing between polls, P-state 0..15).
2. **Collectives under NCCL** (world size 1, one process group on GPU 0): ``all_reduce`` of 4 KiB .. 256 MiB timed
   with CUDA events (``torch.cuda.Event(enable_timing=True)``) against the host's wall clock around the same call; a
   large gap is what an instrumentation that times collectives on the host would get wrong.
3. **A busy GPU is not a slowdown.** One rank under ``otel-gpu run`` (NCCL, world 1) runs bf16 matmuls for
   ``--load-s`` seconds (its steps marked with ``otel_gpu.step``) against an in-process collector with the real
   ``nvml`` receiver and the attribution processor. The check passes when the GPU reached its power cap (power >= 90%
   of the enforced limit, or ``sw_power_cap`` active) and the collector attributed nothing: the clock-event flags of
   a busy GPU (``sw_power_cap``, ``applications_clocks`` ...) are not blamed.
4. **A real CUDA out-of-memory error** on the right rank: two ranks (gloo, both on GPU 0: NCCL refuses two ranks on
   one GPU) under ``otel-gpu run -- torchrun``; rank 1 asks for twice the GPU's memory and gets
   ``torch.cuda.OutOfMemoryError``; the collector must say ``crash/cuda_oom`` naming rank 1 (``user_fix``).

Findings go to ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` (default ``./gpu-check-out``). Without a CUDA device
(no driver, a CPU build of torch) it says so, writes that, and exits 0: nothing here can be checked without one. Exit
status 1 when a check that ran failed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


# -- device ------------------------------------------------------------------------------------------------------
def device_info() -> dict[str, Any] | None:
    """The CUDA device this check runs on, or None (with the reason in ``why``) when there is none."""
    try:
        import torch
    except ImportError as exc:
        return {"ok": False, "why": f"torch is not installed ({exc})"}
    if not torch.cuda.is_available():
        build = getattr(torch.version, "cuda", None)
        why = "torch is a CPU build (torch.version.cuda is None)" if build is None else \
            "torch.cuda.is_available() is False (no NVIDIA driver or no visible GPU)"
        return {"ok": False, "why": why, "torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    return {"ok": True, "torch": torch.__version__, "cuda": torch.version.cuda, "name": props.name,
            "total_memory": int(props.total_memory), "count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}", "bf16": bool(torch.cuda.is_bf16_supported())}


# -- 1. NVML -----------------------------------------------------------------------------------------------------
_FRACTIONS = {"hw.gpu.utilization", "hw.gpu.memory.utilization", "gpu.memory.activity"}
_MONOTONIC = {"hw.energy", "hw.errors", "gpu.pcie.replay", "gpu.nvlink.errors", "gpu.xid.errors"}


def _points(request) -> dict[tuple[str, int, tuple], float]:
    """(metric, gpu index, other attributes) -> value, from an ExportMetricsServiceRequest."""
    out: dict[tuple[str, int, tuple], float] = {}
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                data = m.gauge if m.HasField("gauge") else m.sum if m.HasField("sum") else None
                if data is None:
                    continue
                for p in data.data_points:
                    attrs = {}
                    for kv in p.attributes:
                        v = kv.value
                        attrs[kv.key] = v.string_value if v.HasField("string_value") else v.int_value
                    gpu = int(attrs.pop("gpu.index", -1))
                    for k in ("hw.id", "gpu.pci.bus_id", "hw.model", "hw.vendor", "hw.type", "hw.driver_version"):
                        attrs.pop(k, None)
                    value = p.as_double if p.HasField("as_double") else float(p.as_int)
                    out[(m.name, gpu, tuple(sorted(attrs.items())))] = value
    return out


def _plausible(name: str, attrs: dict, value: float, polls: list[dict], key) -> str | None:
    """None when ``value`` is plausible; else why not."""
    if name in _FRACTIONS and not 0.0 <= value <= 1.0:
        return f"{value} is not a fraction"
    if name == "hw.temperature" and not 5 <= value <= 110:
        return f"{value} C"
    if name == "gpu.performance_state" and not 0 <= value <= 15:
        return f"P{value}"
    if name in ("hw.power", "gpu.power.limit") and not 0 <= value <= 2000:
        return f"{value} W"
    if name in _MONOTONIC or name == "hw.energy":
        seen = [p[key] for p in polls if key in p]
        if any(b < a for a, b in zip(seen, seen[1:])):
            return f"decreased between polls: {seen}"
    return None


def check_nvml(polls_n: int = 3, backend: str = "auto", scenario: str | None = None,
               interval_s: float = 1.0) -> dict[str, Any]:
    """The real nvml receiver's reads of every schema GPU metric (``backend``/``scenario``: the receiver's own
    settings; the fake NVML lets the check itself be tested without a GPU)."""
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.component import ComponentHost
    from otel_gpu.config import build
    from otel_gpu.receivers.nvml import NvmlReceiver, NvmlReceiverConfig
    from otel_gpu.schema import gpu as G
    from otel_gpu.schema._model import Metric

    settings: dict[str, Any] = {"backend": backend, "xid_events": False}
    if scenario:
        settings["scenario"] = scenario
    cfg = build(NvmlReceiverConfig, settings, "receivers.nvml")
    receiver = NvmlReceiver(cfg, ComponentHost("nvml", PrometheusSelfTelemetry()))
    receiver.backend = receiver._load_backend()
    if receiver.backend is None or not receiver._init():
        return {"ok": False, "why": "NVML could not start (see the warning above)"}
    receiver._discover()
    receiver.config.nvlink_interval_s = 1e-9  # read NVLink on every poll here
    polls = []
    for i in range(polls_n):
        request = receiver.poll()
        polls.append(_points(request) if request is not None else {})
        if i < polls_n - 1:
            time.sleep(interval_s)
    skipped = {gpu.index: sorted(gpu.skip) for gpu in receiver.gpus}
    schema_metrics = [m for m in vars(G).values() if isinstance(m, Metric)]
    rows = []
    problems = []
    last = polls[-1]
    for m in schema_metrics:
        keys = [k for k in last if k[0] == m.name]
        if not keys:
            rows.append({"metric": m.name, "status": "not read", "values": {}})
            continue
        values, bad = {}, []
        for key in keys:
            attrs = dict(key[2])
            value = last[key]
            values[f"gpu{key[1]}" + "".join(f",{k}={v}" for k, v in key[2])] = value
            why = _plausible(m.name, attrs, value, polls, key)
            if why:
                bad.append(f"{key}: {why}")
        # relations between metrics of one GPU
        for gpu in {k[1] for k in keys}:
            if m.name == "hw.gpu.memory.usage":
                used = last.get(("hw.gpu.memory.usage", gpu, ()))
                total = last.get(("hw.gpu.memory.limit", gpu, ()))
                if used is not None and total is not None and used > total:
                    bad.append(f"gpu{gpu}: used {used} > size {total}")
            if m.name == "gpu.clock.frequency":
                for dom in ("sm", "memory"):
                    cur = last.get(("gpu.clock.frequency", gpu, (("gpu.clock.domain", dom),)))
                    top = last.get(("gpu.clock.frequency.max", gpu, (("gpu.clock.domain", dom),)))
                    if cur is not None and top is not None and cur > top * 1.01:
                        bad.append(f"gpu{gpu} {dom}: {cur} MHz > max {top}")
            if m.name == "hw.power":
                p = last.get(("hw.power", gpu, ()))
                lim = last.get(("gpu.power.limit", gpu, ()))
                if p is not None and lim and p > 1.5 * lim:
                    bad.append(f"gpu{gpu}: {p} W > 1.5 x limit {lim} W")
        rows.append({"metric": m.name, "status": "read" if not bad else "implausible", "values": values,
                     "problems": bad})
        problems += bad
    # "not read" is either unsupported here (the receiver noted the feature) or never asked (e.g. NVLink on a
    # PCIe card, processes when none run): it is reported, not failed.
    return {"ok": not problems, "gpus": len(receiver.gpus), "unsupported_features": skipped, "metrics": rows,
            "problems": problems, "read": sum(r["status"] == "read" for r in rows),
            "not_read": [r["metric"] for r in rows if r["status"] == "not read"]}


# -- 2. collectives under NCCL, timed with CUDA events -----------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_nccl(iters: int = 20) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    rows = []
    try:
        for size in (4 << 10, 1 << 20, 64 << 20, 256 << 20):
            t = torch.ones(size // 4, dtype=torch.float32, device="cuda")
            dist.all_reduce(t)  # warm-up (communicator set-up)
            torch.cuda.synchronize()
            gpu_ms, host_ms, launch_ms = [], [], []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                dist.all_reduce(t)
                end.record()
                t1 = time.perf_counter()  # the call returned: NCCL only enqueued the kernel
                end.synchronize()
                t2 = time.perf_counter()
                gpu_ms.append(start.elapsed_time(end))
                launch_ms.append((t1 - t0) * 1e3)
                host_ms.append((t2 - t0) * 1e3)
            rows.append({"bytes": size, "cuda_event_ms_median": statistics.median(gpu_ms),
                         "host_call_ms_median": statistics.median(launch_ms),
                         "host_until_done_ms_median": statistics.median(host_ms)})
    finally:
        dist.destroy_process_group()
    ok = all(r["cuda_event_ms_median"] > 0 for r in rows)
    return {"ok": ok, "iters": iters, "rows": rows,
            "note": "host_call_ms is what a host-side timer around the Python call measures: NCCL returns after "
                    "enqueueing, so only CUDA events (or a synchronize) give the collective's duration"}


# -- 3 and 4: jobs under otel-gpu run against an in-process collector ---------------------------------------------
def _collector(workdir: Path, grpc_port: int):
    from otel_gpu.collector.config import load_text
    from otel_gpu.collector.runtime import Collector

    config = {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}, "http": None},
                      "nvml": {"backend": "auto", "interval": "1s"}},
        "processors": {"attribution": {"hang_timeout": "15s"}, "goodput": {"report_interval": "2s"}},
        "exporters": {"store": {"path": str(workdir / "store")}},
        "service": {"telemetry": {"logs": {"level": "warning"}}, "pipelines": {
            "traces": {"receivers": ["otlp"], "processors": ["attribution", "goodput"], "exporters": ["store"]},
            "metrics": {"receivers": ["otlp", "nvml"], "processors": ["attribution", "goodput"],
                        "exporters": ["store"]},
            "logs": {"receivers": ["otlp", "nvml"], "processors": ["attribution", "goodput"], "exporters": ["store"]},
        }},
    }
    c = Collector(load_text(json.dumps(config), "<gpu_check>"))
    c.start()
    return c


def _failures(workdir: Path, job_id: str) -> list[dict]:
    import sqlite3

    from otel_gpu.exporters.store import db

    try:
        conn = db.open_reader(workdir / "store")
    except (db.StoreMissing, sqlite3.Error):
        return []
    try:
        return [r for r in db.failures(conn, job_id) if not db.is_withdrawn(r)]
    finally:
        conn.close()


def _power_sampler(stop_after_s: float) -> dict[str, Any]:
    """Samples GPU 0's power, its enforced limit and its clock-event reasons every 0.5 s (pynvml directly)."""
    import pynvml as nv

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    limit_w = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
    get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nv.nvmlDeviceGetCurrentClocksThrottleReasons
    sw_cap = getattr(nv, "nvmlClocksEventReasonSwPowerCap", 0x4)
    samples = []
    deadline = time.monotonic() + stop_after_s
    while time.monotonic() < deadline:
        try:
            samples.append((nv.nvmlDeviceGetPowerUsage(h) / 1000.0, int(get_reasons(h))))
        except nv.NVMLError:
            pass
        time.sleep(0.5)
    nv.nvmlShutdown()
    top = max((p for p, _ in samples), default=0.0)
    return {"limit_w": limit_w, "max_power_w": top, "samples": len(samples),
            "sw_power_cap_seen": any(r & sw_cap for _, r in samples),
            "reasons_seen": sorted({hex(r) for _, r in samples})}


_LOAD_WORKER = r"""
import os, sys, time
import torch, torch.distributed as dist
import otel_gpu
torch.cuda.set_device(0)
dist.init_process_group("nccl")
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
flag = torch.ones(1024, device="cuda")
deadline = time.time() + float(sys.argv[1])
step = 0
while time.time() < deadline:
    with otel_gpu.step(step):
        for _ in range(20):
            c = a @ b
        dist.all_reduce(flag)
        torch.cuda.synchronize()
    step += 1
dist.destroy_process_group()
print(f"steps {step}")
"""

_OOM_WORKER = r"""
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.cuda.set_device(0)  # both ranks on GPU 0 (gloo allows it; NCCL would not)
x = torch.ones(1 << 20, device="cuda")
for step in range(40):
    y = torch.ones(1024)
    dist.all_reduce(y)
    if rank == 1 and step == 10:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # raises torch.cuda.OutOfMemoryError
    time.sleep(0.1)
dist.destroy_process_group()
"""


def _run_job(workdir: Path, name: str, script: str, args: list[str], torchrun_n: int, timeout_s: float,
             grpc_port: int) -> tuple[str, int, str]:
    path = workdir / f"{name}.py"
    path.write_text(script)
    job_id = f"gpu-check-{name}-{os.getpid()}"
    env = dict(os.environ, OTEL_GPU_JOB_ID=job_id, OTEL_GPU_HEARTBEAT_S="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "otel_gpu", "run", "--endpoint", f"http://127.0.0.1:{grpc_port}", "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun_n}",
           "--max-restarts=0", str(path), *args]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        return job_id, done.returncode, (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return job_id, -1, f"timed out after {timeout_s:.0f} s\n{out[-3000:]}"


def check_busy_gpu(workdir: Path, grpc_port: int, load_s: float) -> dict[str, Any]:
    import threading

    power: dict[str, Any] = {}
    sampler = threading.Thread(target=lambda: power.update(_power_sampler(load_s + 20)), daemon=True)
    sampler.start()
    job_id, rc, out = _run_job(workdir, "load", _LOAD_WORKER, [str(load_s)], 1, load_s + 120, grpc_port)
    time.sleep(3.0)  # the collector's last decisions
    sampler.join(timeout=30)
    found = _failures(workdir, job_id)
    at_cap = bool(power.get("sw_power_cap_seen")) or (
        power.get("limit_w") and power.get("max_power_w", 0) >= 0.9 * power["limit_w"])
    return {"ok": rc == 0 and not found and bool(at_cap), "exit_status": rc, "power": power, "at_power_cap": at_cap,
            "failures": found, "output_tail": out[-800:]}


def check_oom(workdir: Path, grpc_port: int) -> dict[str, Any]:
    job_id, rc, out = _run_job(workdir, "oom", _OOM_WORKER, [], 2, 180, grpc_port)
    deadline = time.time() + 10
    found = _failures(workdir, job_id)
    while not found and time.time() < deadline:
        time.sleep(0.5)
        found = _failures(workdir, job_id)
    verdicts = [(f.get("kind"), f.get("root_cause"), (f.get("culprit") or {}).get("rank"), f.get("action"))
                for f in found]
    return {"ok": verdicts == [("crash", "cuda_oom", 1, "user_fix")], "exit_status": rc, "verdicts": verdicts,
            "summaries": [f.get("summary") for f in found], "output_tail": out[-800:]}


# -- report ------------------------------------------------------------------------------------------------------
def _markdown(result: dict[str, Any]) -> str:
    lines = ["# gpu_check", "", f"- when: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(result['time']))}",
             f"- device: {json.dumps(result['device'])}", ""]
    if not result["device"].get("ok"):
        lines += ["**Not run: no CUDA device.** " + result["device"].get("why", ""), ""]
        return "\n".join(lines)
    nvml = result.get("nvml") or {}
    lines += ["## NVML (the real nvml receiver)", "", f"ok: {nvml.get('ok')}; GPUs {nvml.get('gpus')}; metrics read "
              f"{nvml.get('read')}; unsupported features {nvml.get('unsupported_features')}", "",
              "| metric | status | problems |", "|---|---|---|"]
    for row in nvml.get("metrics", []):
        lines.append(f"| `{row['metric']}` | {row['status']} | {'; '.join(row.get('problems', []))[:200]} |")
    nccl = result.get("nccl") or {}
    lines += ["", "## all_reduce under NCCL, world size 1", "", f"ok: {nccl.get('ok')}", "",
              "| bytes | CUDA events (ms) | host: the call (ms) | host: until done (ms) |", "|---|---|---|---|"]
    for r in nccl.get("rows", []):
        lines.append(f"| {r['bytes']} | {r['cuda_event_ms_median']:.3f} | {r['host_call_ms_median']:.3f} | "
                     f"{r['host_until_done_ms_median']:.3f} |")
    for key, title in (("busy", "bf16 load at the power cap: no verdict"), ("oom", "real CUDA OOM on rank 1")):
        part = result.get(key) or {}
        lines += ["", f"## {title}", "", "```", json.dumps({k: v for k, v in part.items() if k != "output_tail"},
                                                           indent=1, default=str)[:3000], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check-out")
    ap.add_argument("--load-s", type=float, default=90.0, help="seconds of bf16 load (default 90)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip what would not finish within this")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"time": time.time(), "device": device_info()}
    if not result["device"].get("ok"):
        print(f"gpu_check: no CUDA device here, nothing checked: {result['device'].get('why')}")
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
        (out / "gpu_check.md").write_text(_markdown(result))
        return 0
    print(f"gpu_check: {result['device']['name']} x{result['device']['count']}, torch {result['device']['torch']}",
          flush=True)
    result["nvml"] = check_nvml()
    print(f"nvml: ok={result['nvml'].get('ok')} read={result['nvml'].get('read')} "
          f"problems={result['nvml'].get('problems')}", flush=True)
    result["nccl"] = check_nccl()
    print(f"nccl: {json.dumps(result['nccl']['rows'])}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="otel-gpu-check-"))
    grpc_port = _free_port()
    collector = _collector(workdir, grpc_port)
    try:
        if time.monotonic() - t0 + args.load_s + 90 < args.budget_s:
            result["busy"] = check_busy_gpu(workdir, grpc_port, args.load_s)
            print(f"busy GPU: ok={result['busy']['ok']} power={result['busy']['power']} "
                  f"failures={[(f.get('kind'), f.get('root_cause')) for f in result['busy']['failures']]}",
                  flush=True)
        else:
            result["busy"] = {"ok": None, "why": "skipped: not enough of the time budget left"}
        if time.monotonic() - t0 + 120 < args.budget_s:
            result["oom"] = check_oom(workdir, grpc_port)
            print(f"oom: ok={result['oom']['ok']} verdicts={result['oom']['verdicts']}", flush=True)
        else:
            result["oom"] = {"ok": None, "why": "skipped: not enough of the time budget left"}
    finally:
        collector.shutdown(timeout_s=10)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "gpu_check.md").write_text(_markdown(result))
    failed = [k for k in ("nvml", "nccl", "busy", "oom") if (result.get(k) or {}).get("ok") is False]
    print(f"gpu_check: {'failed: ' + ', '.join(failed) if failed else 'all checks that ran passed'}; "
          f"{result['wall_s']} s; findings in {out}/gpu_check.json and .md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
