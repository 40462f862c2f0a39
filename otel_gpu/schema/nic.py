"""NIC / InfiniBand / Ethernet health metrics (receiver: nic).

Counters from sysfs are reported twice: as a monotonic sum that survives counter resets (the receiver adds up the
increments it saw, so a reset or wrap never makes it go down), and as a per-second rate over the last poll interval
(absent for the interval in which a counter reset).

Example:
    >>> from otel_gpu.schema import nic
    >>> nic.IB_IO.name, nic.IB_IO.unit
    ('nic.ib.io', 'By')
"""
from __future__ import annotations

from otel_gpu.schema._model import MetricType, attr, metric
from otel_gpu.schema.gpu import NETWORK_IO_DIRECTION
from otel_gpu.schema.identity import HW_TYPE

_G = "NIC health"
_GA = "NIC health attributes"

DEVICE = attr("nic.device", "string", "Device name: an InfiniBand HCA (mlx5_0) or a network interface (eth0).",
              group=_GA)
PORT = attr("nic.port", "int", "InfiniBand port number (1-based).", group=_GA)
COUNTER = attr("nic.counter", "string", "The sysfs counter file, e.g. symbol_error, link_downed, rx_crc_errors, "
               "or an hw_counters file (out_of_buffer, ...).", group=_GA)

IB_ATTRS = (DEVICE, PORT, HW_TYPE)
ETH_ATTRS = (DEVICE, HW_TYPE)

# -- InfiniBand ---------------------------------------------------------------------------------------------------
IB_IO = metric("nic.ib.io", MetricType.COUNTER, "By", "Bytes through the port (port_{xmit,rcv}_data x 4: the "
               "counters count 4-byte words).", group=_G, attributes=IB_ATTRS + (NETWORK_IO_DIRECTION,))
IB_IO_RATE = metric("nic.ib.io.rate", MetricType.GAUGE, "By/s", "Bytes per second through the port.", group=_G,
                    attributes=IB_ATTRS + (NETWORK_IO_DIRECTION,))
IB_PACKETS = metric("nic.ib.packets", MetricType.COUNTER, "{packet}", "Packets through the port.", group=_G,
                    attributes=IB_ATTRS + (NETWORK_IO_DIRECTION,))
IB_PACKETS_RATE = metric("nic.ib.packets.rate", MetricType.GAUGE, "{packet}/s", "Packets per second.", group=_G,
                         attributes=IB_ATTRS + (NETWORK_IO_DIRECTION,))
IB_ERRORS = metric("nic.ib.errors", MetricType.COUNTER, "{error}",
                   "Port error counters (symbol_error, link_downed, link_error_recovery, port_rcv_errors, "
                   "port_xmit_discards, local_link_integrity_errors, excessive_buffer_overrun_errors, port_xmit_wait, "
                   "...), one series per nic.counter.", group=_G, attributes=IB_ATTRS + (COUNTER,))
IB_ERRORS_RATE = metric("nic.ib.errors.rate", MetricType.GAUGE, "{error}/s", "Port error counters, per second.",
                        group=_G, attributes=IB_ATTRS + (COUNTER,))
IB_HW_COUNTERS = metric("nic.ib.hw_counters", MetricType.COUNTER, "{event}",
                        "Vendor counters from ports/N/hw_counters (e.g. out_of_buffer, local_ack_timeout_err).",
                        group=_G, attributes=IB_ATTRS + (COUNTER,))
IB_HW_COUNTERS_RATE = metric("nic.ib.hw_counters.rate", MetricType.GAUGE, "{event}/s",
                             "Vendor hw_counters, per second.", group=_G, attributes=IB_ATTRS + (COUNTER,))
IB_STATE = metric("nic.ib.port.state", MetricType.GAUGE, "{state}",
                  "Logical port state id (1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER).", group=_G,
                  attributes=IB_ATTRS)
IB_PHYS_STATE = metric("nic.ib.port.phys_state", MetricType.GAUGE, "{state}",
                       "Physical port state id (2 Polling, 3 Disabled, 5 LinkUp, 6 LinkErrorRecovery, ...).",
                       group=_G, attributes=IB_ATTRS)
IB_UP = metric("nic.ib.port.up", MetricType.GAUGE, "{flag}", "1 when the port is ACTIVE and LinkUp, else 0.",
               group=_G, attributes=IB_ATTRS)
IB_RATE = metric("nic.ib.port.rate", MetricType.GAUGE, "By/s", "Link rate from the port's rate file.", group=_G,
                 attributes=IB_ATTRS)

# -- Ethernet / RoCE ----------------------------------------------------------------------------------------------
ETH_IO = metric("nic.eth.io", MetricType.COUNTER, "By", "Bytes through the interface (statistics/{rx,tx}_bytes).",
                group=_G, attributes=ETH_ATTRS + (NETWORK_IO_DIRECTION,))
ETH_IO_RATE = metric("nic.eth.io.rate", MetricType.GAUGE, "By/s", "Bytes per second through the interface.",
                     group=_G, attributes=ETH_ATTRS + (NETWORK_IO_DIRECTION,))
ETH_PACKETS = metric("nic.eth.packets", MetricType.COUNTER, "{packet}", "Packets through the interface.", group=_G,
                     attributes=ETH_ATTRS + (NETWORK_IO_DIRECTION,))
ETH_PACKETS_RATE = metric("nic.eth.packets.rate", MetricType.GAUGE, "{packet}/s", "Packets per second.", group=_G,
                          attributes=ETH_ATTRS + (NETWORK_IO_DIRECTION,))
ETH_ERRORS = metric("nic.eth.errors", MetricType.COUNTER, "{error}",
                    "Error and drop counters (rx_errors, tx_errors, rx_dropped, tx_dropped, rx_crc_errors, "
                    "carrier_changes, ...), one series per nic.counter.", group=_G, attributes=ETH_ATTRS + (COUNTER,))
ETH_ERRORS_RATE = metric("nic.eth.errors.rate", MetricType.GAUGE, "{error}/s", "Error counters, per second.",
                         group=_G, attributes=ETH_ATTRS + (COUNTER,))
ETH_UP = metric("nic.eth.up", MetricType.GAUGE, "{flag}", "1 when operstate is up and carrier is 1, else 0.",
                group=_G, attributes=ETH_ATTRS)
ETH_SPEED = metric("nic.eth.speed", MetricType.GAUGE, "By/s", "Link speed (the speed file, Mb/s, converted); absent "
                   "when the kernel reports none.", group=_G, attributes=ETH_ATTRS)
