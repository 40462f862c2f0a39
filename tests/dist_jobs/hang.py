"""3 gloo ranks; rank 2 stalls (time.sleep in ``slow_data_prep``) before the 3rd collective, the others wait in it.

MODE python: the 3rd collective is a plain dist.all_reduce. MODE ddp: rank 2 stalls before step 2's forward, the
others wait in DDP's collectives (issued in C++; only the flight recorder sees them). MODE both: one, then the other.
Instruments itself through ``import otel_gpu.auto``.

Usage: python hang.py MODE PORT SLEEP_S
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def slow_data_prep(seconds: float) -> None:
    time.sleep(seconds)


def run(rank: int, world: int, port: int, mode: str, sleep_s: float) -> None:
    import otel_gpu.auto  # noqa: F401

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(1024)
    if mode in ("python", "both"):
        dist.all_reduce(t)
        dist.all_reduce(t)
        if rank == 2:
            slow_data_prep(sleep_s)
        dist.all_reduce(t)  # seq 3: ranks 0 and 1 wait here for rank 2
    if mode in ("ddp", "both"):
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(3):
            opt.zero_grad()
            if step == 1 and rank == 2:
                slow_data_prep(sleep_s)
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, port, sleep_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    mp.spawn(run, args=(3, port, mode, sleep_s), nprocs=3)
