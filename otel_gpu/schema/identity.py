"""Who emitted a signal: job, rank, host, process and GPU. Resource attributes on every signal."""
from __future__ import annotations

from otel_gpu.schema._model import attr

_G = "Identity (resource attributes)"

JOB_ID = attr("training.job.id", "string",
              "Training job identity: OTEL_GPU_JOB_ID, else TORCHELASTIC_RUN_ID, else a generated id. "
              "The routing key for sharding jobs over aggregators.", group=_G)
RANK = attr("training.rank", "int", "Global rank of the process (RANK).", group=_G)
LOCAL_RANK = attr("training.local_rank", "int", "Rank on its node (LOCAL_RANK).", group=_G)
WORLD_SIZE = attr("training.world_size", "int", "Number of ranks in the job (WORLD_SIZE).", group=_G)
RESTART_COUNT = attr("training.restart_count", "int", "torchelastic restart count (TORCHELASTIC_RESTART_COUNT).",
                     group=_G)
NET_INTERFACES = attr("training.net.interfaces", "string",
                      "Network interfaces / HCAs the rank communicates over, comma-separated (from GLOO_SOCKET_IFNAME, "
                      "NCCL_SOCKET_IFNAME, NCCL_IB_HCA); only their ports are network evidence for the job.", group=_G)
HOST_NAME = attr("host.name", "string", "Host name of the node.", group=_G, semconv=True)
PROCESS_PID = attr("process.pid", "int", "Process id.", group=_G, semconv=True)
PROCESS_CREATION_TIME = attr("process.creation.time", "string",
                             "When the process was created (ISO 8601, UTC). The collector uses it to tell a rank's "
                             "own application XIDs from those of a process that ran on its GPU before it.", group=_G,
                             semconv=True)
SERVICE_NAME = attr("service.name", "string", "OTEL_SERVICE_NAME; defaults to otel-gpu-training.", group=_G,
                    semconv=True)
HW_ID = attr("hw.id", "string", "An identifier for the hardware component, unique within the host: a GPU's UUID; "
             "a NIC's device:port (mlx5_0:1) or interface (eth0).", group=_G, semconv=True)
HW_NAME = attr("hw.name", "string", "An easily-recognizable name for the hardware component: a NIC's device "
               "(mlx5_0) or interface (eth0).", group=_G, semconv=True)
HW_MODEL = attr("hw.model", "string", "Descriptive model name of the hardware component: a GPU's product name, e.g. "
                "NVIDIA H100 80GB HBM3.", group=_G, semconv=True)
HW_VENDOR = attr("hw.vendor", "string", "Vendor name of the hardware component, e.g. NVIDIA.", group=_G, semconv=True)
HW_DRIVER_VERSION = attr("hw.driver_version", "string", "Driver version for the hardware component, e.g. 550.54.15 "
                         "(NVML's system driver version).", group=_G, semconv=True)
HW_TYPE = attr("hw.type", "string", "Type of the component: gpu, network.", group=_G, values=("gpu", "network"),
               semconv=True)
GPU_INDEX = attr("gpu.index", "int", "NVML device index (the CUDA device index when CUDA_DEVICE_ORDER=PCI_BUS_ID).",
                 group=_G)
GPU_UUID = attr("gpu.uuid", "string", "GPU UUID (same value as hw.id on GPU metrics): the CUDA device's UUID from "
                "torch, else the CUDA_VISIBLE_DEVICES entry when it names one. The collector joins a rank to its GPU "
                "by it first (then NVML pid, then index).", group=_G)
GPU_PCI_BUS_ID = attr("gpu.pci.bus_id", "string", "PCI bus id, e.g. 00000000:07:00.0.", group=_G)
COMPONENT = attr("otel_gpu.component", "string", "Collector component id, e.g. otlp or nvml/fast.", group=_G)
SIGNAL = attr("otel_gpu.signal", "string", "traces, metrics or logs.", group=_G, values=("traces", "metrics", "logs"))

#: Resource attributes the Prometheus exporter keeps as labels of every series although
#: ``resource_to_telemetry_conversion`` is off (its ``promote_resource_attributes`` default): what the dashboards
#: filter on. The other resource attributes reach Prometheus through ``target_info``.
PROMOTED_RESOURCE_ATTRIBUTES = (JOB_ID, HOST_NAME, RANK, GPU_INDEX)
