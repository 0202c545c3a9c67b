"""The event bus's live sessions and the pushed streams they carry (SPEC §7, router side).

Owns: `BusSession` (one welcomed listener session: what it announced, its credential, its
outbox of control lines, its streams) and `BusStream` (one backend's pushed SSE bytes for one
consumer: a bounded buffer, how it ended, the attach timer), whose states step the router's
tables in `core/push_session.py` (`SESSION_TABLE`, `STREAM_TABLE`). A stream tells its owner
what happened through the two callbacks it was given (`on_end`, `on_draining`); the server
drives it through its public methods (`attach`, `receive`, `body_ended`, `end`).
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import Hello, StreamEnd
from kv_listener.core.push_session import (
    SESSION_TABLE,
    STREAM_TABLE,
    SessionInput,
    SessionState,
    StreamInput,
    StreamState,
    step,
)
from kv_listener.router.bus_auth import Credential
from kv_listener.timer import Deadline

log = structlog.get_logger(__name__)


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


class BusSession:
    """One welcomed session; `state` steps `SESSION_TABLE`."""

    __slots__ = ("announced", "auth", "client_id", "end_reason", "outbox", "session_id", "state",
                 "streams", "welcomed_at")

    def __init__(self, session_id: str, hello: Hello, auth: Credential, now: float) -> None:
        self.session_id = session_id
        self.client_id = hello.client_id
        self.announced = hello.sources
        self.auth = auth
        self.welcomed_at = now
        self.state = SessionState.LIVE
        self.end_reason: SessionEnd | None = None
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.streams: dict[str, BusStream] = {}

    @property
    def live(self) -> bool:
        return self.state is not SessionState.ENDED

    @property
    def draining(self) -> bool:
        """One of its streams ended with `draining`: it is asked for no new stream."""
        return self.state is SessionState.DRAINING

    def mark_draining(self) -> bool:
        """True when this made a live session draining."""
        before = self.state
        self.state = step(SESSION_TABLE, before, SessionInput.DRAINING_SEEN)
        return self.state is not before

    def end(self, reason: SessionEnd) -> bool:
        """True when this ended it (False: it had ended already)."""
        if self.state is SessionState.ENDED:
            return False
        self.state = step(SESSION_TABLE, self.state, SessionInput.END)
        self.end_reason = reason
        return True


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    client_id: str
    sources: tuple[str, ...]
    welcomed_at: float  # monotonic
    draining: bool
    streams: int


#: `on_end(stream, reason, unsubscribe)`: count it, tell the listener, forget it if unattached.
OnStreamEnd = Callable[["BusStream", StreamEndReason, bool], None]


class BusStream:
    """One backend's pushed SSE bytes, for one consumer. Async-iterate it; it ends (raises
    StopAsyncIteration) when the stream is over for any reason (`end_reason` says which), after
    handing out every byte received. Close it (`aclose()`) to give it up: the listener is told to
    `unsubscribe`. `state` steps `STREAM_TABLE`; the attach timer runs while it is `REQUESTED`."""

    def __init__(self, session: BusSession, stream_id: str, backend: str,
                 last_event_id: str | None, max_buffer_bytes: int, *, on_end: OnStreamEnd,
                 on_draining: Callable[[BusSession], None]) -> None:
        self.session = session
        self.stream_id = stream_id
        self.backend = backend
        self.last_event_id = last_event_id
        self.client_id = session.client_id
        self.session_id = session.session_id
        self.state = StreamState.REQUESTED
        self.end_reason: StreamEndReason | None = None
        self.attached = asyncio.Event()  # the listener opened the stream (its POST was accepted)
        self.bytes_received = 0
        self._on_end = on_end
        self._on_draining = on_draining
        self._max_buffer_bytes = max_buffer_bytes
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._wake = asyncio.Event()
        self._tail = b""
        self._attach_deadline = Deadline(self._attach_timed_out)

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
        self.end(StreamEndReason.CLOSED, unsubscribe=True)

    async def __aenter__(self) -> BusStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # --- driven by the server ---

    def arm_attach_timer(self, timeout_s: float) -> None:
        """The listener must open the stream within `timeout_s`, or it ends (`attach_timeout`)."""
        self._attach_deadline.arm(timeout_s)

    def attach(self) -> None:
        self.state = step(STREAM_TABLE, self.state, StreamInput.ATTACH)
        self.attached.set()
        self._attach_deadline.cancel()

    def receive(self, data: bytes) -> None:
        """Bytes of the pushed body."""
        if self.end_reason is not None:
            return  # given up (unsubscribed, forbidden): the listener is ending the body
        self.bytes_received += len(data)
        self._chunks.append(data)
        self._buffered += len(data)
        # Only the end matters; slicing `data` first keeps this O(tail), not O(chunk).
        self._tail = (self._tail + data[-bp.STREAM_TAIL_BYTES:])[-bp.STREAM_TAIL_BYTES:]
        if b"draining" in data and bp.stream_end_kind(self._tail) is StreamEnd.DRAINING:
            # Known before the consumer reads it: its re-request must go to another session.
            self._on_draining(self.session)
        self._wake.set()
        if self._buffered > self._max_buffer_bytes:
            # The consumer cannot keep up; holding more would be unbounded memory, and stalling
            # the request body would stall every stream of the connection. It gets what it has,
            # then the end; it re-requests from its last event ID (nothing lost).
            log.warning("bus_consumer_overflow", backend=self.backend, stream_id=self.stream_id,
                        buffered=self._buffered)
            self.end(StreamEndReason.CONSUMER_OVERFLOW, unsubscribe=True, keep_buffer=True)

    def body_ended(self) -> StreamEnd:
        """The listener ended the body: how, from its last record."""
        kind = bp.stream_end_kind(self._tail)
        self.end(_STREAM_END_BY_BODY[kind], unsubscribe=False, keep_buffer=True)
        return kind

    def end(self, reason: StreamEndReason, *, unsubscribe: bool, keep_buffer: bool = False) -> None:
        """End it (the first reason wins); `unsubscribe`: tell the listener to end the body."""
        if self.end_reason is not None:
            return
        self.state = step(STREAM_TABLE, self.state, StreamInput.END)
        self.end_reason = reason
        if not keep_buffer:
            self._chunks.clear()
            self._buffered = 0
        self._attach_deadline.cancel()
        self._wake.set()
        self._on_end(self, reason, unsubscribe)

    def _attach_timed_out(self) -> None:
        if self.state is StreamState.REQUESTED:
            log.warning("bus_stream_attach_timeout", backend=self.backend,
                        stream_id=self.stream_id, session_id=self.session_id)
            self.end(StreamEndReason.ATTACH_TIMEOUT, unsubscribe=True)
