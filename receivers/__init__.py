"""Receivers: one folder per component (otlp, nvml, nic, xid, ...); installed as ``otel_gpu.receivers``."""
