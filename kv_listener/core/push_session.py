"""Push-mode session rules (SPEC §7) as explicit state tables, one per side, with no I/O.

Owns: what a push session may do in each state, written once as a table per side in the manner
of h11's `_state.py` (every legal (state, input) -> state listed; anything else raises
`PushStateError`, a bug in the shell that fed it):

- the listener (`ListenerSession`): connect, welcome, reload, drain, and the router's control
  lines. Bytes of the session's response body go in (`receive_data`), actions come out
  (`StartPush`, `StopPush`, `LineRefused`, `SessionFailed`, `Welcomed`), which the asyncio shell
  (`outputs/bus_client.py`) carries out. The reason an attempt ended is a `BusFailure`, the one
  enum of failure reasons the network seam also raises (its values are metric labels).
- the router (`SESSION_TABLE`, `STREAM_TABLE`, `SERVER_TABLE`): a session is live, draining or
  ended; a requested stream is attached or not, ended or not (the attach timer runs while it is
  `REQUESTED`); the server refuses new sessions once closing. `router/bus_server.py` and
  `router/bus_stream.py` step them.

Pure: no asyncio, sockets or clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import (
    BusProtocolError,
    BusProtocolErrorReason,
    Forbidden,
    Subscribe,
    Unsubscribe,
    Welcome,
)


class PushStateError(RuntimeError):
    """An input the state table does not allow in the current state (a bug of the caller)."""


class BusFailure(enum.StrEnum):
    """Why a listener's connection or session ended. Values are metric labels."""

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


S = TypeVar("S", bound=enum.Enum)
I = TypeVar("I", bound=enum.Enum)  # noqa: E741 - the table's "input", as in h11


def step(table: Mapping[tuple[S, I], S], state: S, event: I) -> S:
    """The next state, or `PushStateError` for a pair the table does not list."""
    try:
        return table[state, event]
    except KeyError:
        raise PushStateError(f"{event.name} is not allowed in state {state.name}") from None


# --- the listener ---------------------------------------------------------------------------


class ListenerState(enum.Enum):
    IDLE = "idle"  # no attempt running: before the first, or backing off between two
    CONNECTING = "connecting"  # an attempt runs; lines are read once the router answers 200
    WELCOMED = "welcomed"
    RELOADING = "reloading"  # sources changed: this attempt ends, the next starts at once
    DRAINING = "draining"  # shutdown: subscriptions get `draining`; the attempt ends, no next
    CLOSED = "closed"  # drained: `run()` returns


class ListenerInput(enum.Enum):
    CONNECT = "connect"  # an attempt starts
    WELCOME = "welcome"
    SUBSCRIBE = "subscribe"
    UNSUBSCRIBE = "unsubscribe"
    FORBIDDEN = "forbidden"
    ODD_LINE = "odd_line"  # a second welcome, or a line that does not decode: counted, skipped
    RELOAD = "reload"  # the sources to announce differ from the session's
    DRAIN = "drain"
    ATTEMPT_OVER = "attempt_over"  # the connection is closed, whatever ended it


_L, _I = ListenerState, ListenerInput
_SESSION_LINES = (_I.SUBSCRIBE, _I.UNSUBSCRIBE, _I.FORBIDDEN, _I.ODD_LINE)

#: Every legal (state, input) of the listener side. `RELOAD` and `DRAIN` may come at any time
#: (signals, reloads); lines only while an attempt runs; a reload while idle just ends the
#: backoff wait; draining outranks reloading.
LISTENER_TABLE: dict[tuple[ListenerState, ListenerInput], ListenerState] = {
    (_L.IDLE, _I.CONNECT): _L.CONNECTING,
    (_L.IDLE, _I.RELOAD): _L.IDLE,
    (_L.IDLE, _I.DRAIN): _L.CLOSED,
    (_L.CONNECTING, _I.WELCOME): _L.WELCOMED,
    (_L.CONNECTING, _I.RELOAD): _L.RELOADING,
    (_L.CONNECTING, _I.DRAIN): _L.DRAINING,
    (_L.CONNECTING, _I.ATTEMPT_OVER): _L.IDLE,
    **{(_L.WELCOMED, line): _L.WELCOMED for line in _SESSION_LINES},
    (_L.WELCOMED, _I.RELOAD): _L.RELOADING,
    (_L.WELCOMED, _I.DRAIN): _L.DRAINING,
    (_L.WELCOMED, _I.ATTEMPT_OVER): _L.IDLE,
    (_L.RELOADING, _I.WELCOME): _L.RELOADING,
    **{(_L.RELOADING, line): _L.RELOADING for line in _SESSION_LINES},
    (_L.RELOADING, _I.RELOAD): _L.RELOADING,
    (_L.RELOADING, _I.DRAIN): _L.DRAINING,
    (_L.RELOADING, _I.ATTEMPT_OVER): _L.IDLE,
    (_L.DRAINING, _I.WELCOME): _L.DRAINING,
    **{(_L.DRAINING, line): _L.DRAINING for line in _SESSION_LINES},
    (_L.DRAINING, _I.RELOAD): _L.DRAINING,
    (_L.DRAINING, _I.DRAIN): _L.DRAINING,
    (_L.DRAINING, _I.ATTEMPT_OVER): _L.CLOSED,
    (_L.CLOSED, _I.RELOAD): _L.CLOSED,
    (_L.CLOSED, _I.DRAIN): _L.CLOSED,
}


@dataclass(frozen=True, slots=True)
class Welcomed:
    """The session is welcome: count it, say so."""

    session_id: str


@dataclass(frozen=True, slots=True)
class StartPush:
    """Open `POST /bus/v1/streams/{id}` and push the subscribed backend's bytes."""

    subscribe: Subscribe


@dataclass(frozen=True, slots=True)
class StopPush:
    """Unsubscribed: end that stream's request body."""

    stream_id: str


@dataclass(frozen=True, slots=True)
class LineRefused:
    """A session line counted and skipped under `label`. `reason` is set when the line did not
    decode (it is logged unless its type is only unknown); `backend` for an unannounced one."""

    label: str
    reason: BusProtocolErrorReason | None = None
    backend: str | None = None


@dataclass(frozen=True, slots=True)
class SessionFailed:
    """The session cannot go on: close the connection, the attempt failed with `failure`."""

    failure: BusFailure
    detail: str


ListenerAction = Welcomed | StartPush | StopPush | LineRefused | SessionFailed


class ListenerSession:
    """The listener's side of push mode: one object for the whole life of a `BusClient`.

    Per attempt: `connect()`, then `receive_data()` with each chunk of the session's
    response body (after its 200), `router_ended()` when that body ends, `push_ended()` when a
    pushed stream is over, and `attempt_over()` once the connection is closed. `reload()` and
    `drain()` at any time.
    """

    __slots__ = ("_splitter", "pushes", "session_id", "sources", "state")

    def __init__(self) -> None:
        self.state = ListenerState.IDLE
        self.sources: tuple[str, ...] = ()
        self.session_id: str | None = None
        self.pushes: set[str] = set()  # stream ids being pushed in this session
        self._splitter = bp.LineSplitter()

    def _to(self, event: ListenerInput) -> None:
        self.state = step(LISTENER_TABLE, self.state, event)

    @property
    def draining(self) -> bool:
        return self.state in (ListenerState.DRAINING, ListenerState.CLOSED)

    @property
    def closed(self) -> bool:
        return self.state is ListenerState.CLOSED

    @property
    def ends_now(self) -> bool:
        """A reload or drain asked for the attempt to end."""
        return self.state in (ListenerState.RELOADING, ListenerState.DRAINING)

    def connect(self) -> None:
        """An attempt starts; the shell sets `sources` once it knows what the hello announces."""
        self._to(ListenerInput.CONNECT)
        self.sources = ()
        self.session_id = None
        self.pushes = set()
        self._splitter = bp.LineSplitter()

    def reload(self) -> None:
        self._to(ListenerInput.RELOAD)

    def drain(self) -> None:
        self._to(ListenerInput.DRAIN)

    def push_ended(self, stream_id: str) -> None:
        self.pushes.discard(stream_id)

    def attempt_over(self, failure: BusFailure | None, *, crashed: bool = False) -> BusFailure:
        """The attempt is over (`failure` None: it ended because a reload or drain asked).
        Returns the reason to count it under: a reload outranks what broke, except a bug."""
        reloading = self.state is ListenerState.RELOADING
        self._to(ListenerInput.ATTEMPT_OVER)
        self.session_id = None
        self.pushes = set()
        if crashed:
            return BusFailure.PROTOCOL
        if self.state is ListenerState.CLOSED:
            return failure or BusFailure.DRAINED
        if reloading or failure is None:
            return BusFailure.RELOAD
        return failure

    def router_ended(self) -> SessionFailed:
        if self.session_id is None:
            return SessionFailed(BusFailure.SESSION_ENDED, "ended before welcome")
        return SessionFailed(BusFailure.SESSION_ENDED, "the router ended the session")

    def receive_data(self, chunk: bytes) -> list[ListenerAction]:
        """Bytes of the session's response body in, actions out. A `SessionFailed` is last."""
        try:
            lines = self._splitter.feed(chunk)
        except BusProtocolError as exc:
            if self.session_id is None:
                return [SessionFailed(BusFailure.PROTOCOL, str(exc))]
            return [LineRefused(exc.reason.value), SessionFailed(BusFailure.PROTOCOL, str(exc))]
        actions: list[ListenerAction] = []
        for line in lines:
            actions.extend(self._line(line))
            if actions and isinstance(actions[-1], SessionFailed):
                break
        return actions

    def _line(self, line: bytes) -> list[ListenerAction]:
        try:
            msg: bp.RouterMessage | None = bp.decode_message(line)
            refused: list[ListenerAction] = []
        except BusProtocolError as exc:
            msg, refused = None, [LineRefused(exc.reason.value, exc.reason)]
        if self.session_id is None:
            return [*refused, self._first(msg)]
        if msg is None:
            self._to(ListenerInput.ODD_LINE)  # an unknown kind of line from a newer router
            return refused
        if isinstance(msg, Welcome):
            self._to(ListenerInput.ODD_LINE)
            return [LineRefused("second_welcome")]
        if isinstance(msg, Forbidden):
            self._to(ListenerInput.FORBIDDEN)
            return [SessionFailed(BusFailure.FORBIDDEN, msg.reason)]
        if isinstance(msg, Unsubscribe):
            self._to(ListenerInput.UNSUBSCRIBE)
            return [StopPush(msg.stream_id)] if msg.stream_id in self.pushes else []
        self._to(ListenerInput.SUBSCRIBE)
        if msg.stream_id in self.pushes:
            return [LineRefused("duplicate_stream")]
        if msg.announced_source not in self.sources:
            # Only what this session announced may be pushed (the router checked its side).
            return [LineRefused("unannounced_source", backend=msg.announced_source)]
        self.pushes.add(msg.stream_id)
        return [StartPush(msg)]

    def _first(self, msg: bp.RouterMessage | None) -> ListenerAction:
        if isinstance(msg, Welcome):
            self._to(ListenerInput.WELCOME)
            self.session_id = msg.session_id
            return Welcomed(msg.session_id)
        if isinstance(msg, Forbidden):
            return SessionFailed(BusFailure.FORBIDDEN, msg.reason)
        return SessionFailed(BusFailure.PROTOCOL, "the first session line is not welcome")


# --- the router -----------------------------------------------------------------------------


class ServerState(enum.Enum):
    SERVING = "serving"
    CLOSING = "closing"  # `close()` began: no new session


class ServerInput(enum.Enum):
    OPEN_SESSION = "open_session"
    CLOSE = "close"


#: A session is only created while serving; `close()` may be called again (it then waits).
SERVER_TABLE: dict[tuple[ServerState, ServerInput], ServerState] = {
    (ServerState.SERVING, ServerInput.OPEN_SESSION): ServerState.SERVING,
    (ServerState.SERVING, ServerInput.CLOSE): ServerState.CLOSING,
    (ServerState.CLOSING, ServerInput.CLOSE): ServerState.CLOSING,
}


class SessionState(enum.Enum):
    LIVE = "live"
    DRAINING = "draining"  # one of its streams ended with `draining`: not asked for new streams
    ENDED = "ended"


class SessionInput(enum.Enum):
    DRAINING_SEEN = "draining_seen"
    END = "end"


#: Draining after the end changes nothing (a stream's last bytes may arrive after a reload
#: ended its session); a session ends once (the shell does not step an ended one again).
SESSION_TABLE: dict[tuple[SessionState, SessionInput], SessionState] = {
    (SessionState.LIVE, SessionInput.DRAINING_SEEN): SessionState.DRAINING,
    (SessionState.LIVE, SessionInput.END): SessionState.ENDED,
    (SessionState.DRAINING, SessionInput.DRAINING_SEEN): SessionState.DRAINING,
    (SessionState.DRAINING, SessionInput.END): SessionState.ENDED,
    (SessionState.ENDED, SessionInput.DRAINING_SEEN): SessionState.ENDED,
}


class StreamState(enum.Enum):
    REQUESTED = "requested"  # `subscribe` sent; the attach timer runs
    ATTACHED = "attached"  # the listener's POST was accepted; bytes flow
    ENDED_UNATTACHED = "ended_unattached"  # ended before the listener opened it: forget now
    ENDED = "ended"  # ended after attaching: forgotten when its request ends


class StreamInput(enum.Enum):
    ATTACH = "attach"
    END = "end"


#: A stream is attached at most once (a second POST for it is a 404 the shell answers before
#: stepping) and ends once (the first reason wins; the shell does not step again).
STREAM_TABLE: dict[tuple[StreamState, StreamInput], StreamState] = {
    (StreamState.REQUESTED, StreamInput.ATTACH): StreamState.ATTACHED,
    (StreamState.REQUESTED, StreamInput.END): StreamState.ENDED_UNATTACHED,
    (StreamState.ATTACHED, StreamInput.END): StreamState.ENDED,
}
