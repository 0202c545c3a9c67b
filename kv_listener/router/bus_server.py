"""Router side of push mode (SPEC §7): the event-bus server that listeners connect to.

Owns: an HTTP/2-only TLS endpoint served by hypercorn (our own ASGI app, no framework), the
authentication of every request (bearer token compared by its `sha256:<hex>` hash against
`brokers[].token_hash`, in constant time; or the mTLS client certificate whose DNS SAN equals the
broker `id`), roles and the per-credential backend allow-list, the live sessions
(`POST /bus/v1/session`: hello in, NDJSON control lines out) and their pushed streams
(`POST /bus/v1/streams/{id}`: the listener's SSE bytes in), and the consumer side:
`open_announced_stream(backend, last_event_id)` asks a live session for a backend's stream and
returns an async iterator of exactly the bytes the listener pushes.

Security failures never crash anything: each is answered (401/403/400/404, or the TLS handshake
is refused), counted under a `SecurityFailure` label and logged once per occurrence without
secrets.

Hypercorn (0.18) does not implement the ASGI TLS extension (pgjones/hypercorn#62, open), so the
ASGI scope carries no peer certificate. The well-kept stdlib hooks fill the gap:
`SSLContext.sslobject_class` (documented as overridable) gives us the `SSLObject` at the end of
each handshake, where we check ALPN (`h2` only: HTTP/1.1 clients are refused at the TLS layer)
and read the verified certificate's DNS SANs into a `ContextVar`. asyncio creates the connection
task right after a successful handshake, in the same context, and hypercorn spawns each request's
ASGI task from that connection task, so every request of the connection sees its own peer
identity and nothing else (contexts are copied per task). The tests prove it over real sockets.

Two hypercorn behaviours shape the app: a request body still being sent after our response has
ended makes hypercorn fail that connection, so every refusal is sent as a complete status and body
but the response is only ended once the request body has ended (bounded by a timeout); and
hypercorn acknowledges request DATA as soon as the app queue takes it, so each stream keeps its
own bounded buffer towards its consumer (a consumer too slow for it loses the stream, counted,
and re-requests it from its last event ID: nothing is dropped silently).
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import json
import logging
import secrets
import socket
import ssl
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import (
    NDJSON_CONTENT_TYPE,
    BusProtocolError,
    BusProtocolErrorReason,
    Forbidden,
    Hello,
    Role,
    StreamEnd,
    Subscribe,
    Unsubscribe,
    Welcome,
)
from kv_listener.router.consumer import NoSessionError

log = structlog.get_logger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


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


class SessionEnd(enum.StrEnum):
    """Why a session ended. Values are metric labels."""

    DISCONNECTED = "disconnected"  # the listener went away (reset, connection lost)
    FORBIDDEN = "forbidden"  # `forbidden` sent after a reload
    SERVER_CLOSED = "server_closed"


class StreamEndReason(enum.StrEnum):
    """Why a consumer's `BusStream` ended. Values are metric labels."""

    DRAINING = "draining"  # the body ended after a `draining` record: re-request elsewhere
    BUFFER_OVERFLOW = "buffer_overflow"  # the listener's hub dropped this consumer
    ENDED = "ended"  # the body ended otherwise
    RESET = "reset"  # the listener reset the stream or the connection was lost
    SESSION_ENDED = "session_ended"  # the session died before or while the stream ran
    FORBIDDEN = "forbidden"  # the session was ended by a reload
    ATTACH_TIMEOUT = "attach_timeout"  # the listener never opened the stream
    CONSUMER_OVERFLOW = "consumer_overflow"  # the consumer fell too far behind
    CLOSED = "closed"  # the consumer closed it
    SERVER_CLOSED = "server_closed"


_STREAM_END_BY_BODY = {
    StreamEnd.DRAINING: StreamEndReason.DRAINING,
    StreamEnd.BUFFER_OVERFLOW: StreamEndReason.BUFFER_OVERFLOW,
    StreamEnd.OTHER: StreamEndReason.ENDED,
}


class NoSession(NoSessionError):
    """No live session announces this backend (yet): retry after `reconnect_interval_ms`. A
    `router.consumer.NoSessionError`, which the consumer manager counts as `no_session`."""

    def __init__(self, backend: str) -> None:
        super().__init__(f"no live event-bus session announces {backend!r}")
        self.backend = backend


@dataclass(slots=True)
class BusServerStats:
    """Counters behind /metrics and the admin JSON. Counter keys are Enum values."""

    security_failures: Counter[str] = field(default_factory=Counter)  # SecurityFailure -> n
    sessions_opened: int = 0
    sessions_ended: Counter[str] = field(default_factory=Counter)  # SessionEnd -> n
    streams_requested: int = 0
    streams_attached: int = 0
    streams_ended: Counter[str] = field(default_factory=Counter)  # StreamEndReason -> n
    no_session: int = 0  # open_announced_stream calls answered with NoSession
    bytes_received: int = 0  # pushed SSE bytes


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


def _sslobject_class(on_failure: Callable[[SecurityFailure], None]) -> type[ssl.SSLObject]:
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


# --- sessions and streams -------------------------------------------------------------------


class _Session:
    __slots__ = ("announced", "auth", "client_id", "draining", "ended", "outbox", "session_id",
                 "streams", "welcomed_at")

    def __init__(self, session_id: str, hello: Hello, auth: _Credential, now: float) -> None:
        self.session_id = session_id
        self.client_id = hello.client_id
        self.announced = hello.sources
        self.auth = auth
        self.welcomed_at = now
        self.draining = False  # one of its streams ended with `draining`: no new subscriptions
        self.ended: SessionEnd | None = None
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.streams: dict[str, BusStream] = {}

    @property
    def live(self) -> bool:
        return self.ended is None


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    client_id: str
    sources: tuple[str, ...]
    welcomed_at: float  # monotonic
    draining: bool
    streams: int


class BusStream:
    """One backend's pushed SSE bytes, for one consumer. Async-iterate it; it ends (raises
    StopAsyncIteration) when the stream is over for any reason (`end_reason` says which), after
    handing out every byte received. Close it (`aclose()`) to give it up: the listener is told to
    `unsubscribe`."""

    def __init__(self, server: EventBusServer, session: _Session, stream_id: str, backend: str,
                 last_event_id: str | None, max_buffer_bytes: int) -> None:
        self._server = server
        self._session = session
        self.stream_id = stream_id
        self.backend = backend
        self.last_event_id = last_event_id
        self.client_id = session.client_id
        self.session_id = session.session_id
        self.end_reason: StreamEndReason | None = None
        self.attached = asyncio.Event()  # the listener opened the stream (its POST was accepted)
        self.bytes_received = 0
        self._max_buffer_bytes = max_buffer_bytes
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._wake = asyncio.Event()
        self._tail = b""
        self._attach_timer: asyncio.TimerHandle | None = None

    @property
    def ended(self) -> bool:
        return self.end_reason is not None

    def __aiter__(self) -> BusStream:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._chunks:
                chunk = b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                return chunk
            if self.end_reason is not None:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Give the stream up (idempotent): buffered bytes are dropped, the listener is told to
        unsubscribe."""
        self._chunks.clear()
        self._buffered = 0
        self._end(StreamEndReason.CLOSED, unsubscribe=True)

    async def __aenter__(self) -> BusStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # --- server side ---

    def _push(self, data: bytes) -> None:
        if self.end_reason is not None:
            return  # given up (unsubscribed, forbidden): the listener is ending the body
        self.bytes_received += len(data)
        self._chunks.append(data)
        self._buffered += len(data)
        # Only the end matters; slicing `data` first keeps this O(tail), not O(chunk).
        self._tail = (self._tail + data[-bp.STREAM_TAIL_BYTES:])[-bp.STREAM_TAIL_BYTES:]
        if b"draining" in data and bp.stream_end_kind(self._tail) is StreamEnd.DRAINING:
            # Known before the consumer reads it: its re-request must go to another session.
            self._server._session_draining(self._session)
        self._wake.set()
        if self._buffered > self._max_buffer_bytes:
            # The consumer cannot keep up; holding more would be unbounded memory, and stalling
            # the request body would stall every stream of the connection. It gets what it has,
            # then the end; it re-requests from its last event ID (nothing lost).
            log.warning("bus_consumer_overflow", backend=self.backend, stream_id=self.stream_id,
                        buffered=self._buffered)
            self._end(StreamEndReason.CONSUMER_OVERFLOW, unsubscribe=True, keep_buffer=True)

    def _body_ended(self) -> StreamEnd:
        kind = bp.stream_end_kind(self._tail)
        self._end(_STREAM_END_BY_BODY[kind], unsubscribe=False, keep_buffer=True)
        return kind

    def _end(self, reason: StreamEndReason, *, unsubscribe: bool, keep_buffer: bool = False) -> None:
        if self.end_reason is not None:
            return
        self.end_reason = reason
        if not keep_buffer:
            self._chunks.clear()
            self._buffered = 0
        if self._attach_timer is not None:
            self._attach_timer.cancel()
            self._attach_timer = None
        self._wake.set()
        self._server._stream_ended(self, reason, unsubscribe=unsubscribe)


@dataclass(frozen=True, slots=True)
class _Credential:
    """What a request proved: the sha256 of its bearer token (if any) and the DNS SANs of the
    connection's verified client certificate."""

    token_hash: str | None
    cert_names: tuple[str, ...]


class _Refusal(Exception):
    def __init__(self, status: int, failure: SecurityFailure | None, body: bytes,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(failure.value if failure is not None else str(status))
        self.status = status
        self.failure = failure
        self.body = body
        self.headers = list(headers)


def _json_body(kind: str, reason: str) -> bytes:
    return json.dumps({"type": kind, "reason": reason}, separators=(",", ":")).encode() + b"\n"


def _unauthorized(failure: SecurityFailure) -> _Refusal:
    return _Refusal(401, failure, _json_body("unauthorized", failure.value),
                    [(b"www-authenticate", b'Bearer realm="event-bus"')])


def _forbidden(failure: SecurityFailure) -> _Refusal:
    return _Refusal(403, failure, bp.forbidden_body(failure.value))


def _bad_request(failure: SecurityFailure, detail: str) -> _Refusal:
    return _Refusal(400, failure, _json_body("bad_request", detail))


def _not_found(failure: SecurityFailure) -> _Refusal:
    return _Refusal(404, failure, _json_body("not_found", "unknown_stream"))


# --- the server -----------------------------------------------------------------------------


class EventBusServer:
    """The event bus: `await start()`, then consumers call `open_announced_stream()`;
    `update_brokers()` on reload; `await close()` at the end.

    `host`/`port` default to the config's `listen_host`/`listen_port` (port 0: any free port,
    read it back from `.port`).
    """

    def __init__(
        self,
        tls: BusTls,
        brokers: Iterable[BrokerEntry],
        *,
        host: str = "0.0.0.0",  # noqa: S104 - listeners connect from elsewhere; TLS only
        port: int = 9443,
        stats: BusServerStats | None = None,
        hello_timeout_s: float = 10.0,
        attach_timeout_s: float = 10.0,
        reject_drain_s: float = 5.0,
        max_stream_buffer_bytes: int = 8 << 20,
        read_timeout_s: int | None = 60,
        graceful_timeout_s: float = 2.0,
        max_concurrent_streams: int = 256,
        on_security_failure: Callable[[SecurityFailure], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tls = tls
        self.host = host
        self._requested_port = port
        self.stats = stats if stats is not None else BusServerStats()
        self.hello_timeout_s = hello_timeout_s
        self.attach_timeout_s = attach_timeout_s
        self.reject_drain_s = reject_drain_s
        self.max_stream_buffer_bytes = max_stream_buffer_bytes
        # hypercorn closes a connection that sent nothing for this long; a listener's keep-alive
        # PINGs (every 10 s) keep a healthy one open, so a dead peer is noticed.
        self.read_timeout_s = read_timeout_s
        self.graceful_timeout_s = graceful_timeout_s
        self.max_concurrent_streams = max_concurrent_streams
        self._on_security_failure = on_security_failure
        self._clock = clock
        self._brokers: tuple[BrokerEntry, ...] = tuple(brokers)
        self._sessions: dict[str, _Session] = {}
        self._streams: dict[str, BusStream] = {}
        self._changed = asyncio.Event()
        self._port: int | None = None
        self._shutdown = asyncio.Event()
        self._started = asyncio.Event()
        self._serve_task: asyncio.Task[None] | None = None
        self._closing = False

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> EventBusServer:
        """From router/config.py's `EventBusServerConfig` (`listen_host`, `listen_port`, `tls`,
        `brokers`)."""
        if config.tls is None:
            raise ValueError("dynamo.event_bus.tls is required: the event bus is TLS only")
        kwargs.setdefault("host", config.listen_host)
        kwargs.setdefault("port", config.listen_port)
        return cls(config.tls, config.brokers, **kwargs)

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the event bus is not started")
        return self._port

    def ssl_context(self) -> ssl.SSLContext:
        """The server context: TLS >= 1.2, ALPN h2 only, client certificates verified against
        `tls.client_ca` when set (optional: a bearer token is the other way in)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 9113 §9.2
        ctx.options |= ssl.OP_NO_COMPRESSION  # RFC 9113 §9.2.1
        ctx.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20")  # RFC 9113 §9.2.2: no blocklisted suites
        ctx.set_alpn_protocols(["h2"])
        ctx.load_cert_chain(self.tls.cert, self.tls.key)
        if self.tls.client_ca is not None:
            ctx.load_verify_locations(self.tls.client_ca)
            ctx.verify_mode = ssl.CERT_OPTIONAL
        else:
            ctx.verify_mode = ssl.CERT_NONE
        ctx.sslobject_class = _sslobject_class(self._security_failure)
        return ctx

    async def start(self) -> None:
        """Bind, and serve in the background. Raises on a bad certificate or address."""
        if self._serve_task is not None:
            raise RuntimeError("already started")
        ssl_context = self.ssl_context()  # fails here, not in the background, on bad files
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
            # Listening now: a client connecting before hypercorn's accept loop runs waits in
            # the backlog instead of being refused.
            sock.listen(128)
            self._port = sock.getsockname()[1]
        except OSError:
            sock.close()
            raise
        config = _HypercornConfig(ssl_context)
        config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the socket from here
        config.graceful_timeout = self.graceful_timeout_s
        config.read_timeout = self.read_timeout_s
        config.h2_max_concurrent_streams = self.max_concurrent_streams
        # hypercorn sends GOAWAY after this many requests on a connection; every subscribe is
        # one, and a session should not end because consumers re-requested often.
        config.keep_alive_max_requests = 1 << 40
        config.include_server_header = False
        config.accesslog = None
        config.errorlog = logging.getLogger("kv_listener.router.bus_server.hypercorn")
        self._serve_task = asyncio.create_task(
            serve(self._asgi, config, shutdown_trigger=self._shutdown.wait, mode="asgi"),  # type: ignore[arg-type]
            name="event-bus-server",
        )
        started = asyncio.create_task(self._started.wait())
        try:
            await asyncio.wait({started, self._serve_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if self._serve_task.done():
            self._serve_task.result()  # raises what stopped it
            raise RuntimeError("the event bus stopped while starting")
        log.info("bus_server_started", host=self.host, port=self._port,
                 mtls=self.tls.client_ca is not None, brokers=len(self._brokers))

    async def close(self) -> None:
        """End every session (their streams end with `server_closed`) and stop serving."""
        if self._closing:
            if self._serve_task is not None:
                await asyncio.shield(self._serve_task)
            return
        self._closing = True
        for session in list(self._sessions.values()):
            self._end_session(session, SessionEnd.SERVER_CLOSED, forbidden=None)
        self._shutdown.set()
        if self._serve_task is not None:
            try:
                await self._serve_task
            except Exception as exc:  # shutting down: report, do not mask the caller
                log.error("bus_server_stopped_with_error", error=repr(exc))
        log.info("bus_server_stopped")

    async def __aenter__(self) -> EventBusServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- consumers ----------------------------------------------------------------------

    async def open_announced_stream(self, backend: str, last_event_id: str | None) -> BusStream:
        """Ask a live session that announced `backend` to push that backend's SSE stream from
        `last_event_id` (None: a new consumer, the listener sends a resync). Returns at once; the
        stream's bytes arrive as the listener pushes them. Raises `NoSession` when no live session
        announces `backend` (retry every `reconnect_interval_ms`, no backoff); a session that
        drained is not asked again, so a re-request goes to another live session."""
        session = self._pick_session(backend)
        if session is None:
            self.stats.no_session += 1
            raise NoSession(backend)
        stream_id = secrets.token_hex(12)
        stream = BusStream(self, session, stream_id, backend, last_event_id,
                           self.max_stream_buffer_bytes)
        session.streams[stream_id] = stream
        self._streams[stream_id] = stream
        self.stats.streams_requested += 1
        session.outbox.put_nowait(bp.encode_message(Subscribe(stream_id, backend, last_event_id)))
        stream._attach_timer = asyncio.get_running_loop().call_later(
            self.attach_timeout_s, self._attach_timed_out, stream)
        log.info("bus_stream_requested", backend=backend, stream_id=stream_id,
                 session_id=session.session_id, resume=last_event_id is not None)
        return stream

    def announced_backends(self) -> set[str]:
        """Backends a live, non-draining session announces now."""
        return {b for s in self._sessions.values() if s.live and not s.draining for b in s.announced}

    async def wait_announced(self, backend: str) -> None:
        """Return once a live, non-draining session announces `backend`."""
        while backend not in self.announced_backends():
            changed = self._changed
            await changed.wait()

    def sessions(self) -> list[SessionInfo]:
        return [SessionInfo(s.session_id, s.client_id, s.announced, s.welcomed_at, s.draining,
                            len(s.streams)) for s in self._sessions.values() if s.live]

    # --- reload -------------------------------------------------------------------------

    def update_brokers(self, brokers: Iterable[BrokerEntry]) -> None:
        """Replace the credentials (hot reload). A live session its credential no longer allows
        (entry removed, token or role changed, an announced backend taken out of `backends`)
        gets `forbidden`, is ended, and its streams end."""
        self._brokers = tuple(brokers)
        for session in list(self._sessions.values()):
            reason = self._still_allowed(session)
            if reason is not None:
                self._security_failure(SecurityFailure.REVOKED)
                log.warning("bus_session_revoked", session_id=session.session_id,
                            client_id=session.client_id, reason=reason.value)
                self._end_session(session, SessionEnd.FORBIDDEN, forbidden=reason.value)

    def _still_allowed(self, session: _Session) -> SecurityFailure | None:
        if session.client_id not in self._identities(session.auth):
            return SecurityFailure.BAD_TOKEN  # the credential no longer names this client
        broker = self._broker(session.client_id)
        assert broker is not None
        if str(broker.role) != Role.KV_LISTENER.value:
            return SecurityFailure.ROLE_MISMATCH
        allowed = set(broker.backends)
        if any(b not in allowed for b in session.announced):
            return SecurityFailure.BACKEND_NOT_ALLOWED
        return None

    # --- internals: sessions and streams ------------------------------------------------

    def _pick_session(self, backend: str) -> _Session | None:
        best: _Session | None = None
        for s in self._sessions.values():
            # The newest session wins: after a listener restart the old one may linger until its
            # connection times out.
            if (s.live and not s.draining and backend in s.announced
                    and (best is None or s.welcomed_at >= best.welcomed_at)):
                best = s
        return best

    def _notify_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _end_session(self, session: _Session, reason: SessionEnd, *, forbidden: str | None) -> None:
        if session.ended is not None:
            return
        session.ended = reason
        self._sessions.pop(session.session_id, None)
        self.stats.sessions_ended[reason.value] += 1
        if forbidden is not None:
            session.outbox.put_nowait(bp.encode_message(Forbidden(forbidden)))
        session.outbox.put_nowait(None)  # ends the session's response
        stream_reason = {SessionEnd.FORBIDDEN: StreamEndReason.FORBIDDEN,
                         SessionEnd.SERVER_CLOSED: StreamEndReason.SERVER_CLOSED}.get(
                             reason, StreamEndReason.SESSION_ENDED)
        for stream in list(session.streams.values()):
            # Bytes already received are valid records; a revoked credential's are withheld.
            stream._end(stream_reason, unsubscribe=False,
                        keep_buffer=stream_reason is not StreamEndReason.FORBIDDEN)
        log.info("bus_session_ended", session_id=session.session_id, client_id=session.client_id,
                 reason=reason.value)
        self._notify_changed()

    def _stream_ended(self, stream: BusStream, reason: StreamEndReason, *, unsubscribe: bool) -> None:
        self.stats.streams_ended[reason.value] += 1
        session = stream._session
        if unsubscribe and session.live:
            session.outbox.put_nowait(bp.encode_message(Unsubscribe(stream.stream_id)))
        if not stream.attached.is_set():
            # Never opened: forget it now. An attached one is forgotten when its request ends.
            self._forget_stream(stream)
        if reason is StreamEndReason.DRAINING:
            self._session_draining(session)
        log.info("bus_stream_ended", backend=stream.backend, stream_id=stream.stream_id,
                 reason=reason.value, bytes=stream.bytes_received)

    def _session_draining(self, session: _Session) -> None:
        if session.live and not session.draining:
            session.draining = True
            log.info("bus_session_draining", session_id=session.session_id,
                     client_id=session.client_id)
            self._notify_changed()

    def _forget_stream(self, stream: BusStream) -> None:
        self._streams.pop(stream.stream_id, None)
        stream._session.streams.pop(stream.stream_id, None)

    def _attach_timed_out(self, stream: BusStream) -> None:
        stream._attach_timer = None
        if not stream.attached.is_set():
            log.warning("bus_stream_attach_timeout", backend=stream.backend,
                        stream_id=stream.stream_id, session_id=stream.session_id)
            stream._end(StreamEndReason.ATTACH_TIMEOUT, unsubscribe=True)

    def _security_failure(self, failure: SecurityFailure) -> None:
        self.stats.security_failures[failure.value] += 1
        log.warning("bus_security_failure", reason=failure.value)
        if self._on_security_failure is not None:
            self._on_security_failure(failure)

    # --- internals: authentication --------------------------------------------------------

    def _broker(self, broker_id: str) -> BrokerEntry | None:
        for b in self._brokers:
            if b.id == broker_id:
                return b
        return None

    def _identities(self, cred: _Credential) -> set[str]:
        ids: set[str] = set()
        if cred.token_hash is not None:
            # Every entry is compared (constant time each) so the time taken does not depend on
            # which entry, if any, matches.
            for b in self._brokers:
                if bp.token_hash_matches(cred.token_hash, b.token_hash):
                    ids.add(b.id)
        for b in self._brokers:
            if b.id in cred.cert_names:
                ids.add(b.id)
        return ids

    def _authenticate(self, scope: Scope) -> tuple[_Credential, set[str]]:
        auth_headers = [v for k, v in scope["headers"] if k == b"authorization"]
        peer = _PEER.get()
        cert_names = peer.dns_names if peer is not None else ()
        token_hash: str | None = None
        if auth_headers:
            token = bp.parse_bearer(auth_headers[0]) if len(auth_headers) == 1 else None
            if token is None:
                raise _unauthorized(SecurityFailure.MALFORMED_AUTHORIZATION)
            token_hash = bp.token_hash(token)
        cred = _Credential(token_hash, cert_names)
        ids = self._identities(cred)
        if token_hash is not None and not any(
                bp.token_hash_matches(token_hash, b.token_hash) for b in self._brokers):
            raise _unauthorized(SecurityFailure.BAD_TOKEN)  # a wrong token is never ignored
        if not ids:
            if cert_names:
                raise _unauthorized(SecurityFailure.UNKNOWN_CLIENT_CERT)
            raise _unauthorized(SecurityFailure.MISSING_CREDENTIAL)
        return cred, ids

    # --- the ASGI app ---------------------------------------------------------------------

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            return  # websocket: nothing served (hypercorn closes it)
        body_done = False
        try:
            if scope.get("http_version") != "2":
                raise _Refusal(505, SecurityFailure.NOT_HTTP2,
                               _json_body("bad_request", "http2_required"))
            path = scope["path"]
            if path == bp.SESSION_PATH:
                route = "session"
            elif path.startswith(bp.STREAMS_PATH):
                route = "stream"
            else:
                raise _Refusal(404, SecurityFailure.UNKNOWN_PATH, _json_body("not_found", "path"))
            if scope["method"] != "POST":
                raise _Refusal(405, SecurityFailure.METHOD_NOT_ALLOWED,
                               _json_body("bad_request", "method"), [(b"allow", b"POST")])
            cred, ids = self._authenticate(scope)
            if route == "session":
                body_done = True  # _session reads the body before it can refuse
                await self._session(receive, send, cred, ids)
            else:
                await self._stream(scope, receive, send, ids)
        except _Refusal as refusal:
            if refusal.failure is not None:
                self._security_failure(refusal.failure)
            await self._refuse(receive, send, refusal, body_done=body_done)
        except Exception as exc:  # a request must never take the server down
            log.error("bus_request_failed", error=repr(exc))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
                self._started.set()
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _refuse(self, receive: Receive, send: Send, refusal: _Refusal, *,
                      body_done: bool) -> None:
        headers = [(b"content-type", b"application/json"), *refusal.headers]
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": refusal.body, "more_body": not body_done})
        if body_done:
            return
        # Keep the response open until the client ended its body (hypercorn fails a connection
        # that sends DATA on a stream whose response has ended), discarding what it sends.
        try:
            async with asyncio.timeout(self.reject_drain_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            pass
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _read_hello(self, receive: Receive) -> Hello | None:
        body = bytearray()
        try:
            async with asyncio.timeout(self.hello_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body += message.get("body", b"")
                    if len(body) > bp.MAX_LINE_BYTES + 2:
                        # Refuse now, but keep reading (and discarding) until the body ends.
                        raise _BodyTooLong
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise _HelloRefused(_bad_request(SecurityFailure.HELLO_TIMEOUT, "hello_timeout"),
                                body_done=False) from None
        except _BodyTooLong:
            raise _HelloRefused(_bad_request(SecurityFailure.LINE_TOO_LONG,
                                             BusProtocolErrorReason.LINE_TOO_LONG.value),
                                body_done=False) from None
        try:
            return bp.decode_hello_body(bytes(body))
        except BusProtocolError as exc:
            failure = (SecurityFailure.LINE_TOO_LONG
                       if exc.reason is BusProtocolErrorReason.LINE_TOO_LONG
                       else SecurityFailure.MALFORMED_HELLO)
            raise _HelloRefused(_bad_request(failure, exc.reason.value), body_done=True) from None

    async def _session(self, receive: Receive, send: Send, cred: _Credential,
                       ids: set[str]) -> None:
        try:
            hello = await self._read_hello(receive)
        except _HelloRefused as refused:
            assert refused.refusal.failure is not None
            self._security_failure(refused.refusal.failure)
            await self._refuse(receive, send, refused.refusal, body_done=refused.body_done)
            return
        if hello is None:
            return
        broker = self._broker(hello.client_id) if hello.client_id in ids else None
        if broker is None:
            raise _forbidden(SecurityFailure.CLIENT_ID_MISMATCH)
        if hello.role.value != str(broker.role):
            raise _forbidden(SecurityFailure.ROLE_MISMATCH)
        if hello.role is not Role.KV_LISTENER:
            raise _forbidden(SecurityFailure.ROLE_NOT_SERVED)
        allowed = set(broker.backends)
        if any(b not in allowed for b in hello.sources):
            raise _forbidden(SecurityFailure.BACKEND_NOT_ALLOWED)
        if self._closing:
            raise _Refusal(503, None, _json_body("unavailable", "closing"))

        session = _Session(secrets.token_hex(16), hello, cred, self._clock())
        self._sessions[session.session_id] = session
        self.stats.sessions_opened += 1
        log.info("bus_session_opened", session_id=session.session_id, client_id=session.client_id,
                 sources=list(session.announced))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", NDJSON_CONTENT_TYPE.encode())]})
        await send({"type": "http.response.body",
                    "body": bp.encode_message(Welcome(session.session_id)), "more_body": True})
        self._notify_changed()
        watcher = asyncio.create_task(self._watch_disconnect(receive, session))
        try:
            while True:
                line = await session.outbox.get()
                if line is None:
                    break
                await send({"type": "http.response.body", "body": line, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self._end_session(session, SessionEnd.DISCONNECTED, forbidden=None)

    async def _watch_disconnect(self, receive: Receive, session: _Session) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._end_session(session, SessionEnd.DISCONNECTED, forbidden=None)
                return

    async def _stream(self, scope: Scope, receive: Receive, send: Send, ids: set[str]) -> None:
        stream_id = bp.parse_stream_path(scope["path"])
        stream = self._streams.get(stream_id) if stream_id is not None else None
        if stream is None or stream.attached.is_set() or stream.ended or not stream._session.live:
            raise _not_found(SecurityFailure.UNKNOWN_STREAM)
        if stream.client_id not in ids:
            # Same answer as an unknown stream: another client's stream IDs are not confirmed.
            raise _not_found(SecurityFailure.STREAM_OF_OTHER_CLIENT)
        stream.attached.set()
        if stream._attach_timer is not None:
            stream._attach_timer.cancel()
            stream._attach_timer = None
        self.stats.streams_attached += 1
        log.info("bus_stream_attached", backend=stream.backend, stream_id=stream.stream_id)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    stream._end(StreamEndReason.RESET, unsubscribe=False, keep_buffer=True)
                    return
                data = message.get("body", b"")
                if data:
                    self.stats.bytes_received += len(data)
                    stream._push(data)
                if not message.get("more_body", False):
                    stream._body_ended()
                    break
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            stream._end(StreamEndReason.RESET, unsubscribe=False, keep_buffer=True)
            self._forget_stream(stream)


class _BodyTooLong(Exception):
    pass


class _HelloRefused(Exception):
    def __init__(self, refusal: _Refusal, *, body_done: bool) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal
        self.body_done = body_done


class _HypercornConfig(HypercornConfig):
    """hypercorn's config with our own SSL context (ALPN h2 only, the peer-identity hook)."""

    def __init__(self, ssl_context: ssl.SSLContext) -> None:
        super().__init__()
        self._ssl_context = ssl_context
        # `ssl_enabled` is "certfile and keyfile are set"; the files are in our context already.
        self.certfile = "<in ssl context>"
        self.keyfile = "<in ssl context>"

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return self._ssl_context
