"""Plain collectives, p2p and async ops on gloo, then a few DDP steps. Instrumented explicitly (otel_gpu.instrument)
unless OTEL_GPU_TEST_NO_INSTRUMENT=1 (then the launcher or opentelemetry-instrument does it).

Usage: python collectives.py WORLD_SIZE PORT [ddp_steps]
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world: int, port: int, ddp_steps: int) -> None:
    if os.environ.get("OTEL_GPU_TEST_NO_INSTRUMENT") != "1":
        import otel_gpu

        otel_gpu.instrument()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(256)
    for _ in range(3):
        dist.all_reduce(t)
    out = torch.zeros(256 * world)
    dist.all_gather_into_tensor(out, t)
    dist.broadcast(t, src=0)
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    dist.barrier()
    if ddp_steps:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32)), batch_size=16)
        for _, (x,) in zip(range(ddp_steps), data):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        torch.save(model.state_dict(), os.path.join(os.environ.get("TEST_TMP", "/tmp"), f"ckpt-{rank}.pt"))
    dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, port = int(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    mp.spawn(run, args=(world, port, steps), nprocs=world)
