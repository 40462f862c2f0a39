"""The ``verdict`` exporter: keeps the latest version of each failure per job and serves them over HTTP."""
from __future__ import annotations

import collections
import ipaddress
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from otel_gpu.collector import httpserver
from otel_gpu.collector.security import BearerChecker, server_ssl_context
from otel_gpu.component import ComponentHost, Exporter, ExportResult
from otel_gpu.exporters.verdict.config import VerdictExporterConfig, parse_endpoint
from otel_gpu.exporters.verdict.jobs import JobBoard, Refused
from otel_gpu.pdata import Batch, Signal, body_object, event_name, log_records
from otel_gpu.schema import failure as failure_schema
from otel_gpu.schema import health as health_schema

__all__ = ["VerdictExporter", "failure_key"]

_logger = logging.getLogger(__name__)
_FAILURE = failure_schema.FAILURE_EVENT.name
_STATE_CHANGE = health_schema.STATE_CHANGE_EVENT.name
_PATH = "/api/v1/failures"
_DEVICES_PATH = "/api/v1/devices"
_DEVICE_FIELDS = ("device_id", "kind", "host", "uuid", "gpu_index", "state", "since", "time", "evidence")
_STATES = ("healthy", "watch", "drain")
_JOBS_PATH = "/api/v1/jobs"
_REGISTER_PATH = "/api/v1/jobs/register"
_DECISIONS_PATH = "/api/v1/jobs/decisions"
_MAX_BODY = 64 * 1024


def failure_key(record: dict[str, Any]) -> str:
    """The identity of a failure across its revisions: ``failure_id``, else (older engines) kind, cause and onset."""
    fid = record.get("failure_id")
    if fid not in (None, ""):
        return str(fid)
    return f"{record.get('kind')}|{record.get('root_cause')}|{record.get('onset_time')}|{record.get('signature')}"


def _number(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def _version(record: dict[str, Any]) -> float:
    return _number(record.get("version"))


def _detected(record: dict[str, Any]) -> float:
    return _number(record.get("detected_time"))


class _JobFailures:
    __slots__ = ("by_key", "updated")

    def __init__(self) -> None:
        self.by_key: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.updated = 0.0


class VerdictExporter(Exporter):
    """``export()`` parses failure and device-state events under a lock (no I/O); the collector's shared HTTP(S)
    server (:mod:`otel_gpu.collector.httpserver`: TLS per connection, bounded connections and read timeouts) answers."""

    def __init__(self, config: VerdictExporterConfig, host: ComponentHost):
        super().__init__(config, host)
        self._jobs: collections.OrderedDict[str, _JobFailures] = collections.OrderedDict()
        #: The latest state per device id (from otel_gpu.device.state_change), least recently changed first.
        self._devices: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._server: httpserver.ThreadedHttpServer | None = None
        self._auth: BearerChecker | None = None
        #: Many-node jobs: membership and one decision per failure (otel_gpu.exporters.verdict.jobs).
        self.board = JobBoard(config.max_jobs)

    # -- pipeline side -------------------------------------------------------------------------------------------
    def export(self, batch: Batch) -> ExportResult:
        if batch.signal is not Signal.LOGS:
            return ExportResult.SUCCESS
        for _, _, record in log_records(batch.message):
            name = event_name(record)
            if name not in (_FAILURE, _STATE_CHANGE):
                continue
            body = body_object(record)
            if body is None:
                continue
            if name == _STATE_CHANGE:
                self.add_device_state(body)
            elif isinstance(body.get("job_id"), str) and body["job_id"]:
                self.add(body)
        return ExportResult.SUCCESS

    def add(self, record: dict[str, Any]) -> None:
        """Keeps ``record`` unless a newer version of the same failure is already here."""
        job_id, key = record["job_id"], failure_key(record)
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                if len(self._jobs) >= self.config.max_jobs:
                    self._jobs.popitem(last=False)
                job = self._jobs[job_id] = _JobFailures()
            self._jobs.move_to_end(job_id)
            known = job.by_key.get(key)
            if known is not None and _version(known) > _version(record):
                return
            job.by_key[key] = record
            job.by_key.move_to_end(key)
            job.updated = time.time()
            while len(job.by_key) > self.config.max_failures_per_job:
                job.by_key.popitem(last=False)

    def add_device_state(self, body: dict[str, Any]) -> None:
        """Keeps the latest state of the device (a later ``time`` supersedes); bounded by ``max_devices``."""
        device = body.get("device_id")
        if not isinstance(device, str) or not device or body.get("state") not in _STATES:
            return
        record = {k: body.get(k) for k in _DEVICE_FIELDS}
        with self._lock:
            known = self._devices.get(device)
            if known is not None and _number(known.get("time")) > _number(record.get("time")):
                return
            self._devices[device] = record
            self._devices.move_to_end(device)
            while len(self._devices) > self.config.max_devices:
                self._devices.popitem(last=False)

    def devices(self, states: tuple[str, ...] = ("watch", "drain"),
                hosts: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """The devices whose latest state is one of ``states`` (on ``hosts``, if given), most recent change first."""
        with self._lock:
            records = [dict(r) for r in self._devices.values()]
        return [r for r in reversed(records) if r.get("state") in states and (not hosts or r.get("host") in hosts)]

    def failures(self, job_id: str | None, since: float | None = None,
                 include_withdrawn: bool = False) -> list[dict[str, Any]]:
        """The latest version of each failure (of one job, or all), newest detection first."""
        with self._lock:
            jobs = [self._jobs[job_id]] if job_id is not None and job_id in self._jobs else (
                [] if job_id is not None else list(self._jobs.values()))
            records = [r for j in jobs for r in j.by_key.values()]
        if not include_withdrawn:
            records = [r for r in records if not r.get("withdrawn")]
        if since is not None:
            records = [r for r in records if _detected(r) >= since]
        return sorted(records, key=_detected, reverse=True)

    def job_failures(self, job_id: str) -> dict[str, dict[str, Any]]:
        """The job's failures this collector holds (latest versions), by failure_id: what a decision may cite."""
        return {str(r["failure_id"]): r for r in self.failures(job_id) if r.get("failure_id") not in (None, "")}

    def drained_hosts(self) -> set[str]:
        return {str(d["host"]) for d in self.devices(("drain",)) if isinstance(d.get("host"), str)}

    # -- HTTP side -----------------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server is not None else 0

    @property
    def url(self) -> str:
        return httpserver.url(self._server)

    def start(self) -> None:
        host, port = parse_endpoint(self.config.endpoint)
        if self.config.auth is not None:  # reads bearer_token_file now: a missing file fails start-up, naming it
            self._auth = BearerChecker(self.config.auth, "auth.bearer_token")
        exporter = self

        class Handler(_Handler):
            owner = exporter

        ssl_context = server_ssl_context(self.config.tls) if self.config.tls is not None else None
        try:
            self._server = httpserver.serve(host, port, Handler, ssl_context=ssl_context, what="verdict",
                                            thread_name=f"otel-gpu-verdict-{self.host.component_id}")
        except OSError as exc:
            hint = (f"port {port} is already in use (another collector?); set exporters.{self.host.component_id}"
                    ".endpoint to a free port") if port else "check the host address"
            raise RuntimeError(f"verdict exporter cannot listen on {self.config.endpoint}: {exc.strerror or exc}; "
                               f"{hint}") from None
        _logger.info("verdict exporter %s serving %s%s", self.host.component_id, self.url, _PATH)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            httpserver.stop(server, timeout_s)


class _Handler(BaseHTTPRequestHandler):
    owner: VerdictExporter
    server_version = "otel-gpu-verdict"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Requests are not logged (``run`` polls every second)."""

    def _send(self, status: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # http.server's name
        url = urlsplit(self.path)
        if url.path in ("/health", "/healthz"):
            self._send(200, {"status": "ok"})
            return
        auth = self.owner._auth
        if auth is not None and not auth.check(self.headers.get("Authorization")):
            self._send(401, {"error": "unauthorized: send Authorization: Bearer <token>"},
                       (("WWW-Authenticate", 'Bearer realm="otel-gpu"'),))
            return
        query = parse_qs(url.query)
        if url.path == _JOBS_PATH:
            job_id = (query.get("job_id") or [""])[0]
            host = (query.get("host") or [None])[0]
            state = self.owner.board.state(job_id, host) if job_id else None
            if state is None:
                self._send(404, {"error": f"unknown job {job_id[:80]!r}: its nodes register with POST "
                                          f"{_REGISTER_PATH}"})
            else:
                self._send(200, state)
            return
        if url.path == _DEVICES_PATH:
            states = tuple(s for v in query.get("state") or ["watch,drain"] for s in v.split(",") if s)
            bad = [s for s in states if s not in _STATES]
            if bad:
                self._send(400, {"error": f"state must be one of {', '.join(_STATES)} (got {bad[0]!r})"})
                return
            hosts = tuple(h for v in query.get("host") or [] for h in v.split(",") if h)
            self._send(200, {"devices": self.owner.devices(states, hosts)})
            return
        if url.path != _PATH:
            self._send(404, {"error": f"not found: try {_PATH}?job_id=ID, {_DEVICES_PATH}?state=drain or /health"})
            return
        job_id = (query.get("job_id") or [None])[0]
        if not job_id and auth is None:
            # Every job's failures (their hosts, ranks, causes) to whoever asks: only to a holder of the token.
            self._send(403, {"error": "listing every job's failures needs the token: ask with ?job_id=ID, or set "
                                      f"exporters.{self.owner.host.component_id}.auth (bearer_token_file) and send "
                                      "Authorization: Bearer <token>"})
            return
        since = None
        if query.get("since"):
            try:
                since = float(query["since"][0])
            except ValueError:
                self._send(400, {"error": f"since must be unix seconds (got {query['since'][0]!r})"})
                return
        withdrawn = (query.get("include_withdrawn") or ["0"])[0] in ("1", "true", "yes")
        self._send(200, {"failures": self.owner.failures(job_id or None, since, withdrawn)})

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        if url.path not in (_REGISTER_PATH, _DECISIONS_PATH):
            self._send(405, {"error": f"read-only API: use GET (POST only to {_REGISTER_PATH} and "
                                      f"{_DECISIONS_PATH})"}, (("Allow", "GET"),))
            return
        auth = self.owner._auth
        if auth is not None:
            if not auth.check(self.headers.get("Authorization")):
                self._send(401, {"error": "unauthorized: send Authorization: Bearer <token>"},
                           (("WWW-Authenticate", 'Bearer realm="otel-gpu"'),))
                return
        elif not _loopback(self.client_address[0]):
            # Without a token only this host may decide for a job (a listener on 0.0.0.0 without auth serves reads).
            self._send(403, {"error": "decisions need the token from another host: set exporters."
                                      f"{self.owner.host.component_id}.auth (bearer_token_file)"})
            return
        body = self._body()
        if body is None:
            return
        job_id = body.get("job_id")
        if not isinstance(job_id, str) or not job_id or len(job_id) > 256:
            self._send(400, {"error": "job_id must be a non-empty string (at most 256 characters)"})
            return
        board = self.owner.board
        try:
            if url.path == _REGISTER_PATH:
                self._send(200, board.register(job_id, body.get("host"), body.get("rdzv_host"), body.get("nnodes"),
                                               body.get("min_nodes"), body.get("rdzv_endpoint_host"),
                                               body.get("generation"), body.get("was"),
                                               body.get("serves_rdzv") is True))
            else:
                self._send(200, board.propose(job_id, body.get("generation"), body.get("decision"),
                                              self.owner.job_failures(job_id), self.owner.drained_hosts))
        except Refused as exc:
            self._send(exc.status, {"error": str(exc)})

    def _body(self) -> dict[str, Any] | None:
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if not 0 <= length <= _MAX_BODY:
            self._send(411 if length < 0 else 413, {"error": f"send a JSON body of at most {_MAX_BODY} bytes with "
                                                             "Content-Length"})
            return None
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            self._send(400, {"error": "the body must be a JSON object"})
            return None
        return body

    def do_PUT(self) -> None:
        self._send(405, {"error": "use GET (or POST to the jobs API)"}, (("Allow", "GET, POST"),))

    do_DELETE = do_PATCH = do_PUT


def _loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)
