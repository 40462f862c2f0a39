"""A plain DDP training script, as a user writes it: nothing of otel_gpu is imported (``otel-gpu run`` adds it).

Usage: torchrun --standalone --nproc-per-node 4 plain_ddp.py [--fault none|exception|sigkill|sleep] [--rank K]
       [--step N] [--steps N]

Every rank trains a small model on CPU (gloo); at step ``--step`` rank ``--rank`` raises ValueError, kills itself
with SIGKILL, or sleeps before the next collective (its peers wait in the all-reduce).
"""
from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="none", choices=("none", "exception", "sigkill", "sleep"))
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
    for step in range(args.steps):
        if rank == args.rank and step == args.step:
            if args.fault == "exception":
                raise ValueError(f"bad value in batch {step}")
            if args.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "sleep":
                time.sleep(3600)
        time.sleep(0.05)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
