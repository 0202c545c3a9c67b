"""Who may use the event bus (SPEC §7, router side): credentials, TLS peer identity, refusals.

Owns: the configuration the server sees (`BrokerEntry`, `BusTls`, duck-typed: router/config.py's
classes fit; `Broker` and `TlsFiles` are the plain ones), the `SecurityFailure` labels, the
server's TLS context (`server_ssl_context`) with the hook that refuses non-h2 connections and
records each connection's verified client-certificate DNS SANs (see bus_server.py's docstring
for why a hook), the authentication of a request (`Authenticator`: bearer token compared by its
`sha256:<hex>` hash against `brokers[].token_hash` in constant time, or the client certificate
whose DNS SAN equals the broker `id`; the hello's role and backends; whether a live session is
still allowed after a reload), and the refusal answers (`Refusal`: 401/403/400/404 with their
JSON bodies).

No I/O but reading the certificate files; the server decides when to ask.
"""

from __future__ import annotations

import contextvars
import enum
import json
import ssl
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import Hello, Role

# --- configuration seen by the server (duck-typed: router/config.py's classes fit) -----------


class BrokerEntry(Protocol):
    """One credential (`dynamo.event_bus.brokers[]`)."""

    @property
    def id(self) -> str: ...
    @property
    def role(self) -> str: ...  # "kv_listener" | "broker" (a StrEnum is a str)
    @property
    def token_hash(self) -> str | None: ...  # "sha256:<64 lowercase hex>"
    @property
    def backends(self) -> Sequence[str]: ...


class BusTls(Protocol):
    @property
    def cert(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def client_ca(self) -> str | None: ...  # trust anchor for mTLS client certs; None: no mTLS


@dataclass(frozen=True, slots=True)
class Broker:
    """A plain `BrokerEntry` (tests, embedding routers without a config file)."""

    id: str
    role: str
    token_hash: str | None = None
    backends: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A plain `BusTls`."""

    cert: str
    key: str
    client_ca: str | None = None


# --- labels -----------------------------------------------------------------------------------


class SecurityFailure(enum.StrEnum):
    """Why a connection or request was refused. Values are metric labels (fixed set)."""

    PLAINTEXT = "plaintext"  # not TLS at all (TLS handshake failed on a cleartext request)
    BAD_CLIENT_CERT = "bad_client_cert"  # client certificate not trusted (handshake refused)
    TLS_HANDSHAKE = "tls_handshake"  # any other failed handshake
    ALPN_NOT_H2 = "alpn_not_h2"  # TLS without ALPN h2 (HTTP/1.1 clients): refused after handshake
    NOT_HTTP2 = "not_http2"  # a request over another HTTP version (defence in depth)
    MISSING_CREDENTIAL = "missing_credential"  # 401
    MALFORMED_AUTHORIZATION = "malformed_authorization"  # 401
    BAD_TOKEN = "bad_token"  # 401: the token's hash matches no broker
    UNKNOWN_CLIENT_CERT = "unknown_client_cert"  # 401: trusted cert, no SAN names a broker
    CLIENT_ID_MISMATCH = "client_id_mismatch"  # 403: hello client_id is not the credential's id
    ROLE_MISMATCH = "role_mismatch"  # 403: hello role differs from the credential's role
    ROLE_NOT_SERVED = "role_not_served"  # 403: broker sessions are not served here
    BACKEND_NOT_ALLOWED = "backend_not_allowed"  # 403: a source outside the credential's backends
    MALFORMED_HELLO = "malformed_hello"  # 400
    LINE_TOO_LONG = "line_too_long"  # 400: hello line > 64 KiB
    HELLO_TIMEOUT = "hello_timeout"  # 400: no complete hello in time
    UNKNOWN_STREAM = "unknown_stream"  # 404
    STREAM_OF_OTHER_CLIENT = "stream_of_other_client"  # 404: a live stream, another client's
    UNKNOWN_PATH = "unknown_path"  # 404
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405
    REVOKED = "revoked"  # a reload withdrew a live session's permission: `forbidden` sent


# --- per-connection TLS identity ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Peer:
    dns_names: tuple[str, ...]  # DNS SANs of the verified client certificate (none: no cert)


_PEER: contextvars.ContextVar[_Peer | None] = contextvars.ContextVar("kv_bus_peer", default=None)

_PLAINTEXT_REASONS = frozenset({"HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "WRONG_VERSION_NUMBER",
                                "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE"})
_CERT_REASONS = frozenset({"CERTIFICATE_VERIFY_FAILED", "PEER_DID_NOT_RETURN_A_CERTIFICATE",
                           "NO_CERTIFICATE_RETURNED", "TLSV1_ALERT_UNKNOWN_CA",
                           "SSLV3_ALERT_BAD_CERTIFICATE"})


def _classify_handshake_error(exc: ssl.SSLError) -> SecurityFailure:
    reason = getattr(exc, "reason", None) or ""
    if reason in _PLAINTEXT_REASONS:
        return SecurityFailure.PLAINTEXT
    if reason in _CERT_REASONS or isinstance(exc, ssl.SSLCertVerificationError):
        return SecurityFailure.BAD_CLIENT_CERT
    return SecurityFailure.TLS_HANDSHAKE


def _dns_names(cert: Any) -> tuple[str, ...]:
    """DNS SANs of a verified peer certificate as `getpeercert()` returns it ({} or None: none)."""
    if not cert:
        return ()
    return tuple(str(entry[1]) for entry in cert.get("subjectAltName", ())
                 if len(entry) == 2 and entry[0] == "DNS")


def sslobject_class(on_failure: Callable[[SecurityFailure], None]) -> type[ssl.SSLObject]:
    class _BusSSLObject(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise
            except ssl.SSLError as exc:
                on_failure(_classify_handshake_error(exc))
                raise
            if self.selected_alpn_protocol() != "h2":
                on_failure(SecurityFailure.ALPN_NOT_H2)
                # asyncio treats this as a failed handshake: the transport is aborted before
                # any HTTP/1.1 byte is read (Python cannot send the no_application_protocol alert).
                raise ssl.SSLError("the event bus speaks HTTP/2 only (ALPN h2)")
            _PEER.set(_Peer(_dns_names(self.getpeercert())))

    return _BusSSLObject


def server_ssl_context(tls: BusTls, on_failure: Callable[[SecurityFailure], None]) -> ssl.SSLContext:
    """The event bus's server context: TLS >= 1.2, ALPN h2 only, client certificates verified
    against `tls.client_ca` when set (optional: a bearer token is the other way in), every
    refused handshake reported to `on_failure`."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 9113 §9.2
    ctx.options |= ssl.OP_NO_COMPRESSION  # RFC 9113 §9.2.1
    ctx.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20")  # RFC 9113 §9.2.2: no blocklisted suites
    ctx.set_alpn_protocols(["h2"])
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca is not None:
        ctx.load_verify_locations(tls.client_ca)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    else:
        ctx.verify_mode = ssl.CERT_NONE
    ctx.sslobject_class = sslobject_class(on_failure)
    return ctx


@dataclass(frozen=True, slots=True)
class Credential:
    """What a request proved: the sha256 of its bearer token (if any) and the DNS SANs of the
    connection's verified client certificate."""

    token_hash: str | None
    cert_names: tuple[str, ...]


class Refusal(Exception):
    """A request refused: its status, the label it is counted under (None: not a security
    failure, e.g. 503 while closing), its JSON body and extra headers."""

    def __init__(self, status: int, failure: SecurityFailure | None, body: bytes,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(failure.value if failure is not None else str(status))
        self.status = status
        self.failure = failure
        self.body = body
        self.headers = list(headers)


def json_body(kind: str, reason: str) -> bytes:
    return json.dumps({"type": kind, "reason": reason}, separators=(",", ":")).encode() + b"\n"


def unauthorized(failure: SecurityFailure) -> Refusal:
    return Refusal(401, failure, json_body("unauthorized", failure.value),
                    [(b"www-authenticate", b'Bearer realm="event-bus"')])


def forbidden(failure: SecurityFailure) -> Refusal:
    return Refusal(403, failure, bp.forbidden_body(failure.value))


def bad_request(failure: SecurityFailure, detail: str) -> Refusal:
    return Refusal(400, failure, json_body("bad_request", detail))


def not_found(failure: SecurityFailure) -> Refusal:
    return Refusal(404, failure, json_body("not_found", "unknown_stream"))



class Authenticator:
    """The credentials (`brokers`, replaced on reload) and every question asked of them."""

    __slots__ = ("brokers",)

    def __init__(self, brokers: Iterable[BrokerEntry]) -> None:
        self.brokers: tuple[BrokerEntry, ...] = tuple(brokers)

    def broker(self, broker_id: str) -> BrokerEntry | None:
        for b in self.brokers:
            if b.id == broker_id:
                return b
        return None

    def identities(self, cred: Credential) -> set[str]:
        ids: set[str] = set()
        if cred.token_hash is not None:
            # Every entry is compared (constant time each) so the time taken does not depend on
            # which entry, if any, matches.
            for b in self.brokers:
                if bp.token_hash_matches(cred.token_hash, b.token_hash):
                    ids.add(b.id)
        for b in self.brokers:
            if b.id in cred.cert_names:
                ids.add(b.id)
        return ids

    def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[Credential, set[str]]:
        """A request's credential and the broker ids it proves; `Refusal` (401) otherwise."""
        auth_headers = [v for k, v in headers if k == b"authorization"]
        peer = _PEER.get()
        cert_names = peer.dns_names if peer is not None else ()
        token_hash: str | None = None
        if auth_headers:
            token = bp.parse_bearer(auth_headers[0]) if len(auth_headers) == 1 else None
            if token is None:
                raise unauthorized(SecurityFailure.MALFORMED_AUTHORIZATION)
            token_hash = bp.token_hash(token)
        cred = Credential(token_hash, cert_names)
        ids = self.identities(cred)
        if token_hash is not None and not any(
                bp.token_hash_matches(token_hash, b.token_hash) for b in self.brokers):
            raise unauthorized(SecurityFailure.BAD_TOKEN)  # a wrong token is never ignored
        if not ids:
            if cert_names:
                raise unauthorized(SecurityFailure.UNKNOWN_CLIENT_CERT)
            raise unauthorized(SecurityFailure.MISSING_CREDENTIAL)
        return cred, ids

    def admit(self, hello: Hello, ids: set[str]) -> None:
        """May a session with this hello open for these identities? `Refusal` (403) if not."""
        broker = self.broker(hello.client_id) if hello.client_id in ids else None
        if broker is None:
            raise forbidden(SecurityFailure.CLIENT_ID_MISMATCH)
        if hello.role.value != str(broker.role):
            raise forbidden(SecurityFailure.ROLE_MISMATCH)
        if hello.role is not Role.KV_LISTENER:
            raise forbidden(SecurityFailure.ROLE_NOT_SERVED)
        allowed = set(broker.backends)
        if any(b not in allowed for b in hello.sources):
            raise forbidden(SecurityFailure.BACKEND_NOT_ALLOWED)

    def still_allowed(self, client_id: str, cred: Credential,
                      announced: Sequence[str]) -> SecurityFailure | None:
        """After a reload: None when a live session's credential still allows it."""
        if client_id not in self.identities(cred):
            return SecurityFailure.BAD_TOKEN  # the credential no longer names this client
        broker = self.broker(client_id)
        assert broker is not None
        if str(broker.role) != Role.KV_LISTENER.value:
            return SecurityFailure.ROLE_MISMATCH
        allowed = set(broker.backends)
        if any(b not in allowed for b in announced):
            return SecurityFailure.BACKEND_NOT_ALLOWED
        return None
