"""An unmodified torchrun worker script: a few DDP steps; with KILL_RANK set, that rank SIGKILLs itself at step 2."""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if step == 2 and str(rank) == os.environ.get("KILL_RANK"):
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
