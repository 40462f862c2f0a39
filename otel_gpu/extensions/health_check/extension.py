"""The ``health_check`` HTTP endpoint."""
from __future__ import annotations

import datetime as _dt
import json
import logging
import time

from otel_gpu.collector.httpserver import HttpEndpoint, Response
from otel_gpu.collector.security import BearerChecker, server_ssl_context
from otel_gpu.component import COMPONENT_STATUS, READY, Extension
from otel_gpu.config import format_duration
from otel_gpu.extensions.health_check.config import HealthCheckConfig

__all__ = ["HealthCheckExtension"]

_logger = logging.getLogger(__name__)


class HealthCheckExtension(Extension):
    """Healthy while ``host.services.get(READY)()`` says the pipelines run (always, outside a collector)."""

    config: HealthCheckConfig

    def __init__(self, config: HealthCheckConfig, host):
        super().__init__(config, host)
        self._endpoint: HttpEndpoint | None = None
        self._up_since = _dt.datetime.now(_dt.timezone.utc)
        self._t0 = time.monotonic()

    @property
    def port(self) -> int:
        return self._endpoint.port if self._endpoint is not None else 0

    def _healthy(self) -> bool:
        ready = self.host.services.get(READY)
        return True if ready is None else bool(ready())

    def _handle(self, method: str, path: str) -> Response:
        if path != self.config.path:
            return 404, "text/plain; charset=utf-8", f"not found: the health check is at {self.config.path}\n".encode()
        healthy = self._healthy()
        status = 200 if healthy else 503
        custom = self.config.response_body
        if custom is not None and (custom.healthy if healthy else custom.unhealthy):
            return status, "text/plain; charset=utf-8", (custom.healthy if healthy else custom.unhealthy).encode()
        body = {"status": "Server available" if healthy else "Server not available",
                "upSince": self._up_since.isoformat().replace("+00:00", "Z"),
                "uptime": format_duration(round(time.monotonic() - self._t0, 3))}
        # A component that runs degraded (a store that cannot write) leaves the collector available (a restart would
        # not mend a full disk) and is named here: {"components": {"exporters.store": {"status": "degraded", ...}}}.
        degraded = {}
        for component_status in self.host.services.get(COMPONENT_STATUS):
            try:
                name, why = component_status()
            except Exception:  # noqa: BLE001 - a broken status never breaks the health check
                continue
            if why is not None:
                degraded[name] = why
        if degraded:
            body["components"] = {name: {"status": "degraded", "error": why} for name, why in sorted(degraded.items())}
        return status, "application/json", json.dumps(body).encode()

    def start(self) -> None:
        host, _, port = self.config.endpoint.rpartition(":")
        host = host.strip("[]")
        cfg = self.config
        authorize = BearerChecker(cfg.auth, "auth.bearer_token").check if cfg.auth is not None else None
        ssl_context = server_ssl_context(cfg.tls, "tls") if cfg.tls is not None else None
        try:
            self._endpoint = HttpEndpoint(host, int(port), self._handle, f"otel-gpu-{self.host.component_id}",
                                          ssl_context=ssl_context, max_connections=cfg.max_connections,
                                          authorize=authorize)
        except OSError as exc:
            raise OSError(f"cannot listen on {self.config.endpoint}: {exc.strerror or exc}; set extensions."
                          f"{self.host.component_id}.endpoint to a free port") from None
        self._endpoint.start()
        _logger.info("%s: health check on %s://%s:%d%s%s", self.host.component_id, "https" if ssl_context else "http",
                     host, self.port, self.config.path, " (bearer-token auth)" if authorize else "")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.stop(timeout_s)
