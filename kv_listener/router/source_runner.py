"""One event source's consumer: its reconnect loop, its three transports and its stream reader.

Owns, for one `kv_cache_index.event_sources[]` entry (the rules are `router.consumer`'s module
docstring): connecting over http(s), ws(s) or the event bus with the last event ID seen, reading
the SSE bytes (`core.sse.SseParser`), decoding each record with the one decoder
(`core.records.decode_data`, its faults counted under `EventDropReason`), handing valid records
to the manager's `apply_record`, and what the source waits and logs after each attempt.
`KvEventConsumerManager` (`router.consumer`) runs one `_SourceRunner` per source.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
import yarl

from kv_listener.core.records import ControlEvent, InvalidRecord, Record, decode_data
from kv_listener.core.sse import MAX_DATA_BYTES, MAX_LINE_BYTES, SseError, SseEvent, SseParser
from kv_listener.router.config import EventSourceConfig, Transport
from kv_listener.router.consumer_state import Attempt, ConsumeEndReason, SourceState, reconnect_backoff
from kv_listener.router.metrics import EventDropReason
from kv_listener.router.oplog import LogThrottle, error_fields

if TYPE_CHECKING:
    from kv_listener.router.consumer import KvEventConsumerManager

log = structlog.get_logger(__name__)

#: A WebSocket message is one SSE record: at most one capped line per field plus the line ends.
#: The exact caps are the parser's; this only stops aiohttp from buffering far beyond them.
WS_MAX_MESSAGE_BYTES = MAX_LINE_BYTES + MAX_DATA_BYTES

#: How long a consumer waits for a drained pushed stream's body to end (SPEC §7: within 1 s).
DRAIN_BODY_END_S = 1.0


class RecordDropped(ValueError):
    """A record the consumer cannot use; `reason` is the metric label."""

    def __init__(self, reason: EventDropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def decode_record(backend: str, event: SseEvent) -> Record | ControlEvent:
    """One dispatched SSE event of `backend`'s stream -> a `Record`, or the control event that
    ends the stream. Raises `RecordDropped` with the reason to count."""
    try:
        # The SSE field wins over the body (seed); "message" is what a block without `event:` gets.
        return decode_data(backend, event.data, record_id=event.id,
                           event=event.event if event.event != "message" else None)
    except InvalidRecord as exc:
        # The faults' values are the drop reasons' labels.
        raise RecordDropped(EventDropReason(exc.fault.value), str(exc)) from None


class _SourceRunner:
    """One event source's reconnect loop."""

    def __init__(self, manager: KvEventConsumerManager, config: EventSourceConfig,
                 state: SourceState) -> None:
        self.manager = manager
        self.config = config
        self.state = state
        self.backoff = reconnect_backoff(config.reconnect_interval_s)
        self.task: asyncio.Task[None] | None = None
        context: dict[str, Any] = {"backend": config.backend_name,
                                   "transport": config.transport.value}
        if config.endpoint is not None:
            context["url"] = redacted(config.endpoint)
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
            polling_session = attempt.reason is ConsumeEndReason.NO_SESSION
            delay = self._delay_after(attempt)
            self.state.next_delay_s = delay
            self._log_end(attempt, delay, started)
            if delay > 0:
                await self.manager.sleep(delay)

    def _delay_after(self, attempt: Attempt) -> float:
        if attempt.delivered:
            self.backoff.reset()
            self._prompt_used = False
        if attempt.reason is ConsumeEndReason.NO_SESSION:
            # SPEC §7: a listener that connects right after us must be picked up quickly.
            return self.config.reconnect_interval_s
        if attempt.reason is ConsumeEndReason.DRAINING and not self._prompt_used:
            self._prompt_used = True
            return 0.0
        return self.backoff.next_delay()

    def _log_end(self, attempt: Attempt, delay: float, started: float) -> None:
        """One line per attempt that ended, bounded: the first failure, a changed failure, then
        the same failure at most every `log_repeat_interval_s` (the others at debug level),
        each with the attempt count, the outage so far and the next retry delay."""
        if attempt.reason not in (ConsumeEndReason.DRAINING, ConsumeEndReason.BUFFER_OVERFLOW,
                                  ConsumeEndReason.STREAM_ENDED):
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
        if attempt.reason in (ConsumeEndReason.DRAINING, ConsumeEndReason.BUFFER_OVERFLOW,
                              ConsumeEndReason.STREAM_ENDED, ConsumeEndReason.NO_SESSION):
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

    async def _connect_once(self) -> Attempt:
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
            return self.attempt(ConsumeEndReason.TIMEOUT, detail, exc=exc)
        except aiohttp.WSServerHandshakeError as exc:
            reason = ConsumeEndReason.HTTP_404 if exc.status == 404 else ConsumeEndReason.HTTP_STATUS
            return self.attempt(reason, f"HTTP {exc.status}", http_status=exc.status)
        except aiohttp.ClientPayloadError as exc:
            # The peer cut the response body (listener killed, proxy reset): a plain disconnect.
            return self.attempt(ConsumeEndReason.STREAM_ENDED, exc=exc)
        except (aiohttp.ClientConnectionError, OSError) as exc:
            return self.attempt(ConsumeEndReason.CONNECT_ERROR, exc=exc)
        except Exception as exc:
            # Whatever else a transport (or an injected bus stream) raises must not end this
            # backend's updates: count it, log it with its traceback (once per class and
            # outage: the attempt's own line repeats, bounded), back off, try again.
            if type(exc).__name__ not in self._tracebacks_logged:
                self._tracebacks_logged.add(type(exc).__name__)
                self.log.error("kv_consumer_error", error=type(exc).__name__, exc_info=exc)
            return self.attempt(ConsumeEndReason.ERROR, exc=exc)

    def attempt(self, reason: ConsumeEndReason, detail: str = "", *, exc: BaseException | None = None,
                http_status: int | None = None) -> Attempt:
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
        return Attempt(reason, detail, self.delivered, self.state.connected, error)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if self.state.last_event_id:
            headers["Last-Event-ID"] = self.state.last_event_id
        return headers

    async def _run_http(self, url: str) -> Attempt:
        m = self.manager
        session = m.session()
        timeout = aiohttp.ClientTimeout(total=None, connect=m.connect_timeout_s,
                                        sock_read=m.read_timeout_s)
        # No redirects: an endpoint is configured per backend, following a redirect would read
        # whatever stream the other side picks.
        async with session.get(url, headers=self._headers(), allow_redirects=False,
                               timeout=timeout, ssl=m.ssl_param) as resp:
            if resp.status != 200:
                reason = ConsumeEndReason.HTTP_404 if resp.status == 404 else ConsumeEndReason.HTTP_STATUS
                return self.attempt(reason, f"HTTP {resp.status}", http_status=resp.status)
            if resp.content_type != "text/event-stream":
                return self.attempt(ConsumeEndReason.BAD_CONTENT_TYPE, resp.content_type[:64])
            self.set_connected(True)
            reader = _StreamReader(self)
            async for chunk in resp.content.iter_any():
                end = await reader.feed(chunk)
                if end is not None:
                    return end
            return self.attempt(ConsumeEndReason.STREAM_ENDED)

    async def _run_ws(self, url: str) -> Attempt:
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
                        return self.attempt(ConsumeEndReason.OVERSIZED, "WebSocket message over the cap")
                    return self.attempt(ConsumeEndReason.PROTOCOL_ERROR, exc=exc)
            return self.attempt(ConsumeEndReason.STREAM_ENDED)

    async def _run_bus(self) -> Attempt:
        m = self.manager
        if m.open_announced_stream is None:
            # Config validation rejects event_bus sources without an enabled bus; an embedding
            # router that did not wire one gets a clear, counted state instead of a crash.
            return self.attempt(ConsumeEndReason.NO_SESSION, "no event bus configured")
        try:
            stream = m.open_announced_stream(self.config.backend_name, self.state.last_event_id)
            if inspect.isawaitable(stream):
                stream = await stream
        except m.no_session_error:
            return self.attempt(ConsumeEndReason.NO_SESSION)
        iterator: AsyncIterator[bytes] = aiter(stream)
        reader = _StreamReader(self)
        try:
            while True:
                try:
                    chunk = await anext(iterator)
                except StopAsyncIteration:
                    return self.attempt(ConsumeEndReason.STREAM_ENDED)
                except m.no_session_error:
                    return self.attempt(ConsumeEndReason.NO_SESSION)
                self.set_connected(True)
                end = await reader.feed(chunk)
                if end is not None:
                    if end.reason is ConsumeEndReason.DRAINING:
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

    async def feed(self, chunk: bytes) -> Attempt | None:
        """Feed bytes; returns how the connection ends when a record or a cap ends it."""
        try:
            events = self.parser.feed(chunk)
        except SseError as exc:
            # Records parsed earlier in this chunk are not applied: they come again, since the
            # resume ID is the last one *applied*.
            self.runner.drop(EventDropReason.OVERSIZED, str(exc))
            return self.runner.attempt(ConsumeEndReason.OVERSIZED, str(exc))
        for ev in events:
            end = await self._event(ev)
            if end is not None:
                return end
        # Also picks up an `id:` in a block without data (WHATWG: it still sets the ID).
        self._set_last_id(self.parser.last_event_id)
        return None

    def _set_last_id(self, value: str) -> None:
        self.state.last_event_id = value or None

    async def _event(self, ev: SseEvent) -> Attempt | None:
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
            reason = (ConsumeEndReason.DRAINING if record is ControlEvent.DRAINING
                      else ConsumeEndReason.BUFFER_OVERFLOW)
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


def redacted(endpoint: str | None) -> str | None:
    """The endpoint without userinfo (it may carry a password)."""
    if endpoint is None:
        return None
    url = yarl.URL(endpoint)
    return str(url.with_user(None)) if url.user or url.password else endpoint


