"""NIC / InfiniBand / Ethernet health metrics (receiver: nic). hw.network.* semantic conventions where they exist.

One name for InfiniBand ports and network interfaces alike (``nic.kind`` tells them apart): ``hw.network.io``,
``hw.network.packets``, ``hw.network.up``, ``hw.network.bandwidth.limit`` and ``hw.errors`` (``hw.type`` =
``network``, ``error.type`` = the sysfs counter) are the semantic conventions'; what they lack (per-second rates,
InfiniBand port states and vendor hw_counters) is otel-gpu's own, under ``otel_gpu.nic.*``.

Counters from sysfs are reported twice: as a monotonic sum that survives counter resets (the receiver adds up the
increments it saw, so a reset or wrap never makes it go down), and as a per-second rate over the last poll interval
(absent for the interval in which a counter reset).

Example:
    >>> from otel_gpu.schema import nic
    >>> nic.IO.name, nic.IO.unit, nic.IO.prometheus_name
    ('hw.network.io', 'By', 'hw_network_io_bytes_total')
    >>> nic.PACKETS_RATE.prometheus_name
    'otel_gpu_nic_packets_rate_per_second'
"""
from __future__ import annotations

from otel_gpu.schema._model import MetricType, attr, metric
from otel_gpu.schema.gpu import ERROR_TYPE, HW_ERRORS, NETWORK_IO_DIRECTION, NIC_KIND, NIC_PORT, NIC_PORT_GUID
from otel_gpu.schema.identity import HW_ID, HW_NAME, HW_TYPE

_G = "NIC health"
_GA = "NIC health attributes"

#: The device (mlx5_0) or interface (eth0): the semantic conventions' hw.name.
DEVICE = HW_NAME
PORT = NIC_PORT
KIND = NIC_KIND
PORT_GUID = NIC_PORT_GUID
COUNTER = attr("nic.counter", "string", "The vendor counter file under ports/N/hw_counters (out_of_buffer, "
               "local_ack_timeout_err, ...).", group=_GA)

#: Identity of every NIC data point: hw.id (mlx5_0:1 or eth0), hw.name (mlx5_0 or eth0), nic.port (InfiniBand
#: only), nic.kind, hw.type = network.
NIC_ATTRS = (HW_ID, HW_NAME, PORT, KIND, HW_TYPE, PORT_GUID)

# -- semantic conventions -----------------------------------------------------------------------------------------
IO = metric("hw.network.io", MetricType.COUNTER, "By", "Received and transmitted network traffic in bytes: "
            "InfiniBand port_{xmit,rcv}_data x 4 (the counters count 4-byte words), statistics/{tx,rx}_bytes of an "
            "interface.", group=_G, attributes=NIC_ATTRS + (NETWORK_IO_DIRECTION,), semconv=True)
PACKETS = metric("hw.network.packets", MetricType.COUNTER, "{packet}", "Received and transmitted network traffic "
                 "in packets (or frames).", group=_G, attributes=NIC_ATTRS + (NETWORK_IO_DIRECTION,), semconv=True)
UP = metric("hw.network.up", MetricType.UPDOWN, "1", "Link status: 1 (up) or 0 (down); an InfiniBand port is up "
            "when ACTIVE and LinkUp, an interface when operstate is up and carrier is 1.", group=_G,
            attributes=NIC_ATTRS, semconv=True)
BANDWIDTH_LIMIT = metric("hw.network.bandwidth.limit", MetricType.UPDOWN, "By/s", "Link speed: an InfiniBand port's "
                         "rate file, an interface's speed file (Mb/s, converted); absent when the kernel reports "
                         "none.", group=_G, attributes=NIC_ATTRS, semconv=True)
#: hw.errors (defined with the GPU metrics: one metric for every hw.type) with hw.type = network.
ERRORS = HW_ERRORS
NIC_ERROR_ATTRS = NIC_ATTRS + (ERROR_TYPE,)

# -- otel-gpu's own -----------------------------------------------------------------------------------------------
IO_RATE = metric("otel_gpu.nic.io.rate", MetricType.GAUGE, "By/s", "Bytes per second through the port or "
                 "interface over the last poll interval.", group=_G, attributes=NIC_ATTRS + (NETWORK_IO_DIRECTION,))
PACKETS_RATE = metric("otel_gpu.nic.packets.rate", MetricType.GAUGE, "{packet}/s", "Packets per second.", group=_G,
                      attributes=NIC_ATTRS + (NETWORK_IO_DIRECTION,))
ERRORS_RATE = metric("otel_gpu.nic.errors.rate", MetricType.GAUGE, "{error}/s", "The hw.errors counters of a port "
                     "or interface, per second.", group=_G, attributes=NIC_ERROR_ATTRS)
IB_HW_COUNTERS = metric("otel_gpu.nic.ib.hw_counters", MetricType.COUNTER, "{event}",
                        "Vendor counters from ports/N/hw_counters (e.g. out_of_buffer, local_ack_timeout_err).",
                        group=_G, attributes=NIC_ATTRS + (COUNTER,))
IB_HW_COUNTERS_RATE = metric("otel_gpu.nic.ib.hw_counters.rate", MetricType.GAUGE, "{event}/s",
                             "Vendor hw_counters, per second.", group=_G, attributes=NIC_ATTRS + (COUNTER,))
IB_STATE = metric("otel_gpu.nic.ib.port.state", MetricType.GAUGE, "{state}",
                  "Logical port state id (1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER).", group=_G,
                  attributes=NIC_ATTRS)
IB_PHYS_STATE = metric("otel_gpu.nic.ib.port.phys_state", MetricType.GAUGE, "{state}",
                       "Physical port state id (2 Polling, 3 Disabled, 5 LinkUp, 6 LinkErrorRecovery, ...).",
                       group=_G, attributes=NIC_ATTRS)

# Per-kind names of the metrics InfiniBand ports and interfaces now share (readers that tell them apart by nic.kind).
IB_IO = ETH_IO = IO
IB_IO_RATE = ETH_IO_RATE = IO_RATE
IB_PACKETS = ETH_PACKETS = PACKETS
IB_PACKETS_RATE = ETH_PACKETS_RATE = PACKETS_RATE
IB_ERRORS = ETH_ERRORS = ERRORS
IB_ERRORS_RATE = ETH_ERRORS_RATE = ERRORS_RATE
IB_UP = ETH_UP = UP
IB_RATE = ETH_SPEED = BANDWIDTH_LIMIT

#: Every metric the nic receiver emits, in order (for docs and tests).
METRICS = (IO, PACKETS, ERRORS, UP, BANDWIDTH_LIMIT, IO_RATE, PACKETS_RATE, ERRORS_RATE, IB_HW_COUNTERS,
           IB_HW_COUNTERS_RATE, IB_STATE, IB_PHYS_STATE)
