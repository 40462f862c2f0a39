"""``health_check`` extension: an HTTP liveness/readiness endpoint, as the OpenTelemetry Collector's.

``GET http://127.0.0.1:13133/`` answers 200 ``{"status":"Server available","upSince":"...","uptime":"..."}`` while
the collector's pipelines run, 503 ``{"status":"Server not available",...}`` while it starts or shuts down::

    extensions:
      health_check:               # endpoint 127.0.0.1:13133, path /
    service:
      extensions: [health_check]
      pipelines: ...
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.extensions.health_check.config import HealthCheckConfig
from otel_gpu.extensions.health_check.extension import HealthCheckExtension

__all__ = ["FACTORY", "HealthCheckConfig", "HealthCheckExtension"]

FACTORY = ComponentFactory("health_check", "extension", HealthCheckConfig, HealthCheckExtension,
                           description="HTTP health endpoint (200 while the pipelines run, else 503).")
