"""The router's event consumers: one task per `kv_cache_index.event_sources[]` entry (SPEC §8).

Owns: connecting to a listener's per-backend prefix event stream (SSE over http/https, one SSE
record per WebSocket message over ws/wss, or an announced stream of this router's event bus,
SPEC §7), resuming it with the last event ID seen, turning its records into typed
`PrefixRecord`s handed to the injected `apply_record` callback, and the reconnect policy. What
applying means is the embedding router's choice; `index_applier(index)` is the usual one (each
record becomes an `IndexEvent` for a `KvIndex`). Over ws/wss every WebSocket message carries one
SSE record (the seed lists the schemes without a framing; this is the natural one), parsed by the
same `core.sse.SseParser` as the byte streams of http(s) and the event bus.

Rules (SPEC §6-§8, seed "SSE 파싱 세부사항" and "스트림 동작 및 재연결"):
- Event type from the SSE `event:` field, else the JSON body's `event`. `draining` and
  `buffer_overflow` end the connection; everything else that is not one of the four prefix events,
  or whose fields are malformed, is a counted drop (`EventDropReason`), never fatal.
- `Last-Event-ID` is the WHATWG last event ID: a record without `id:` (the body of a resync) does
  not change it, so a consumer cut off in the middle of a resync asks again with its old ID.
- One line, and one record's `data:`, are capped at 1 MiB (`core.sse.SseParser` enforces both):
  exceeding closes the stream, backs off, and resumes from the last ID.
- Backoff: from `reconnect_interval_ms`, doubling, capped at max(reconnect_interval_ms, 60 s),
  reset once a connection delivered a record. `draining` is a planned restart: reconnect at once
  (once; a peer that drains again without delivering anything gets the backoff). Event bus: while
  no listener session announces the backend (`no_session`), retry every `reconnect_interval_ms`
  without growing the backoff.
- Logs (issue 14, finding 9), every line with `backend`, `transport` and the endpoint's `url`
  (userinfo stripped): `kv_consumer_connect_failed` (an attempt that did not connect) and
  `kv_consumer_disconnected` (a stream that was up ended) carry `reason` (`EndReason`), `error`
  (exception class), `errno` and `strerror` or `http_status`, `detail`, `retry_in_s`, and for
  connect failures `attempt` (consecutive failures) and `outage_s`. The first failure and a
  changed one are logged at once, an unchanged one at most every `log_repeat_interval_s` (300 s)
  with `suppressed` (the repeats logged at debug level meanwhile). `kv_consumer_connected`
  (info) ends an outage with `outage_s` and `failed_attempts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import json
import math
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import structlog
import yarl

from kv_listener.core.eventlog import RecordEvent
from kv_listener.core.model import Tier
from kv_listener.core.sse import MAX_DATA_BYTES, MAX_LINE_BYTES, ControlEvent, SseError, SseEvent, SseParser
from kv_listener.router.admin import SourceStatus
from kv_listener.router.config import EventSourceConfig, Transport
from kv_listener.router.index import IndexEvent, KvIndex, PrefixEventType
from kv_listener.router.metrics import EventDropReason
from kv_listener.router.oplog import LOG_REPEAT_INTERVAL_S, LogThrottle, error_fields

log = structlog.get_logger(__name__)

#: Backoff cap floor (seed: "max(reconnect_interval_ms, 60s)").
MAX_BACKOFF_FLOOR_S = 60.0
#: The listener sends `: ping` every 15 s; three missed pings mean a dead peer.
DEFAULT_READ_TIMEOUT_S = 45.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
#: A WebSocket message is one SSE record: at most one capped line per field plus the line ends.
#: The exact caps are the parser's; this only stops aiohttp from buffering far beyond them.
WS_MAX_MESSAGE_BYTES = MAX_LINE_BYTES + MAX_DATA_BYTES
_PREFIX_HASH_CHARS = frozenset("0123456789abcdef")
_MAX_TOKEN_COUNT = 1 << 53  # JSON numbers above this are not exact integers
_PREFIX_EVENTS = {e.value: e for e in RecordEvent}
_CONTROL_EVENTS = {e.value: e for e in ControlEvent}


class NoSessionError(LookupError):
    """No live listener session announces the backend yet (event bus, SPEC §7). The event-bus
    server raises this (or the class given as `no_session_error`) from `open_announced_stream`."""


class EndReason(enum.StrEnum):
    """Why one connection attempt ended. Values are the keys of a source's `ended` stats."""

    DRAINING = "draining"  # the listener restarts: planned, reconnect at once
    BUFFER_OVERFLOW = "buffer_overflow"  # we lagged max_lag records: resume after backoff
    STREAM_ENDED = "stream_ended"  # the peer ended the stream without a control record
    OVERSIZED = "oversized"  # line or data over 1 MiB (or a WebSocket message over its cap)
    HTTP_404 = "http_404"  # the listener does not know this backend (yet)
    HTTP_STATUS = "http_status"  # any other non-200 answer (503 draining / too many clients, ...)
    BAD_CONTENT_TYPE = "bad_content_type"  # 200 but not text/event-stream (a proxy's page)
    CONNECT_ERROR = "connect_error"  # DNS, refused, TLS, reset
    TIMEOUT = "timeout"  # nothing (not even a keep-alive) for read_timeout_s
    NO_SESSION = "no_session"  # event bus: nobody announces the backend yet
    PROTOCOL_ERROR = "protocol_error"  # WebSocket error frame, ...
    ERROR = "error"  # anything else the transport raised


@dataclass(frozen=True, slots=True)
class PrefixRecord:
    """One prefix event of a backend's stream, validated, tagged with the consumer's backend.

    `prefix_hash` is None only for `cache_cleared`; `token_count` and `tier` are None for
    `cache_evicted` and `cache_cleared`. `tier` defaults from the event when the record has none
    (`cache_created` -> gpu_hot, `cache_offloaded` -> storage_warm). `id` is the record's own
    `id:` (None inside a resync); `ts` the listener's wall-clock time, when given.
    """

    event: RecordEvent
    backend: str
    prefix_hash: str | None
    token_count: int | None
    tier: Tier | None
    ts: float | None
    id: str | None

    def as_dict(self) -> dict[str, Any]:
        """The SSE data object (SPEC §6 keys) plus `id`."""
        data: dict[str, Any] = {"event": self.event.value, "backend": self.backend}
        if self.prefix_hash is not None:
            data["prefix_hash"] = self.prefix_hash
        if self.token_count is not None:
            data["token_count"] = self.token_count
        if self.tier is not None:
            data["tier"] = self.tier.value
        if self.ts is not None:
            data["ts"] = self.ts
        data["id"] = self.id
        return data


ApplyRecord = Callable[[PrefixRecord], Awaitable[None]]
OpenAnnouncedStream = Callable[[str, str | None], Any]
"""`open_announced_stream(backend, last_event_id)` -> an async iterator of SSE bytes (or an
awaitable of one); raises the no-session error while no session announces `backend`."""
Sleep = Callable[[float], Awaitable[None]]


class ConsumerMetrics(Protocol):
    """The part of `router.metrics.RouterMetrics` the consumers feed."""

    def event_dropped_inc(self, backend: str, reason: EventDropReason, n: int = 1) -> None: ...

    def set_connected(self, backend: str, connected: bool) -> None: ...


class RecordDropped(ValueError):
    """A record the consumer cannot use; `reason` is the metric label."""

    def __init__(self, reason: EventDropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def decode_record(backend: str, event: SseEvent) -> PrefixRecord | ControlEvent:
    """One dispatched SSE event of `backend`'s stream -> a `PrefixRecord`, or the control event
    that ends the stream. Raises `RecordDropped` with the reason to count."""
    try:
        data = json.loads(event.data)
    # JSONDecodeError, UnicodeDecodeError of lone surrogates, and nesting deeper than the stack
    except (ValueError, RecursionError):
        raise RecordDropped(EventDropReason.MALFORMED_JSON, "data is not JSON") from None
    if not isinstance(data, dict):
        raise RecordDropped(EventDropReason.MALFORMED_JSON, "data is not a JSON object")
    # The SSE field wins over the body (seed); "message" is what a block without `event:` gets.
    name: Any = event.event if event.event != "message" else data.get("event")
    if not isinstance(name, str):
        raise RecordDropped(EventDropReason.UNKNOWN_EVENT, "no event type")
    control = _CONTROL_EVENTS.get(name)
    if control is not None:
        return control
    kind = _PREFIX_EVENTS.get(name)
    if kind is None:
        raise RecordDropped(EventDropReason.UNKNOWN_EVENT, "unknown event type")

    claimed = data.get("backend", backend)
    if claimed != backend:
        # A stream of another backend (a mis-pointed endpoint) must not fill this backend's
        # entries: routing would send requests where the prefix is not cached.
        raise RecordDropped(EventDropReason.BACKEND_MISMATCH, "record names another backend")
    ts = data.get("ts")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)
                           or not math.isfinite(ts)):
        raise RecordDropped(EventDropReason.INVALID_FIELD, "ts is not a number")
    if kind is RecordEvent.CACHE_CLEARED:
        return PrefixRecord(kind, backend, None, None, None, ts, event.id)

    prefix_hash = data.get("prefix_hash")
    if (not isinstance(prefix_hash, str) or len(prefix_hash) != 64
            or not _PREFIX_HASH_CHARS.issuperset(prefix_hash)):
        raise RecordDropped(EventDropReason.INVALID_FIELD, "prefix_hash is not 64 lowercase hex")
    if kind is RecordEvent.CACHE_EVICTED:
        return PrefixRecord(kind, backend, prefix_hash, None, None, ts, event.id)

    token_count = data.get("token_count")
    if (isinstance(token_count, bool) or not isinstance(token_count, int)
            or not 0 <= token_count < _MAX_TOKEN_COUNT):
        raise RecordDropped(EventDropReason.INVALID_FIELD, "token_count is not a non-negative integer")
    raw_tier = data.get("tier")
    if raw_tier is None:
        tier = Tier.GPU_HOT if kind is RecordEvent.CACHE_CREATED else Tier.STORAGE_WARM
    else:
        try:
            tier = Tier(raw_tier)
        except ValueError:
            raise RecordDropped(EventDropReason.INVALID_FIELD, "unknown tier") from None
    return PrefixRecord(kind, backend, prefix_hash, token_count, tier, ts, event.id)


def index_applier(index: KvIndex) -> ApplyRecord:
    """The usual `apply_record`: each record becomes an `IndexEvent` applied to `index`."""

    async def apply(record: PrefixRecord) -> None:
        await index.apply(IndexEvent(
            type=PrefixEventType(record.event.value), backend=record.backend,
            prefix_hash=record.prefix_hash,
            # token_count is absent only where the tier rule does not read it (evicted, cleared)
            token_count=record.token_count or 0,
        ))

    return apply


class Backoff:
    """Reconnect delays: `initial_s`, doubling, capped at max(initial_s, 60 s)."""

    def __init__(self, initial_s: float, floor_max_s: float = MAX_BACKOFF_FLOOR_S) -> None:
        self.initial_s = initial_s
        self.max_s = max(initial_s, floor_max_s)
        self._next = initial_s

    @property
    def peek_s(self) -> float:
        return self._next

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next = self.initial_s


@dataclass(slots=True)
class SourceState:
    """Counters and connection state of one event source (what `stats()` shows)."""

    backend: str
    connected: bool = False
    received: int = 0  # prefix records dispatched by the stream (before validation)
    applied: int = 0  # records `apply_record` accepted
    applied_by_event: Counter[str] = field(default_factory=Counter)  # RecordEvent -> applied
    dropped: Counter[str] = field(default_factory=Counter)  # EventDropReason -> n
    ended: Counter[str] = field(default_factory=Counter)  # EndReason -> connection attempts
    last_event_at: float | None = None  # wall clock of the last prefix record received
    reconnect_count: int = 0  # connection attempts after the first, no_session polls excluded
    connections: int = 0  # connections established (HTTP 200, WebSocket open, bus bytes)
    last_event_id: str | None = None  # sent as Last-Event-ID on the next connection
    last_error: str | None = None  # "<EndReason>: <detail>" of the last failed attempt
    next_delay_s: float | None = None  # the wait before the next attempt (None: connecting)


#: How long a consumer waits for a drained pushed stream's body to end (SPEC §7: within 1 s).
DRAIN_BODY_END_S = 1.0


@dataclass(slots=True)
class _Attempt:
    reason: EndReason
    detail: str = ""
    delivered: bool = False  # at least one record dispatched on this connection
    connected: bool = False  # the connection was established (HTTP 200, WebSocket open, bus bytes)
    # What the operator acts on (`error`, `errno`, `strerror`, `http_status`): logged as fields.
    error: dict[str, Any] = field(default_factory=dict)

    def error_key(self) -> tuple[Any, ...]:
        """What makes two failures "the same" for the log throttle."""
        e = self.error
        return (self.connected, self.reason, e.get("error"), e.get("errno"), e.get("http_status"))


class _SourceRunner:
    """One event source's reconnect loop."""

    def __init__(self, manager: KvEventConsumerManager, config: EventSourceConfig,
                 state: SourceState) -> None:
        self.manager = manager
        self.config = config
        self.state = state
        self.backoff = Backoff(config.reconnect_interval_s)
        self.task: asyncio.Task[None] | None = None
        context: dict[str, Any] = {"backend": config.backend_name,
                                   "transport": config.transport.value}
        if config.endpoint is not None:
            context["url"] = _redacted(config.endpoint)
        self.log = log.bind(**context)
        self._prompt_used = False  # a draining-triggered immediate reconnect is pending proof
        self.delivered = False  # the current connection dispatched at least one record
        self._drop_logged: set[EventDropReason] = set()
        # Failure logs (issue 14, finding 9): bounded, and paired with the recovery line.
        self._throttle = LogThrottle(manager.log_repeat_interval_s, manager.monotonic)
        self._outage_since: float | None = None  # monotonic time the stream went down
        self._failures = 0  # attempts that did not connect since the stream was last up
        self._down_logged = False  # a down line was logged since the last connection
        self._tracebacks_logged: set[str] = set()  # unexpected error classes, per outage

    # --- loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        first = True
        polling_session = False
        while True:
            if not first and not polling_session:
                self.state.reconnect_count += 1
            first = False
            self.state.next_delay_s = None
            self._drop_logged.clear()
            started = self.manager.monotonic()
            try:
                attempt = await self._connect_once()
            finally:
                self.set_connected(False)
            self.state.ended[attempt.reason.value] += 1
            polling_session = attempt.reason is EndReason.NO_SESSION
            delay = self._delay_after(attempt)
            self.state.next_delay_s = delay
            self._log_end(attempt, delay, started)
            if delay > 0:
                await self.manager.sleep(delay)

    def _delay_after(self, attempt: _Attempt) -> float:
        if attempt.delivered:
            self.backoff.reset()
            self._prompt_used = False
        if attempt.reason is EndReason.NO_SESSION:
            # SPEC §7: a listener that connects right after us must be picked up quickly.
            return self.config.reconnect_interval_s
        if attempt.reason is EndReason.DRAINING and not self._prompt_used:
            self._prompt_used = True
            return 0.0
        return self.backoff.next_delay()

    def _log_end(self, attempt: _Attempt, delay: float, started: float) -> None:
        """One line per attempt that ended, bounded: the first failure, a changed failure, then
        the same failure at most every `log_repeat_interval_s` (the others at debug level),
        each with the attempt count, the outage so far and the next retry delay."""
        if attempt.reason not in (EndReason.DRAINING, EndReason.BUFFER_OVERFLOW,
                                  EndReason.STREAM_ENDED):
            self.state.last_error = (f"{attempt.reason.value}: {attempt.detail}" if attempt.detail
                                     else attempt.reason.value)
        now = self.manager.monotonic()
        fields: dict[str, Any] = {"reason": attempt.reason.value, **attempt.error}
        if attempt.detail:
            fields["detail"] = attempt.detail
        if attempt.connected:  # a stream that was up ended: the outage starts now
            event = "kv_consumer_disconnected"
            self._outage_since, self._failures = now, 0
        else:
            event = "kv_consumer_connect_failed"
            if self._outage_since is None:  # never connected since the start
                self._outage_since = started
            self._failures += 1
            fields["attempt"] = self._failures
            fields["outage_s"] = round(max(0.0, now - self._outage_since), 3)
        fields["retry_in_s"] = round(delay, 3)
        held = self._throttle.check(attempt.error_key())
        if held is None:
            self.log.debug(event, **fields)
            return
        if held:
            fields["suppressed"] = held  # same failure, logged at debug level since the last line
        self._down_logged = True
        if attempt.reason in (EndReason.DRAINING, EndReason.BUFFER_OVERFLOW,
                              EndReason.STREAM_ENDED, EndReason.NO_SESSION):
            self.log.info(event, **fields)
        else:
            self.log.warning(event, **fields)

    def set_connected(self, connected: bool) -> None:
        if self.state.connected == connected:
            return
        self.state.connected = connected
        if connected:
            self.state.connections += 1
            fields: dict[str, Any] = {"resume": self.state.last_event_id is not None}
            if self._outage_since is not None:
                fields["outage_s"] = round(max(0.0, self.manager.monotonic() - self._outage_since), 3)
                fields["failed_attempts"] = self._failures
            # Every down line the operator saw gets its up line; a flapping stream whose down
            # lines were held back has its up lines at debug level too.
            if self._down_logged or self.state.connections == 1:
                self.log.info("kv_consumer_connected", **fields)
            else:
                self.log.debug("kv_consumer_connected", **fields)
            self._down_logged = False
            self._outage_since, self._failures = None, 0
            self._tracebacks_logged.clear()
        metrics = self.manager.metrics
        if metrics is not None:
            metrics.set_connected(self.config.backend_name, connected)

    # --- one connection --------------------------------------------------------------------

    async def _connect_once(self) -> _Attempt:
        cfg = self.config
        self.delivered = False
        try:
            if cfg.transport is Transport.EVENT_BUS:
                return await self._run_bus()
            assert cfg.endpoint is not None  # the config requires it for transport sse
            scheme = yarl.URL(cfg.endpoint).scheme
            if scheme in ("ws", "wss"):
                return await self._run_ws(cfg.endpoint)
            return await self._run_http(cfg.endpoint)
        except asyncio.CancelledError:
            raise
        except TimeoutError as exc:
            m = self.manager
            detail = (f"no connection within {m.connect_timeout_s:g} s"
                      if isinstance(exc, aiohttp.ConnectionTimeoutError)
                      else f"no data within {m.read_timeout_s:g} s")
            return self.attempt(EndReason.TIMEOUT, detail, exc=exc)
        except aiohttp.WSServerHandshakeError as exc:
            reason = EndReason.HTTP_404 if exc.status == 404 else EndReason.HTTP_STATUS
            return self.attempt(reason, f"HTTP {exc.status}", http_status=exc.status)
        except aiohttp.ClientPayloadError as exc:
            # The peer cut the response body (listener killed, proxy reset): a plain disconnect.
            return self.attempt(EndReason.STREAM_ENDED, exc=exc)
        except (aiohttp.ClientConnectionError, OSError) as exc:
            return self.attempt(EndReason.CONNECT_ERROR, exc=exc)
        except Exception as exc:
            # Whatever else a transport (or an injected bus stream) raises must not end this
            # backend's updates: count it, log it with its traceback (once per class and
            # outage: the attempt's own line repeats, bounded), back off, try again.
            if type(exc).__name__ not in self._tracebacks_logged:
                self._tracebacks_logged.add(type(exc).__name__)
                self.log.error("kv_consumer_error", error=type(exc).__name__, exc_info=exc)
            return self.attempt(EndReason.ERROR, exc=exc)

    def attempt(self, reason: EndReason, detail: str = "", *, exc: BaseException | None = None,
                http_status: int | None = None) -> _Attempt:
        """How this connection attempt ended. `exc` adds its class, errno and strerror (and
        makes the detail, when none is given); never its message, which may hold a URL."""
        error: dict[str, Any] = {}
        if exc is not None:
            error = error_fields(exc)
            if not detail:
                detail = error["error"]
                if "errno" in error:
                    detail += f": [Errno {error['errno']}] {error['strerror']}"
        if http_status is not None:
            error["http_status"] = http_status
        return _Attempt(reason, detail, self.delivered, self.state.connected, error)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if self.state.last_event_id:
            headers["Last-Event-ID"] = self.state.last_event_id
        return headers

    async def _run_http(self, url: str) -> _Attempt:
        m = self.manager
        session = m.session()
        timeout = aiohttp.ClientTimeout(total=None, connect=m.connect_timeout_s,
                                        sock_read=m.read_timeout_s)
        # No redirects: an endpoint is configured per backend, following a redirect would read
        # whatever stream the other side picks.
        async with session.get(url, headers=self._headers(), allow_redirects=False,
                               timeout=timeout, ssl=m.ssl_param) as resp:
            if resp.status != 200:
                reason = EndReason.HTTP_404 if resp.status == 404 else EndReason.HTTP_STATUS
                return self.attempt(reason, f"HTTP {resp.status}", http_status=resp.status)
            if resp.content_type != "text/event-stream":
                return self.attempt(EndReason.BAD_CONTENT_TYPE, resp.content_type[:64])
            self.set_connected(True)
            reader = _StreamReader(self)
            async for chunk in resp.content.iter_any():
                end = await reader.feed(chunk)
                if end is not None:
                    return end
            return self.attempt(EndReason.STREAM_ENDED)

    async def _run_ws(self, url: str) -> _Attempt:
        m = self.manager
        async with m.session().ws_connect(
            url, headers=self._headers(), max_msg_size=WS_MAX_MESSAGE_BYTES,
            timeout=aiohttp.ClientWSTimeout(ws_receive=m.read_timeout_s, ws_close=5.0),
            ssl=m.ssl_param, decode_text=False,
        ) as ws:
            self.set_connected(True)
            reader = _StreamReader(self)
            async for msg in ws:
                if msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                    # One record per message: the blank line ends it even if the sender left it
                    # out (extra blank lines dispatch nothing).
                    end = await reader.feed(bytes(msg.data) + b"\n\n")
                    if end is not None:
                        return end
                elif msg.type is aiohttp.WSMsgType.ERROR:
                    exc = msg.data
                    if (isinstance(exc, aiohttp.WebSocketError)
                            and exc.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG):
                        self.drop(EventDropReason.OVERSIZED, "WebSocket message over the cap")
                        return self.attempt(EndReason.OVERSIZED, "WebSocket message over the cap")
                    return self.attempt(EndReason.PROTOCOL_ERROR, exc=exc)
            return self.attempt(EndReason.STREAM_ENDED)

    async def _run_bus(self) -> _Attempt:
        m = self.manager
        if m.open_announced_stream is None:
            # Config validation rejects event_bus sources without an enabled bus; an embedding
            # router that did not wire one gets a clear, counted state instead of a crash.
            return self.attempt(EndReason.NO_SESSION, "no event bus configured")
        try:
            stream = m.open_announced_stream(self.config.backend_name, self.state.last_event_id)
            if inspect.isawaitable(stream):
                stream = await stream
        except m.no_session_error:
            return self.attempt(EndReason.NO_SESSION)
        iterator: AsyncIterator[bytes] = aiter(stream)
        reader = _StreamReader(self)
        try:
            while True:
                try:
                    chunk = await anext(iterator)
                except StopAsyncIteration:
                    return self.attempt(EndReason.STREAM_ENDED)
                except m.no_session_error:
                    return self.attempt(EndReason.NO_SESSION)
                self.set_connected(True)
                end = await reader.feed(chunk)
                if end is not None:
                    if end.reason is EndReason.DRAINING:
                        await _await_body_end(iterator)
                    return end
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    # --- records ---------------------------------------------------------------------------

    def drop(self, reason: EventDropReason, detail: str) -> None:
        self.state.dropped[reason.value] += 1
        metrics = self.manager.metrics
        if metrics is not None:
            metrics.event_dropped_inc(self.config.backend_name, reason)
        if reason not in self._drop_logged:  # once per reason per connection: floods are counted
            self._drop_logged.add(reason)
            self.log.warning("kv_event_dropped", reason=reason.value, detail=detail)


async def _await_body_end(iterator: AsyncIterator[bytes]) -> None:
    """After `draining` the listener ends the pushed body within 1 s (SPEC §7). Let it, so the
    router sees a drained stream rather than our early close (which it would count as `closed`
    and answer with `unsubscribe`). Whatever still arrives is after `draining`: ignored."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(DRAIN_BODY_END_S):
            async for _ in iterator:
                pass


class _StreamReader:
    """Parses one connection's bytes and applies its records."""

    def __init__(self, runner: _SourceRunner) -> None:
        self.runner = runner
        self.state = runner.state
        self.parser = SseParser(last_event_id=runner.state.last_event_id or "")

    async def feed(self, chunk: bytes) -> _Attempt | None:
        """Feed bytes; returns how the connection ends when a record or a cap ends it."""
        try:
            events = self.parser.feed(chunk)
        except SseError as exc:
            # Records parsed earlier in this chunk are not applied: they come again, since the
            # resume ID is the last one *applied*.
            self.runner.drop(EventDropReason.OVERSIZED, str(exc))
            return self.runner.attempt(EndReason.OVERSIZED, str(exc))
        for ev in events:
            end = await self._event(ev)
            if end is not None:
                return end
        # Also picks up an `id:` in a block without data (WHATWG: it still sets the ID).
        self._set_last_id(self.parser.last_event_id)
        return None

    def _set_last_id(self, value: str) -> None:
        self.state.last_event_id = value or None

    async def _event(self, ev: SseEvent) -> _Attempt | None:
        runner = self.runner
        try:
            record = decode_record(runner.config.backend_name, ev)
        except RecordDropped as exc:
            self.state.received += 1
            self.state.last_event_at = runner.manager.clock()
            runner.drop(exc.reason, str(exc))
            self._set_last_id(ev.last_event_id)
            return None
        if isinstance(record, ControlEvent):
            reason = (EndReason.DRAINING if record is ControlEvent.DRAINING
                      else EndReason.BUFFER_OVERFLOW)
            return self.runner.attempt(reason)
        # A valid record proves the stream works (backoff resets); garbage and control records
        # do not, so a peer that only sends those keeps backing off.
        runner.delivered = True
        self.state.received += 1
        self.state.last_event_at = runner.manager.clock()
        try:
            await runner.manager.apply_record(record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The index failed (Redis down without fallback): counted, the stream goes on; the
            # next resync or upsert repairs the entry.
            runner.drop(EventDropReason.INDEX_ERROR, type(exc).__name__)
        else:
            self.state.applied += 1
            self.state.applied_by_event[record.event.value] += 1
        self._set_last_id(ev.last_event_id)
        return None


@dataclass(frozen=True, slots=True)
class ReloadResult:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    restarted: tuple[str, ...]


class KvEventConsumerManager:
    """One consumer task per event source; sources can be added, removed and changed at runtime.

    `apply_record(record)` is awaited for every valid prefix record, in stream order; an exception
    from it is counted (`index_error`) and the stream goes on. `open_announced_stream` serves
    `transport: event_bus` sources (see `OpenAnnouncedStream`); `no_session_error` is the
    exception (class or tuple) it raises while nobody announces the backend. `clock` gives the
    wall-clock time of `last_event_at`; `sleep` waits between attempts; `monotonic` times outages
    and spaces the repeats of an unchanged failure's log line by `log_repeat_interval_s` (tests
    inject all three). `ssl_context` is passed to aiohttp for https/wss endpoints (None: verify
    against the system roots).
    """

    def __init__(
        self,
        sources: Iterable[EventSourceConfig],
        apply_record: ApplyRecord,
        *,
        open_announced_stream: OpenAnnouncedStream | None = None,
        no_session_error: type[BaseException] | tuple[type[BaseException], ...] = NoSessionError,
        metrics: ConsumerMetrics | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        log_repeat_interval_s: float = LOG_REPEAT_INTERVAL_S,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        self.apply_record = apply_record
        self.open_announced_stream = open_announced_stream
        self.no_session_error = no_session_error
        self.metrics = metrics
        self.clock = clock
        self.sleep = sleep
        self.monotonic = monotonic
        self.log_repeat_interval_s = log_repeat_interval_s
        self.ssl_param: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._configs: dict[str, EventSourceConfig] = {}
        self._states: dict[str, SourceState] = {}
        self._runners: dict[str, _SourceRunner] = {}
        self._session: aiohttp.ClientSession | None = None
        self._started = False
        for cfg in sources:
            if cfg.backend_name in self._configs:
                raise ValueError(f"duplicate event source {cfg.backend_name!r}")
            self._configs[cfg.backend_name] = cfg
            self._states[cfg.backend_name] = SourceState(cfg.backend_name)

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def backends(self) -> list[str]:
        return list(self._configs)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # One pool for every source; no per-host limit (each source holds one long stream).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                auto_decompress=False, trust_env=False,
            )
        return self._session

    def start(self) -> None:
        """Start one task per source (call from the running event loop)."""
        asyncio.get_running_loop()
        if self._started:
            return
        self._started = True
        for name in self._configs:
            self._spawn(name)

    async def stop(self) -> None:
        """Cancel every consumer, wait for them, close the HTTP session."""
        self._started = False
        runners = list(self._runners.values())
        self._runners.clear()
        await _cancel_all(runners)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> KvEventConsumerManager:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, name: str) -> None:
        runner = _SourceRunner(self, self._configs[name], self._states[name])
        runner.task = asyncio.create_task(runner.run(), name=f"kv-consumer-{name}")
        self._runners[name] = runner
        if self.metrics is not None:
            self.metrics.set_connected(name, False)

    # --- runtime changes (config reload) ----------------------------------------------------

    def add_source(self, config: EventSourceConfig) -> None:
        """Add a source (started at once when the manager runs). Raises ValueError if it exists."""
        name = config.backend_name
        if name in self._configs:
            raise ValueError(f"event source {name!r} already exists")
        self._configs[name] = config
        self._states[name] = SourceState(name)
        if self._started:
            self._spawn(name)

    async def remove_source(self, backend: str) -> bool:
        """Stop and forget a source; False when there is none by that name. Its index entries
        are the caller's business (clear them, or let them age out by TTL)."""
        if backend not in self._configs:
            return False
        del self._configs[backend]
        self._states.pop(backend, None)
        runner = self._runners.pop(backend, None)
        if runner is not None:
            await _cancel_all([runner])
        return True

    async def reload(self, sources: Iterable[EventSourceConfig]) -> ReloadResult:
        """Make the sources exactly `sources`: new ones start, missing ones stop, changed ones
        restart (keeping their counters and last event ID: the listener resumes or resyncs),
        unchanged ones keep their connection."""
        wanted: dict[str, EventSourceConfig] = {}
        for cfg in sources:
            if cfg.backend_name in wanted:
                raise ValueError(f"duplicate event source {cfg.backend_name!r}")
            wanted[cfg.backend_name] = cfg
        removed = tuple(n for n in self._configs if n not in wanted)
        added = tuple(n for n in wanted if n not in self._configs)
        restarted = tuple(n for n, cfg in wanted.items()
                          if n in self._configs and self._configs[n] != cfg)
        for name in removed:
            await self.remove_source(name)
        stopping = [r for n in restarted if (r := self._runners.pop(n, None)) is not None]
        await _cancel_all(stopping)
        for name in restarted:
            self._configs[name] = wanted[name]
            if self._started:
                self._spawn(name)
        for name in added:
            self.add_source(wanted[name])
        if added or removed or restarted:
            log.info("kv_consumers_reloaded", added=list(added), removed=list(removed),
                     restarted=list(restarted))
        return ReloadResult(added, removed, restarted)

    async def resync_all(self, reason: str) -> list[str]:
        """Every source connects again at once, without a Last-Event-ID, so its listener sends a
        full resync (`cache_cleared`, then the backend's current prefixes). For an index that
        lost writes: a Redis restarted empty, or removals made while the fallback held them."""
        names = [n for n in self._configs if n in self._runners]
        await _cancel_all([self._runners.pop(n) for n in names])
        for name in names:
            self._states[name].last_event_id = None
            if self._started:
                self._spawn(name)
        log.info("kv_consumers_resync", reason=reason, sources=len(names))
        return names

    # --- stats -----------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, Any]]:
        """backend -> {connected, received, applied, dropped: {reason: n}, last_event_at (wall
        clock seconds), reconnect_count, last_event_id, last_error, ...}."""
        out: dict[str, dict[str, Any]] = {}
        for name, cfg in self._configs.items():
            s = self._states[name]
            out[name] = {
                "backend_name": name,
                "transport": cfg.transport.value,
                "endpoint": _redacted(cfg.endpoint),
                "connected": s.connected,
                "received": s.received,
                "applied": s.applied,
                "applied_by_event": dict(s.applied_by_event),
                "dropped": dict(s.dropped),
                "dropped_total": s.dropped.total(),
                "last_event_at": s.last_event_at,
                "reconnect_count": s.reconnect_count,
                "connections": s.connections,
                "last_event_id": s.last_event_id,
                "last_error": s.last_error,
                "ended": dict(s.ended),
                "next_delay_s": s.next_delay_s,
            }
        return out

    def source_statuses(self) -> list[SourceStatus]:
        """The admin API's per-source view (`create_admin_app(source_status=...)`)."""
        return [
            SourceStatus(
                backend_name=name, connected=s.connected, events_received=s.received,
                events_dropped=s.dropped.total(),
                index_created=s.applied_by_event[RecordEvent.CACHE_CREATED.value],
                index_evicted=s.applied_by_event[RecordEvent.CACHE_EVICTED.value],
                reconnect_count=s.reconnect_count, last_event_at=s.last_event_at,
            )
            for name, s in ((n, self._states[n]) for n in self._configs)
        ]

    def state(self, backend: str) -> SourceState:
        return self._states[backend]


def _redacted(endpoint: str | None) -> str | None:
    """The endpoint without userinfo (it may carry a password)."""
    if endpoint is None:
        return None
    url = yarl.URL(endpoint)
    return str(url.with_user(None)) if url.user or url.password else endpoint


async def _cancel_all(runners: list[_SourceRunner]) -> None:
    tasks = [r.task for r in runners if r.task is not None]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    for r in runners:
        r.set_connected(False)
