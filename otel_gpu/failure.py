"""The failure record of docs/design.md section 3: its taxonomy defaults, its stable signature, how it is read
back from JSON (every field checked: :func:`from_json`) and printed (:func:`format_failure`, total over any input;
:func:`printable`, the one escape for every string that came from telemetry).

Example:
    >>> record = FailureRecord(Kind.CRASH, RootCause.GPU_XID, "job-1", 100.0, 100.4, 0.95,
    ...                        Culprit(rank=3, host="node-a", gpu="0"), ["hw.gpu.xid=79 @100.0"])
    >>> from_json(record.to_json()) == record
    True
    >>> print(format_failure(record).splitlines()[0])
    CRASH in job job-1: gpu xid on rank 3, host node-a, GPU 0 (gpu_xid, hardware) -> action: exclude_node_and_restart; confidence 0.95; detected 0.4 s after onset
    >>> print(format_failure({"kind": "crash", "job_id": "j\x1b[2J", "recurrence": "Infinity"}), end="")
    unreadable record ?: root_cause: missing
"""
from __future__ import annotations

import datetime
import enum
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from otel_gpu.schema.failure import Action, Category, Kind, RootCause

__all__ = ["Action", "Category", "Culprit", "FailureRecord", "Kind", "Revision", "RootCause", "TAXONOMY",
           "UnreadableRecord", "failure_lines", "format_failure", "format_seconds", "finite", "format_time",
           "from_json", "is_gpu_id", "is_host_name", "printable", "record_id"]

# root_cause -> (category, action, auto_remediable). Category "software or user (by stack)" is decided by the engine.
TAXONOMY: dict[RootCause, tuple[Category, Action, bool]] = {
    RootCause.GPU_XID: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.GPU_FELL_OFF_BUS: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.GPU_ECC_UNCORRECTABLE: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.GPU_THERMAL_THROTTLE: (Category.HARDWARE, Action.INVESTIGATE, False),
    RootCause.GPU_POWER_THROTTLE: (Category.HARDWARE, Action.INVESTIGATE, False),
    RootCause.GPU_HW_SLOWDOWN: (Category.HARDWARE, Action.INVESTIGATE, False),
    RootCause.NVLINK_ERROR: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.PCIE_ERROR: (Category.HARDWARE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.NIC_LINK_DOWN: (Category.INFRASTRUCTURE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.NIC_ERRORS: (Category.INFRASTRUCTURE, Action.EXCLUDE_NODE_AND_RESTART, True),
    RootCause.RANK_NOT_IN_COLLECTIVE: (Category.USER, Action.USER_FIX, False),
    RootCause.COLLECTIVE_MISMATCH: (Category.USER, Action.USER_FIX, False),
    RootCause.RANK_PROCESS_DIED: (Category.INFRASTRUCTURE, Action.AUTO_RESTART, True),
    RootCause.CUDA_OOM: (Category.USER, Action.USER_FIX, False),
    RootCause.PYTHON_EXCEPTION: (Category.USER, Action.USER_FIX, False),
    RootCause.STRAGGLER_COMPUTE: (Category.SOFTWARE, Action.INVESTIGATE, False),
    RootCause.DATALOADER_STALL: (Category.SOFTWARE, Action.INVESTIGATE, False),
    RootCause.CHECKPOINT_STALL: (Category.SOFTWARE, Action.INVESTIGATE, False),
    RootCause.RANK_EXITED_EARLY: (Category.USER, Action.USER_FIX, False),
    RootCause.NODE_LOST: (Category.INFRASTRUCTURE, Action.EXCLUDE_NODE_AND_RESTART, True),
    # stopped (SIGSTOP, a debugger) or in uninterruptible sleep outside the GPU driver; D inside the NVIDIA driver
    # is hardware (the finding says so: category hardware, exclude_node_and_restart)
    RootCause.RANK_FROZEN: (Category.INFRASTRUCTURE, Action.INVESTIGATE, False),
    RootCause.UNKNOWN: (Category.SOFTWARE, Action.INVESTIGATE, False),
}


@dataclass
class Culprit:
    rank: int | None = None
    host: str | None = None
    gpu: str | None = None


@dataclass
class FailureRecord:
    kind: Kind
    root_cause: RootCause
    job_id: str
    onset_time: float
    detected_time: float
    confidence: float
    culprit: Culprit = field(default_factory=Culprit)
    evidence: list[str] = field(default_factory=list)
    category: Category | None = None
    action: Action | None = None
    auto_remediable: bool | None = None
    summary: str = ""  # one sentence for people, e.g. "rank 2 never reached all_reduce seq 41"
    details: dict[str, Any] = field(default_factory=dict)  # e.g. xid code, op, seq, stack top
    signature: str = ""
    recurrence: int = 0
    #: Stable id of this failure; a revision (late hardware evidence, a hang that resumed) keeps it and bumps
    #: ``version``. ``withdrawn``: the revision says it was no failure after all (the ranks progressed again).
    failure_id: str = ""
    version: int = 1
    withdrawn: bool = False
    previous_root_cause: str | None = None  # on a revision that changed the root cause: the one it replaces

    def __post_init__(self) -> None:
        category, action, auto = TAXONOMY[self.root_cause]
        self.category = self.category or category
        self.action = self.action or action
        if self.auto_remediable is None:
            self.auto_remediable = auto
        if not self.signature:
            self.signature = self.compute_signature()

    def compute_signature(self) -> str:
        """Same cause, same fingerprint, across jobs and runs: kind, cause and its stable details (XID code, the op
        a hang stopped in, the stack top of the culprit, the exception type), never times, ranks or job ids."""
        stable = {k: self.details[k] for k in ("xid", "op", "exception_type", "stack_top", "signal", "reason")
                  if self.details.get(k) is not None}
        text = json.dumps([self.kind.value, self.root_cause.value, stable], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("kind", "root_cause", "category", "action"):
            out[key] = getattr(self, key).value
        out["onset_time"] = round(self.onset_time, 3)
        out["detected_time"] = round(self.detected_time, 3)
        out["confidence"] = round(self.confidence, 2)
        if self.previous_root_cause is None:
            del out["previous_root_cause"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)


# -- reading a record that crossed a wire or a file --------------------------------------------------------------
class UnreadableRecord(ValueError):
    """A failure record that does not validate; ``key`` names the field (``culprit.rank``, ``evidence[2]``)."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")


_MISSING = object()
#: RFC 1123 host name (labels of letters, digits and '-', never starting or ending with '-'; dots between labels).
#: Telemetry also carries underscores (some cloud and Slurm names do); printing allows them, hooks do not.
_HOST = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                   r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$")
_HOST_STRICT = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                          r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
#: A device id as records name it: an NVML UUID (``GPU-``/``MIG-`` + hex groups), or a test bed's shorter
#: ``GPU-<letters, digits, dashes>``; never a space, quote or shell character.
_GPU_ID = re.compile(r"^(?:GPU|MIG)-[A-Za-z0-9](?:[A-Za-z0-9-]{0,94}[A-Za-z0-9])?$")
_GPU_UUID = re.compile(r"^(?:GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
MAX_GPU_INDEX = 1023
_MAX_INT = 2**63 - 1  # ranks, recurrence, versions: what the store's INTEGER columns and every consumer hold


def is_host_name(value: Any, strict: bool = False) -> bool:
    """A DNS name (RFC 1123; ``strict``: no underscore, no trailing dot), as a hook may receive it.

    >>> is_host_name("node-7.cluster"), is_host_name("-rf"), is_host_name("a b"), is_host_name("x$(id)")
    (True, False, False, False)
    """
    return isinstance(value, str) and (_HOST_STRICT if strict else _HOST).match(value) is not None


def is_gpu_id(value: Any, strict: bool = False) -> bool:
    """A GPU index (0..1023) or UUID (``GPU-8a1c7b2e-57a5-4c4e-9f7e-0d7a3b1c2d3e``, MIG too); ``strict``: the
    UUID in NVML's exact form (what a hook may receive), else any ``GPU-<letters, digits, dashes>``.

    >>> is_gpu_id("3"), is_gpu_id("GPU-8a1c7b2e-57a5-4c4e-9f7e-0d7a3b1c2d3e", strict=True), is_gpu_id("GPU-$(x)")
    (True, True, False)
    """
    if not isinstance(value, str):
        return False
    if value.isascii() and value.isdigit():
        return len(value) <= 4 and int(value) <= MAX_GPU_INDEX
    return (_GPU_UUID if strict else _GPU_ID).match(value) is not None


def _plain_int(value: Any, key: str, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnreadableRecord(key, f"must be an integer (got {_shown(value)})")
    if minimum is not None and value < minimum:
        raise UnreadableRecord(key, f"must be >= {minimum} (got {value})")
    if value > _MAX_INT:
        raise UnreadableRecord(key, f"must be <= {_MAX_INT} (got an integer of {value.bit_length()} bits)")
    return value


def _finite(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnreadableRecord(key, f"must be a number (got {_shown(value)})")
    try:
        number = float(value)
    except OverflowError:
        raise UnreadableRecord(key, "must be a finite number (got an integer too large)") from None
    if not math.isfinite(number):
        raise UnreadableRecord(key, f"must be a finite number (got {number})")
    return number


def _text(value: Any, key: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise UnreadableRecord(key, f"must be a string (got {_shown(value)})")
    return value


def _object(value: Any, key: str) -> Mapping[str, Any]:
    """An optional JSON object: ``{}`` for null or missing."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UnreadableRecord(key, f"must be an object (got {_shown(value)})")
    return value


def _enum(cls: type[enum.Enum], value: Any, key: str) -> Any:
    try:
        return cls(value)
    except (ValueError, TypeError):
        known = ("a root cause of the taxonomy (failure.root_cause in docs/schema.md)" if cls is RootCause
                 else "one of " + ", ".join(m.value for m in cls))
        raise UnreadableRecord(key, f"{_shown(value)} is not {known}") from None


def _shown(value: Any) -> str:
    """A bad value in a message: its type, and a short printable form."""
    if isinstance(value, (Mapping, list)):
        return f"{type(value).__name__} of {len(value)}"
    text = printable(_safe_repr(value))
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a message about a bad value must not fail on it
        return f"<{type(value).__name__}>"


def _evidence_item(item: Any, key: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        # Hand-written senders give {"metric": m, "value": v, "time": t, ...}: read as its one line of text.
        name = item.get("metric") or item.get("signal") or item.get("name") or ""
        parts = [f"{name} = {item['value']}" if "value" in item else str(name)]
        extra = {k: v for k, v in item.items() if k not in ("metric", "signal", "name", "value", "time")}
        for k, v in [("value", item.get("value")), *extra.items()]:
            if isinstance(v, (Mapping, list)):
                raise UnreadableRecord(f"{key}.{k}", f"must be a scalar (got {_shown(v)})")
        if extra:
            parts.append("(" + ", ".join(f"{k} {v}" for k, v in extra.items()) + ")")
        text = " ".join(p for p in parts if p)
        if item.get("time") is not None:
            text += f" @{_finite(item['time'], f'{key}.time'):.3f}"
        return text
    raise UnreadableRecord(key, f"must be a string (got {_shown(item)})")


def from_json(data: str | bytes | Mapping[str, Any]) -> FailureRecord:
    """The :class:`FailureRecord` in ``data`` (JSON text or an already decoded mapping), every field checked.

    Unknown keys are ignored (a newer otel-gpu may add some); the store's older spellings are read too
    (``status: withdrawn``, a top-level ``xid``, ``withdrawn_reason``, evidence items as objects).

    Raises:
        UnreadableRecord: naming the first bad key and what is wrong with it.

    >>> r = from_json('{"kind": "crash", "root_cause": "gpu_xid", "job_id": "j", "onset_time": 1, '
    ...               '"detected_time": 2, "confidence": 0.9, "culprit": {"rank": 3, "host": "node-a"}}')
    >>> r.action.value, r.culprit.rank, from_json(r.to_json()) == r
    ('exclude_node_and_restart', 3, True)
    >>> from_json('{"kind": "crash", "root_cause": "gpu_xid$(touch X)"}')
    Traceback (most recent call last):
    ...
    otel_gpu.failure.UnreadableRecord: root_cause: str 'gpu_xid$(touch X)' is not a root cause of the taxonomy ...
    """
    if isinstance(data, (str, bytes, bytearray)):
        try:
            data = json.loads(data)  # NaN and Infinity parse: the field they stand in is named below
        except (ValueError, RecursionError) as exc:
            raise UnreadableRecord("record", f"not JSON ({printable(str(exc))[:100]})") from None
    if not isinstance(data, Mapping):
        raise UnreadableRecord("record", f"must be a JSON object (got {type(data).__name__})")
    get = data.get

    def need(key: str) -> Any:
        value = get(key, _MISSING)
        if value is _MISSING:
            raise UnreadableRecord(key, "missing")
        return value

    kind = _enum(Kind, need("kind"), "kind")
    root_cause = _enum(RootCause, need("root_cause"), "root_cause")
    job_id = _text(need("job_id"), "job_id") or ""
    onset = _finite(need("onset_time"), "onset_time")
    detected = _finite(need("detected_time"), "detected_time")
    confidence = _finite(need("confidence"), "confidence")
    if not 0.0 <= confidence <= 1.0:
        raise UnreadableRecord("confidence", f"must be within 0..1 (got {confidence})")
    culprit_data = _object(get("culprit"), "culprit")
    rank = culprit_data.get("rank")
    rank = None if rank is None else _plain_int(rank, "culprit.rank")
    host = _text(culprit_data.get("host"), "culprit.host", optional=True)
    if host == "":
        host = None
    if host is not None and not is_host_name(host):
        raise UnreadableRecord("culprit.host", f"must be a host name (RFC 1123), got {_shown(host)}")
    gpu = culprit_data.get("gpu")
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        gpu = str(gpu)
    if gpu == "":
        gpu = None
    if gpu is not None and not is_gpu_id(gpu):
        raise UnreadableRecord("culprit.gpu", f"must be a GPU index (0..{MAX_GPU_INDEX}) or UUID (GPU-...), got "
                               f"{_shown(gpu)}")
    gpu = gpu if isinstance(gpu, str) else None  # is_gpu_id accepted a string or it was None
    raw_evidence = get("evidence")
    if raw_evidence is None:
        raw_evidence = []
    if not isinstance(raw_evidence, list):
        raise UnreadableRecord("evidence", f"must be a list of strings (got {_shown(raw_evidence)})")
    lines = [_evidence_item(item, f"evidence[{i}]") for i, item in enumerate(raw_evidence)]
    category = get("category")
    category = None if category is None else _enum(Category, category, "category")
    action = get("action")
    action = None if action is None else _enum(Action, action, "action")
    auto = get("auto_remediable")
    if auto is not None and not isinstance(auto, bool):
        raise UnreadableRecord("auto_remediable", f"must be true, false or null (got {_shown(auto)})")
    details = dict(_object(get("details"), "details"))
    for legacy in ("xid", "withdrawn_reason"):  # the store's older records carry these at the top
        if get(legacy) is not None and legacy not in details:
            details[legacy] = get(legacy)
    for key in details:
        if not isinstance(key, str):
            raise UnreadableRecord("details", f"keys must be strings (got {_shown(key)})")
    withdrawn = get("withdrawn", False)
    if withdrawn is None:
        withdrawn = False
    if not isinstance(withdrawn, bool):
        raise UnreadableRecord("withdrawn", f"must be true or false (got {_shown(withdrawn)})")
    if get("status") == "withdrawn":
        withdrawn = True
    previous = get("previous_root_cause")
    if previous is not None:
        previous = _enum(RootCause, previous, "previous_root_cause").value
    summary = _text(get("summary", ""), "summary", optional=True) or ""
    signature = _text(get("signature", ""), "signature", optional=True) or ""
    failure_id = _text(get("failure_id", ""), "failure_id", optional=True) or ""
    recurrence = get("recurrence")
    version = get("version")
    return FailureRecord(
        kind=kind, root_cause=root_cause, job_id=job_id, onset_time=onset, detected_time=detected,
        confidence=confidence, culprit=Culprit(rank=rank, host=host, gpu=gpu), evidence=lines, category=category,
        action=action, auto_remediable=auto, summary=summary, details=details, signature=signature,
        recurrence=0 if recurrence is None else _plain_int(recurrence, "recurrence"), failure_id=failure_id,
        version=1 if version is None else _plain_int(version, "version"), withdrawn=withdrawn,
        previous_root_cause=previous)


def record_id(data: Any, fallback: str = "?") -> str:
    """What to call a record that may not read: its ``failure_id`` when it has a string one, else ``fallback``."""
    if isinstance(data, FailureRecord):
        return printable(data.failure_id or fallback)
    if isinstance(data, Mapping):
        fid = data.get("failure_id")
        if isinstance(fid, str) and fid:
            return printable(fid)
    return printable(fallback)


# -- printing -------------------------------------------------------------------------------------------------------
#: Code points a terminal acts on, or that reorder or break what follows: C0 and C1 controls, DEL, the Unicode bidi
#: controls and line/paragraph separators, and lone surrogates (which no UTF-8 terminal can be sent).
_UNPRINTABLE = ([*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
                 *range(0x2066, 0x206A), 0x2028, 0x2029, 0xFEFF, *range(0xD800, 0xE000)])
_ESCAPES = {cp: (f"\\x{cp:02x}" if cp <= 0xFF else f"\\u{cp:04x}") for cp in _UNPRINTABLE}
_ESCAPES.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"})


def printable(value: Any) -> str:
    """``value`` as text safe to print on a terminal or in a log line: every control character (C0, C1, DEL), bidi
    control, line separator and lone surrogate shown escaped (``\\x1b``, ``\\u202e``). Never raises.

    >>> printable("job\\x1b]0;owned\\x07\\nFAKE LINE"), printable("a\\u202eb"), printable(None)
    ('job\\\\x1b]0;owned\\\\x07\\\\nFAKE LINE', 'a\\\\u202eb', 'None')
    """
    if not isinstance(value, str):
        try:
            value = str(value)
        except Exception:  # noqa: BLE001 - printing must never fail on what a stranger sent
            value = _safe_repr(value)
        if not isinstance(value, str):
            return "<unprintable>"
    return value.translate(_ESCAPES)


def format_time(t: Any) -> str:
    """Unix seconds as local time; ``unknown time`` for anything else (non-finite, out of range, not a number)."""
    number = finite(t)
    if number is None:
        return "unknown time"
    try:
        return datetime.datetime.fromtimestamp(number).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    except (ValueError, OverflowError, OSError):
        return "unknown time"


def format_seconds(s: Any) -> str:
    """A duration for people (``7.8 s``, ``14.6 min``, ``2.0 h``); ``unknown`` for anything not a finite number."""
    number = finite(s)
    if number is None:
        return "unknown"
    if abs(number) < 120:
        return f"{number:.1f} s"
    if abs(number) < 7200:
        return f"{number / 60:.1f} min"
    return f"{number / 3600:.1f} h"


def finite(value: Any) -> float | None:
    """A finite float from a number or numeric text; None for anything else (bools, NaN, infinity, objects)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    except Exception:  # noqa: BLE001 - a hostile __float__
        return None
    return number if math.isfinite(number) else None


_AT_TIME = re.compile(r"^(.*\S)\s+@(\d{1,12}(?:\.\d{1,9})?)$")


def _culprit_text(culprit: Any) -> str:
    if not isinstance(culprit, Culprit):
        return ""
    parts = []
    if isinstance(culprit.rank, int) and not isinstance(culprit.rank, bool):
        parts.append(f"rank {culprit.rank}")
    elif culprit.rank is not None:
        parts.append("rank unreadable")
    if culprit.host:
        parts.append(f"host {printable(culprit.host)}")
    if culprit.gpu not in (None, ""):
        parts.append(f"GPU {printable(culprit.gpu)}")
    return ", ".join(parts)


def _value(enum_value: Any, unknown: str = "unknown") -> str:
    """An enum member's value, a string as it is, anything else ``unknown``; always printable."""
    if isinstance(enum_value, enum.Enum):
        enum_value = enum_value.value
    if isinstance(enum_value, str) and enum_value:
        return printable(enum_value)
    return unknown


def _summary(record: FailureRecord) -> str:
    if isinstance(record.summary, str) and record.summary.strip():
        return printable(record.summary.strip())
    who = _culprit_text(record.culprit)
    cause = _value(record.root_cause, "unknown cause").replace("_", " ")
    xid = record.details.get("xid") if isinstance(record.details, Mapping) else None
    if xid is not None and not isinstance(xid, (Mapping, list)):
        cause += f" (XID {printable(xid)})"
    return f"{cause} on {who}" if who else cause


def _evidence_line(item: Any, onset: float | None) -> str:
    text = item if isinstance(item, str) else _safe_repr(item)
    match = _AT_TIME.match(text)  # the attribution processor's "signal=value @unix-seconds"
    if match is None:
        return printable(text)
    t = float(match.group(2))
    when = f"at {t - onset:+.1f} s from onset" if onset is not None else f"at {format_time(t)}"
    return f"{printable(match.group(1))} {when}"


def _headline(record: FailureRecord) -> str:
    kind = _value(record.kind, "failure").upper()
    job = printable(record.job_id) if isinstance(record.job_id, str) and record.job_id else "unknown job"
    cause = ", ".join(_value(x) for x in (record.root_cause, record.category) if x)
    line = f"{kind} in job {job}: {_summary(record)}"
    if cause:
        line += f" ({cause})"
    if record.action:
        line += f" -> action: {_value(record.action)}"
    tail = []
    confidence = finite(record.confidence)
    tail.append(f"confidence {confidence:.2g}" if confidence is not None else "confidence unreadable")
    onset, detected = finite(record.onset_time), finite(record.detected_time)
    if onset is not None and detected is not None:
        tail.append(f"detected {format_seconds(max(0.0, detected - onset))} after onset")
    return line + "; " + "; ".join(tail)


def _verdict(record: FailureRecord | None) -> str:
    if not isinstance(record, FailureRecord):
        return "unreadable"
    who = _culprit_text(record.culprit)
    text = f"{_value(record.kind, '?')}/{_value(record.root_cause, '?')}"
    return f"{text} ({who})" if who else text


def _withdrawn_reason(record: FailureRecord) -> str:
    reason = record.details.get("withdrawn_reason") if isinstance(record.details, Mapping) else None
    if isinstance(reason, str) and reason.strip():
        return printable(reason.strip())
    summary = record.summary if isinstance(record.summary, str) else ""
    if summary.startswith("withdrawn:"):
        return printable(summary.split(":", 1)[1].split(";")[0].strip())
    return "the verdict was taken back"


@dataclass
class Revision:
    """One version of a failure as the store received it; ``record`` None when that version does not read."""

    version: int
    received_time: float | None
    record: FailureRecord | None
    problem: str | None = None  # why ``record`` is None


def failure_lines(record: FailureRecord, versions: Sequence[Revision] = ()) -> list[str]:
    """The lines of :func:`format_failure`."""
    withdrawn = record.withdrawn is True
    lines = [("WITHDRAWN " if withdrawn else "") + _headline(record)]
    if withdrawn:
        lines.append(f"  status: withdrawn ({_withdrawn_reason(record)}); not counted as a failure")
    versions = [v for v in versions if isinstance(v, Revision)]
    if len(versions) > 1:
        steps = " -> ".join(f"v{printable(v.version)} {_verdict(v.record)}"
                            + (" withdrawn" if isinstance(v.record, FailureRecord) and v.record.withdrawn is True
                               else "") for v in versions)
        lines.append(f"  revisions: {steps}")
    onset, detected = finite(record.onset_time), finite(record.detected_time)
    lines.append(f"  detected: {format_time(detected)}" + (f" (onset {format_time(onset)})" if onset is not None
                                                           else ""))
    lines.append(f"  culprit: {_culprit_text(record.culprit) or 'not identified'}")
    if isinstance(record.auto_remediable, bool):
        lines.append(f"  auto-remediable: {'yes' if record.auto_remediable else 'no'}")
    details = record.details if isinstance(record.details, Mapping) else {}
    # Lists (e.g. every waiting rank of a hang) are for machines: --format json has them.
    shown = [f"{printable(k)} {printable(v)}" for k, v in details.items()
             if k != "withdrawn_reason" and v not in (None, "") and not isinstance(v, (list, dict))]
    if shown:
        lines.append("  details: " + ", ".join(shown))
    evidence = record.evidence if isinstance(record.evidence, list) else None
    if evidence is None:
        lines.append("  evidence: unreadable")
    elif evidence:
        lines.append("  evidence:")
        lines.extend(f"    - {_evidence_line(item, onset)}" for item in evidence)
    recurrence = record.recurrence
    if isinstance(recurrence, int) and not isinstance(recurrence, bool):
        seen = "first time seen" if recurrence <= 0 else \
            f"seen {recurrence} time{'s' if recurrence != 1 else ''} before"
    else:
        seen = "unreadable"
    sig = f" (signature {printable(record.signature)})" if record.signature else ""
    lines.append(f"  recurrence: {seen}{sig}")
    return lines


def format_failure(record: Any, versions: Sequence[Revision] = ()) -> str:
    """One failure as ``otel-gpu report`` prints it, and ``otel-gpu run --restart`` when it stops a job: headline
    (kind, job, summary, cause, action, confidence), revisions, times, culprit, details, evidence, recurrence.

    Total: takes a :class:`FailureRecord` (or a mapping, read with :func:`from_json`); a field of the wrong type or
    a number that is not finite prints as ``unreadable`` / ``unknown``, a record that does not read as
    ``unreadable record <id>: <reason>``; never raises. Every string from telemetry goes through :func:`printable`.
    """
    try:
        if not isinstance(record, FailureRecord):
            try:
                record = from_json(record)
            except UnreadableRecord as exc:
                return f"unreadable record {record_id(record)}: {printable(str(exc))}\n"
            except Exception as exc:  # noqa: BLE001 - e.g. a mapping whose methods fail
                return f"unreadable record {record_id(None)}: {printable(type(exc).__name__)}\n"
        return "\n".join(failure_lines(record, versions)) + "\n"
    except Exception as exc:  # noqa: BLE001 - a hand-built record with a field no check foresaw
        return f"unreadable record {record_id(record)}: {printable(type(exc).__name__)} while formatting\n"
