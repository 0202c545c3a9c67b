"""KvEventConsumerManager against real servers on 127.0.0.1: a scripted aiohttp SSE server (ids,
resync without ids, comments, control records, caps, malformed records, HTTP errors, cut
connections) that records the Last-Event-ID of every connection, a WebSocket server, an injected
event-bus stream, and the listener's own SSE server. Waits go through an injected sleep that
records the delays (no real backoff waiting); conditions are awaited on queues with timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from kv_listener.core.eventlog import Record, RecordEvent, parse_event_id
from kv_listener.core.model import PrefixTransition, Tier, TransitionKind
from kv_listener.core.sse import ControlEvent, encode_control, encode_record
from kv_listener.outputs.bus_client import BusClient
from kv_listener.outputs.sse_server import NoSources, create_app, serve
from kv_listener.outputs.streams import StreamHub
from kv_listener.router.bus_server import NoSession
from kv_listener.router.config import EventSourceConfig, Transport
from kv_listener.router.consumer import (
    KvEventConsumerManager,
    NoSessionError,
    index_applier,
)
from kv_listener.router.consumer_state import SourceStatus
from kv_listener.router.consumer_state import reconnect_backoff as Backoff
from kv_listener.router.index import Holder, InMemoryKvIndex
from kv_listener.router.metrics import RouterMetrics
from tests.support.bus import TOKEN_A, listener_config, running_server, write_token
from tests.support.golden import golden
from tests.support.ports import free_port
from tests.support.tls import TlsMaterial

B = "vllm-1"
P1 = "1" * 64
P2 = "2" * 64
P3 = "3" * 64
TIMEOUT = 5.0
MIB = 1 << 20


def rec(event: RecordEvent, prefix: str | None = None, *, id_: str | None = None, n: int | None = None,
        tier: Tier | None = None, backend: str = B) -> bytes:
    """A record exactly as the listener encodes it."""
    if event in (RecordEvent.CACHE_CREATED, RecordEvent.CACHE_OFFLOADED):
        n = 16 if n is None else n
        tier = tier or (Tier.GPU_HOT if event is RecordEvent.CACHE_CREATED else Tier.STORAGE_WARM)
    return encode_record(Record(id_, event, backend, prefix, n, tier, 1764412345.123))


def created(prefix: str, id_: str | None = None, n: int = 16) -> bytes:
    return rec(RecordEvent.CACHE_CREATED, prefix, id_=id_, n=n)


def cleared(id_: str | None = None) -> bytes:
    return rec(RecordEvent.CACHE_CLEARED, id_=id_)


DRAINING = encode_control(ControlEvent.DRAINING, B)
OVERFLOW = encode_control(ControlEvent.BUFFER_OVERFLOW, B)


# --- servers ------------------------------------------------------------------------------------

HOLD = "hold"  # keep the stream open until the server stops
ABORT = "abort"  # cut the TCP connection in the middle of the body


@dataclass
class Conn:
    """What the server does on one connection."""

    actions: list[bytes | str] = field(default_factory=list)
    status: int = 200
    content_type: str = "text/event-stream"


class ScriptedServer:
    """Serves `GET /events/{backend}` (SSE) and `/ws/{backend}` (WebSocket), one script per
    connection in order; once the scripts run out, every connection is held open. Each
    connection's Last-Event-ID header (None when absent) goes on `requests`."""

    def __init__(self, scripts: Iterable[Conn] = (), ssl_context: ssl.SSLContext | None = None) -> None:
        self.scripts: deque[Conn] = deque(scripts)
        self.ssl_context = ssl_context
        self.requests: asyncio.Queue[str | None] = asyncio.Queue()
        self.paths: list[str] = []
        self.stopping = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    def url(self, path: str = f"/events/{B}", scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def _next(self, request: web.Request) -> Conn:
        self.paths.append(request.path)
        self.requests.put_nowait(request.headers.get("Last-Event-ID"))
        return self.scripts.popleft() if self.scripts else Conn([HOLD])

    async def sse(self, request: web.Request) -> web.StreamResponse:
        script = self._next(request)
        if script.status != 200:
            return web.json_response({"error": "scripted"}, status=script.status)
        resp = web.StreamResponse()
        resp.content_type = script.content_type
        await resp.prepare(request)
        try:
            for action in script.actions:
                if action == HOLD:
                    await self.stopping.wait()
                elif action == ABORT:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                else:
                    assert isinstance(action, bytes)
                    await resp.write(action)
            await resp.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass  # the consumer hung up (caps): expected
        return resp

    async def ws(self, request: web.Request) -> web.StreamResponse:
        script = self._next(request)
        if script.status != 200:
            return web.json_response({"error": "scripted"}, status=script.status)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        try:
            for action in script.actions:
                if action == HOLD:
                    await self.stopping.wait()
                else:
                    assert isinstance(action, bytes)
                    await ws.send_str(action.decode())
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass
        await ws.close()
        return ws

    async def __aenter__(self) -> ScriptedServer:
        app = web.Application()
        app.router.add_get("/events/{backend}", self.sse)
        app.router.add_get("/ws/{backend}", self.ws)
        self.runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self.runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self.runner, sock, ssl_context=self.ssl_context).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stopping.set()
        assert self.runner is not None
        await self.runner.cleanup()

    async def next_request(self) -> str | None:
        return await asyncio.wait_for(self.requests.get(), TIMEOUT)


# --- consumer side helpers ----------------------------------------------------------------------


class Applied:
    """The `apply_record` callback: collects records, lets tests await them."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.queue: asyncio.Queue[Record] = asyncio.Queue()

    async def __call__(self, record: Record) -> None:
        self.records.append(record)
        self.queue.put_nowait(record)

    async def next(self) -> Record:
        return await asyncio.wait_for(self.queue.get(), TIMEOUT)

    async def take(self, n: int) -> list[Record]:
        return [await self.next() for _ in range(n)]

    def after(self, first: Callable[[Record], Awaitable[None]]) -> Callable[[Record], Awaitable[None]]:
        """A callback that gives each record to `first` (an index), then collects it."""

        async def apply(record: Record) -> None:
            await first(record)
            await self(record)

        return apply


class FakeSleep:
    """Records the requested delays without waiting; from call `block_after` on it blocks until
    cancelled, so a consumer that would retry forever parks there."""

    def __init__(self, block_after: int = 1000) -> None:
        self.delays: list[float] = []
        self.queue: asyncio.Queue[float] = asyncio.Queue()
        self.block_after = block_after

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        self.queue.put_nowait(delay)
        if len(self.delays) >= self.block_after:
            await asyncio.Event().wait()
        await asyncio.sleep(0)

    async def wait_count(self, n: int) -> list[float]:
        while len(self.delays) < n:
            await asyncio.wait_for(self.queue.get(), TIMEOUT)
        return self.delays[:n]


def source(endpoint: str | None, *, interval_ms: int = 1000, backend: str = B,
           transport: Transport = Transport.SSE) -> EventSourceConfig:
    return EventSourceConfig(backend_name=backend, transport=transport, endpoint=endpoint,
                             reconnect_interval_ms=interval_ms)


def manager(sources: list[EventSourceConfig], applied: Callable[[Record], Awaitable[None]],
            sleep: FakeSleep, **kwargs: Any) -> KvEventConsumerManager:
    return KvEventConsumerManager(sources, applied, sleep=sleep, clock=lambda: 1000.0, **kwargs)


class WatchedMetrics(RouterMetrics):
    """The real router metrics, plus a queue of connected-gauge changes tests can await."""

    def __init__(self, registry: CollectorRegistry, backends: Iterable[str]) -> None:
        super().__init__(registry, backends)
        self.changes: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()

    def set_connected(self, backend: str, connected: bool) -> None:
        super().set_connected(backend, connected)
        self.changes.put_nowait((backend, connected))

    async def wait_connected(self, backend: str = B) -> None:
        async with asyncio.timeout(TIMEOUT):
            while await self.changes.get() != (backend, True):
                pass


# --- SSE over HTTP ------------------------------------------------------------------------------


async def test_records_applied_in_order_and_resumed_with_last_id() -> None:
    first = Conn([
        b": ping\n\n",
        # resync: cleared + snapshot without ids, the last one carries the newest ID
        cleared(), created(P1), rec(RecordEvent.CACHE_OFFLOADED, P2, n=32, id_="ep-3"),
        b": ping\n\n",
        created(P3, "ep-4", n=48),
        rec(RecordEvent.CACHE_EVICTED, P1, id_="ep-5"),
    ])
    async with ScriptedServer([first]) as server:
        applied, sleep = Applied(), FakeSleep()
        registry = CollectorRegistry()
        metrics = WatchedMetrics(registry, [B])
        async with manager([source(server.url())], applied, sleep, metrics=metrics) as m:
            assert await server.next_request() is None  # a new consumer: no Last-Event-ID
            await metrics.wait_connected()
            got = await applied.take(5)
            assert [(r.event, r.prefix_hash, r.token_count, r.tier, r.id) for r in got] == [
                (RecordEvent.CACHE_CLEARED, None, None, None, None),
                (RecordEvent.CACHE_CREATED, P1, 16, Tier.GPU_HOT, None),
                (RecordEvent.CACHE_OFFLOADED, P2, 32, Tier.STORAGE_WARM, "ep-3"),
                (RecordEvent.CACHE_CREATED, P3, 48, Tier.GPU_HOT, "ep-4"),
                (RecordEvent.CACHE_EVICTED, P1, None, None, "ep-5"),
            ]
            assert all(r.backend == B and r.ts == 1764412345.123 for r in got)
            # the stream ended cleanly: reconnect after the (reset) backoff, resuming at ep-5
            assert await server.next_request() == "ep-5"
            assert sleep.delays == [1.0]
            await metrics.wait_connected()
            assert registry.get_sample_value("continuum_kv_consumer_connected", {"backend": B}) == 1
            s = m.stats()[B]
            assert (s["received"], s["applied"], s["dropped"], s["last_event_id"]) == (5, 5, {}, "ep-5")
            assert (s["reconnect_count"], s["connections"], s["last_event_at"]) == (1, 2, 1000.0)
            assert s["ended"] == {"stream_ended": 1}
        assert registry.get_sample_value("continuum_kv_consumer_connected", {"backend": B}) == 0


async def test_resync_cut_in_the_middle_keeps_the_old_id() -> None:
    scripts = [
        Conn([created(P1, "ep-7")]),
        # a resync (unknown epoch) cut before its last, numbered record
        Conn([cleared(), created(P2)]),
        Conn([cleared(), created(P2), created(P3, "new-9")]),
    ]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        async with manager([source(server.url())], applied, sleep):
            assert await server.next_request() is None
            assert await server.next_request() == "ep-7"
            assert await server.next_request() == "ep-7"  # no id: lines -> still the old ID
            assert await server.next_request() == "new-9"
            assert len(applied.records) == 6


async def test_event_type_comes_from_the_sse_field_else_the_json_body() -> None:
    body_only = json.dumps({"event": "cache_created", "backend": B, "prefix_hash": P1,
                            "token_count": 8, "tier": "gpu_hot", "ts": 1.5})
    # The SSE field wins over a body that says something else.
    evicted_by_field = json.dumps({"event": "cache_created", "backend": B, "prefix_hash": P2,
                                   "token_count": 8})
    scripts = [Conn([
        f"id: a-1\ndata: {body_only}\n\n".encode(),
        f"id: a-2\r\nevent: cache_evicted\r\ndata: {evicted_by_field}\r\n\r\n".encode(),
        # no tier: derived from the event
        f'event: cache_offloaded\ndata: {{"prefix_hash":"{P3}","token_count":4}}\n\n'.encode(),
        HOLD,
    ])]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        async with manager([source(server.url())], applied, sleep) as m:
            got = await applied.take(3)
            assert [(r.event, r.prefix_hash, r.token_count, r.tier, r.id, r.ts) for r in got] == [
                (RecordEvent.CACHE_CREATED, P1, 8, Tier.GPU_HOT, "a-1", 1.5),
                (RecordEvent.CACHE_EVICTED, P2, None, None, "a-2", None),
                (RecordEvent.CACHE_OFFLOADED, P3, 4, Tier.STORAGE_WARM, None, None),
            ]
            assert m.stats()[B]["last_event_id"] == "a-2"
            assert got[0].as_dict() == {"event": "cache_created", "backend": B, "prefix_hash": P1,
                                        "token_count": 8, "tier": "gpu_hot", "ts": 1.5, "id": "a-1"}


async def test_bad_records_are_counted_drops_and_the_stream_goes_on() -> None:
    def data(**fields: Any) -> bytes:
        return f"event: cache_created\ndata: {json.dumps(fields)}\n\n".encode()

    bad = [
        b"event: cache_created\ndata: {not json\n\n",  # malformed_json
        b"event: cache_created\ndata: [1, 2]\n\n",  # malformed_json (not an object)
        b'event: cache_exploded\ndata: {"backend": "vllm-1"}\n\n',  # unknown_event
        b'data: {"backend": "vllm-1"}\n\n',  # unknown_event (no type anywhere)
        data(backend=B, prefix_hash="AB" * 32, token_count=1),  # invalid_field
        data(backend=B, prefix_hash=P1, token_count=-1),  # invalid_field
        data(backend=B, prefix_hash=P1, token_count=True),  # invalid_field
        data(backend=B, prefix_hash=P1, token_count=1, tier="lukewarm"),  # invalid_field
        data(backend="vllm-2", prefix_hash=P1, token_count=1),  # backend_mismatch
    ]
    scripts = [Conn([*bad, created(P2, "b-1"), HOLD])]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        registry = CollectorRegistry()
        with capture_logs() as logs:
            async with manager([source(server.url())], applied, sleep,
                               metrics=RouterMetrics(registry, [B])) as m:
                good = await applied.next()
                s = m.stats()[B]
        # a flood is counted, not logged: one warning per reason per connection
        dropped_logs = [e for e in logs if e["event"] == "kv_event_dropped"]
        assert sorted(e["reason"] for e in dropped_logs) == [
            "backend_mismatch", "invalid_field", "malformed_json", "unknown_event"]
        assert all(e["log_level"] == "warning" and e["backend"] == B for e in dropped_logs)
        assert (good.prefix_hash, good.id) == (P2, "b-1")
        assert s["dropped"] == {"malformed_json": 2, "unknown_event": 2, "invalid_field": 4,
                                "backend_mismatch": 1}
        assert (s["received"], s["applied"], s["connections"], s["connected"]) == (10, 1, 1, True)

        def dropped(reason: str) -> float | None:
            return registry.get_sample_value("continuum_kv_event_dropped_total",
                                             {"backend": B, "reason": reason})

        assert (dropped("malformed_json"), dropped("invalid_field")) == (2, 4)
        assert sleep.delays == []  # nothing of this closed the stream


async def test_apply_errors_are_counted_as_index_errors() -> None:
    calls: list[Record] = []
    done = asyncio.Event()

    async def failing(record: Record) -> None:
        calls.append(record)
        if len(calls) == 2:
            done.set()
        if record.prefix_hash == P1:
            raise ConnectionError("index down")

    async with ScriptedServer([Conn([created(P1, "c-1"), created(P2, "c-2"), HOLD])]) as server:
        sleep = FakeSleep()
        async with manager([source(server.url())], failing, sleep) as m:
            await asyncio.wait_for(done.wait(), TIMEOUT)
            # the consumer records the outcome before it next yields to the loop
            s = m.stats()[B]
            assert s["last_event_id"] == "c-2"
            assert (s["dropped"], s["applied"]) == ({"index_error": 1}, 1)


async def test_draining_reconnects_at_once_with_the_last_id() -> None:
    scripts = [Conn([created(P1, "d-1"), DRAINING, created(P2, "d-2")]),
               Conn([DRAINING]),  # drains again without delivering anything: back off now
               Conn([created(P3, "d-3"), HOLD])]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        async with manager([source(server.url())], applied, sleep) as m:
            assert await server.next_request() is None
            assert await server.next_request() == "d-1"  # the record after draining is ignored
            assert await server.next_request() == "d-1"
            # one wait for two reconnects: none after the planned restart, the backoff after
            # the second drain that delivered nothing
            assert sleep.delays == [1.0]
            assert [r.id for r in await applied.take(2)] == ["d-1", "d-3"]
            assert m.stats()[B]["ended"] == {"draining": 2}


async def test_buffer_overflow_resumes_after_backoff() -> None:
    scripts = [Conn([created(P1, "o-1"), OVERFLOW]), Conn([OVERFLOW])]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        async with manager([source(server.url(), interval_ms=500)], applied, sleep) as m:
            assert await server.next_request() is None
            assert await server.next_request() == "o-1"
            assert await server.next_request() == "o-1"
            # reset after the healthy first connection, then doubling for the empty second
            assert sleep.delays == [0.5, 1.0]
            assert m.stats()[B]["ended"] == {"buffer_overflow": 2}


@pytest.mark.parametrize("oversized", [
    pytest.param([b"data: " + b"x" * (MIB + 1)], id="line-without-end"),
    pytest.param([b"event: cache_created\n", *[b"data: " + b"y" * (MIB // 2) + b"\n"] * 3],
                 id="data-of-one-record"),
])
async def test_oversized_line_or_data_closes_backs_off_and_resumes(oversized: list[bytes]) -> None:
    scripts = [Conn([created(P1, "x-1"), *oversized, created(P2, "x-2"), HOLD])]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        async with manager([source(server.url())], applied, sleep) as m:
            assert await server.next_request() is None
            assert (await applied.next()).id == "x-1"
            assert await server.next_request() == "x-1"
            s = m.stats()[B]
            assert s["dropped"] == {"oversized": 1}
            assert s["ended"] == {"oversized": 1}
            assert s["last_error"].startswith("oversized: SSE ")
            assert sleep.delays == [1.0]
            assert [r.id for r in applied.records] == ["x-1"]  # x-2 came after the cut


async def test_record_exactly_at_the_caps_is_accepted() -> None:
    # A 1 MiB data line (with its "data: " field name it is the longest line allowed, too).
    payload = json.dumps({"event": "cache_created", "backend": B, "prefix_hash": P1,
                          "token_count": 1, "pad": ""})
    pad = MIB - len(payload) - len(b"data: ")
    padded = payload[:-2] + "x" * pad + '"}'
    line = b"data: " + padded.encode()
    assert len(line) == MIB
    async with ScriptedServer([Conn([line + b"\n\n", HOLD])]) as server:
        applied, sleep = Applied(), FakeSleep()
        async with manager([source(server.url())], applied, sleep) as m:
            assert (await applied.next()).prefix_hash == P1
            assert m.stats()[B]["dropped"] == {}


async def test_backoff_doubles_to_the_cap_on_404() -> None:
    async with ScriptedServer([Conn(status=404)] * 12) as server:
        applied, sleep = Applied(), FakeSleep(block_after=9)
        registry = CollectorRegistry()
        async with manager([source(server.url())], applied, sleep,
                           metrics=RouterMetrics(registry, [B])) as m:
            assert await sleep.wait_count(9) == [1, 2, 4, 8, 16, 32, 60, 60, 60]
            s = m.stats()[B]
            assert (s["connected"], s["connections"], s["reconnect_count"]) == (False, 0, 8)
            assert s["last_error"] == "http_404: HTTP 404"
            assert s["ended"] == {"http_404": 9}
            assert registry.get_sample_value("continuum_kv_consumer_connected", {"backend": B}) == 0


async def test_backoff_resets_after_a_healthy_connection() -> None:
    scripts = [Conn(status=404), Conn(status=503), Conn([created(P1, "h-1")]),
               Conn(status=500), Conn(content_type="text/html"), Conn([ABORT])]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        async with manager([source(server.url())], applied, sleep) as m:
            for expected in [None, None, None, "h-1", "h-1", "h-1", "h-1"]:
                assert await server.next_request() == expected
            assert sleep.delays == [1, 2, 1, 2, 4, 8]
            assert m.stats()[B]["ended"] == {"http_404": 1, "http_status": 2, "stream_ended": 2,
                                             "bad_content_type": 1}


async def test_a_silent_peer_times_out_and_is_left() -> None:
    # No record and no keep-alive within the read timeout: the peer is presumed dead.
    async with ScriptedServer([Conn([created(P1, "q-1"), HOLD])]) as server:
        applied, sleep = Applied(), FakeSleep(block_after=1)
        async with manager([source(server.url())], applied, sleep, read_timeout_s=0.2) as m:
            await sleep.wait_count(1)
            s = m.stats()[B]
            assert s["ended"] == {"timeout": 1}
            assert s["last_error"] == "timeout: no data within 0.2 s"
            assert s["connected"] is False
            assert sleep.delays == [1.0]  # reset by the record it did deliver


def test_backoff_cap_is_the_interval_when_above_60_s() -> None:
    b = Backoff(90.0)
    assert [b.next_delay() for _ in range(3)] == [90.0, 90.0, 90.0]
    b = Backoff(0.01)
    assert [b.next_delay() for _ in range(15)][-3:] == [40.96, 60.0, 60.0]
    b.reset()
    assert b.next_delay() == 0.01


async def test_connection_refused_backs_off() -> None:
    port = free_port()  # nothing listens there
    applied, sleep = Applied(), FakeSleep(block_after=3)
    async with manager([source(f"http://127.0.0.1:{port}/events/{B}")], applied, sleep) as m:
        assert await sleep.wait_count(3) == [1, 2, 4]
        assert m.stats()[B]["ended"] == {"connect_error": 3}
        assert m.stats()[B]["last_error"].startswith("connect_error: ")


# --- WebSocket ----------------------------------------------------------------------------------


async def test_websocket_one_record_per_message() -> None:
    scripts = [
        Conn([created(P1, "w-1").rstrip(b"\n"),  # no blank line: the message boundary ends it
              b": ping",
              b"event: cache_created\ndata: {oops\n\n",
              rec(RecordEvent.CACHE_EVICTED, P1, id_="w-2")]),
        Conn([created(P2, "w-3"), DRAINING]),
        Conn([b"data: " + b"z" * (2 * MIB + 10)]),  # over the message cap
        Conn([HOLD]),
    ]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        url = server.url(f"/ws/{B}", scheme="ws")
        async with manager([source(url)], applied, sleep) as m:
            assert await server.next_request() is None
            assert await server.next_request() == "w-2"  # closed by the server: resume
            assert await server.next_request() == "w-3"  # draining: at once
            assert await server.next_request() == "w-3"  # oversized: after backoff
            assert [(r.event, r.id) for r in applied.records] == [
                (RecordEvent.CACHE_CREATED, "w-1"), (RecordEvent.CACHE_EVICTED, "w-2"),
                (RecordEvent.CACHE_CREATED, "w-3")]
            s = m.stats()[B]
            assert s["dropped"] == {"malformed_json": 1, "oversized": 1}
            assert s["ended"] == {"stream_ended": 1, "draining": 1, "oversized": 1}
            assert sleep.delays == [1.0, 1.0]
            assert server.paths == [f"/ws/{B}"] * 4


async def test_websocket_handshake_404_backs_off() -> None:
    async with ScriptedServer([Conn(status=404)] * 3) as server:
        applied, sleep = Applied(), FakeSleep(block_after=2)
        async with manager([source(server.url(f"/ws/{B}", scheme="ws"))], applied, sleep) as m:
            assert await sleep.wait_count(2) == [1.0, 2.0]
            assert m.stats()[B]["ended"] == {"http_404": 2}


# --- TLS ----------------------------------------------------------------------------------------


async def test_https_and_wss_verify_the_listener_certificate() -> None:
    ca, rogue = trustme.CA(), trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    rogue_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    rogue.issue_cert("127.0.0.1").configure_cert(rogue_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)

    def anonymous(prefix: str, id_: str) -> bytes:  # no backend field: fits either source
        data = json.dumps({"prefix_hash": prefix, "token_count": 1})
        return f"id: {id_}\nevent: cache_created\ndata: {data}\n\n".encode()

    scripts = [Conn([anonymous(P1, "t-1"), HOLD]), Conn([anonymous(P2, "t-2"), HOLD])]
    async with ScriptedServer(scripts, ssl_context=server_ctx) as server:
        applied, sleep = Applied(), FakeSleep()
        sources = [source(server.url(f"/events/{B}", scheme="https")),
                   source(server.url("/ws/vllm-2", scheme="wss"), backend="vllm-2")]
        async with manager(sources, applied, sleep, ssl_context=client_ctx) as m:
            got = await applied.take(2)
            assert {r.backend for r in got} == {B, "vllm-2"}
            assert {r.id for r in got} == {"t-1", "t-2"}
            assert sorted(server.paths) == [f"/events/{B}", "/ws/vllm-2"]
            assert all(s["connected"] for s in m.stats().values())
    async with ScriptedServer([Conn([created(P1, "t-1"), HOLD])], ssl_context=rogue_ctx) as server:
        applied, sleep = Applied(), FakeSleep(block_after=1)
        async with manager([source(server.url(scheme="https"))], applied, sleep,
                           ssl_context=client_ctx) as m:
            await sleep.wait_count(1)
            assert m.stats()[B]["last_error"].startswith("connect_error: ")
            assert server.paths == []  # the handshake failed before any request


# --- event bus ----------------------------------------------------------------------------------


async def test_event_bus_retries_no_session_without_backoff_and_resumes() -> None:
    calls: list[tuple[str, str | None]] = []
    call_queue: asyncio.Queue[int] = asyncio.Queue()
    body = cleared() + created(P1, "bus-1") + b": ping\n\n" + created(P2, "bus-2")

    async def chunks(data: bytes) -> AsyncIterator[bytes]:
        for i in range(len(data)):  # one byte at a time: the parser is incremental
            yield data[i:i + 1]

    async def vanished() -> AsyncIterator[bytes]:
        raise NoSessionError(B)
        yield b""  # pragma: no cover - makes this an async generator

    async def held() -> AsyncIterator[bytes]:
        yield created(P3, "bus-3")
        await asyncio.Event().wait()

    def open_announced_stream(backend: str, last_event_id: str | None) -> AsyncIterator[bytes]:
        calls.append((backend, last_event_id))
        call_queue.put_nowait(len(calls))
        n = len(calls)
        if n <= 3:
            raise NoSessionError(backend)
        if n == 4:
            return chunks(body)
        if n == 5:
            return vanished()
        return held()

    applied, sleep = Applied(), FakeSleep()
    registry = CollectorRegistry()
    cfg = source(None, interval_ms=250, transport=Transport.EVENT_BUS)
    async with manager([cfg], applied, sleep, open_announced_stream=open_announced_stream,
                       metrics=RouterMetrics(registry, [B])) as m:
        assert [r.id for r in await applied.take(4)] == [None, "bus-1", "bus-2", "bus-3"]
        assert m.stats()[B]["connected"]  # set on the stream's first bytes, before its records
        assert calls == [(B, None)] * 4 + [(B, "bus-2")] * 2
        # no_session: every reconnect_interval, never doubled; after the stream ended: reset
        assert sleep.delays == [0.25] * 5
        s = m.stats()[B]
        assert s["ended"] == {"no_session": 4, "stream_ended": 1}
        assert s["reconnect_count"] == 1  # no_session polls are not reconnects
        assert registry.get_sample_value("continuum_kv_consumer_connected", {"backend": B}) == 1


async def test_event_bus_without_a_bus_waits_for_one() -> None:
    applied, sleep = Applied(), FakeSleep(block_after=2)
    cfg = source(None, interval_ms=100, transport=Transport.EVENT_BUS)
    async with manager([cfg], applied, sleep) as m:
        assert await sleep.wait_count(2) == [0.1, 0.1]
        assert m.stats()[B]["last_error"] == "no_session: no event bus configured"


async def test_a_failing_bus_stream_is_an_error_not_a_crash() -> None:
    attempts = 0

    def broken(backend: str, last_event_id: str | None) -> AsyncIterator[bytes]:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("bus bug")

    applied, sleep = Applied(), FakeSleep(block_after=3)
    cfg = source(None, transport=Transport.EVENT_BUS)
    with capture_logs() as logs:
        async with manager([cfg], applied, sleep, open_announced_stream=broken) as m:
            assert await sleep.wait_count(3) == [1, 2, 4]
            assert attempts == 3
            assert m.stats()[B]["last_error"] == "error: RuntimeError"
    # The traceback once per outage, not once per attempt.
    assert [e["error"] for e in logs if e["event"] == "kv_consumer_error"] == ["RuntimeError"]


# --- several sources, reload --------------------------------------------------------------------


async def test_sources_run_independently_and_reload_adds_removes_restarts() -> None:
    scripts = [Conn([created(P1, "r-1"), HOLD]),
               Conn([rec(RecordEvent.CACHE_CREATED, P2, id_="s-1", backend="vllm-2"), HOLD]),
               Conn([created(P3, "r-2"), HOLD])]
    async with ScriptedServer(scripts) as server:
        applied, sleep = Applied(), FakeSleep()
        a = source(server.url(f"/events/{B}"))
        b = source(server.url("/events/vllm-2"), backend="vllm-2")
        async with manager([a], applied, sleep) as m:
            assert await server.next_request() is None
            assert ((r := await applied.next()).backend, r.id) == (B, "r-1")

            result = await m.reload([b])
            assert (result.added, result.removed, result.restarted) == (("vllm-2",), (B,), ())
            assert m.backends == ["vllm-2"]
            assert await server.next_request() is None
            assert ((r := await applied.next()).backend, r.id) == ("vllm-2", "s-1")

            m.add_source(a)  # removed before: starts afresh, without an ID
            with pytest.raises(ValueError, match="already exists"):
                m.add_source(a)
            assert await server.next_request() is None
            assert ((r := await applied.next()).backend, r.id) == (B, "r-2")

            # same endpoint, other interval: restarted, resuming from its last ID; b untouched
            result = await m.reload([source(a.endpoint, interval_ms=2000), b])
            assert (result.added, result.removed, result.restarted) == ((), (), (B,))
            assert await server.next_request() == "r-2"
            assert m.stats()["vllm-2"]["connections"] == 1
            assert m.stats()[B]["connections"] == 2

            assert await m.remove_source("vllm-2") is True
            assert await m.remove_source("vllm-2") is False
            assert set(m.stats()) == {B}
        assert server.paths == [f"/events/{B}", "/events/vllm-2", f"/events/{B}", f"/events/{B}"]


def test_duplicate_sources_are_refused() -> None:
    async def noop(record: Record) -> None:
        return None

    with pytest.raises(ValueError, match="duplicate"):
        KvEventConsumerManager([source("http://x/events/a"), source("http://y/events/a")], noop)


# --- the listener's own SSE server ---------------------------------------------------------------




def transition(i: int, n: int = 16) -> PrefixTransition:
    return PrefixTransition(TransitionKind.CREATED, f"{i:064x}", n, Tier.GPU_HOT)


async def test_against_the_listener_sse_server_into_a_real_index() -> None:
    """Resync, live records, a buffer_overflow resumed from the history without gap or duplicate,
    and a backend re-created under a new epoch (draining, then a resync that clears the index)."""
    hub = StreamHub(history_size=100, max_lag=5, update_interval_s=0.05, max_sse_clients=4)
    hub.add_backend(B)
    hub.publish(B, [transition(1), transition(2, 32)])
    server = await serve(create_app(hub, NoSources()), "127.0.0.1", 0, graceful_timeout_s=1)
    index = InMemoryKvIndex()
    applied = Applied()
    apply = applied.after(index_applier(index))

    sleep = FakeSleep()
    metrics = WatchedMetrics(CollectorRegistry(), [B])
    endpoint = f"http://127.0.0.1:{server.port}/events/{B}"
    try:
        async with manager([source(endpoint)], apply, sleep, metrics=metrics) as m:
            resync = await applied.take(3)
            epoch = hub.backend(B).log.epoch
            assert [(r.event, r.id) for r in resync] == [
                (RecordEvent.CACHE_CLEARED, None), (RecordEvent.CACHE_CREATED, None),
                (RecordEvent.CACHE_CREATED, f"{epoch}-2")]
            assert await index.query(f"{2:064x}") == [Holder(B, 32, Tier.GPU_HOT)]

            hub.publish(B, [transition(3)])  # live
            assert (await applied.next()).id == f"{epoch}-3"

            # A backlog growing past max_lag (two publishes before the consumer can read): it is
            # cut off with buffer_overflow and resumes from epoch-3 out of the history.
            hub.publish(B, [transition(i) for i in range(10, 13)])
            hub.publish(B, [transition(i) for i in range(13, 18)])
            replayed = await applied.take(8)
            assert [parse_event_id(r.id or "") for r in replayed] == [
                (epoch, seq) for seq in range(4, 12)]
            assert [r.prefix_hash for r in replayed] == [f"{i:064x}" for i in range(10, 18)]
            assert m.stats()[B]["ended"] == {"buffer_overflow": 1}
            assert hub.stats()[B]["resumes"] == 1
            assert sleep.delays == [1.0]

            # The backend is re-created (new epoch): its stream drains, the consumer comes back
            # at once with its old ID, gets a resync and the index forgets the old prefixes.
            hub.remove_backend(B)
            hub.add_backend(B)
            new_epoch = hub.backend(B).log.epoch
            again = await applied.next()
            assert (again.event, again.id) == (RecordEvent.CACHE_CLEARED, f"{new_epoch}-0")
            assert await index.query(f"{2:064x}") == []
            assert sleep.delays == [1.0]  # the planned restart did not wait
            s = m.stats()[B]
            assert s["ended"] == {"buffer_overflow": 1, "draining": 1}
            assert (s["last_event_id"], s["dropped"], s["connected"]) == (f"{new_epoch}-0", {}, True)
            assert s["applied_by_event"] == {"cache_cleared": 2, "cache_created": 11}
            assert m.source_statuses() == [SourceStatus(
                backend_name=B, connected=True, events_received=13, events_dropped=0,
                index_created=11, index_evicted=0, reconnect_count=2, last_event_at=1000.0)]
    finally:
        await hub.drain(timeout_s=1)
        await server.stop()
        hub.close()


# --- push mode: the golden stream, and the whole way over the real event bus --------------------


def expected_golden_records() -> list[dict[str, Any]]:
    """The golden file's prefix records as the consumer hands them on (`as_dict()`)."""
    return [{**data, "id": id_} for event, id_, data in golden.EXPECTED if event != "draining"]


@pytest.mark.parametrize("split", [1, 7, 1 << 20])
async def test_golden_push_stream_parses_the_same_over_both_transports(split: int) -> None:
    """fixtures/push_stream_golden.sse (the listener's exact bytes, SPEC §7), cut into chunks of
    `split` bytes, through the event bus and through SSE over HTTP: the same records, ending with
    `draining` and an immediate re-request with the last ID."""
    data = golden.GOLDEN.read_bytes()
    chunks: list[bytes | str] = [data[i:i + split] for i in range(0, len(data), split)]
    bus_calls: list[str | None] = []

    async def pushed() -> AsyncIterator[bytes]:
        for chunk in chunks:
            assert isinstance(chunk, bytes)
            yield chunk

    def open_announced_stream(backend: str, last_event_id: str | None) -> AsyncIterator[bytes]:
        bus_calls.append(last_event_id)
        if len(bus_calls) > 1:
            raise NoSession(backend)  # the real server's error: the draining session is gone
        return pushed()

    bus_records: list[dict[str, Any]] = []
    sse_records: list[dict[str, Any]] = []

    async def to_bus_list(record: Record) -> None:
        bus_records.append(record.as_dict())

    async def to_sse_list(record: Record) -> None:
        sse_records.append(record.as_dict())

    bus = source(None, transport=Transport.EVENT_BUS, backend=golden.BACKEND)
    sleep = FakeSleep(block_after=1)
    async with manager([bus], to_bus_list, sleep, open_announced_stream=open_announced_stream) as m:
        await sleep.wait_count(1)
        assert m.stats()[golden.BACKEND]["ended"] == {"draining": 1, "no_session": 1}
    assert bus_calls == [None, f"{golden.EPOCH}-6"]  # after draining: at once, with the last ID
    assert bus_records == expected_golden_records()

    async with ScriptedServer([Conn(chunks)]) as server:
        sse = source(server.url(f"/events/{golden.BACKEND}"), backend=golden.BACKEND)
        async with manager([sse], to_sse_list, FakeSleep()) as m:
            assert await server.next_request() is None
            assert await server.next_request() == f"{golden.EPOCH}-6"
            assert m.stats()[golden.BACKEND]["ended"] == {"draining": 1}
    assert sse_records == bus_records


@pytest.fixture
def bus_tls(tmp_path: Path) -> TlsMaterial:
    return TlsMaterial.create(tmp_path / "tls")


async def test_over_the_real_event_bus_from_a_real_listener_client(
        bus_tls: TlsMaterial, tmp_path: Path) -> None:
    """The consumer starts before any listener (no_session), the listener's BusClient connects,
    the resync and live records arrive over TLS HTTP/2 into a real index, and a restarted consumer
    resumes from its last ID without a resync."""
    hub = StreamHub(history_size=100, max_lag=100, update_interval_s=0.05, max_sse_clients=4,
                    ping_interval_s=None)
    hub.add_backend(B)
    index = InMemoryKvIndex()
    applied = Applied()
    apply = applied.after(index_applier(index))

    async with running_server(bus_tls) as bus:
        delays: list[float] = []

        async def sleep(delay: float) -> None:  # a retry waits until a session announces B
            delays.append(delay)
            async with asyncio.timeout(TIMEOUT):
                await bus.wait_announced(B)

        cfg = source(None, transport=Transport.EVENT_BUS, interval_ms=300)
        m = KvEventConsumerManager([cfg], apply, open_announced_stream=bus.open_announced_stream,
                                   sleep=sleep, clock=lambda: 1000.0)
        client = BusClient(listener_config(bus.port, bus_tls, write_token(tmp_path, TOKEN_A)),
                           lambda: [B], hub.open)
        client_task: asyncio.Task[None] | None = None
        try:
            m.start()
            client_task = asyncio.create_task(client.run())
            first = await applied.next()  # the resync of a new consumer: empty log
            epoch = hub.backend(B).log.epoch
            assert (first.event, first.id) == (RecordEvent.CACHE_CLEARED, f"{epoch}-0")
            assert delays and set(delays) == {0.3}  # no_session: flat interval until announced
            assert m.stats()[B]["ended"] == {"no_session": len(delays)}

            hub.publish(B, [transition(1, 64)])
            live = await applied.next()
            assert (live.event, live.prefix_hash, live.id) == (RecordEvent.CACHE_CREATED,
                                                              f"{1:064x}", f"{epoch}-1")
            assert await index.query(f"{1:064x}") == [Holder(B, 64, Tier.GPU_HOT)]

            # Restart the consumer (a reload that changed its interval): it gives its stream up
            # and asks again with its last ID; the listener replays nothing and goes live.
            await m.reload([source(None, transport=Transport.EVENT_BUS, interval_ms=400)])
            hub.publish(B, [transition(2, 32)])
            resumed = await applied.next()
            assert (resumed.prefix_hash, resumed.id) == (f"{2:064x}", f"{epoch}-2")
            assert m.stats()[B]["connections"] == 2
            assert m.stats()[B]["applied_by_event"] == {"cache_cleared": 1, "cache_created": 2}
        finally:
            await m.stop()
            if client_task is not None:
                client_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await client_task
            hub.close()


async def test_a_resync_cancelled_midway_still_leaves_the_source_consumed() -> None:
    """The router cancels a resync still running when its index changes state again (two
    outages ridden out in a row during a Redis master's failover). Cancelled while it waits for
    the old runner to end, the resync must still leave the source a runner: without one the
    router keeps the backend's lease and never writes it again (suspected in test_many_routers'
    one failure, 2026-12-04: two routers' reads of one backend stale for 20 s)."""
    async with ScriptedServer() as server:  # every connection held open
        applied, sleep = Applied(), FakeSleep()
        async with manager([source(server.url())], applied, sleep) as m:
            assert await server.next_request() is None
            resync = asyncio.create_task(m.resync_all("index_recovered"))
            await asyncio.sleep(0)  # it took the runner and waits for it to end
            resync.cancel()
            await asyncio.gather(resync, return_exceptions=True)
            assert resync.cancelled()
            assert await server.next_request() is None  # consumed again, from a resync
            assert m.stats()[B]["connections"] == 2
