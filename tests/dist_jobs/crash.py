"""A 3-rank gloo job (mp.spawn) where rank 1 fails after two steps; an unmodified script (no otel_gpu import).

Usage: python crash.py MODE PORT, MODE in raise | exit | kill | exit_kill (rank 1 os._exit(3), rank 2 SIGKILL) | ok
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world: int, port: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = torch.ones(64)
    for step in range(4):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        dist.all_reduce(t)
        opt.step()
        if step == 1 and rank == 1:
            if mode == "raise":
                raise ValueError("bad batch in user code")
            if mode == "exit":
                os._exit(3)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "exit_kill":
                os._exit(3)
        if step == 1 and rank == 2 and mode == "exit_kill":
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    world = 3
    t0 = time.time()
    try:
        mp.spawn(run, args=(world, port, mode), nprocs=world)
    except Exception as exc:  # noqa: BLE001
        print(f"job failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
