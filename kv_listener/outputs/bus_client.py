"""Listener side of push mode (SPEC §7): the outbound TLS HTTP/2 connection to a router's event bus.

Owns: one TLS connection (ALPN `h2`, https only, `tls_server_name` for both SNI and the verified
name, optional mTLS client certificate, bearer token read from `credential_file` /
`credential_env` at every connect), the HTTP/2 connection state machine on top of the sans-IO
`h2` library (flow-control windows honoured on every DATA frame, PINGs answered and sent as
keep-alive, GOAWAY and RST_STREAM handled), the session (`POST /bus/v1/session`: one hello line
out, NDJSON control lines in) and one pushed stream per `subscribe` (`POST /bus/v1/streams/{id}`
whose body is exactly the bytes of `open_stream(source, last_event_id)`, the same iterator
`GET /events/{backend}` serves), reconnecting with jittered exponential backoff, and draining on
shutdown.

Shape (after httpcore): `_H2Connection` is the protocol logic behind a thin network seam
(`NetworkStream`, opened by a `Connect` callable; `open_tls` is the real one); every library
error (OSError, ssl.SSLError, h2's ProtocolError) is translated at that edge into a `BusError`
whose `reason` is a `BusFailure` (a metric label). `BusClient` is the policy: what to send when.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import random
import ssl
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import structlog
from hpack import HeaderTuple, NeverIndexedHeaderTuple

from kv_listener import __version__
from kv_listener.config import ConfigError, EventBusConfig, read_secret
from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import (
    BusProtocolError,
    BusProtocolErrorReason,
    Forbidden,
    Hello,
    Role,
    Subscribe,
    Unsubscribe,
    Welcome,
)
from kv_listener.core.sse import ControlEvent, encode_control

log = structlog.get_logger(__name__)

OpenStream = Callable[[str, str | None], AsyncIterator[bytes]]

#: A session welcome this long resets the reconnect backoff (SPEC §7).
BACKOFF_RESET_AFTER_S = 30.0
#: Jitter: each backoff delay is shortened by up to this fraction (never beyond `max`).
BACKOFF_JITTER = 0.2
#: SPEC §7: after `unsubscribe` the request body ends within 1 s; we end it at once.
UNSUBSCRIBE_DEADLINE_S = 1.0
_READ_SIZE = 65536
_ERROR_BODY_CAP = 64 * 1024


class BusFailure(enum.StrEnum):
    """Why a connection or session ended. Values are metric labels."""

    CONFIG = "config"  # credential / certificate files unreadable
    CONNECT = "connect"  # TCP connect failed
    TIMEOUT = "timeout"  # connect + TLS + welcome took longer than connect_timeout
    TLS = "tls"  # handshake failed (untrusted certificate, wrong name, refused client cert)
    ALPN = "alpn"  # the router did not agree on h2
    UNAUTHORIZED = "unauthorized"  # 401
    FORBIDDEN = "forbidden"  # 403, or a `forbidden` line
    REJECTED = "rejected"  # any other non-200 answer to the session
    PROTOCOL = "protocol"  # HTTP/2 protocol error, or a session that breaks the bus protocol
    CONNECTION_LOST = "connection_lost"
    GOAWAY = "goaway"
    PING_TIMEOUT = "ping_timeout"
    SESSION_ENDED = "session_ended"  # the router ended the session's response
    RELOAD = "reload"  # the announced sources changed: reconnect at once with a new hello
    DRAINED = "drained"


class PushEnd(enum.StrEnum):
    """How one pushed stream ended. Values are metric labels."""

    COMPLETED = "completed"  # the iterator ended (after draining / buffer_overflow): body ended
    UNSUBSCRIBED = "unsubscribed"
    REFUSED = "refused"  # the router answered the stream POST with a non-200 status
    RESET_BY_ROUTER = "reset_by_router"
    OPEN_FAILED = "open_failed"  # open_stream raised (backend removed by a reload, hub limit)
    DRAINING = "draining"  # subscribed while draining: only the `draining` record was sent
    ABORTED = "aborted"  # the session or the connection ended under it


class BusError(Exception):
    def __init__(self, reason: BusFailure, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class StreamReset(Exception):
    """The router reset one stream (RST_STREAM)."""

    def __init__(self, error_code: int) -> None:
        super().__init__(f"stream reset by the router (error code {error_code})")
        self.error_code = error_code


@dataclass(slots=True)
class BusClientStats:
    """Counters for /stats and /metrics. Counter keys are Enum values."""

    connects: int = 0  # connection attempts
    sessions: int = 0  # sessions welcomed
    failures: Counter[str] = field(default_factory=Counter)  # BusFailure -> n
    protocol_errors: Counter[str] = field(default_factory=Counter)  # BusProtocolErrorReason -> n
    streams_opened: int = 0
    streams_ended: Counter[str] = field(default_factory=Counter)  # PushEnd -> n
    bytes_pushed: int = 0
    connected: bool = False  # a session is welcome now
    session_id: str | None = None
    last_welcome_at: float | None = None  # monotonic
    next_retry_in_s: float | None = None  # the backoff delay being waited, None otherwise


# --- the network seam -----------------------------------------------------------------------


class NetworkStream(Protocol):
    """The byte stream under one HTTP/2 connection (TLS already negotiated)."""

    async def read(self, n: int) -> bytes: ...  # b"" at EOF
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def alpn_protocol(self) -> str | None: ...
    async def aclose(self) -> None: ...


Connect = Callable[[str, int, ssl.SSLContext, str, float], Awaitable[NetworkStream]]


class _AsyncioTlsStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, n: int) -> bytes:
        return await self._reader.read(n)

    def write(self, data: bytes) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    def alpn_protocol(self) -> str | None:
        sslobj = self._writer.get_extra_info("ssl_object")
        return sslobj.selected_alpn_protocol() if sslobj is not None else None

    async def aclose(self) -> None:
        self._writer.close()
        try:
            # A peer that never answers the TLS close_notify must not hold shutdown up.
            async with asyncio.timeout(1.0):
                await self._writer.wait_closed()
        except (TimeoutError, OSError, ssl.SSLError):
            self._writer.transport.abort()


async def open_tls(host: str, port: int, context: ssl.SSLContext, server_hostname: str,
                   timeout_s: float) -> NetworkStream:
    """TCP connect + TLS handshake within `timeout_s`; errors become `BusError`."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=context, server_hostname=server_hostname,
                ssl_handshake_timeout=timeout_s)
    except TimeoutError:
        raise BusError(BusFailure.TIMEOUT, f"connect to {host}:{port}") from None
    except ssl.SSLError as exc:
        raise BusError(BusFailure.TLS, str(exc)) from None
    except OSError as exc:
        raise BusError(BusFailure.CONNECT, f"{host}:{port}: {exc.strerror or exc}") from None
    return _AsyncioTlsStream(reader, writer)


# --- HTTP/2 connection ----------------------------------------------------------------------


class _Stream:
    __slots__ = ("ended", "inbound", "reset", "response", "wake")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.response: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = loop.create_future()
        self.inbound: deque[bytes] = deque()
        self.ended = False  # the router's END_STREAM arrived
        self.reset: int | None = None  # RST_STREAM error code
        self.wake = asyncio.Event()


class _H2Connection:
    """Client side of one HTTP/2 connection: h2's state machine plus the I/O it asks for.

    h2 calls are synchronous, so each one and the `data_to_send()` that follows it run without
    an await in between: no other task can interleave with a half-done operation.
    """

    def __init__(self, net: NetworkStream, *, ping_interval_s: float, ping_timeout_s: float) -> None:
        self._net = net
        self._h2 = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding=None))
        self._loop = asyncio.get_running_loop()
        self._streams: dict[int, _Stream] = {}
        self._progress = asyncio.Event()  # replaced on every set: "something changed"
        self._ping_interval_s = ping_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._pings: dict[bytes, asyncio.Future[None]] = {}
        self._ping_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self.error: BusError | None = None
        self.failed = asyncio.Event()

    async def start(self) -> None:
        self._h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0,  # the router opens no streams
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 65536,
        })
        self._h2.initiate_connection()
        await self._flush_and_drain()
        self._tasks.append(asyncio.create_task(self._reader(), name="bus-h2-reader"))
        self._tasks.append(asyncio.create_task(self._pinger(), name="bus-h2-ping"))

    # --- I/O ---

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data:
            self._net.write(data)

    async def _flush_and_drain(self) -> None:
        self._flush()
        try:
            await self._net.drain()
        except (OSError, ssl.SSLError, RuntimeError) as exc:
            self._fail(BusError(BusFailure.CONNECTION_LOST, str(exc)))
            raise self.error or BusError(BusFailure.CONNECTION_LOST) from None

    def _signal(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def _fail(self, error: BusError) -> None:
        if self.error is not None:
            return
        self.error = error
        self.failed.set()
        for st in self._streams.values():
            st.wake.set()
            if not st.response.done():
                st.response.set_exception(error)
                st.response.exception()  # retrieved: nobody may be waiting for it
        for fut in self._pings.values():
            if not fut.done():
                fut.set_exception(error)
                fut.exception()
        self._signal()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    async def _reader(self) -> None:
        try:
            while True:
                data = await self._net.read(_READ_SIZE)
                if not data:
                    raise BusError(BusFailure.CONNECTION_LOST, "the router closed the connection")
                try:
                    events = self._h2.receive_data(data)
                except h2.exceptions.ProtocolError as exc:
                    self._flush()  # h2 queued a GOAWAY for the router
                    raise BusError(BusFailure.PROTOCOL, f"HTTP/2: {exc}") from None
                for event in events:
                    self._on_event(event)
                self._flush()  # PING and SETTINGS acks, WINDOW_UPDATEs
                self._signal()
        except BusError as exc:
            self._fail(exc)
        except (OSError, ssl.SSLError) as exc:
            self._fail(BusError(BusFailure.CONNECTION_LOST, str(exc)))

    def _on_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            st = self._streams.get(event.stream_id)
            if st is not None and not st.response.done():
                status = 0
                headers: list[tuple[bytes, bytes]] = []
                for name, value in event.headers or ():
                    n, v = bytes(name), bytes(value)
                    if n == b":status":
                        status = int(v) if v.isdigit() else 0
                    else:
                        headers.append((n, v))
                st.response.set_result((status, headers))
        elif isinstance(event, h2.events.DataReceived):
            sid = event.stream_id
            assert sid is not None
            # Acknowledge at once: what we keep is bounded by the consumers (session lines are
            # capped at 64 KiB; stream responses carry no body and are discarded).
            if event.flow_controlled_length:
                self._h2.acknowledge_received_data(event.flow_controlled_length, sid)
            st = self._streams.get(sid)
            if st is not None and event.data:
                st.inbound.append(bytes(event.data))
                st.wake.set()
        elif isinstance(event, h2.events.StreamEnded):
            st = self._streams.get(event.stream_id)
            if st is not None:
                st.ended = True
                st.wake.set()
                if not st.response.done():
                    st.response.set_exception(
                        BusError(BusFailure.PROTOCOL, "stream ended without a response"))
                    st.response.exception()
        elif isinstance(event, h2.events.StreamReset):
            st = self._streams.get(event.stream_id)
            if st is not None:
                st.reset = int(event.error_code or 0)
                st.wake.set()
                if not st.response.done():
                    st.response.set_exception(StreamReset(st.reset))
                    st.response.exception()
        elif isinstance(event, h2.events.PingAckReceived):
            fut = self._pings.pop(bytes(event.ping_data or b""), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(event, h2.events.ConnectionTerminated):
            code = event.error_code
            raise BusError(BusFailure.GOAWAY, f"GOAWAY from the router (error code {code})")
        # PingReceived: h2 queued the ACK itself. WindowUpdated / RemoteSettingsChanged: the
        # `_signal()` after this batch wakes every sender waiting for a window.

    async def _pinger(self) -> None:
        """Keep-alive: a PING every `ping_interval_s`; no ACK within `ping_timeout_s` means the
        connection is dead (a silent network drop would otherwise go unnoticed)."""
        while self.error is None:
            await asyncio.sleep(self._ping_interval_s)
            if self.error is not None:
                return
            payload = next(self._ping_ids).to_bytes(8, "big")
            fut: asyncio.Future[None] = self._loop.create_future()
            self._pings[payload] = fut
            try:
                self._h2.ping(payload)
                await self._flush_and_drain()
                async with asyncio.timeout(self._ping_timeout_s):
                    await fut
            except TimeoutError:
                self._fail(BusError(BusFailure.PING_TIMEOUT,
                                    f"no PING ACK within {self._ping_timeout_s:g} s"))
                return
            except BusError:
                return

    # --- streams ---

    async def open_request(self, path: str, headers: list[HeaderTuple]) -> int:
        """Send a request's HEADERS (body to follow); waits for a free stream slot."""
        while True:
            self._check()
            # Respect the router's SETTINGS_MAX_CONCURRENT_STREAMS.
            if self._h2.open_outbound_streams < self._h2.remote_settings.max_concurrent_streams:
                break
            await self._progress.wait()
        stream_id = self._h2.get_next_available_stream_id()
        self._streams[stream_id] = _Stream(self._loop)
        try:
            self._h2.send_headers(stream_id, [HeaderTuple(b":path", path.encode()), *headers])
        except h2.exceptions.ProtocolError as exc:
            self._streams.pop(stream_id, None)
            raise BusError(BusFailure.PROTOCOL, f"cannot open a stream: {exc}") from None
        await self._flush_and_drain()
        return stream_id

    async def send_data(self, stream_id: int, data: bytes, *, end_stream: bool = False) -> None:
        """Send `data`, frame by frame, each no larger than the flow-control window allows;
        waits for WINDOW_UPDATE when the window is empty. Raises StreamReset or BusError."""
        st = self._streams[stream_id]
        view = memoryview(data)
        while view:
            self._check()
            if st.reset is not None:
                raise StreamReset(st.reset)
            try:
                window = self._h2.local_flow_control_window(stream_id)
            except h2.exceptions.StreamClosedError:
                raise StreamReset(st.reset or 0) from None
            size = min(window, self._h2.max_outbound_frame_size, len(view))
            if size <= 0:
                await self._progress.wait()
                continue
            self._h2.send_data(stream_id, view[:size].tobytes())
            view = view[size:]
            await self._flush_and_drain()
        if end_stream:
            await self.end_stream(stream_id)

    async def end_stream(self, stream_id: int) -> None:
        """End the request body (an empty DATA frame with END_STREAM needs no window)."""
        self._check()
        try:
            self._h2.end_stream(stream_id)
        except h2.exceptions.ProtocolError:
            return  # already closed (reset by the router)
        await self._flush_and_drain()

    def reset_stream(self, stream_id: int, code: int = h2.errors.ErrorCodes.CANCEL) -> None:
        if self.error is not None:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self._h2.reset_stream(stream_id, code)
            self._flush()

    async def response(self, stream_id: int) -> tuple[int, list[tuple[bytes, bytes]]]:
        return await self._streams[stream_id].response

    async def read(self, stream_id: int) -> bytes | None:
        """Next chunk of the response body; None once the router ended it."""
        st = self._streams[stream_id]
        while True:
            if st.inbound:
                return b"".join(st.inbound.popleft() for _ in range(len(st.inbound)))
            if st.reset is not None:
                raise StreamReset(st.reset)
            if st.ended:
                return None
            self._check()
            st.wake.clear()
            await st.wake.wait()

    async def read_all(self, stream_id: int, cap: int) -> bytes:
        out = bytearray()
        while len(out) <= cap:
            chunk = await self.read(stream_id)
            if chunk is None:
                break
            out += chunk
        return bytes(out[:cap])

    async def remote_done(self, stream_id: int) -> None:
        """Return once the router ended or reset its side of the stream (or the connection
        failed)."""
        st = self._streams[stream_id]
        while st.reset is None and not st.ended and self.error is None:
            st.wake.clear()
            await st.wake.wait()

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def close(self) -> None:
        """GOAWAY (when still healthy), stop the tasks, close the TLS stream."""
        if self.error is None:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.close_connection()
                self._flush()
            self._fail(BusError(BusFailure.DRAINED, "closed"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._net.aclose()


# --- backoff --------------------------------------------------------------------------------


class Backoff:
    """Exponential reconnect delay: `initial_s`, doubling to `max_s`, each delay shortened by a
    random fraction up to `BACKOFF_JITTER` (so a fleet of listeners does not reconnect in
    lockstep, and `max_s` is never exceeded)."""

    def __init__(self, initial_s: float, max_s: float, rng: Callable[[], float] = random.random) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._rng = rng
        self._next = initial_s

    def reset(self) -> None:
        self._next = self.initial_s

    def next_delay(self) -> float:
        base = self._next
        self._next = min(self._next * 2, self.max_s)
        return base * (1.0 - BACKOFF_JITTER * self._rng())


# --- the client -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    authority: str
    base_path: str
    server_hostname: str


def _target(config: EventBusConfig) -> _Target:
    parts = urlsplit(config.url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"event_bus.url must be an https URL with a host, got {config.url!r}")
    port = parts.port or 443
    host = parts.hostname
    authority = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        authority += f":{port}"
    return _Target(host, port, authority, parts.path.rstrip("/"), config.tls_server_name or host)


class _Session:
    """Bookkeeping of one welcomed session (one connection)."""

    def __init__(self, conn: _H2Connection, sources: tuple[str, ...]) -> None:
        self.conn = conn
        self.sources = sources
        self.session_id: str | None = None
        self.welcomed_at: float | None = None
        self.pushes: dict[str, _Push] = {}


class _Push:
    __slots__ = ("stop", "sub", "task")

    def __init__(self, sub: Subscribe) -> None:
        self.sub = sub
        self.stop = asyncio.Event()  # unsubscribe
        self.task: asyncio.Task[None] | None = None


class BusClient:
    """Push mode, listener side. `await run()` (until cancelled, or until `drain()` finished);
    `await drain()` on shutdown; `sources_changed()` after a reload.

    `sources()` returns the backends to announce (read at every connect). `open_stream(backend,
    last_event_id)` returns the async iterator of that backend's SSE bytes from that ID, the
    exact bytes `GET /events/{backend}` would send (the stream hub's `open`); it ends after a
    `draining` or `buffer_overflow` record, and is closed (`aclose()`) when the push ends early.
    """

    def __init__(
        self,
        config: EventBusConfig,
        sources: Callable[[], Sequence[str]],
        open_stream: OpenStream,
        *,
        stats: BusClientStats | None = None,
        connect: Connect = open_tls,
        ping_interval_s: float = 10.0,
        ping_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.config = config
        self._target = _target(config)
        self._sources = sources
        self._open_stream = open_stream
        self.stats = stats if stats is not None else BusClientStats()
        self._connect = connect
        self._ping_interval_s = ping_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._clock = clock
        self._backoff = Backoff(config.reconnect_backoff.initial_s, config.reconnect_backoff.max_s, rng)
        self._session: _Session | None = None
        self._wakeup = asyncio.Event()  # reload or drain: stop waiting / end the session
        self._reload = False
        self._draining = False
        self._running = False
        self._stopped = asyncio.Event()
        self._stopped.set()
        self.welcomed = asyncio.Event()  # set while a session is welcome (tests, readiness)
        self._changed = asyncio.Event()  # replaced on every set: "stats changed"

    # --- public ---

    async def wait_stats(self, predicate: Callable[[BusClientStats], bool]) -> None:
        """Return once `predicate(stats)` holds (checked after every change of the counters)."""
        while not predicate(self.stats):
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def announced(self) -> tuple[str, ...] | None:
        """Sources the current session announced (None: no session)."""
        return self._session.sources if self._session is not None else None

    def sources_changed(self) -> None:
        """Call after a reload: when the sources to announce differ from the current session's,
        the session ends and a new one announces the new list at once (no backoff). Pushed
        streams end; the router's consumers resume them from their last IDs."""
        current = self.announced
        if current is not None and tuple(self._sources()) == current:
            return
        self._reload = True
        self._wakeup.set()

    async def run(self) -> None:
        """Connect, keep a session, push what the router subscribes; reconnect with backoff.
        Returns after `drain()`; otherwise runs until cancelled."""
        if self._running:
            raise RuntimeError("BusClient.run() is already running")
        self._running = True
        self._stopped.clear()
        try:
            while not self._draining:
                self._reload = False
                self._wakeup.clear()
                session_welcomed_for = 0.0
                detail = ""
                try:
                    session_welcomed_for = await self._run_session()
                    failure = BusFailure.DRAINED if self._draining else BusFailure.RELOAD
                except BusError as exc:
                    failure = exc.reason
                    detail = exc.detail  # router's refusal reason, TLS error text: no secrets
                    if self._reload and not self._draining:
                        failure = BusFailure.RELOAD
                    if self._session is not None and self._session.welcomed_at is not None:
                        session_welcomed_for = self._clock() - self._session.welcomed_at
                    if failure not in (BusFailure.RELOAD, BusFailure.DRAINED):
                        self.stats.failures[failure.value] += 1
                except Exception as exc:  # never let a bug end push mode: log, back off, retry
                    log.error("bus_session_crashed", error=repr(exc))
                    failure = BusFailure.PROTOCOL
                    self.stats.failures[failure.value] += 1
                finally:
                    self._session = None
                    self.stats.connected = False
                    self.stats.session_id = None
                    self.welcomed.clear()
                if self._draining:
                    break
                if failure is BusFailure.RELOAD:
                    log.info("bus_reconnect_for_reload")
                    self._notify()
                    continue
                if session_welcomed_for >= BACKOFF_RESET_AFTER_S:
                    self._backoff.reset()
                delay = self._backoff.next_delay()
                self.stats.next_retry_in_s = delay
                self._notify()
                log.warning("bus_session_lost", reason=failure.value, detail=detail[:300],
                            retry_in_s=round(delay, 3))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wakeup.wait()
                self.stats.next_retry_in_s = None
        finally:
            self._running = False
            self._stopped.set()

    async def drain(self) -> None:
        """Shutdown: accept no new subscription; every pushed stream carries on until its
        iterator ends (the hub sends `draining` to each when it drains) and the router has the
        whole body; then close. Waits at most `drain_deadline`; streams still open then are
        reset. `run()` returns."""
        self._draining = True
        deadline = self.config.drain_deadline_s
        session = self._session
        if session is not None:
            pushes = [p.task for p in session.pushes.values() if p.task is not None]
            if pushes:
                _done, pending = await asyncio.wait(pushes, timeout=deadline)
                if pending:
                    log.warning("bus_drain_deadline", streams_left=len(pending))
        self._wakeup.set()
        if self._running:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline + 1.0):
                    await self._stopped.wait()
        log.info("bus_drained")

    # --- session ---

    def _headers(self, token: bytes | None, content_type: bytes) -> list[HeaderTuple]:
        headers = [
            HeaderTuple(b":method", b"POST"),
            HeaderTuple(b":scheme", b"https"),
            HeaderTuple(b":authority", self._target.authority.encode()),
            HeaderTuple(b"content-type", content_type),
            HeaderTuple(b"user-agent", f"continuum-kv-listener/{__version__}".encode()),
        ]
        if token is not None:
            # Never indexed: keeps the token out of HPACK tables (compression side channels).
            headers.append(NeverIndexedHeaderTuple(b"authorization", b"Bearer " + token))
        return headers

    def _credentials(self) -> tuple[bytes | None, ssl.SSLContext]:
        cfg = self.config
        try:
            token = read_secret(cfg.credential_file, cfg.credential_env)
        except ConfigError as exc:
            raise BusError(BusFailure.CONFIG, str(exc)) from None
        if token is not None and not bp.valid_token(token):
            raise BusError(BusFailure.CONFIG, "the bus credential has characters a header cannot carry")
        try:
            ctx = ssl.create_default_context(cafile=cfg.ca_file)  # None: the system roots
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.set_alpn_protocols(["h2"])
            if cfg.client_cert_file is not None:
                ctx.load_cert_chain(cfg.client_cert_file, cfg.client_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(BusFailure.CONFIG, f"TLS files: {exc}") from None
        return token, ctx

    async def _run_session(self) -> float:
        """One connection and its session. Returns (after a reload or drain request) how long the
        session was welcome; raises BusError when it failed."""
        token, ctx = self._credentials()
        sources = tuple(self._sources())
        try:
            hello = bp.encode_hello(Hello(Role.KV_LISTENER, self.config.client_id, sources))
        except BusProtocolError as exc:
            raise BusError(BusFailure.CONFIG, f"hello: {exc}") from None
        t = self._target
        self.stats.connects += 1
        timeout_s = self.config.connect_timeout_s
        net = await self._connect(t.host, t.port, ctx, t.server_hostname, timeout_s)
        if net.alpn_protocol() != "h2":
            await net.aclose()
            raise BusError(BusFailure.ALPN, "the router did not negotiate h2")
        conn = _H2Connection(net, ping_interval_s=self._ping_interval_s,
                             ping_timeout_s=self._ping_timeout_s)
        session = _Session(conn, sources)
        self._session = session
        try:
            await conn.start()
            sid = await conn.open_request(t.base_path + bp.SESSION_PATH,
                                          self._headers(token, bp.NDJSON_CONTENT_TYPE.encode()))
            await conn.send_data(sid, hello, end_stream=True)
            try:
                async with asyncio.timeout(timeout_s):
                    status, _headers = await conn.response(sid)
                    if status != 200:
                        body = await conn.read_all(sid, _ERROR_BODY_CAP)
                        raise _refusal(status, body)
                    splitter = bp.LineSplitter()
                    lines: deque[bytes] = deque()
                    while not lines:
                        chunk = await conn.read(sid)
                        if chunk is None:
                            raise BusError(BusFailure.SESSION_ENDED, "ended before welcome")
                        lines.extend(splitter.feed(chunk))
            except TimeoutError:
                raise BusError(BusFailure.TIMEOUT, "no welcome within connect_timeout") from None
            except StreamReset as exc:
                raise BusError(BusFailure.REJECTED, str(exc)) from None
            except BusProtocolError as exc:
                raise BusError(BusFailure.PROTOCOL, str(exc)) from None
            first = self._decode(lines.popleft())
            if not isinstance(first, Welcome):
                if isinstance(first, Forbidden):
                    raise BusError(BusFailure.FORBIDDEN, first.reason)
                raise BusError(BusFailure.PROTOCOL, "the first session line is not welcome")
            session.session_id = first.session_id
            session.welcomed_at = self._clock()
            self.stats.sessions += 1
            self.stats.connected = True
            self.stats.session_id = first.session_id
            self.stats.last_welcome_at = session.welcomed_at
            self.welcomed.set()
            self._notify()
            log.info("bus_session_welcome", session_id=first.session_id, sources=list(sources))
            for line in lines:
                self._on_line(session, line)
            await self._session_loop(session, sid, splitter)
            return self._clock() - session.welcomed_at
        finally:
            await self._end_session(session)

    async def _session_loop(self, session: _Session, sid: int, splitter: bp.LineSplitter) -> None:
        conn = session.conn
        wake = asyncio.create_task(self._wakeup.wait())
        read: asyncio.Task[bytes | None] | None = None
        try:
            while True:
                read = asyncio.create_task(conn.read(sid))
                await asyncio.wait({read, wake}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    with contextlib.suppress(asyncio.CancelledError, BusError, StreamReset):
                        await read
                    # Reload, or drain() has waited for the pushes already: end the session.
                    return
                try:
                    chunk = read.result()
                except StreamReset as exc:
                    raise BusError(BusFailure.SESSION_ENDED, str(exc)) from None
                if chunk is None:
                    raise BusError(BusFailure.SESSION_ENDED, "the router ended the session")
                try:
                    lines = splitter.feed(chunk)
                except BusProtocolError as exc:
                    self.stats.protocol_errors[exc.reason.value] += 1
                    raise BusError(BusFailure.PROTOCOL, str(exc)) from None
                for line in lines:
                    self._on_line(session, line)
        finally:
            wake.cancel()
            if read is not None:
                # Cancelled from outside mid-read: the read fails once the connection closes.
                read.cancel()
                read.add_done_callback(_retrieve)

    def _decode(self, line: bytes) -> bp.RouterMessage | None:
        try:
            return bp.decode_message(line)
        except BusProtocolError as exc:
            self.stats.protocol_errors[exc.reason.value] += 1
            self._notify()
            if exc.reason is not BusProtocolErrorReason.UNKNOWN_TYPE:
                log.warning("bus_bad_session_line", reason=exc.reason.value)
            return None

    def _on_line(self, session: _Session, line: bytes) -> None:
        msg = self._decode(line)
        if msg is None:
            return  # counted; an unknown kind of line from a newer router is skipped
        if isinstance(msg, Forbidden):
            log.error("bus_forbidden", reason=msg.reason, session_id=session.session_id)
            raise BusError(BusFailure.FORBIDDEN, msg.reason)
        if isinstance(msg, Welcome):
            self.stats.protocol_errors["second_welcome"] += 1
            return
        if isinstance(msg, Unsubscribe):
            push = session.pushes.get(msg.stream_id)
            if push is not None:
                push.stop.set()
            return
        # Subscribe
        if msg.stream_id in session.pushes:
            self.stats.protocol_errors["duplicate_stream"] += 1
            return
        if msg.announced_source not in session.sources:
            # Only what this session announced may be pushed (the router checked its side).
            self.stats.protocol_errors["unannounced_source"] += 1
            log.warning("bus_subscribe_unannounced", backend=msg.announced_source)
            return
        push = _Push(msg)
        session.pushes[msg.stream_id] = push
        push.task = asyncio.create_task(self._push(session, push),
                                        name=f"bus-push-{msg.announced_source}")

    async def _end_session(self, session: _Session) -> None:
        # A list: each push removes itself from `session.pushes` when it ends.
        tasks = [p.task for p in list(session.pushes.values()) if p.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await session.conn.close()

    # --- one pushed stream ---

    async def _push(self, session: _Session, push: _Push) -> None:
        conn = session.conn
        sub = push.sub
        end = PushEnd.ABORTED
        sid: int | None = None
        iterator: AsyncIterator[bytes] | None = None
        try:
            token = self._token()
            sid = await conn.open_request(
                self._target.base_path + bp.stream_path(sub.stream_id),
                self._headers(token, b"text/event-stream"))
            self.stats.streams_opened += 1
            self._notify()
            if self._draining:
                # Subscribed while shutting down: the answer a new consumer gets is `draining`.
                await conn.send_data(sid, encode_control(ControlEvent.DRAINING, sub.announced_source),
                                     end_stream=True)
                end = PushEnd.DRAINING
                return
            try:
                iterator = self._open_stream(sub.announced_source, sub.last_event_id)
            except Exception as exc:  # the hub refused (backend removed by a reload, limits)
                log.warning("bus_open_stream_failed", backend=sub.announced_source, error=repr(exc))
                conn.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
                end = PushEnd.OPEN_FAILED
                return
            log.info("bus_push_started", backend=sub.announced_source, stream_id=sub.stream_id,
                     resume=sub.last_event_id is not None)
            end = await self._pump(conn, sid, push, iterator)
            if end in (PushEnd.COMPLETED, PushEnd.UNSUBSCRIBED):
                await conn.end_stream(sid)
                if end is PushEnd.COMPLETED:
                    # The router ends its response once it has the whole body: wait for that so
                    # a drain does not close the connection under the last bytes.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.config.drain_deadline_s):
                            await conn.remote_done(sid)
            else:
                conn.reset_stream(sid)
        except (BusError, StreamReset) as exc:
            end = PushEnd.RESET_BY_ROUTER if isinstance(exc, StreamReset) else PushEnd.ABORTED
            if sid is not None:
                conn.reset_stream(sid)
        except asyncio.CancelledError:
            if sid is not None:
                conn.reset_stream(sid)
            raise
        except Exception as exc:  # a bug must end this push only, never the session
            log.error("bus_push_failed", stream_id=sub.stream_id, error=repr(exc))
            if sid is not None:
                conn.reset_stream(sid)
        finally:
            self.stats.streams_ended[end.value] += 1
            self._notify()
            if iterator is not None:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            if sid is not None:
                conn.forget(sid)
            session.pushes.pop(sub.stream_id, None)
            log.info("bus_push_ended", backend=sub.announced_source, stream_id=sub.stream_id,
                     end=end.value)

    async def _pump(self, conn: _H2Connection, sid: int, push: _Push,
                    iterator: AsyncIterator[bytes]) -> PushEnd:
        """Copy the iterator into the request body until it ends, the router unsubscribes,
        refuses or resets the stream. Unsubscribe interrupts even a send waiting for a window."""
        outcome: list[PushEnd] = []

        async def copy() -> None:
            async for chunk in iterator:
                await conn.send_data(sid, chunk)
                self.stats.bytes_pushed += len(chunk)
            outcome.append(PushEnd.COMPLETED)

        async def watch_router() -> None:
            try:
                status, _ = await conn.response(sid)
            except StreamReset:
                outcome.append(PushEnd.RESET_BY_ROUTER)
                return
            if status != 200:
                log.warning("bus_stream_refused", stream_id=push.sub.stream_id, status=status)
                outcome.append(PushEnd.REFUSED)
                return
            await conn.remote_done(sid)  # ends early only if the router gave up the stream
            if conn.error is not None:
                raise conn.error
            outcome.append(PushEnd.RESET_BY_ROUTER)

        async def watch_stop() -> None:
            await push.stop.wait()
            outcome.append(PushEnd.UNSUBSCRIBED)

        tasks = [asyncio.create_task(copy()), asyncio.create_task(watch_router()),
                 asyncio.create_task(watch_stop())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for task, result in zip(tasks, results, strict=True):
            if task not in done or not isinstance(result, BaseException):
                continue
            if isinstance(result, BusError | StreamReset):
                raise result
            if not isinstance(result, asyncio.CancelledError):
                # The iterator itself failed (a hub bug): this stream ends, the session lives.
                log.error("bus_push_iterator_failed", stream_id=push.sub.stream_id,
                          error=repr(result))
                return PushEnd.ABORTED
        if not outcome:
            raise BusError(BusFailure.PROTOCOL, "push ended without an outcome")
        return outcome[0]

    def _token(self) -> bytes | None:
        # Re-read for each stream: a rotated token file applies to new streams too. Unreadable
        # now, it ends only this push.
        try:
            return read_secret(self.config.credential_file, self.config.credential_env)
        except ConfigError as exc:
            raise BusError(BusFailure.CONFIG, str(exc)) from None


def _retrieve(task: asyncio.Task[bytes | None]) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved: its failure is the session's, already handled


def _refusal(status: int, body: bytes) -> BusError:
    reason = ""
    try:
        obj = json.loads(body.decode("utf-8").splitlines()[0]) if body.strip() else {}
        if isinstance(obj, dict) and isinstance(obj.get("reason"), str):
            reason = obj["reason"][:256]
    except (ValueError, UnicodeDecodeError, IndexError, RecursionError):
        pass
    if status == 401:
        return BusError(BusFailure.UNAUTHORIZED, reason or "401")
    if status == 403:
        return BusError(BusFailure.FORBIDDEN, reason or "403")
    return BusError(BusFailure.REJECTED, f"HTTP {status}" + (f" ({reason})" if reason else ""))
