"""The failure record (docs/design.md section 3) and goodput: keys, enumerations, the failure span and events."""
from __future__ import annotations

import enum

from otel_gpu.schema._model import MetricType, attr, enumeration, event, metric, span

_G = "Failures"


@enumeration
class Kind(str, enum.Enum):
    CRASH = "crash"
    HANG = "hang"
    SLOWDOWN = "slowdown"


@enumeration
class Category(str, enum.Enum):
    HARDWARE = "hardware"
    INFRASTRUCTURE = "infrastructure"
    SOFTWARE = "software"
    USER = "user"


#: Categories whose failures say nothing of the culprit's hardware: they follow the code, not the machine.
NOT_THE_DEVICE = (Category.USER.value, Category.SOFTWARE.value)


def counts_against_device(category: object) -> bool:
    """Whether a failure of this category counts against its culprit's devices (their recurrence, a recurring
    culprit's drain): hardware, infrastructure and a category not known do; a user's bug or a software cause does
    not (a rank 0 that raises on every attempt would otherwise drain rank 0's node, then the next one).

    >>> [counts_against_device(c) for c in ("hardware", "infrastructure", None, "user", Category.SOFTWARE)]
    [True, True, True, False, False]
    """
    return getattr(category, "value", category) not in NOT_THE_DEVICE


@enumeration
class Action(str, enum.Enum):
    AUTO_RESTART = "auto_restart"
    EXCLUDE_NODE_AND_RESTART = "exclude_node_and_restart"
    USER_FIX = "user_fix"
    INVESTIGATE = "investigate"


@enumeration
class RootCause(str, enum.Enum):
    GPU_XID = "gpu_xid"
    GPU_FELL_OFF_BUS = "gpu_fell_off_bus"
    GPU_ECC_UNCORRECTABLE = "gpu_ecc_uncorrectable"
    GPU_THERMAL_THROTTLE = "gpu_thermal_throttle"
    GPU_POWER_THROTTLE = "gpu_power_throttle"
    GPU_HW_SLOWDOWN = "gpu_hw_slowdown"
    NVLINK_ERROR = "nvlink_error"
    PCIE_ERROR = "pcie_error"
    NIC_LINK_DOWN = "nic_link_down"
    NIC_ERRORS = "nic_errors"
    RANK_NOT_IN_COLLECTIVE = "rank_not_in_collective"
    COLLECTIVE_MISMATCH = "collective_mismatch"
    RANK_PROCESS_DIED = "rank_process_died"
    CUDA_OOM = "cuda_oom"
    PYTHON_EXCEPTION = "python_exception"
    STRAGGLER_COMPUTE = "straggler_compute"
    DATALOADER_STALL = "dataloader_stall"
    CHECKPOINT_STALL = "checkpoint_stall"
    RANK_EXITED_EARLY = "rank_exited_early"  # ended cleanly (code 0) while its peers still wait or fail
    NODE_LOST = "node_lost"  # every process and the node agent of a host vanished together, no exit records
    RANK_FROZEN = "rank_frozen"  # its process exists but does not run: stopped (state T) or stuck in the kernel (D)
    UNKNOWN = "unknown"


# Record keys. In the JSON of `otel-gpu report` they appear bare; on spans they are prefixed "failure.".
RECORD_KEYS = ("kind", "root_cause", "category", "action", "auto_remediable", "culprit", "job_id", "onset_time",
               "detected_time", "confidence", "evidence", "signature", "recurrence")
# Keys of a versioned record (docs/design.md section 3): every record the attribution processor emits carries them; records
# stored before revisions existed lack them. ``withdrawn`` (bool) and ``previous_root_cause`` (on a revision that
# changed the cause) sit beside them.
REVISION_KEYS = ("failure_id", "version")

KIND = attr("failure.kind", "string", "crash, hang or slowdown.", group=_G, values=Kind)
ROOT_CAUSE = attr("failure.root_cause", "string", "Root cause from the taxonomy.", group=_G, values=RootCause)
CATEGORY = attr("failure.category", "string", "hardware, infrastructure, software or user.", group=_G,
                values=Category)
ACTION = attr("failure.action", "string", "What should happen next.", group=_G, values=Action)
AUTO_REMEDIABLE = attr("failure.auto_remediable", "bool", "True when a restart (with or without the node) fixes it.",
                       group=_G)
CULPRIT_RANK = attr("failure.culprit.rank", "int", "Rank that caused the failure, when known.", group=_G)
CULPRIT_HOST = attr("failure.culprit.host", "string", "Host that caused the failure, when known.", group=_G)
CULPRIT_GPU = attr("failure.culprit.gpu", "string", "GPU (index or UUID) that caused the failure, when known.",
                   group=_G)
JOB_ID = attr("failure.job_id", "string", "Job the failure belongs to.", group=_G)
ONSET_TIME = attr("failure.onset_time", "double", "When the failure began (unix seconds).", group=_G)
DETECTED_TIME = attr("failure.detected_time", "double", "When otel-gpu knew (unix seconds).", group=_G)
CONFIDENCE = attr("failure.confidence", "double", "0..1.", group=_G)
EVIDENCE = attr("failure.evidence", "string[]", "Signals that decided it: 'metric=value @time'.", group=_G)
SIGNATURE = attr("failure.signature", "string", "Stable fingerprint of the cause (same cause, same signature).",
                 group=_G)
RECURRENCE = attr("failure.recurrence", "int", "How often this signature was seen before, across jobs.", group=_G)
XID = attr("failure.xid", "int", "XID code, for root_cause gpu_xid.", group=_G)
FAILURE_ID = attr("failure.failure_id", "string", "Stable id of the failure; its revisions keep it.", group=_G)
VERSION = attr("failure.version", "int", "Revision of the record: 1 first, +1 per revision (late evidence, a "
               "withdrawn hang).", group=_G)
WITHDRAWN = attr("failure.withdrawn", "bool", "True on a revision that withdraws the failure (the ranks progressed "
                 "again).", group=_G)
PREVIOUS_ROOT_CAUSE = attr("failure.previous_root_cause", "string", "On a revision that changed the root cause: the "
                           "one it replaces.", group=_G, values=RootCause)

FAILURE_SPAN = span("otel_gpu.failure", "One per failure record; carries every failure.* attribute. Spans the "
                    "failure from onset to detection.", group=_G,
                    attributes=(KIND, ROOT_CAUSE, CATEGORY, ACTION, AUTO_REMEDIABLE, CULPRIT_RANK, CULPRIT_HOST,
                                CULPRIT_GPU, JOB_ID, ONSET_TIME, DETECTED_TIME, CONFIDENCE, EVIDENCE, SIGNATURE,
                                RECURRENCE, XID, FAILURE_ID, VERSION, WITHDRAWN, PREVIOUS_ROOT_CAUSE))
FAILURE_EVENT = event("otel_gpu.failure", "The whole failure record, for the embedded store and log backends.",
                      group=_G, body="the failure record as JSON (keys of docs/design.md section 3)")

FAILURES = metric("otel_gpu.failures", MetricType.COUNTER, "{failure}", "Failures attributed, by kind and cause.",
                  group=_G, attributes=(KIND, ROOT_CAUSE, CATEGORY))

# Goodput (docs/design.md section 4).
_GG = "Goodput"


@enumeration
class BadputBucket(str, enum.Enum):
    STARTUP = "startup"
    DATA_LOADING = "data_loading"
    CHECKPOINT_SAVE = "checkpoint_save"
    CHECKPOINT_RESTORE = "checkpoint_restore"
    HANG = "hang"
    WASTED_PROGRESS = "wasted_progress"
    RESTART_GAP = "restart_gap"
    SLOWDOWN = "slowdown"
    OTHER = "other"


BADPUT_BUCKET = attr("goodput.bucket", "string", "Badput bucket.", group=_GG, values=BadputBucket)
ETTR = metric("otel_gpu.goodput.ettr", MetricType.GAUGE, "1",
              "Effective training time ratio: productive step time / job wall time.", group=_GG)
PRODUCTIVE_TIME = metric("otel_gpu.goodput.productive_time", MetricType.COUNTER, "s", "Productive step time.",
                         group=_GG)
WALL_TIME = metric("otel_gpu.goodput.wall_time", MetricType.COUNTER, "s", "Job wall time observed.", group=_GG)
BADPUT = metric("otel_gpu.goodput.badput", MetricType.COUNTER, "s", "Time lost, by bucket.", group=_GG,
                attributes=(BADPUT_BUCKET,))
GOODPUT_EVENT = event("otel_gpu.goodput", "Goodput summary of a job, for the embedded store.", group=_GG,
                      body="{job_id, ettr, wall_time_s, productive_time_s, badput_s: {bucket: seconds}}")
