"""NIC / InfiniBand / Ethernet health metrics (receiver: nic)."""
from __future__ import annotations
