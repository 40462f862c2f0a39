"""A small DDP training job (gloo, CPU) with one injectable fault, for the fault-injection suite and the demo.

Run under torchrun (e.g. ``otel-gpu run -- torchrun --standalone --nproc-per-node 4 -m
otel_gpu.testing.scenarios.train``). The fault comes from the environment, so the same unmodified script serves every
scenario:

- ``OTEL_GPU_FAULT``: none, exception, sigkill, os_exit, cuda_oom, sleep_before_collective, deadlock,
  collective_mismatch, straggler, dataloader_stall, slow_checkpoint, cuda_error (the symptom of an XID/ECC fault),
  comm_hang (the symptom of a dead link), comm_slow (the symptom of a degrading link); and the adversarial ones:
  straggler_then_exception (rank k straggles, later rank k2 raises), subgroup_sleep (subgroups [0,1] and [2,3], rank
  k sleeps before its subgroup all_reduce), uneven_inputs (rank k runs out of data and exits 0), long_checkpoint
  (rank k's first checkpoint takes ``OTEL_GPU_CKPT_STALL_S``, default 40 s), agent_restart (nothing goes wrong in
  the job; the runner restarts the collector when rank k says so), thread_exception (a background thread of rank k
  raises; training goes on), sigstop (rank k stops itself with SIGSTOP: frozen, alive, not running)
- ``OTEL_GPU_LAUNCHER``: who starts the ranks. ``torchrun`` (default: run under torchrun); ``spawn``: this script
  is the parent and starts ``OTEL_GPU_WORLD`` (default 4) ranks with ``torch.multiprocessing.spawn``; ``lightning``:
  Lightning's own launcher (``lightning.fabric.Fabric(strategy="ddp").launch()``): this process becomes rank 0 and
  starts ranks 1.. as subprocesses of itself, and its child-process observer SIGKILLs every survivor (itself
  included) once it sees a child die
- ``OTEL_GPU_FAULT_RANK`` (default 1), ``OTEL_GPU_FAULT_RANK2`` (the second rank, -1: none) and
  ``OTEL_GPU_FAULT_STEP`` (default 25; a checkpoint is saved every 10 steps)
- ``OTEL_GPU_STEPS`` (default 60), ``OTEL_GPU_STEP_SLEEP_S`` (default 0.05: steady, cheap "compute"),
  ``OTEL_GPU_HIDDEN`` (default 256: the model's width, so the gradient bytes each step sends)
- ``OTEL_GPU_SCENARIO_DIR``: when set, the faulty rank writes ``trigger`` there when the fault begins and, if
  ``OTEL_GPU_FAULT_WAIT_ACK=1``, waits for ``ack`` (the hardware part of the fault has been injected) before showing
  the software symptom, as a real device fault precedes the process's failure.

Nothing here imports otel_gpu: the instrumentation is what ``otel-gpu run`` adds.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

FAULT = os.environ.get("OTEL_GPU_FAULT", "none")
FAULT_RANK = int(os.environ.get("OTEL_GPU_FAULT_RANK", "1"))
FAULT_RANK2 = int(os.environ.get("OTEL_GPU_FAULT_RANK2", "-1"))
FAULT_STEP = int(os.environ.get("OTEL_GPU_FAULT_STEP", "25"))
CKPT_STALL_S = float(os.environ.get("OTEL_GPU_CKPT_STALL_S", "40"))
STEPS = int(os.environ.get("OTEL_GPU_STEPS", "60"))
STEP_SLEEP_S = float(os.environ.get("OTEL_GPU_STEP_SLEEP_S", "0.05"))
HIDDEN = int(os.environ.get("OTEL_GPU_HIDDEN", "256"))  # model width: gradient bytes per step (network load)
SCENARIO_DIR = os.environ.get("OTEL_GPU_SCENARIO_DIR")
LAUNCHER = os.environ.get("OTEL_GPU_LAUNCHER", "torchrun")
WORLD = int(os.environ.get("OTEL_GPU_WORLD", "4"))


class Batches(Dataset):
    """One ready batch per index (batch_size=None), so a slow __getitem__ is one slow data wait per step."""

    def __init__(self, rank: int):
        self.rank = rank
        gen = torch.Generator().manual_seed(rank)
        self.x = torch.randn(16, 64, generator=gen)
        self.y = torch.randn(16, 8, generator=gen)

    def __len__(self) -> int:
        return STEPS + 5

    def __getitem__(self, i: int):
        if FAULT == "dataloader_stall" and self.rank == FAULT_RANK and i >= FAULT_STEP:
            begin_fault(wait=False)
            time.sleep(0.25)
        return self.x, self.y


_triggered = False


def begin_fault(wait: bool | None = None) -> None:
    """Tells the scenario runner the fault begins; waits for the hardware side when asked."""
    global _triggered
    if _triggered or not SCENARIO_DIR:
        return
    _triggered = True
    Path(SCENARIO_DIR, "trigger").write_text(f"{time.time()}\n")
    if wait if wait is not None else os.environ.get("OTEL_GPU_FAULT_WAIT_ACK") == "1":
        deadline = time.time() + 15
        while time.time() < deadline and not Path(SCENARIO_DIR, "ack").exists():
            time.sleep(0.05)


class SlowFile:
    """A file object whose writes stall, as a slow shared filesystem does."""

    def __init__(self, path: str, stall_s: float):
        self._f = open(path, "wb")  # noqa: SIM115 - a file object that lives as long as this wrapper
        self._stall_s = stall_s

    def write(self, data):
        if self._stall_s:
            time.sleep(self._stall_s)
            self._stall_s = 0.0
        return self._f.write(data)

    def flush(self):
        self._f.flush()

    def close(self):
        self._f.close()


def _background_failure() -> None:
    raise RuntimeError("metrics upload failed: connection refused (a helper thread; training does not need it)")


def inject(rank: int, step: int, model, world: int) -> None:
    if FAULT == "straggler_then_exception" and rank == FAULT_RANK2 and step == FAULT_STEP + 25:
        raise ValueError(f"bad value in batch at step {step}")
    if rank != FAULT_RANK or step < FAULT_STEP:
        return
    if FAULT in ("straggler", "comm_slow", "straggler_then_exception"):
        begin_fault()
        time.sleep(0.2)
        return
    if step != FAULT_STEP:
        return
    if FAULT == "exception":
        begin_fault()
        raise ValueError(f"bad value in batch at step {step}")
    if FAULT == "cuda_oom":
        begin_fault()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.11 GiB total "
                                     "capacity; 71.30 GiB already allocated)")
    if FAULT == "cuda_error":
        begin_fault()
        raise RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be asynchronously "
                           "reported at some other API call")
    if FAULT == "sigkill":
        begin_fault()
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "sigstop":
        begin_fault()
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen until someone sends SIGCONT (or SIGKILL)
    if FAULT == "os_exit":
        begin_fault()
        os._exit(3)
    if FAULT == "sleep_before_collective":
        begin_fault()
        time.sleep(3600)
    if FAULT == "comm_hang":
        # What a rank behind a dead link looks like on a GPU: blocked inside the library (a CUDA synchronize or
        # .item() on a NCCL kernel that never completes), not asleep in user code; the future is never completed.
        begin_fault()
        torch.futures.Future().wait()
    if FAULT == "agent_restart":
        begin_fault(wait=False)
    if FAULT == "thread_exception":
        begin_fault(wait=False)
        threading.Thread(target=_background_failure, name="uploader", daemon=True).start()
    if FAULT == "deadlock":
        begin_fault()
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns: the same thread takes a non-reentrant lock twice


def _start() -> None:
    """Joins the process group the way the chosen launcher does."""
    if LAUNCHER == "lightning":
        from lightning.fabric import Fabric

        # Lightning's subprocess launcher: this process is rank 0, ranks 1.. are its children (same command line).
        Fabric(accelerator="cpu", devices=WORLD, strategy="ddp", num_nodes=1).launch()
    else:
        dist.init_process_group("gloo")


def _spawned(local_rank: int, world: int, port: int) -> None:
    """One rank started by ``torch.multiprocessing.spawn`` (the parent gives no RANK: the process group does)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    main()


def _spawn_all() -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_spawned, args=(WORLD, port), nprocs=WORLD, join=True)


def main() -> None:
    _start()
    rank, world = dist.get_rank(), dist.get_world_size()
    if SCENARIO_DIR:
        Path(SCENARIO_DIR, f"pid-{rank}").write_text(f"{os.getpid()}\n")
    # Subgroups [0,1], [2,3]: every rank must create every group, in the same order.
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)] if FAULT == "subgroup_sleep" else []
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Batches(rank), batch_size=None, num_workers=0)
    ckpt_dir = Path(SCENARIO_DIR or os.environ.get("TMPDIR", "/tmp"))
    for step, (x, y) in enumerate(loader):
        if step >= STEPS:
            break
        if FAULT == "uneven_inputs" and rank == FAULT_RANK and step == FAULT_STEP:
            begin_fault(wait=False)
            return  # this rank's shard is shorter: it leaves the loop and the program ends with exit code 0
        inject(rank, step, model, world)
        time.sleep(STEP_SLEEP_S)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if pairs:
            if rank == FAULT_RANK and step == FAULT_STEP:
                begin_fault(wait=False)
                time.sleep(3600)  # never reaches its subgroup's all_reduce
            dist.all_reduce(torch.ones(64), group=pairs[rank // 2])
        if FAULT == "collective_mismatch" and step == FAULT_STEP:
            begin_fault(wait=False)
            t = torch.ones(1024 if rank != FAULT_RANK else 2048)
            if rank == FAULT_RANK:
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
        if step % 10 == 9:
            stall = 4.0 if FAULT == "slow_checkpoint" and rank == FAULT_RANK and step >= FAULT_STEP else 0.0
            if FAULT == "long_checkpoint" and rank == FAULT_RANK and step == 9:
                stall = CKPT_STALL_S
            if stall:
                begin_fault(wait=False)
            if rank == 0 or stall:
                f = SlowFile(str(ckpt_dir / f"ckpt-rank{rank}.pt"), stall)
                torch.save(model.state_dict(), f)
                f.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if LAUNCHER == "spawn":
        _spawn_all()
    else:
        main()
