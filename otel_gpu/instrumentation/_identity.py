"""Who this process is: the resource attributes on everything the instrumentation sends (schema.identity)."""
from __future__ import annotations

import logging
import os
import socket
import sys

from otel_gpu.schema import identity as ids

_logger = logging.getLogger(__name__)


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def job_id_from_env(explicit: str | None = None) -> str:
    """The job id (``otel_gpu.jobid.resolve``: OTEL_GPU_JOB_ID, torchrun's run id, Slurm, Kubernetes), else a
    provisional one shared with the processes this one starts (the ranks then agree on rank 0's at their rendezvous)."""
    from otel_gpu import jobid

    found = explicit or (jobid.resolve() or jobid.JobId("", "")).value
    if found:
        return found
    job = os.environ.get(jobid.PROVISIONAL_ENV) or jobid.generated()
    os.environ[jobid.PROVISIONAL_ENV] = job
    return job


class Identity:
    """Resource attributes; rank and world size are refreshed when the default process group is created."""

    def __init__(self, job_id: str, service_name: str, extra: dict[str, str]):
        self.job_id = job_id
        self.service_name = service_name
        self.extra = dict(extra)
        self.rank = _int_env("RANK")
        self.local_rank = _int_env("LOCAL_RANK")
        self.world_size = _int_env("WORLD_SIZE")
        self.restart_count = _int_env("TORCHELASTIC_RESTART_COUNT")
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.gpu_index: int | None = None
        self.gpu_uuid: str | None = None
        self.version = 0  # bumped on every change, so encoders can cache

    def refresh_from_dist(self) -> None:
        """Takes rank / world size from torch.distributed once a default group exists; GPU from CUDA if started."""
        try:
            dist = sys.modules.get("torch.distributed")
            if dist is not None and dist.is_available() and dist.is_initialized():
                self.rank = dist.get_rank()
                self.world_size = dist.get_world_size()
        except Exception:  # noqa: BLE001 - identity is best effort
            _logger.debug("could not read rank from torch.distributed", exc_info=True)
        self.refresh_gpu()
        self.version += 1

    def refresh_gpu(self) -> None:
        torch = sys.modules.get("torch")
        try:
            # Never initialise CUDA from here: only read it when the program already did.
            if torch is not None and torch.cuda.is_initialized():
                idx = torch.cuda.current_device()
                self.gpu_index = idx
                uuid_ = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
                if uuid_ is not None:
                    text = str(uuid_)
                    self.gpu_uuid = text if text.startswith("GPU-") else f"GPU-{text}"
        except Exception:  # noqa: BLE001
            _logger.debug("could not read the CUDA device", exc_info=True)

    def attributes(self) -> dict[str, object]:
        attrs: dict[str, object] = dict(self.extra)
        attrs[str(ids.SERVICE_NAME)] = self.service_name
        attrs[str(ids.JOB_ID)] = self.job_id
        attrs[str(ids.HOST_NAME)] = self.host
        attrs[str(ids.PROCESS_PID)] = self.pid
        for key, value in ((ids.RANK, self.rank), (ids.LOCAL_RANK, self.local_rank),
                           (ids.WORLD_SIZE, self.world_size), (ids.RESTART_COUNT, self.restart_count),
                           (ids.GPU_INDEX, self.gpu_index), (ids.GPU_UUID, self.gpu_uuid)):
            if value is not None:
                attrs[str(key)] = value
        return attrs
