"""Router side of push mode (SPEC §7): the event-bus server that listeners connect to.

Owns: an HTTP/2-only TLS endpoint served by hypercorn (our own ASGI app, no framework), the
asyncio shell of the router's session rules: the live sessions (`POST /bus/v1/session`: hello
in, NDJSON control lines out) and their pushed streams (`POST /bus/v1/streams/{id}`: the
listener's SSE bytes in), and the consumer side: `open_announced_stream(backend,
last_event_id)` asks a live session for a backend's stream and returns an async iterator of
exactly the bytes the listener pushes. Who may do what (credentials, roles, the per-credential
backend allow-list, the TLS peer hook) is `bus_auth.py`; a session and a stream, and their state
tables (`core/push_session.py`), are `bus_sessions.py`.

Security failures never crash anything: each is answered (401/403/400/404, or the TLS handshake
is refused), counted under a `SecurityFailure` label and logged once per occurrence without
secrets.

Hypercorn (0.18) does not implement the ASGI TLS extension (pgjones/hypercorn#62, open), so the
ASGI scope carries no peer certificate. The well-kept stdlib hooks fill the gap:
`SSLContext.sslobject_class` (documented as overridable) gives us the `SSLObject` at the end of
each handshake (`bus_auth.sslobject_class`), where we check ALPN (`h2` only: HTTP/1.1 clients
are refused at the TLS layer) and read the verified certificate's DNS SANs into a `ContextVar`.
asyncio creates the connection task right after a successful handshake, in the same context, and
hypercorn spawns each request's ASGI task from that connection task, so every request of the
connection sees its own peer identity and nothing else (contexts are copied per task). The tests
prove it over real sockets.

Two hypercorn behaviours shape the app: a request body still being sent after our response has
ended makes hypercorn fail that connection, so every refusal is sent as a complete status and body
but the response is only ended once the request body has ended (bounded by a timeout); and
hypercorn acknowledges request DATA as soon as the app queue takes it, so each stream keeps its
own bounded buffer towards its consumer (a consumer too slow for it loses the stream, counted,
and re-requests it from its last event ID: nothing is dropped silently).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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
    NoSessionError,
    Subscribe,
    Unsubscribe,
    Welcome,
)
from kv_listener.core.push_session import (
    SERVER_TABLE,
    ServerInput,
    ServerState,
    StreamState,
    step,
)
from kv_listener.router.bus_auth import (
    Authenticator,
    Broker,
    BrokerEntry,
    BusTls,
    Credential,
    Refusal,
    SecurityFailure,
    TlsFiles,
    bad_request,
    json_body,
    not_found,
    server_ssl_context,
)
from kv_listener.router.bus_sessions import (
    BusSession,
    BusStream,
    SessionEnd,
    SessionInfo,
    StreamEndReason,
)

__all__ = ["Broker", "BrokerEntry", "BusServerStats", "BusStream", "BusTls", "EventBusServer",
           "NoSession", "SecurityFailure", "SessionEnd", "SessionInfo", "StreamEndReason",
           "TlsFiles"]

log = structlog.get_logger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class NoSession(NoSessionError):
    """No live session announces this backend (yet): retry after `reconnect_interval_ms`. A
    `NoSessionError`, which the consumer manager counts as `no_session`."""

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
        self._auth = Authenticator(brokers)
        self._sessions: dict[str, BusSession] = {}
        self._streams: dict[str, BusStream] = {}
        self._changed = asyncio.Event()
        self._port: int | None = None
        self._shutdown = asyncio.Event()
        self._started = asyncio.Event()
        self._serve_task: asyncio.Task[None] | None = None
        self._state = ServerState.SERVING

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
        return server_ssl_context(self.tls, self._security_failure)

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
                 mtls=self.tls.client_ca is not None, brokers=len(self._auth.brokers))

    async def close(self) -> None:
        """End every session (their streams end with `server_closed`) and stop serving."""
        closing = self._state is ServerState.CLOSING
        self._state = step(SERVER_TABLE, self._state, ServerInput.CLOSE)
        if closing:
            if self._serve_task is not None:
                await asyncio.shield(self._serve_task)
            return
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
        stream = BusStream(session, stream_id, backend, last_event_id,
                           self.max_stream_buffer_bytes, on_end=self._stream_ended,
                           on_draining=self._session_draining)
        session.streams[stream_id] = stream
        self._streams[stream_id] = stream
        self.stats.streams_requested += 1
        session.outbox.put_nowait(bp.encode_message(Subscribe(stream_id, backend, last_event_id)))
        stream.arm_attach_timer(self.attach_timeout_s)
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
        self._auth = Authenticator(brokers)
        for session in list(self._sessions.values()):
            reason = self._auth.still_allowed(session.client_id, session.auth, session.announced)
            if reason is not None:
                self._security_failure(SecurityFailure.REVOKED)
                log.warning("bus_session_revoked", session_id=session.session_id,
                            client_id=session.client_id, reason=reason.value)
                self._end_session(session, SessionEnd.FORBIDDEN, forbidden=reason.value)

    # --- internals: sessions and streams ------------------------------------------------

    def _pick_session(self, backend: str) -> BusSession | None:
        best: BusSession | None = None
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

    def _end_session(self, session: BusSession, reason: SessionEnd, *, forbidden: str | None) -> None:
        if not session.end(reason):
            return
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
            stream.end(stream_reason, unsubscribe=False,
                        keep_buffer=stream_reason is not StreamEndReason.FORBIDDEN)
        log.info("bus_session_ended", session_id=session.session_id, client_id=session.client_id,
                 reason=reason.value)
        self._notify_changed()

    def _stream_ended(self, stream: BusStream, reason: StreamEndReason, unsubscribe: bool) -> None:
        self.stats.streams_ended[reason.value] += 1
        session = stream.session
        if unsubscribe and session.live:
            session.outbox.put_nowait(bp.encode_message(Unsubscribe(stream.stream_id)))
        if stream.state is StreamState.ENDED_UNATTACHED:
            # Never opened: forget it now. An attached one is forgotten when its request ends.
            self._forget_stream(stream)
        if reason is StreamEndReason.DRAINING:
            self._session_draining(session)
        log.info("bus_stream_ended", backend=stream.backend, stream_id=stream.stream_id,
                 reason=reason.value, bytes=stream.bytes_received)

    def _session_draining(self, session: BusSession) -> None:
        if session.mark_draining():
            log.info("bus_session_draining", session_id=session.session_id,
                     client_id=session.client_id)
            self._notify_changed()

    def _forget_stream(self, stream: BusStream) -> None:
        self._streams.pop(stream.stream_id, None)
        stream.session.streams.pop(stream.stream_id, None)

    def _security_failure(self, failure: SecurityFailure) -> None:
        self.stats.security_failures[failure.value] += 1
        log.warning("bus_security_failure", reason=failure.value)
        if self._on_security_failure is not None:
            self._on_security_failure(failure)

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
                raise Refusal(505, SecurityFailure.NOT_HTTP2,
                               json_body("bad_request", "http2_required"))
            path = scope["path"]
            if path == bp.SESSION_PATH:
                route = "session"
            elif path.startswith(bp.STREAMS_PATH):
                route = "stream"
            else:
                raise Refusal(404, SecurityFailure.UNKNOWN_PATH, json_body("not_found", "path"))
            if scope["method"] != "POST":
                raise Refusal(405, SecurityFailure.METHOD_NOT_ALLOWED,
                               json_body("bad_request", "method"), [(b"allow", b"POST")])
            cred, ids = self._auth.authenticate(scope["headers"])
            if route == "session":
                body_done = True  # _session reads the body before it can refuse
                await self._session(receive, send, cred, ids)
            else:
                await self._stream(scope, receive, send, ids)
        except Refusal as refusal:
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

    async def _refuse(self, receive: Receive, send: Send, refusal: Refusal, *,
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
            raise _HelloRefused(bad_request(SecurityFailure.HELLO_TIMEOUT, "hello_timeout"),
                                body_done=False) from None
        except _BodyTooLong:
            raise _HelloRefused(bad_request(SecurityFailure.LINE_TOO_LONG,
                                             BusProtocolErrorReason.LINE_TOO_LONG.value),
                                body_done=False) from None
        try:
            return bp.decode_hello_body(bytes(body))
        except BusProtocolError as exc:
            failure = (SecurityFailure.LINE_TOO_LONG
                       if exc.reason is BusProtocolErrorReason.LINE_TOO_LONG
                       else SecurityFailure.MALFORMED_HELLO)
            raise _HelloRefused(bad_request(failure, exc.reason.value), body_done=True) from None

    async def _session(self, receive: Receive, send: Send, cred: Credential,
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
        self._auth.admit(hello, ids)
        if self._state is ServerState.CLOSING:
            raise Refusal(503, None, json_body("unavailable", "closing"))
        self._state = step(SERVER_TABLE, self._state, ServerInput.OPEN_SESSION)

        session = BusSession(secrets.token_hex(16), hello, cred, self._clock())
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

    async def _watch_disconnect(self, receive: Receive, session: BusSession) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._end_session(session, SessionEnd.DISCONNECTED, forbidden=None)
                return

    async def _stream(self, scope: Scope, receive: Receive, send: Send, ids: set[str]) -> None:
        stream_id = bp.parse_stream_path(scope["path"])
        stream = self._streams.get(stream_id) if stream_id is not None else None
        if stream is None or stream.state is not StreamState.REQUESTED or not stream.session.live:
            raise not_found(SecurityFailure.UNKNOWN_STREAM)
        if stream.client_id not in ids:
            # Same answer as an unknown stream: another client's stream IDs are not confirmed.
            raise not_found(SecurityFailure.STREAM_OF_OTHER_CLIENT)
        stream.attach()
        self.stats.streams_attached += 1
        log.info("bus_stream_attached", backend=stream.backend, stream_id=stream.stream_id)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    stream.end(StreamEndReason.RESET, unsubscribe=False, keep_buffer=True)
                    return
                data = message.get("body", b"")
                if data:
                    self.stats.bytes_received += len(data)
                    stream.receive(data)
                if not message.get("more_body", False):
                    stream.body_ended()
                    break
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            stream.end(StreamEndReason.RESET, unsubscribe=False, keep_buffer=True)
            self._forget_stream(stream)


class _BodyTooLong(Exception):
    pass


class _HelloRefused(Exception):
    def __init__(self, refusal: Refusal, *, body_done: bool) -> None:
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
