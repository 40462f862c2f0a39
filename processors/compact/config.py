"""Settings of the ``compact`` processor, with their defaults.

Example:
    >>> from otel_gpu.config import build
    >>> cfg = build(CompactConfig, {"job_id": "llama-7b-run3"}, "processors.compact")
    >>> cfg.job_id, "otel_gpu.collective" in cfg.spans
    ('llama-7b-run3', False)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from otel_gpu.schema import gpu as G
from otel_gpu.schema import health as H
from otel_gpu.schema import nic as N
from otel_gpu.schema import training as T

__all__ = ["CompactConfig", "DEFAULT_EVENTS", "DEFAULT_METRICS", "DEFAULT_NIC_COUNTERS", "DEFAULT_SPANS"]

#: What cross-rank attribution and goodput read from logs: heartbeats, stacks, exceptions, signals, exits, XIDs;
#: the health processor's device state changes (rare), so that the aggregator's store keeps the node's verdicts; and
#: ``otel-gpu run``'s restart decisions (a job's decisions are recorded once, by the node whose proposal won).
DEFAULT_EVENTS = (T.PROGRESS_EVENT.name, T.STACKS_EVENT.name, T.EXCEPTION_EVENT.name, T.SIGNAL_EVENT.name,
                  T.EXIT_EVENT.name, T.STATE_EVENT.name, G.XID_EVENT.name, H.STATE_CHANGE_EVENT.name,
                  T.RESTART_EVENT.name)
#: Step, data-wait and checkpoint spans (one per rank per step at most); never the per-collective spans.
DEFAULT_SPANS = (T.STEP_SPAN.name, T.DATA_SPAN.name, T.CKPT_SAVE_SPAN.name, T.CKPT_LOAD_SPAN.name)
#: The hardware evidence attribution uses (XID, ECC, row remap, NVLink, PCIe replay, throttling, process-to-GPU
#: map, NIC errors and link state) and the per-rank step duration; not utilisation, power, clocks or byte rates.
#: (hw.errors carries both the GPUs' ECC errors and the NICs' error counters.)
DEFAULT_METRICS = (G.XID_ERRORS.name, G.HW_ERRORS.name, G.REMAP_FAILURE.name, G.NVLINK_ERRORS.name,
                   G.PCIE_REPLAY.name, G.CLOCK_EVENT_ACTIVE.name, G.PROCESS_MEMORY.name, N.UP.name,
                   T.STEP_DURATION.name)

#: The NIC error counters (hw.errors points of a port) the aggregator's processors read: attribution's link and error
#: rules and the health processor's port trends. A port reports two dozen; the others (congestion waits, discards,
#: VL15 drops, ...) climb on a busy fabric every poll, which made the whole metric "changed" and forwarded every
#: second to be decoded again at the aggregator. tests/test_compact.py checks this covers what both processors read.
DEFAULT_NIC_COUNTERS = ("link_downed", "symbol_error", "link_error_recovery", "port_rcv_errors",
                        "local_link_integrity_errors", "port_rcv_remote_physical_errors",
                        "excessive_buffer_overrun_errors", "rx_errors", "tx_errors", "rx_crc_errors", "rx_frame_errors",
                        "tx_carrier_errors")


@dataclass
class CompactConfig:
    """What a node sidecar forwards to its job's aggregator.

    Attributes:
        job_id: ``training.job.id`` stamped on node signals that carry none (GPU, NIC and XID records). Empty: the
            job ids the training processes on this node reported within ``job_idle_s`` (usually one job per node).
        job_idle_s: how long a job learned from its training processes stays this node's job after its last record.
        events: log records kept, by event name.
        spans: spans kept, by name.
        metrics: metrics kept, by name.
        metrics_refresh_s: a kept metric whose points are unchanged since it was last forwarded (timestamps aside) is
            forwarded again only after this long. Healthy GPUs and links report the same counters, flags and states
            every poll; the aggregator needs the changes (a counter rising, a throttle flag, a link going down) and a
            periodic refresh. 0: forward every poll.
        nic_counters: the NIC error counters (``error.type`` of a port's hw.errors points) forwarded; a port's other
            counters stay on the node's backend path. Empty: every counter.
        identity_only_metrics: metrics whose values do not matter to the aggregator, only which points exist (the
            per-process GPU memory maps processes to GPUs): a new value alone is not a change.
        batch_interval_s: what is kept is merged into one request per signal and sent at most this often (or when
            ``batch_max_items`` is reached): every rank of a node exports on its own, and each request costs the
            aggregator's gRPC server about 0.3 ms whatever its size (docs/scale.md). 0: pass each batch on at once.
        batch_max_items: spans, log records or metrics that make a merged request go at once.
        digests: instead of every rank's heartbeats and step spans, one ``otel_gpu.node.digest`` record per job per
            ``batch_interval_s`` (``processors/compact/_digest.py``); a rank's exceptions, signals, exits,
            checkpoint spans and (unless it waits in a collective) stacks still go on their own. Off by default:
            the aggregator then gets the step spans of every rank, which some backends behind it want.
        digest_refresh_s: every rank's identity is in a digest at least this often (an aggregator that restarted
            learns the ranks again); new ranks' at once.
    """

    job_id: str | None = None  # None or "": learn it (``${env:OTEL_GPU_JOB_ID:-}`` expands to null)
    job_idle_s: float = 120.0
    events: list[str] = field(default_factory=lambda: list(DEFAULT_EVENTS))
    spans: list[str] = field(default_factory=lambda: list(DEFAULT_SPANS))
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    metrics_refresh_s: float = 30.0
    nic_counters: list[str] = field(default_factory=lambda: list(DEFAULT_NIC_COUNTERS))
    identity_only_metrics: list[str] = field(default_factory=lambda: [G.PROCESS_MEMORY.name])
    batch_interval_s: float = 1.0
    batch_max_items: int = 2000
    digests: bool = False
    digest_refresh_s: float = 30.0

    def validate(self) -> None:
        if not self.job_idle_s > 0:
            raise ValueError(f"job_idle_s must be > 0 (got {self.job_idle_s})")
        if self.batch_interval_s < 0 or self.batch_interval_s > 10:
            raise ValueError(f"batch_interval_s must be within 0..10 (got {self.batch_interval_s})")
        if self.batch_max_items < 1:
            raise ValueError(f"batch_max_items must be >= 1 (got {self.batch_max_items})")
        if self.digests and self.batch_interval_s <= 0:
            raise ValueError("digests need batch_interval_s > 0: a digest goes out every batch_interval_s (got 0)")
        if self.digest_refresh_s <= 0:
            raise ValueError(f"digest_refresh_s must be > 0 (got {self.digest_refresh_s})")
        if self.metrics_refresh_s < 0:
            raise ValueError(f"metrics_refresh_s must be >= 0 (got {self.metrics_refresh_s})")
        for key in ("events", "spans", "metrics"):
            if any(not name for name in getattr(self, key)):
                raise ValueError(f"{key} must not contain empty names")
