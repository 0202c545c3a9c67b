"""The router's event consumers: one task per `kv_cache_index.event_sources[]` entry (SPEC §8).

Owns: connecting to a listener's per-backend prefix event stream (SSE over http/https, one SSE
record per WebSocket message over ws/wss, or an announced stream of this router's event bus,
SPEC §7), resuming it with the last event ID seen, turning its records into the one prefix record type
(`core.records.Record`, decoded and validated by `core.records.decode_data`) handed to the
injected `apply_record` callback, and the reconnect policy. What applying means is the embedding
router's choice; `index_applier(index)` is the usual one (each record goes to a `KvIndex` as it
is). This module is the manager (sources added, removed, reloaded, resynced; their stats); one
source's loop, transports and stream reader are `router.source_runner`'s, its counters and end
reasons `router.consumer_state`'s. Over ws/wss every WebSocket message carries one
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
  `kv_consumer_disconnected` (a stream that was up ended) carry `reason` (`ConsumeEndReason`), `error`
  (exception class), `errno` and `strerror` or `http_status`, `detail`, `retry_in_s`, and for
  connect failures `attempt` (consecutive failures) and `outage_s`. The first failure and a
  changed one are logged at once, an unchanged one at most every `log_repeat_interval_s` (300 s)
  with `suppressed` (the repeats logged at debug level meanwhile). `kv_consumer_connected`
  (info) ends an outage with `outage_s` and `failed_attempts`.

Writer lease (`kv_cache_index.writer_lease`, issue 16; `router.lease`): given a `WriterLease`,
a source's runner runs only while this router holds that backend's lease (one `LeaseKeeper` per
source). Becoming the writer starts the runner without a Last-Event-ID, so the listener sends a
full resync and the shared index becomes right whatever the previous writer left; losing the
lease stops the runner at once; `stop()` and `remove_source()` stop the runner, then give the
lease back. An `event_bus` source contends only while a live session of this router announces
the backend (`announcer`, the event-bus server), so the writer is a router that can open the
stream. `consume_all(True)` (the Redis index fell back to memory, which starts empty: a
standby's would stay so) runs every source regardless of the lease, each from a resync;
`consume_all(False)` returns to the lease rule. While it consumes all, this router does not
contend for any lease and a writer gives its leases back (reason `index_fallback`): it cannot
write the shared index, so a router that can must (else the shared index stays stale until this
router's next probe finds Redis again). Without a lease nothing of this applies.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import structlog

from kv_listener.core.bus_protocol import NoSessionError
from kv_listener.core.records import Record, RecordEvent
from kv_listener.router.config import EventSourceConfig, Transport
from kv_listener.router.consumer_state import (
    ConsumeEndReason,
    SourceState,
    SourceStatus,
)
from kv_listener.router.index import KvIndex
from kv_listener.router.lease import LeaseKeeper, LeaseState, WriterLease
from kv_listener.router.metrics import EventDropReason
from kv_listener.router.oplog import LOG_REPEAT_INTERVAL_S
from kv_listener.router.source_runner import (
    RecordDropped,
    _SourceRunner,
    _StreamReader,
    decode_record,
    redacted,
)

# Names this module has always offered (tests and embedding routers import them from here).
__all__ = [
    "ApplyRecord", "ConsumeEndReason", "ConsumerMetrics", "KvEventConsumerManager",
    "NoSessionError", "OpenAnnouncedStream", "RecordDropped", "ReloadResult",
    "SourceState", "SourceStatus", "_SourceRunner", "_StreamReader", "decode_record",
    "index_applier",
]

log = structlog.get_logger(__name__)

#: The listener sends `: ping` every 15 s; three missed pings mean a dead peer.
DEFAULT_READ_TIMEOUT_S = 45.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0

ApplyRecord = Callable[[Record], Awaitable[None]]
OpenAnnouncedStream = Callable[[str, str | None], Any]
"""`open_announced_stream(backend, last_event_id)` -> an async iterator of SSE bytes (or an
awaitable of one); raises the no-session error while no session announces `backend`."""
Sleep = Callable[[float], Awaitable[None]]


class ConsumerMetrics(Protocol):
    """The part of `router.metrics.RouterMetrics` the consumers feed."""

    def event_dropped_inc(self, backend: str, reason: EventDropReason, n: int = 1) -> None: ...

    def set_connected(self, backend: str, connected: bool) -> None: ...

    def set_lease_held(self, backend: str, held: bool) -> None: ...


class Announcer(Protocol):
    """The part of `router.bus_server.EventBusServer` the writer lease asks (push mode)."""

    def announced_backends(self) -> set[str]: ...

    async def wait_announced(self, backend: str) -> None: ...


def index_applier(index: KvIndex) -> ApplyRecord:
    """The usual `apply_record`: each record goes to `index` as it is (already validated)."""
    return index.apply


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
    against the system roots). `lease` (and `announcer` for event-bus sources) turn on the
    writer lease (the module docstring).
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
        lease: WriterLease | None = None,
        announcer: Announcer | None = None,
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
        self.lease = lease
        self.announcer = announcer
        self._keepers: dict[str, LeaseKeeper] = {}
        # Set unless consuming all (`consume_all`): the lease gates wait on it.
        self._index_writable = asyncio.Event()
        self._index_writable.set()
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
            self._start_source(name)

    async def stop(self) -> None:
        """Cancel every consumer, wait for them, give the leases back, close the HTTP session."""
        self._started = False
        keepers = list(self._keepers.values())
        self._keepers.clear()
        await _stop_keepers(keepers)
        runners = list(self._runners.values())
        self._runners.clear()
        await _cancel_all(runners)
        await asyncio.gather(*(k.close("shutdown") for k in keepers))
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> KvEventConsumerManager:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _start_source(self, name: str) -> None:
        if self.lease is not None:
            keeper = LeaseKeeper(self.lease, name, on_acquired=lambda: self._lease_acquired(name),
                                 on_lost=lambda: self._lease_lost(name),
                                 gate=_SourceGate(self, name), monotonic=self.monotonic,
                                 log_repeat_interval_s=self.log_repeat_interval_s)
            self._keepers[name] = keeper
            keeper.start()
        if self._wants_runner(name):
            self._spawn(name)

    @property
    def _consume_all(self) -> bool:
        return not self._index_writable.is_set()

    def _wants_runner(self, name: str) -> bool:
        if self.lease is None or self._consume_all:
            return True
        keeper = self._keepers.get(name)
        return keeper is not None and keeper.is_writer

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
            self._start_source(name)

    async def remove_source(self, backend: str) -> bool:
        """Stop and forget a source; False when there is none by that name. Its index entries
        are the caller's business (clear them, or let them age out by TTL)."""
        if backend not in self._configs:
            return False
        del self._configs[backend]
        self._states.pop(backend, None)
        keeper = self._keepers.pop(backend, None)
        if keeper is not None:
            await _stop_keepers([keeper])
        runner = self._runners.pop(backend, None)
        if runner is not None:
            await _cancel_all([runner])
        if keeper is not None:
            await keeper.close("source_removed")
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
            if self._started and self._wants_runner(name):
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
        try:
            await _cancel_all([self._runners.pop(n) for n in names])
        finally:
            self._respawn(names)
        log.info("kv_consumers_resync", reason=reason, sources=len(names))
        return names

    def _respawn(self, names: Iterable[str]) -> None:
        """A new runner, from a resync, for each of `names` that has none. Called in a `finally`
        by whoever took their runners away: the router cancels a resync that a newer index state
        change supersedes, and a source left without its runner meanwhile would stay unread
        (with the writer lease: its backend held, and never written again)."""
        for name in names:
            if name in self._configs and name not in self._runners:
                self._states[name].last_event_id = None
                if self._started:
                    self._spawn(name)

    # --- the writer lease ------------------------------------------------------------------

    async def consume_all(self, active: bool) -> None:
        """With the writer lease: `True` runs every source whatever the lease (the index is in its
        in-memory fallback, which only this router's own streams fill), each from a resync,
        and closes every lease gate (writers give their leases back, standbys stop contending);
        `False` opens the gates and stops again the sources this router does not hold."""
        changed = active != self._consume_all
        if active:
            self._index_writable.clear()  # the keepers' gates close: writers give leases back
        else:
            self._index_writable.set()
        if self.lease is None or not changed:
            return
        if active:
            # The fallback starts empty: every source, the ones this router writes included,
            # fills it from a resync.
            try:
                await _cancel_all([self._runners.pop(n) for n in list(self._runners)])
            finally:
                self._respawn(list(self._configs))
            log.info("kv_consumers_consume_all", reason="index_fallback", sources=len(self._runners))
            return
        stopping = [self._runners.pop(n) for n in list(self._runners) if not self._wants_runner(n)]
        await _cancel_all(stopping)
        log.info("kv_consumers_lease_rule", reason="index_recovered", stopped=len(stopping))

    async def _lease_acquired(self, name: str) -> None:
        if self.metrics is not None:
            self.metrics.set_lease_held(name, True)
        runner = self._runners.pop(name, None)
        try:
            if runner is not None:
                await _cancel_all([runner])
        finally:
            # A resync: whatever the previous writer left, the shared index becomes right.
            self._respawn([name])

    async def _lease_lost(self, name: str) -> None:
        if self.metrics is not None:
            self.metrics.set_lease_held(name, False)
        if self._consume_all:
            return
        runner = self._runners.pop(name, None)
        if runner is not None:
            await _cancel_all([runner])

    def lease_status(self, backend: str) -> tuple[str, str | None]:
        """(`writer` | `standby` | `disabled`, the holder id last seen)."""
        keeper = self._keepers.get(backend)
        if self.lease is None or keeper is None:
            return "disabled", None
        role = "writer" if keeper.state is LeaseState.WRITER else "standby"
        return role, keeper.holder

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
                "endpoint": redacted(cfg.endpoint),
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
            if self.lease is not None:
                out[name]["lease"], out[name]["lease_holder"] = self.lease_status(name)
                out[name]["running"] = name in self._runners
        return out

    def source_statuses(self) -> list[SourceStatus]:
        """The admin API's per-source view (`create_admin_app(source_status=...)`)."""
        out = []
        for name in self._configs:
            s = self._states[name]
            lease, holder = self.lease_status(name)
            out.append(SourceStatus(
                backend_name=name, connected=s.connected, events_received=s.received,
                events_dropped=s.dropped.total(),
                index_created=s.applied_by_event[RecordEvent.CACHE_CREATED.value],
                index_evicted=s.applied_by_event[RecordEvent.CACHE_EVICTED.value],
                reconnect_count=s.reconnect_count, last_event_at=s.last_event_at,
                lease=lease, lease_holder=holder,
            ))
        return out

    def state(self, backend: str) -> SourceState:
        return self._states[backend]


class _SourceGate:
    """A source's `WriterGate`: closed while the manager consumes all (the index fell back to
    memory: nothing this router consumes reaches the shared index); else an event-bus source
    while a live session announces it (the source's transport is read at each question: a
    reload may change it), any other always."""

    def __init__(self, manager: KvEventConsumerManager, name: str) -> None:
        self.manager = manager
        self.name = name

    def eligible(self) -> bool:
        return self.closed_reason() is None

    def closed_reason(self) -> str | None:
        if self.manager._consume_all:
            return "index_fallback"
        cfg = self.manager._configs.get(self.name)
        if cfg is not None and cfg.transport is Transport.EVENT_BUS:
            bus = self.manager.announcer
            if bus is None or self.name not in bus.announced_backends():
                return "no_session"
        return None

    async def wait_eligible(self) -> None:
        while (reason := self.closed_reason()) is not None:
            bus = self.manager.announcer
            if reason == "index_fallback":
                await self.manager._index_writable.wait()
            elif bus is None:  # an event-bus source without a bus is never read: never contend
                await asyncio.Event().wait()
            else:
                await bus.wait_announced(self.name)


async def _cancel_tasks(tasks: list[asyncio.Task[Any] | None]) -> None:
    """Cancel the tasks that exist and wait until every one has ended."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    if live:
        await asyncio.gather(*live, return_exceptions=True)


async def _stop_keepers(keepers: list[LeaseKeeper]) -> None:
    """Stop the lease loops (no new lease taken); giving back what they hold is `close()`'s."""
    await _cancel_tasks([k.task for k in keepers])
    for k in keepers:
        k.task = None


async def _cancel_all(runners: list[_SourceRunner]) -> None:
    await _cancel_tasks([r.task for r in runners])
    for r in runners:
        r.set_connected(False)

