"""Client of the collector's verdict API (``GET /api/v1/failures?job_id=``, served by the ``verdict`` exporter)."""
from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from otel_gpu.failure import FailureRecord, UnreadableRecord, from_json, record_id

__all__ = ["Refused", "VerdictClient", "VerdictUnavailable", "Verdicts", "default_url", "latest_versions"]

DEFAULT_PORT = 4319  # otel_gpu.exporters.verdict.DEFAULT_PORT (not imported: run never loads the collector)


class VerdictUnavailable(RuntimeError):
    """The verdict API did not answer (no collector, wrong port, refused, bad token)."""


class Refused(ValueError):
    """The jobs API did not take a registration or a proposed decision (its reason as the message)."""


def default_url(otlp_endpoint: str | None) -> str:
    """``OTEL_GPU_VERDICT_ENDPOINT``, else the OTLP endpoint's host on port 4319, else 127.0.0.1:4319.

    >>> default_url("http://10.0.0.5:4317")
    'http://10.0.0.5:4319'
    >>> default_url(None)
    'http://127.0.0.1:4319'
    """
    env = os.environ.get("OTEL_GPU_VERDICT_ENDPOINT", "").strip()
    if env:
        return env.rstrip("/")
    endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://127.0.0.1:4317"
    url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    host = url.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"{url.scheme or 'http'}://{host}:{DEFAULT_PORT}"


class Verdicts(list):
    """``list[FailureRecord]``, each read with :func:`otel_gpu.failure.from_json`; ``unreadable``: ``(id,
    reason)`` of each record the collector served that does not read (never acted on)."""

    def __init__(self, records=(), unreadable=()):
        super().__init__(records)
        self.unreadable: list[tuple[str, str]] = list(unreadable)


def latest_versions(records: list[FailureRecord]) -> list[FailureRecord]:
    """The highest version of each failure_id (a later version supersedes); withdrawn ones left out.

    >>> def r(fid, version, withdrawn=False):
    ...     return from_json({"failure_id": fid, "version": version, "withdrawn": withdrawn, "kind": "hang",
    ...                       "root_cause": "unknown", "job_id": "j", "onset_time": 1, "detected_time": 2,
    ...                       "confidence": 1})
    >>> [(x.failure_id, x.version) for x in latest_versions([r("a", 1), r("a", 2, True), r("b", 1)])]
    [('b', 1)]
    """
    best: dict[str, FailureRecord] = {}
    for i, record in enumerate(records):
        key = record.failure_id or f"#{i}"
        if key not in best or record.version >= best[key].version:
            best[key] = record
    return [r for r in best.values() if not r.withdrawn]


class VerdictClient:
    def __init__(self, url: str, token: str | None = None, ca_file: str = "", timeout_s: float = 2.0):
        if "://" not in url:
            url = f"http://{url}"
        if not url.startswith(("http://", "https://")):  # urllib would also open file:// and ftp://
            raise ValueError(f"--verdict-url must be an http:// or https:// URL (got {url!r})")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._ssl = ssl.create_default_context(cafile=ca_file or None) if self.url.startswith("https") else None

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """GET ``path`` (POST ``body`` as JSON when given). Raises VerdictUnavailable; :class:`Refused` for a
        request the API answered 400/404/409 (its message says why)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,  # noqa: S310 - http(s) only
                                     headers={"Accept": "application/json", "Content-Type": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:  # noqa: S310
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code in (400, 404, 409) and body is not None:
                try:
                    why = json.loads(exc.read()).get("error")
                except (OSError, ValueError, AttributeError):
                    why = None
                raise Refused(str(why or f"HTTP {exc.code}")[:500]) from None
            hint = " (check the bearer token)" if exc.code == 401 else ""
            raise VerdictUnavailable(f"{self.url}{path.split('?')[0]}: HTTP {exc.code}{hint}") from None
        except (OSError, ValueError) as exc:
            raise VerdictUnavailable(f"{self.url}: {getattr(exc, 'reason', None) or exc}") from None

    def healthy(self) -> bool:
        try:
            return self._request("/health").get("status") == "ok"
        except VerdictUnavailable:
            return False

    def failures(self, job_id: str, since: float | None = None) -> Verdicts:
        """The job's failures (latest version each, withdrawn left out), newest first, read typed; a record that
        does not read is left out and listed in ``unreadable``. Raises VerdictUnavailable."""
        query = {"job_id": job_id}
        if since is not None:
            query["since"] = f"{since:.3f}"
        body = self._request("/api/v1/failures?" + urllib.parse.urlencode(query))
        records = body.get("failures") if isinstance(body, dict) else None
        if not isinstance(records, list):
            raise VerdictUnavailable(f"{self.url}: not a failures answer")
        typed, unreadable = [], []
        for i, raw in enumerate(records):
            try:
                record = from_json(raw)
            except UnreadableRecord as exc:
                unreadable.append((record_id(raw, f"#{i}"), str(exc)))
                continue
            if record.job_id == job_id:  # another job's record is no verdict on this one
                typed.append(record)
        return Verdicts(latest_versions(typed), unreadable)

    def devices(self, state: str = "drain", hosts: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """The devices whose latest health state is ``state`` (on ``hosts``; all when empty). Raises
        VerdictUnavailable (also for a collector too old to serve /api/v1/devices: HTTP 404)."""
        query = {"state": state}
        if hosts:
            query["host"] = ",".join(sorted(hosts))
        body = self._request("/api/v1/devices?" + urllib.parse.urlencode(query))
        records = body.get("devices") if isinstance(body, dict) else None
        if not isinstance(records, list):
            raise VerdictUnavailable(f"{self.url}: not a devices answer")
        return [r for r in records if isinstance(r, dict) and isinstance(r.get("device_id"), str)
                and r.get("state") == state]

    # -- many nodes (otel_gpu.exporters.verdict.jobs) -------------------------------------------------------------
    def register(self, job_id: str, host: str, rdzv_host: str, nnodes: int, min_nodes: int,
                 rdzv_endpoint_host: str | None, generation: int | None = None,
                 was: str | None = None, serves_rdzv: bool = False) -> dict[str, Any]:
        """Joins ``host`` to the job's board; the job's state with this host's ``role``. ``generation`` / ``was``:
        registering again with a board that forgot the job (the aggregator restarted). Raises VerdictUnavailable
        (also for a collector without the jobs API: HTTP 404/405) or Refused."""
        body: dict[str, Any] = {"job_id": job_id, "host": host, "rdzv_host": rdzv_host, "nnodes": nnodes,
                                "min_nodes": min_nodes, "rdzv_endpoint_host": rdzv_endpoint_host,
                                "serves_rdzv": serves_rdzv}
        if generation is not None:
            body.update(generation=generation, was=was)
        return self._dict(self._request("/api/v1/jobs/register", body))

    def job_state(self, job_id: str, host: str) -> dict[str, Any]:
        """The job's membership and decisions (asking also says this host is alive)."""
        return self._dict(self._request("/api/v1/jobs?" + urllib.parse.urlencode({"job_id": job_id, "host": host})))

    def propose(self, job_id: str, generation: int, decision: dict[str, Any]) -> dict[str, Any]:
        """Proposes the decision for ``generation``: ``{accepted, decision (the winner), state}``."""
        return self._dict(self._request("/api/v1/jobs/decisions", {"job_id": job_id, "generation": generation,
                                                                "decision": decision}))

    def _dict(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise VerdictUnavailable(f"{self.url}: not a jobs answer")
        return body
