"""Per-backend event streams: one `EventLog` per backend, fanned out to any number of consumers.

Owns (SPEC §6, §7): applying tracker transitions to each backend's log (`StreamHub.publish`), the
timer that flushes coalesced token-count updates, and the consumers: each one is an
`EventStream`, an async iterator of the exact SSE bytes (resync or replay first, then live
records, `: ping` keep-alives, `draining` / `buffer_overflow` then the end). `GET /events/{backend}`
and the HTTP/2 pusher both iterate it, so the two transports send the same bytes.

A consumer never slows the others: records are encoded once per publish and appended to each
consumer's own queue; a consumer more than `max_lag` records behind loses its queue, gets
`buffer_overflow` and ends (it resumes with its last ID). Backends can be added and removed at
runtime (config reload); removal ends that backend's streams with `draining`.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import structlog

from kv_listener.core.eventlog import EventLog, Record, Replay, ResyncReason
from kv_listener.core.model import PrefixTransition
from kv_listener.core.sse import PING, ControlEvent, encode_control, encode_record_list
from kv_listener.metrics import StreamView

if TYPE_CHECKING:
    from kv_listener.config import ListenerConfig

log = structlog.get_logger(__name__)

DEFAULT_PING_INTERVAL_S = 15.0
# Records joined into one chunk handed to the transport: fewer, larger writes for a consumer
# that is catching up, without building one huge buffer for a 100k-record replay.
_CHUNK_RECORDS = 512


class StreamError(Exception):
    """A stream cannot be opened. Subclasses map to HTTP statuses at the edge."""


class UnknownBackend(StreamError, LookupError):
    """No such backend (HTTP 404)."""

    def __init__(self, backend: str) -> None:
        super().__init__(f"unknown backend {backend!r}")
        self.backend = backend


class TooManyClients(StreamError):
    """`max_sse_clients` streams are open (HTTP 503)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"max_sse_clients ({limit}) streams are open")
        self.limit = limit


class HubDraining(StreamError):
    """The listener is shutting down and takes no new stream (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__("the listener is draining")


class ConsumerEnd(enum.StrEnum):
    """Why one consumer's stream ended: the keys of `streams_ended` in `/stats`."""

    CLOSED = "closed"  # the consumer went away (or the transport closed the iterator)
    BUFFER_OVERFLOW = "buffer_overflow"
    DRAINING = "draining"
    BACKEND_REMOVED = "backend_removed"


@dataclass(slots=True)
class StreamCounters:
    """Per-backend counters behind /stats and /metrics. Keys are Enum values (metric labels).
    Records written, by event, are the event log's own count (`EventLog.records_written`)."""

    resyncs: Counter[str] = field(default_factory=Counter)  # ResyncReason -> streams opened
    resumes: int = 0  # streams opened with a replay from the history
    streams_opened: int = 0
    streams_ended: Counter[str] = field(default_factory=Counter)  # ConsumerEnd -> n
    overflows: int = 0
    rejected_batches: int = 0  # transition batches the event log refused (tracker bug)


class _Consumer:
    __slots__ = ("end", "queue", "wake")

    def __init__(self) -> None:
        self.queue: deque[bytes] = deque()  # one encoded record per item
        self.wake = asyncio.Event()
        self.end: ConsumerEnd | None = None  # set: no more records will be queued


class BackendStreams:
    """One backend: its event log, its consumers, its counters."""

    def __init__(self, log_: EventLog, max_lag: int) -> None:
        self.log = log_
        self.max_lag = max_lag
        self.consumers: set[_Consumer] = set()
        self.counters = StreamCounters()

    @property
    def backend(self) -> str:
        return self.log.backend

    def fan_out(self, records: list[Record]) -> None:
        if not records:
            return
        if not self.consumers:
            return  # nobody to encode for (a later consumer replays from the log)
        encoded = encode_record_list(records)
        for c in self.consumers:
            if c.end is not None:
                continue
            # Lag is what a consumer has not taken yet. One publish bigger than max_lag does not
            # make a consumer that had taken everything "slow": it gets the batch whole, and is
            # cut off only if it still holds a backlog when more arrives.
            if c.queue and len(c.queue) + len(encoded) > self.max_lag:
                # Free its backlog now; it resumes from the last ID it holds.
                c.queue.clear()
                c.end = ConsumerEnd.BUFFER_OVERFLOW
                self.counters.overflows += 1
                log.warning("sse_buffer_overflow", backend=self.backend, max_lag=self.max_lag)
            else:
                c.queue.extend(encoded)
            c.wake.set()

    def end_all(self, reason: ConsumerEnd) -> None:
        for c in self.consumers:
            if c.end is None:
                c.end = reason
                c.wake.set()


class EventStream:
    """Async iterator of one consumer's SSE bytes. Close it (`aclose()`, or `async with`) when
    the transport is done with it; it closes itself when it ends."""

    def __init__(
        self, backend: BackendStreams, consumer: _Consumer, replay: Replay,
        ping_interval_s: float | None, on_close: Callable[[], None],
    ) -> None:
        self._on_close = on_close
        self._backend = backend
        self._consumer = consumer
        self._replay: deque[Record] = deque(replay.records)
        self._ping_interval_s = ping_interval_s
        self._closed = False
        self.resync: ResyncReason | None = replay.resync

    @property
    def backend(self) -> str:
        return self._backend.backend

    @property
    def closed(self) -> bool:
        return self._closed

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        if self._replay:
            replay = self._replay
            n = min(len(replay), _CHUNK_RECORDS)
            return b"".join(encode_record_list([replay.popleft() for _ in range(n)]))
        c = self._consumer
        while True:
            if c.queue:
                q = c.queue
                if len(q) <= _CHUNK_RECORDS:
                    chunk = b"".join(q)
                    q.clear()
                    return chunk
                return b"".join([q.popleft() for _ in range(_CHUNK_RECORDS)])
            if c.end is not None:
                reason = c.end
                self._finish(reason)
                if reason is ConsumerEnd.BUFFER_OVERFLOW:
                    return encode_control(ControlEvent.BUFFER_OVERFLOW, self.backend)
                if reason in (ConsumerEnd.DRAINING, ConsumerEnd.BACKEND_REMOVED):
                    return encode_control(ControlEvent.DRAINING, self.backend)
                raise StopAsyncIteration
            c.wake.clear()
            if self._ping_interval_s is None:
                await c.wake.wait()
                continue
            try:
                async with asyncio.timeout(self._ping_interval_s):
                    await c.wake.wait()
            except TimeoutError:
                return PING

    def close(self) -> None:
        """Unregister now (idempotent). Further iteration ends."""
        self._finish(ConsumerEnd.CLOSED)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def _finish(self, reason: ConsumerEnd) -> None:
        if self._closed:
            return
        self._closed = True
        self._replay.clear()
        self._consumer.queue.clear()
        self._backend.consumers.discard(self._consumer)
        self._backend.counters.streams_ended[reason.value] += 1
        self._on_close()
        log.info("sse_stream_ended", backend=self.backend, reason=reason.value)


class StreamHub:
    """All backends' streams. Lives on one event loop; `publish` and `open` are synchronous, so a
    stream registers atomically with the replay it gets (no record falls between the two)."""

    def __init__(
        self, *, history_size: int, max_lag: int, update_interval_s: float,
        max_sse_clients: int, ping_interval_s: float | None = DEFAULT_PING_INTERVAL_S,
        clock: Callable[[], float] = time.time,
        new_epoch: Callable[[], str] = lambda: secrets.token_hex(8),
    ) -> None:
        self.history_size = history_size
        self.max_lag = max_lag
        self.update_interval_s = update_interval_s
        self.max_sse_clients = max_sse_clients
        self.ping_interval_s = ping_interval_s
        self._clock = clock
        self._new_epoch = new_epoch
        self._backends: dict[str, BackendStreams] = {}
        self._clients = 0
        self._draining = False
        self._clients_changed = asyncio.Event()  # replaced by a fresh one at every change
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due: float | None = None

    @classmethod
    def from_config(cls, config: ListenerConfig, **kwargs: Any) -> StreamHub:
        """A hub with the config's limits and one backend per configured source."""
        hub = cls(
            history_size=config.history_size, max_lag=config.max_lag,
            update_interval_s=config.update_interval_s, max_sse_clients=config.max_sse_clients,
            **kwargs,
        )
        for source in config.sources:
            hub.add_backend(source.backend_name)
        return hub

    # --- backends --------------------------------------------------------------------------

    @property
    def backends(self) -> list[str]:
        return list(self._backends)

    def backend(self, name: str) -> BackendStreams:
        try:
            return self._backends[name]
        except KeyError:
            raise UnknownBackend(name) from None

    def add_backend(self, name: str) -> BackendStreams:
        """Add a backend (idempotent: an existing one keeps its log and its consumers). A fresh
        log gets a fresh epoch, so IDs of an earlier log by that name trigger a resync."""
        existing = self._backends.get(name)
        if existing is not None:
            return existing
        b = BackendStreams(
            EventLog(name, self._new_epoch(), self.history_size, self.update_interval_s),
            self.max_lag,
        )
        self._backends[name] = b
        log.info("sse_backend_added", backend=name, epoch=b.log.epoch)
        return b

    def remove_backend(self, name: str) -> None:
        """Forget a backend; its open streams get `draining` and end."""
        b = self._backends.pop(name, None)
        if b is None:
            return
        b.end_all(ConsumerEnd.BACKEND_REMOVED)
        log.info("sse_backend_removed", backend=name, streams=len(b.consumers))

    def sync_backends(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the backends exactly `names` (config reload). Returns (added, removed)."""
        wanted = list(dict.fromkeys(names))
        removed = [n for n in self._backends if n not in wanted]
        added = [n for n in wanted if n not in self._backends]
        for n in removed:
            self.remove_backend(n)
        for n in added:
            self.add_backend(n)
        return added, removed

    # --- input -----------------------------------------------------------------------------

    def publish(self, backend: str, transitions: Iterable[PrefixTransition]) -> list[Record]:
        """Apply one batch of tracker transitions; returns the records sent (may be empty when
        updates are coalesced). A backend removed meanwhile (reload race) is logged and ignored."""
        b = self._backends.get(backend)
        if b is None:
            log.warning("sse_publish_unknown_backend", backend=backend)
            return []
        try:
            records = b.log.record(transitions, self._clock())
        except ValueError as exc:
            b.counters.rejected_batches += 1
            log.error("eventlog_batch_rejected", backend=backend, error=str(exc))
            return []
        b.fan_out(records)
        self._schedule_flush(b.log.next_flush_at())
        return records

    def flush(self) -> None:
        """Send every coalesced update that is due now (the timer calls this)."""
        now = self._clock()
        for b in self._backends.values():
            b.fan_out(b.log.flush(now))

    def _schedule_flush(self, due: float | None) -> None:
        if due is None or (self._timer_due is not None and self._timer_due <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        # Clamp: `due` is wall clock; a step of the clock must not stall or spin the timer.
        delay = min(max(due - self._clock(), 0.0), self.update_interval_s)
        self._timer_due = due
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_due = None
        self.flush()
        dues = [d for b in self._backends.values() if (d := b.log.next_flush_at()) is not None]
        if dues:
            self._schedule_flush(min(dues))

    # --- consumers -------------------------------------------------------------------------

    @property
    def clients(self) -> int:
        return self._clients

    @property
    def draining(self) -> bool:
        return self._draining

    def open(
        self, backend: str, last_event_id: str | None = None, *,
        ping_interval_s: float | Literal["hub"] | None = "hub",
    ) -> EventStream:
        """A new consumer of `backend` that last saw `last_event_id` (None: a new consumer).

        `ping_interval_s`: seconds between `: ping` keep-alives while idle ("hub": the hub's
        setting; None: none).
        Raises `HubDraining`, `UnknownBackend`, `TooManyClients`.
        """
        if self._draining:
            raise HubDraining
        b = self.backend(backend)
        if self._clients >= self.max_sse_clients:
            raise TooManyClients(self.max_sse_clients)
        replay = b.log.since(last_event_id, now=self._clock())
        consumer = _Consumer()
        b.consumers.add(consumer)
        self._clients += 1
        self._signal_clients_changed()
        b.counters.streams_opened += 1
        if replay.resync is None:
            b.counters.resumes += 1
        else:
            b.counters.resyncs[replay.resync.value] += 1
        ping = self.ping_interval_s if ping_interval_s == "hub" else ping_interval_s
        log.info("sse_stream_opened", backend=backend,
                 resync=replay.resync.value if replay.resync else None,
                 replayed=len(replay.records))
        return EventStream(b, consumer, replay, ping, self._stream_closed)

    def _stream_closed(self) -> None:
        self._clients -= 1
        self._signal_clients_changed()

    def _signal_clients_changed(self) -> None:
        self._clients_changed.set()
        self._clients_changed = asyncio.Event()

    async def wait_clients(self, predicate: Callable[[int], bool]) -> int:
        """Wait until `predicate(open streams)` holds; returns that count. (Shutdown waits for
        0; tests and the pusher wait for a stream to be registered or gone.)"""
        while not predicate(self._clients):
            await self._clients_changed.wait()
        return self._clients

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new streams, end every open one with `draining` (after what it has queued),
        and wait until they are closed. After `timeout_s`, queues are dropped so each stream
        ends at its next read. Returns True when every stream closed in time."""
        self._draining = True
        for b in self._backends.values():
            b.end_all(ConsumerEnd.DRAINING)
        try:
            async with asyncio.timeout(timeout_s):
                await self.wait_clients(lambda n: n == 0)
        except TimeoutError:
            for b in self._backends.values():
                for c in b.consumers:
                    c.queue.clear()
            log.warning("sse_drain_timeout", streams=self._clients)
            return False
        return True

    def close(self) -> None:
        """Stop the flush timer (at shutdown, after `drain`)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_due = None

    # --- stats -----------------------------------------------------------------------------

    def stream_views(self) -> list[StreamView]:
        """What `metrics.ListenerCollector` reads at scrape time."""
        return [
            StreamView(name, clients=len(b.consumers), overflows=b.counters.overflows,
                       records=b.log.records_written())
            for name, b in self._backends.items()
        ]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-backend stream figures for /stats (merged into each source's entry)."""
        out: dict[str, dict[str, Any]] = {}
        for name, b in self._backends.items():
            c = b.counters
            out[name] = {
                "epoch": b.log.epoch,
                "last_event_id": b.log.last_id,
                "history_records": b.log.history_len,
                "prefixes_live": b.log.live_count,
                "pending_updates": b.log.pending_count,
                "sse_clients": len(b.consumers),
                "records": b.log.records_written(),
                "resyncs": dict(c.resyncs),
                "resumes": c.resumes,
                "streams_opened": c.streams_opened,
                "streams_ended": dict(c.streams_ended),
                "buffer_overflows": c.overflows,
                "rejected_batches": c.rejected_batches,
            }
        return out
