"""Settings of the ``nic`` receiver."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NicReceiverConfig", "DEFAULT_EXCLUDE", "DEFAULT_HW_COUNTERS"]

#: Virtual interfaces nobody wants as NIC health (globs).
DEFAULT_EXCLUDE = ["lo", "veth*", "docker*", "br-*", "virbr*", "cni*", "flannel*", "cali*", "vxlan*", "tun*", "tap*"]
#: The hw_counters (mlx5) that tell about RDMA trouble; ``["*"]`` reads them all.
DEFAULT_HW_COUNTERS = ["out_of_buffer", "out_of_sequence", "packet_seq_err", "local_ack_timeout_err",
                       "rnr_nak_retry_err", "implied_nak_seq_err", "duplicate_request", "req_cqe_error",
                       "resp_cqe_error", "rx_icrc_encapsulated"]


@dataclass
class NicReceiverConfig:
    """``receivers.nic`` settings.

    Attributes:
        sysfs_root: where sysfs is mounted (in tests, a fake tree that ``FakeSysfs`` of the testing package writes).
        interval_s: seconds between polls; rates are per second over the last interval.
        infiniband: read ``class/infiniband/*/ports/*``.
        ethernet: read ``class/net/*``.
        ib_devices: HCA names to read (globs); empty: all.
        interfaces: network interfaces to read (globs); empty: all but ``exclude_interfaces``.
        exclude_interfaces: interfaces never read (globs).
        hw_counters: ``ports/N/hw_counters`` files to read; ``["*"]``: all; ``[]``: none.
        rescan_interval_s: seconds between looks for new devices and ports.
        host_name: the host.name resource attribute; empty: this machine's host name.
    """

    sysfs_root: str = "/sys"
    interval_s: float = 1.0
    infiniband: bool = True
    ethernet: bool = True
    ib_devices: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)
    exclude_interfaces: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    hw_counters: list[str] = field(default_factory=lambda: list(DEFAULT_HW_COUNTERS))
    rescan_interval_s: float = 30.0
    host_name: str = ""

    def validate(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0 (got {self.interval_s})")
        if not self.rescan_interval_s > 0:
            raise ValueError(f"rescan_interval_s must be > 0 (got {self.rescan_interval_s})")
        if not self.sysfs_root:
            raise ValueError("sysfs_root must not be empty (the default is /sys)")
        if not (self.infiniband or self.ethernet):
            raise ValueError("infiniband: and ethernet: are both false; enable one (or remove the receiver)")
