"""Processors: one folder per component (attribution, goodput, ...); installed as ``otel_gpu.processors``."""
