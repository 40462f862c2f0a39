"""A small DDP job (gloo, CPU) that checkpoints and resumes, with a fault that strikes once or every time: the job of
``otel-gpu demo --scenario restart``, the restart tests and ``benchmarks/remediation.py``.

Run under torchrun, e.g. ``otel-gpu run --restart auto -- torchrun --standalone --nproc-per-node 2 -m
otel_gpu.testing.restart_train``. Settings from the environment (nothing here imports otel_gpu):

- ``OTEL_GPU_WORKDIR`` (required): checkpoint, fault markers and ``progress.jsonl`` (one line per launch, start after
  the process group is up, fault and end);
- ``OTEL_GPU_FAULT``: none, sigkill (the rank kills itself), exception (ValueError in user code), hang (the rank
  sleeps before a collective); ``OTEL_GPU_FAULT_RANK`` (1), ``OTEL_GPU_FAULT_STEP`` (15);
- ``OTEL_GPU_FAULT_ONCE`` (1): strike only once across restarts (a transient fault; a marker file remembers it);
  0: every start (a bug that a restart cannot fix);
- ``OTEL_GPU_STEPS`` (40), ``OTEL_GPU_STEP_SLEEP_S`` (0.05), ``OTEL_GPU_CKPT_EVERY`` (10);
- ``OTEL_GPU_GLOO_TIMEOUT_S`` (1800, PyTorch's default for gloo): how long peers wait for a rank in a collective.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WORKDIR = Path(os.environ["OTEL_GPU_WORKDIR"])
FAULT = os.environ.get("OTEL_GPU_FAULT", "none")
FAULT_RANK = int(os.environ.get("OTEL_GPU_FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("OTEL_GPU_FAULT_STEP", "15"))
FAULT_ONCE = os.environ.get("OTEL_GPU_FAULT_ONCE", "1") == "1"
STEPS = int(os.environ.get("OTEL_GPU_STEPS", "40"))
STEP_SLEEP_S = float(os.environ.get("OTEL_GPU_STEP_SLEEP_S", "0.05"))
CKPT_EVERY = int(os.environ.get("OTEL_GPU_CKPT_EVERY", "10"))
GLOO_TIMEOUT_S = float(os.environ.get("OTEL_GPU_GLOO_TIMEOUT_S", "1800"))
CKPT = WORKDIR / "checkpoint.pt"


def _log(**fields) -> None:
    with open(WORKDIR / "progress.jsonl", "a") as fh:
        fh.write(json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n")


def _strike() -> bool:
    """True when the fault strikes now; with FAULT_ONCE, only the first time across restarts."""
    if not FAULT_ONCE:
        return True
    try:
        os.close(os.open(WORKDIR / f"fault-{FAULT}-struck", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def inject(rank: int, step: int) -> None:
    if FAULT == "none" or rank != FAULT_RANK or step != FAULT_STEP or not _strike():
        return
    _log(event="fault", fault=FAULT, rank=rank, step=step)
    if FAULT == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "exception":
        raise ValueError(f"bad value in batch at step {step}")
    if FAULT == "hang":
        time.sleep(3600)


def main() -> None:
    if os.environ.get("RANK") == "0":  # before anything can fail: counts every start, torchrun's own restarts too
        _log(event="launch", torchelastic_restart_count=os.environ.get("TORCHELASTIC_RESTART_COUNT"),
             restart_count=os.environ.get("OTEL_GPU_RESTART_COUNT"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if CKPT.exists():
        state = torch.load(CKPT, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
    ddp = DDP(model)
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())  # which nodes this incarnation runs on
    if rank == 0:
        _log(event="start", resumed_from=start, restart_count=os.environ.get("OTEL_GPU_RESTART_COUNT"),
             world=dist.get_world_size(), hosts=sorted(set(hosts)))
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
    for step in range(start, STEPS):
        inject(rank, step)
        time.sleep(STEP_SLEEP_S)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == start and rank == 0:
            _log(event="first_step", step=step, restart_count=os.environ.get("OTEL_GPU_RESTART_COUNT"))
        if step % CKPT_EVERY == CKPT_EVERY - 1 and rank == 0:
            tmp = CKPT.with_suffix(".tmp")
            torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
            os.replace(tmp, CKPT)
    dist.barrier()
    if rank == 0:
        _log(event="done", steps=STEPS)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
