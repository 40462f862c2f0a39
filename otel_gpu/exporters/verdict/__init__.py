"""``verdict`` exporter: the collector's failures over HTTP (JSON), for ``otel-gpu run --restart auto``.

Put it in the logs pipeline after ``attribution``; it keeps, per job, the latest version of each failure record
(a later ``version`` of the same ``failure_id`` supersedes; a ``withdrawn`` one is left out) and serves:

- ``GET /api/v1/failures?job_id=ID`` -> ``{"failures": [...]}`` newest first: the same records as
  ``otel-gpu report --format json`` (docs/design.md section 3); ``&since=UNIX_S`` keeps those detected at or after it;
  ``&include_withdrawn=1`` keeps withdrawn ones; without ``job_id`` (every job) only with the token (``auth``; 403
  when none is configured). It serves only records this collector's processors or a trusted forwarder made
  (docs/security.md): forged ones never reach it;
- ``GET /api/v1/devices?state=drain|watch[&host=H1,H2]`` -> ``{"devices": [...]}``: the latest health state of each
  device (from the ``health`` processor's ``otel_gpu.device.state_change`` events), most recent change first;
- ``GET /health`` -> ``{"status": "ok"}`` (open, even with auth).

Loopback by default (127.0.0.1:4319), with the same bearer-token and TLS settings as the otlp receiver.

Example config::

    exporters:
      verdict:
        endpoint: 127.0.0.1:4319
        auth: {bearer_token_file: /etc/otel-gpu/token}
    service:
      pipelines:
        logs: {receivers: [otlp], processors: [attribution], exporters: [store, verdict]}
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.exporters.verdict.config import DEFAULT_PORT, VerdictExporterConfig
from otel_gpu.exporters.verdict.exporter import VerdictExporter
from otel_gpu.pdata import Signal

__all__ = ["DEFAULT_PORT", "FACTORY", "VerdictExporter", "VerdictExporterConfig"]

FACTORY = ComponentFactory("verdict", "exporter", VerdictExporterConfig, VerdictExporter, signals=(Signal.LOGS,),
                           description="Serves the attributed failures per job over HTTP (GET /api/v1/failures).")
