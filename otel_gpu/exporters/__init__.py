"""Exporters: otlp (gRPC) and otlphttp to any backend, prometheus, store (embedded default), debug."""
