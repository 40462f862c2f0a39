"""GPU health metrics and XID events (receivers: nvml, xid). hw.* semantic conventions where they exist."""
from __future__ import annotations
