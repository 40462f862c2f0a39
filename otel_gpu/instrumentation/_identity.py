"""Who this process is: the resource attributes on everything the instrumentation sends (schema.identity).

Precedence, as in the OpenTelemetry SDK: what the user set wins. ``service.name`` is ``OTEL_SERVICE_NAME`` (or the
``service_name`` option), else ``service.name`` from ``OTEL_RESOURCE_ATTRIBUTES``, else ``otel-gpu-training``;
``host.name`` is the one from ``OTEL_RESOURCE_ATTRIBUTES`` (on Kubernetes: the node name from the Downward API), else
``k8s.node.name`` from there, else this machine's host name (a pod name in a container). The GPU is named by its UUID
when torch has started CUDA (``torch.cuda.get_device_properties(i).uuid``) or ``CUDA_VISIBLE_DEVICES`` lists UUIDs,
so that the collector joins it with NVML's devices however the container numbers them.

Example:
    >>> ident = Identity("job-1", None, {"host.name": "gpu-node-7", "service.name": "llama"})
    >>> a = ident.attributes()
    >>> (a["host.name"], a["service.name"], a["training.job.id"])
    ('gpu-node-7', 'llama', 'job-1')
    >>> Identity("job-1", "explicit", {"service.name": "llama"}).attributes()["service.name"]
    'explicit'
    >>> nvml_index_from_visible_devices(1, "4,5,6")
    5
    >>> net_interfaces_from_env({"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1"})
    'eth0,=mlx5_0:1,mlx5_1'
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Mapping

from otel_gpu.instrumentation.config import env, set_env
from otel_gpu.schema import identity as ids

_logger = logging.getLogger(__name__)


def process_creation_time(pid: int | str = "self") -> float:
    """When the process was created (unix seconds): its start in ``/proc/<pid>/stat`` (clock ticks since boot) plus
    the boot time, read as the wall clock less the boot clock (to the tick: ``/proc/stat``'s btime, the fallback, is
    whole seconds, up to a second early); the current time where /proc says nothing (not Linux).

    >>> import time
    >>> 0 <= time.time() - process_creation_time() < 3600
    True
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces and parentheses
        ticks = int(fields[19])  # field 22 of proc(5), counted after the name
        boottime = getattr(time, "CLOCK_BOOTTIME", None)
        if boottime is not None:
            btime: float = time.time() - time.clock_gettime(boottime)
        else:
            with open("/proc/stat", "rb") as f:
                btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def _int_env(name: str) -> int | None:
    try:
        return int(env(name) or "")
    except ValueError:
        return None


def job_id_from_env(explicit: str | None = None) -> str:
    """The job id (``otel_gpu.instrumentation.jobid.resolve``: OTEL_GPU_JOB_ID, torchrun's run id, Slurm, Kubernetes), else a
    provisional one shared with the processes this one starts (the ranks then agree on rank 0's at their rendezvous)."""
    from otel_gpu.instrumentation import jobid

    found = explicit or (jobid.resolve() or jobid.JobId("", "")).value
    if found:
        return found
    job = env(jobid.PROVISIONAL_ENV) or jobid.generated()
    set_env(jobid.PROVISIONAL_ENV, job)
    return job


def restart_count_from_env() -> int | None:
    """torchrun's restart count plus ``otel-gpu run --restart``'s (OTEL_GPU_RESTART_COUNT: the restarts of the whole
    command so far, torchrun's own restarts in earlier starts included), so every incarnation counts higher."""
    ours, torch_count = _int_env("OTEL_GPU_RESTART_COUNT"), _int_env("TORCHELASTIC_RESTART_COUNT")
    if ours is None and torch_count is None:
        return None
    return (ours or 0) + (torch_count or 0)
DEFAULT_SERVICE_NAME = "otel-gpu-training"


def _uuid_text(value: object) -> str | None:
    """torch's device UUID (a ``_CUuuid`` printing as 8-4-4-4-12 hex, or bytes on some builds) in NVML's form
    ``GPU-<8-4-4-4-12>``; None when there is none."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        if len(value) != 16 or not any(value):
            return None
        text = str(uuid.UUID(bytes=bytes(value)))
    else:
        text = str(value).strip()
    if not text or set(text) <= {"0", "-"}:
        return None
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _visible(visible: str | None) -> list[str]:
    return [v.strip() for v in (visible or "").split(",") if v.strip()]


def nvml_index_from_visible_devices(cuda_index: int, visible: str | None) -> int:
    """The NVML index of CUDA device ``cuda_index``: ``CUDA_VISIBLE_DEVICES=4,5`` makes CUDA device 1 NVML's 5.
    Without the variable (or with UUIDs in it) the CUDA index is the best guess left; the UUID is the real join."""
    entries = _visible(visible)
    if 0 <= cuda_index < len(entries) and entries[cuda_index].isdigit():
        return int(entries[cuda_index])
    return cuda_index


def uuid_from_visible_devices(cuda_index: int, visible: str | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES=GPU-8a...,GPU-3f...`` (what container runtimes often set) names the UUID directly."""
    entries = _visible(visible)
    if 0 <= cuda_index < len(entries) and entries[cuda_index].startswith(("GPU-", "MIG-")):
        return entries[cuda_index]
    return None


def net_interfaces_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The interfaces the job's collectives use, as the user told gloo / NCCL (exclusions, ``^...``, say nothing
    usable and are left out); None when unset, and the collector falls back to the ports up at job start."""
    names: list[str] = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
        for item in (env(var, environ) or "").split(","):
            item = item.strip()
            if item and not item.startswith("^") and item not in names:
                names.append(item)
    return ",".join(names) or None


class Identity:
    """Resource attributes; rank and world size are refreshed when the default process group is created."""

    def __init__(self, job_id: str, service_name: str | None, extra: dict[str, str]):
        self.job_id = job_id
        self.extra = dict(extra)
        # The config's default service name stands for "not set": then OTEL_RESOURCE_ATTRIBUTES' service.name wins.
        explicit = service_name if service_name and service_name != DEFAULT_SERVICE_NAME else None
        self.service_name = explicit or self.extra.get(str(ids.SERVICE_NAME)) or DEFAULT_SERVICE_NAME
        self.rank = _int_env("RANK")
        self.local_rank = _int_env("LOCAL_RANK")
        self.world_size = _int_env("WORLD_SIZE")
        self.restart_count = restart_count_from_env()
        self.host = (self.extra.get(str(ids.HOST_NAME)) or self.extra.get("k8s.node.name")
                     or socket.gethostname())
        self.pid = os.getpid()
        self.created = _iso(process_creation_time())
        self.net_interfaces = net_interfaces_from_env()
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
        except Exception:  # identity is best effort
            _logger.debug("could not read rank from torch.distributed", exc_info=True)
        self.refresh_gpu()
        self.version += 1

    def refresh_gpu(self) -> bool:
        """Reads the CUDA device once the program has started CUDA; True (and ``version`` bumped) when it changed.

        Never initialises CUDA itself (that would take a GPU context the program did not ask for, and on a CPU
        machine there is nothing to read). Cheap enough to call at every export until a GPU is known.
        """
        torch = sys.modules.get("torch")
        try:
            if torch is None or not torch.cuda.is_initialized():
                return False
            cuda_index = torch.cuda.current_device()
            visible = env("CUDA_VISIBLE_DEVICES")
            index = nvml_index_from_visible_devices(cuda_index, visible)
            uuid_ = _uuid_text(getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None))
            if uuid_ is None:
                uuid_ = uuid_from_visible_devices(cuda_index, visible)
        except Exception:  # identity is best effort; an old torch or a broken driver says nothing
            _logger.debug("could not read the CUDA device", exc_info=True)
            return False
        if (index, uuid_) == (self.gpu_index, self.gpu_uuid):
            return False
        self.gpu_index, self.gpu_uuid = index, uuid_
        self.version += 1
        return True

    def attributes(self) -> dict[str, object]:
        attrs: dict[str, object] = dict(self.extra)
        attrs[str(ids.SERVICE_NAME)] = self.service_name
        attrs[str(ids.JOB_ID)] = self.job_id
        attrs[str(ids.HOST_NAME)] = self.host
        attrs[str(ids.PROCESS_PID)] = self.pid
        attrs[str(ids.PROCESS_CREATION_TIME)] = self.created
        for key, value in ((ids.RANK, self.rank), (ids.LOCAL_RANK, self.local_rank),
                           (ids.WORLD_SIZE, self.world_size), (ids.RESTART_COUNT, self.restart_count),
                           (ids.GPU_INDEX, self.gpu_index), (ids.GPU_UUID, self.gpu_uuid),
                           (ids.NET_INTERFACES, self.net_interfaces)):
            if value is not None:
                attrs[str(key)] = value
        return attrs
