"""One pushed stream of the listener's event-bus session (SPEC §7 item 2).

Owns: `POST /bus/v1/streams/{id}` for one `subscribe`: open the request, copy the iterator of
`open_stream(backend, last_event_id)` (the exact bytes `GET /events/{backend}` would send) into
its body, and end it: at the iterator's end (after `draining` / `buffer_overflow`), at once on
`unsubscribe` (even while a send waits for a window: SPEC's 1 s), or by a reset when the router
refuses or resets it or the connection fails. Subscribed while draining, the body is only the
`draining` record. How it ended is a `PushEnd` (a metric label) counted in `BusClientStats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import h2.errors
import structlog
from hpack import HeaderTuple

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import Subscribe
from kv_listener.core.push_session import BusFailure
from kv_listener.core.sse import ControlEvent, encode_control
from kv_listener.outputs.bus_h2 import BusError, H2Connection, StreamReset

log = structlog.get_logger(__name__)

OpenStream = Callable[[str, str | None], AsyncIterator[bytes]]

#: SPEC §7: after `unsubscribe` the request body ends within 1 s; we end it at once.
UNSUBSCRIBE_DEADLINE_S = 1.0


class PushEnd(enum.StrEnum):
    """How one pushed stream ended. Values are metric labels."""

    COMPLETED = "completed"  # the iterator ended (after draining / buffer_overflow): body ended
    UNSUBSCRIBED = "unsubscribed"
    REFUSED = "refused"  # the router answered the stream POST with a non-200 status
    RESET_BY_ROUTER = "reset_by_router"
    OPEN_FAILED = "open_failed"  # open_stream raised (backend removed by a reload, hub limit)
    DRAINING = "draining"  # subscribed while draining: only the `draining` record was sent
    ABORTED = "aborted"  # the session or the connection ended under it


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


class Push:
    """One subscribed stream: `stop` is set on `unsubscribe`; `task` runs `run_push`."""

    __slots__ = ("stop", "sub", "task")

    def __init__(self, sub: Subscribe) -> None:
        self.sub = sub
        self.stop = asyncio.Event()  # unsubscribe
        self.task: asyncio.Task[None] | None = None


@dataclass(frozen=True, slots=True)
class PushContext:
    """What a push needs from its client: the request to open (`headers()` reads the credential
    and may raise `BusError`), whether the client drains, the stream source and the counters."""

    path_prefix: str
    headers: Callable[[], list[HeaderTuple]]
    draining: Callable[[], bool]
    open_stream: OpenStream
    drain_deadline_s: float
    stats: BusClientStats
    notify: Callable[[], None]


async def run_push(ctx: PushContext, conn: H2Connection, push: Push) -> None:
    """Push one stream to its end (never raises but for cancellation: a failure ends this push
    only, never the session)."""
    sub = push.sub
    end = PushEnd.ABORTED
    sid: int | None = None
    iterator: AsyncIterator[bytes] | None = None
    try:
        headers = ctx.headers()
        sid = await conn.open_request(ctx.path_prefix + bp.stream_path(sub.stream_id), headers)
        ctx.stats.streams_opened += 1
        ctx.notify()
        if ctx.draining():
            # Subscribed while shutting down: the answer a new consumer gets is `draining`.
            await conn.send_data(sid, encode_control(ControlEvent.DRAINING, sub.announced_source),
                                 end_stream=True)
            end = PushEnd.DRAINING
            return
        try:
            iterator = ctx.open_stream(sub.announced_source, sub.last_event_id)
        except Exception as exc:  # the hub refused (backend removed by a reload, limits)
            log.warning("bus_open_stream_failed", backend=sub.announced_source, error=repr(exc))
            conn.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            end = PushEnd.OPEN_FAILED
            return
        log.info("bus_push_started", backend=sub.announced_source, stream_id=sub.stream_id,
                 resume=sub.last_event_id is not None)
        end = await _pump(ctx, conn, sid, push, iterator)
        if end in (PushEnd.COMPLETED, PushEnd.UNSUBSCRIBED):
            await conn.end_stream(sid)
            if end is PushEnd.COMPLETED:
                # The router ends its response once it has the whole body: wait for that so
                # a drain does not close the connection under the last bytes.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(ctx.drain_deadline_s):
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
        ctx.stats.streams_ended[end.value] += 1
        ctx.notify()
        if iterator is not None:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        if sid is not None:
            conn.forget(sid)
        log.info("bus_push_ended", backend=sub.announced_source, stream_id=sub.stream_id,
                 end=end.value)


async def _pump(ctx: PushContext, conn: H2Connection, sid: int, push: Push,
                iterator: AsyncIterator[bytes]) -> PushEnd:
    """Copy the iterator into the request body until it ends, the router unsubscribes,
    refuses or resets the stream. Unsubscribe interrupts even a send waiting for a window."""
    outcome: list[PushEnd] = []

    async def copy() -> None:
        async for chunk in iterator:
            await conn.send_data(sid, chunk)
            ctx.stats.bytes_pushed += len(chunk)
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
