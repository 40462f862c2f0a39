"""Secrets, bearer-token / basic auth and TLS settings shared by every listener and exporter of the collector.

Contract (what callers may rely on; tests/test_security.py holds it):

- **Secrets** come from a file (``bearer_token_file``, ``password_file``) or from the config text
  (``bearer_token: ${env:TOKEN}``), never both. A file is re-read when its mtime or size changes (at most once a
  second), so a rotated Kubernetes Secret takes effect without a restart; a file that becomes unreadable or empty
  keeps the last good value (with a warning). A secret is held in a :class:`Secret`, whose ``repr``/``str`` are
  ``***``; no error message of this module quotes a secret; a value YAML typed as a number is refused (``007``
  would become ``7``).
- **Checks** (:class:`BearerChecker`, :class:`BasicAuthChecker`) take the ``Authorization`` header value (or None)
  and return a bool; comparisons are constant-time (:func:`hmac.compare_digest`), and basic auth compares user and
  password both, always.
- **Server TLS** (:class:`ServerTlsConfig`): PEM ``cert_file`` + ``key_file``; ``client_ca_file`` turns on mutual
  TLS; TLS >= ``min_version`` (1.2 or 1.3). :func:`server_ssl_context` (HTTP listeners, served by
  :mod:`otel_gpu.collector.httpserver`) and :func:`grpc_server_credentials` (gRPC) build from the same config with the same
  checks. Files are read when a component starts, not when the config is validated (a config can be checked away
  from its secrets); a missing or non-PEM file raises ValueError naming ``<prefix>.<key>``.
- **Client TLS** (:class:`ClientTlsConfig`): one class for every client of ours (``ca_file``, client certificate,
  ``insecure``, ``insecure_skip_verify``, ``server_name_override``).
- Config errors are ``ValueError`` whose message starts with the key (the config loader prefixes the path).

Example:
    >>> from otel_gpu.config import build
    >>> auth = build(BearerAuthConfig, {"bearer_token": "s3cret"}, "receivers.otlp.auth")
    >>> auth
    BearerAuthConfig(bearer_token=Secret('***'), bearer_token_file='')
    >>> checker = BearerChecker(auth)
    >>> checker.check("Bearer s3cret"), checker.check("Bearer nope"), checker.check(None)
    (True, False, False)
"""
from __future__ import annotations

import base64
import hmac
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BasicAuthChecker", "BasicAuthConfig", "BearerAuthConfig", "BearerChecker", "ClientTlsConfig", "Secret",
           "SecretFile", "ServerTlsConfig", "grpc_server_credentials", "read_optional", "read_pem",
           "server_ssl_context", "validate_secret"]

_logger = logging.getLogger(__name__)


class Secret:
    """A string that is never shown: ``repr`` and ``str`` give ``***``; :meth:`reveal` gives the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


def validate_secret(value: Any, key: str) -> Secret:
    """A config value as a :class:`Secret`; the error names the key and the type, never the value.

    ``${env:VAR}`` standing for a whole value is typed by YAML (as the OpenTelemetry Collector does), so a token of
    digits arrives as a number: refuse it rather than pass on a changed token (``007`` would become ``7``).
    """
    if isinstance(value, Secret):
        return value
    if value is None or value == "":
        return Secret("")
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected a string, got a {type(value).__name__} (value not shown); YAML typed it: "
                         f"quote it, or put it in a file and use {key}_file")
    if any(c in value for c in "\r\n\0"):
        raise ValueError(f"{key}: contains a line break or NUL (value not shown)")
    return Secret(value)


class SecretFile:
    """A secret read from a file, stripped of surrounding whitespace, re-read when its mtime or size changes
    (checked at most once per ``recheck_s``). A file that becomes unreadable keeps the last good value."""

    def __init__(self, path: str, key: str, recheck_s: float = 1.0):
        self.path, self.key, self.recheck_s = path, key, recheck_s
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._value = self._read(initial=True)

    def _read(self, initial: bool = False) -> bytes:
        try:
            st = os.stat(self.path)
            with open(self.path, "rb") as f:
                data = f.read(64 * 1024).strip()
        except OSError as exc:
            if initial:
                raise ValueError(f"{self.key}: cannot read {self.path!r} ({exc.strerror})") from None
            _logger.warning("%s: cannot re-read %s (%s); keeping the previous secret", self.key, self.path,
                            exc.strerror)
            return self._value
        if not data:
            if initial:
                raise ValueError(f"{self.key}: {self.path!r} is empty")
            _logger.warning("%s: %s is now empty; keeping the previous secret", self.key, self.path)
            return self._value
        self._stamp = (st.st_mtime_ns, st.st_size)
        return data

    def value(self) -> bytes:
        now = time.monotonic()
        if now - self._checked < self.recheck_s:
            return self._value
        with self._lock:
            self._checked = now
            try:
                st = os.stat(self.path)
                stamp = (st.st_mtime_ns, st.st_size)
            except OSError:
                stamp = None
            if stamp != self._stamp:
                self._value = self._read()
        return self._value


def _secret_source(inline: Secret, path: str, key: str) -> Any:
    """``() -> bytes`` reading the secret from ``path`` or the inline value."""
    if path:
        source = SecretFile(path, f"{key}_file")
        return source.value
    raw = inline.reveal().encode()
    return lambda: raw


# -- bearer token --------------------------------------------------------------------------------------------------
@dataclass
class BearerAuthConfig:
    """``auth: {bearer_token_file: PATH}`` or ``auth: {bearer_token: ${env:TOKEN}}``: exactly one of the two."""

    bearer_token: Any = field(default="", repr=True)
    bearer_token_file: str = ""

    def validate(self) -> None:
        self.bearer_token = validate_secret(self.bearer_token, "bearer_token")
        if self.bearer_token and self.bearer_token_file:
            raise ValueError("bearer_token: set bearer_token or bearer_token_file, not both")
        if not self.bearer_token and not self.bearer_token_file:
            raise ValueError("bearer_token_file: auth needs bearer_token_file (or bearer_token: ${env:VAR})")

    def token_source(self, key: str = "auth.bearer_token"):
        """``() -> bytes``: the current token. Raises ValueError (naming the key) when the file cannot be read."""
        return _secret_source(self.bearer_token, self.bearer_token_file, key)


class BearerChecker:
    """Checks an ``Authorization`` header value against the configured token in constant time."""

    def __init__(self, config: BearerAuthConfig, key: str = "auth.bearer_token"):
        self._token = config.token_source(key)

    def check(self, authorization: str | bytes | None) -> bool:
        if not authorization:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "replace")
        scheme, _, presented = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(presented.strip(), self._token())


# -- basic auth ----------------------------------------------------------------------------------------------------
@dataclass
class BasicAuthConfig:
    """HTTP basic auth: ``username`` and ``password_file`` (or ``password: ${env:VAR}``)."""

    username: str = ""
    password: Any = ""
    password_file: str = ""

    def validate(self) -> None:
        self.password = validate_secret(self.password, "password")
        if not self.username or ":" in self.username:
            raise ValueError(f"username: required, without ':' (got {self.username!r})")
        if self.password and self.password_file:
            raise ValueError("password: set password or password_file, not both")
        if not self.password and not self.password_file:
            raise ValueError("password_file: basic auth needs password_file (or password: ${env:VAR})")


class BasicAuthChecker:
    """Checks an ``Authorization: Basic ...`` header in constant time (user and password both compared)."""

    def __init__(self, config: BasicAuthConfig, key: str = "basic_auth.password"):
        self._user = config.username.encode()
        self._password = _secret_source(config.password, config.password_file, key)

    def check(self, authorization: str | None) -> bool:
        if not authorization:
            return False
        scheme, _, encoded = authorization.strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
        except ValueError:
            return False
        # Both compared, always, so that the time does not tell which one was wrong.
        ok_user = hmac.compare_digest(user, self._user)
        ok_password = hmac.compare_digest(password, self._password())
        return bool(sep) and ok_user and ok_password


# -- TLS -----------------------------------------------------------------------------------------------------------
def read_pem(path: str, key: str) -> bytes:
    """The bytes of a PEM file; ValueError naming the setting when it cannot be read. Files are read when the
    component starts, not when the config is validated, so that a config can be checked away from its secrets."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{key}: cannot read {path!r} ({exc.strerror})") from None


@dataclass
class ServerTlsConfig:
    """A listener's TLS: ``cert_file`` + ``key_file`` (PEM); ``client_ca_file`` turns on mutual TLS (clients must
    present a certificate signed by it)."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    min_version: str = "1.2"

    def validate(self) -> None:
        if not self.cert_file or not self.key_file:
            raise ValueError("cert_file: TLS needs both cert_file and key_file")
        if self.min_version not in ("1.2", "1.3"):
            raise ValueError(f"min_version must be 1.2 or 1.3 (got {self.min_version!r})")


def server_ssl_context(cfg: ServerTlsConfig, prefix: str = "tls") -> ssl.SSLContext:
    """An ``ssl.SSLContext`` for a server socket (TLS >= min_version; client certificates required with
    ``client_ca_file``). Raises ValueError naming ``prefix.<key>`` for a file that is missing or not PEM."""
    for key in ("cert_file", "key_file", "client_ca_file"):
        if getattr(cfg, key):
            read_pem(getattr(cfg, key), f"{prefix}.{key}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3 if cfg.min_version == "1.3" else ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    except ssl.SSLError as exc:
        raise ValueError(f"{prefix}.cert_file / key_file: not a matching PEM certificate and key ({exc.reason})") \
            from None
    if cfg.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=cfg.client_ca_file)
        except ssl.SSLError as exc:
            raise ValueError(f"{prefix}.client_ca_file: not a PEM CA certificate ({exc.reason})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def grpc_server_credentials(cfg: ServerTlsConfig, prefix: str = "tls"):
    """``grpc.ServerCredentials`` for :class:`ServerTlsConfig` (mTLS with ``client_ca_file``)."""
    import grpc

    server_ssl_context(cfg, prefix)  # the same checks, with the same messages, before grpc's own (vaguer) ones
    key = read_pem(cfg.key_file, f"{prefix}.key_file")
    cert = read_pem(cfg.cert_file, f"{prefix}.cert_file")
    roots = read_pem(cfg.client_ca_file, f"{prefix}.client_ca_file") if cfg.client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=roots, require_client_auth=roots is not None)


@dataclass
class ClientTlsConfig:
    """An exporter's TLS: ``ca_file`` (roots; default: the system's), ``cert_file`` + ``key_file`` (a client
    certificate, for servers that require mTLS), ``insecure`` / ``insecure_skip_verify`` and ``server_name_override``.
    """

    insecure: bool | None = None  # otlp: null = TLS only for https://; otlphttp: see the exporter
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure_skip_verify: bool = False
    server_name_override: str = ""

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file: a client certificate needs both cert_file and key_file")


def read_optional(path: str, key: str = "tls") -> bytes | None:
    return read_pem(path, key) if path else None
