"""Stream hub and HTTP app: StreamHub directly, then the app under real uvicorn on 127.0.0.1 with a
real aiohttp client (resync, resume by header and query, 404, 503, overflow of a slow consumer
next to a fast one, draining, keep-alives, health/readiness/stats/metrics)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from kv_listener.config import ListenerConfig, SourceConfig
from kv_listener.core.eventlog import Record
from kv_listener.core.model import Engine, PrefixTransition, Tier, TransitionKind
from kv_listener.core.sse import (
    PING,
    ControlEvent,
    SseEvent,
    SseParser,
    encode_control,
    encode_records,
)
from kv_listener.metrics import ListenerCollector, SourceView, new_registry
from kv_listener.outputs.sse_server import RunningServer, create_app, serve, source_stats_entry
from kv_listener.outputs.streams import (
    EventStream,
    HubDraining,
    StreamHub,
    TooManyClients,
    UnknownBackend,
)
from kv_listener.stats import SourceStats

B1, B2 = "vllm-1", "sglang-2"
TIMEOUT = 10.0


def prefix(i: int) -> str:
    return f"{i:064x}"


def created(i: int, n: int = 16, tier: Tier = Tier.GPU_HOT) -> PrefixTransition:
    return PrefixTransition(TransitionKind.CREATED, prefix(i), n, tier)


def make_hub(**kw: Any) -> StreamHub:
    params: dict[str, Any] = {
        "history_size": 1000, "max_lag": 100, "update_interval_s": 0.05, "max_sse_clients": 8,
    }
    params.update(kw)
    hub = StreamHub(**params)
    hub.add_backend(B1)
    hub.add_backend(B2)
    return hub


async def read_until(stream: EventStream, parser: SseParser, n: int) -> tuple[bytes, list[SseEvent]]:
    raw = b""
    events: list[SseEvent] = []
    async with asyncio.timeout(TIMEOUT):
        async for chunk in stream:
            raw += chunk
            events += parser.feed(chunk)
            if len(events) >= n:
                break
    return raw, events


# --- StreamHub, no HTTP ---------------------------------------------------------------------


async def test_new_consumer_gets_resync_then_live_records_byte_exact() -> None:
    # A fixed clock: the resync's cache_cleared carries "now", compared below byte for byte.
    hub = make_hub(clock=lambda: 1764412345.123)
    first = hub.publish(B1, [created(1), created(2, 32, Tier.STORAGE_WARM)])
    stream = hub.open(B1)
    assert stream.resync is not None
    later = hub.publish(B1, [created(3)])  # between open and the first read: not lost
    replay = hub.backend(B1).log.since(None).records  # what a resync looks like now
    raw, events = await read_until(stream, SseParser(), 4)
    assert [e.event for e in events] == ["cache_cleared", "cache_created", "cache_offloaded",
                                         "cache_created"]
    assert [e.id for e in events] == [None, None, first[-1].id, later[0].id]
    assert raw.startswith(encode_records(replay[:1]))
    assert raw.endswith(encode_records(later))
    await stream.aclose()
    assert hub.clients == 0
    hub.close()


async def test_resume_replays_exactly_the_missing_records() -> None:
    hub = make_hub()
    records: list[Record] = []
    for i in range(5):
        records += hub.publish(B1, [created(i)])
    stream = hub.open(B1, records[1].id)
    assert stream.resync is None
    raw, _ = await read_until(stream, SseParser(), 3)
    assert raw == encode_records(records[2:])
    await stream.aclose()
    assert hub.backend(B1).counters.resumes == 1
    hub.close()


async def test_slow_consumer_overflows_without_holding_back_a_fast_one() -> None:
    hub = make_hub(max_lag=10)
    fast, slow = hub.open(B1), hub.open(B1)
    fast_parser, slow_parser = SseParser(), SseParser()
    await read_until(fast, fast_parser, 1)  # resync
    await read_until(slow, slow_parser, 1)
    sent: list[Record] = []
    for i in range(4):
        batch = hub.publish(B1, [created(10 * i + k) for k in range(4)])
        sent += batch
        _, got = await read_until(fast, fast_parser, 4)
        assert [e.id for e in got] == [r.id for r in batch]
    raw, _ = await read_until(slow, slow_parser, 1)
    assert raw == encode_control(ControlEvent.BUFFER_OVERFLOW, B1)
    with pytest.raises(StopAsyncIteration):
        await anext(slow)
    assert slow.closed
    assert hub.clients == 1
    # The slow one resumes from the last ID it holds and gets everything it missed.
    again = hub.open(B1, slow_parser.last_event_id)
    assert again.resync is None
    raw, _ = await read_until(again, SseParser(), len(sent))
    assert raw == encode_records(sent)
    assert hub.backend(B1).counters.overflows == 1
    assert hub.stats()[B1]["streams_ended"] == {"buffer_overflow": 1}
    await fast.aclose()
    await again.aclose()
    hub.close()


async def test_coalesced_update_is_flushed_by_the_timer() -> None:
    hub = make_hub(update_interval_s=0.05)
    stream = hub.open(B1)
    parser = SseParser()
    await read_until(stream, parser, 1)
    hub.publish(B1, [created(1, 16)])
    assert hub.publish(B1, [PrefixTransition(TransitionKind.TOKEN_COUNT, prefix(1), 64,
                                             Tier.GPU_HOT)]) == []
    _, events = await read_until(stream, parser, 2)
    assert [json.loads(e.data)["token_count"] for e in events] == [16, 64]
    assert hub.backend(B1).log.pending_count == 0
    await stream.aclose()
    hub.close()


async def test_open_errors_and_client_limit() -> None:
    hub = make_hub(max_sse_clients=2)
    with pytest.raises(UnknownBackend):
        hub.open("nope")
    a, b = hub.open(B1), hub.open(B2)
    with pytest.raises(TooManyClients):
        hub.open(B1)
    await a.aclose()
    await a.aclose()  # idempotent
    c = hub.open(B1)
    assert hub.clients == 2
    assert hub.stats()[B1]["sse_clients"] == 1
    await b.aclose()
    await c.aclose()
    hub.close()


async def test_drain_sends_queued_records_then_draining_and_refuses_new_streams() -> None:
    hub = make_hub()
    s1, s2 = hub.open(B1), hub.open(B2)
    rec = hub.publish(B1, [created(1)])
    drained = asyncio.create_task(hub.drain(timeout_s=TIMEOUT))
    raw1 = b"".join([chunk async for chunk in s1])
    raw2 = b"".join([chunk async for chunk in s2])
    assert await drained is True
    assert raw1.endswith(encode_records(rec) + encode_control(ControlEvent.DRAINING, B1))
    assert raw2.endswith(encode_control(ControlEvent.DRAINING, B2))
    with pytest.raises(HubDraining):
        hub.open(B1)
    hub.close()


async def test_drain_timeout_drops_queues_of_streams_nobody_reads() -> None:
    hub = make_hub()
    stuck = hub.open(B1)
    hub.publish(B1, [created(i) for i in range(5)])
    assert await hub.drain(timeout_s=0.01) is False
    chunks = [chunk async for chunk in stuck]
    # The resync was already in its hands; the queued records are gone; then draining.
    assert chunks[-1] == encode_control(ControlEvent.DRAINING, B1)
    assert b"".join(chunks).count(b"\nid: ") == 0
    assert hub.clients == 0
    hub.close()


async def test_remove_backend_ends_its_streams_and_readding_changes_epoch() -> None:
    hub = make_hub()
    stream = hub.open(B1)
    records = hub.publish(B1, [created(1)])
    old_epoch = hub.backend(B1).log.epoch
    hub.remove_backend(B1)
    chunks = [chunk async for chunk in stream]
    assert chunks[-1] == encode_control(ControlEvent.DRAINING, B1)
    with pytest.raises(UnknownBackend):
        hub.open(B1)
    assert hub.publish(B1, [created(2)]) == []  # a reload race: logged, ignored
    assert hub.sync_backends([B2, B1, "trt-3"]) == ([B1, "trt-3"], [])
    assert hub.backend(B1).log.epoch != old_epoch
    again = hub.open(B1, records[0].id)  # an ID of the old log: resync, not a wrong replay
    assert again.resync is not None
    assert hub.sync_backends([B1]) == ([], [B2, "trt-3"])
    await again.aclose()
    hub.close()


async def test_malformed_batch_is_counted_not_raised() -> None:
    hub = make_hub()
    bad = PrefixTransition(TransitionKind.TIER, prefix(1), 1, None)
    assert hub.publish(B1, [created(2), bad]) == []
    assert hub.backend(B1).counters.rejected_batches == 1
    assert hub.backend(B1).log.last_seq == 0
    hub.close()


async def test_keepalive_ping_when_idle() -> None:
    hub = make_hub(ping_interval_s=0.02)
    stream = hub.open(B1)
    await read_until(stream, SseParser(), 1)
    async with asyncio.timeout(TIMEOUT):
        assert await anext(stream) == PING
    quiet = hub.open(B1, ping_interval_s=None)
    await read_until(quiet, SseParser(), 1)
    hub.publish(B1, [created(1)])
    assert (await anext(quiet)).startswith(b"id: ")
    await stream.aclose()
    await quiet.aclose()
    hub.close()


# --- HTTP: real uvicorn, real aiohttp ---------------------------------------------------------


class Status:
    """A ListenerStatus with real SourceStats and the real metrics collector."""

    def __init__(self, hub: StreamHub) -> None:
        self.stats = {B1: SourceStats(engine="vllm"), B2: SourceStats(engine="sglang")}
        self.stats[B1].ready = True
        self.stats[B1].events_received = 7
        self.stats[B1].last_event_at = 1773397457.5
        self.stats[B1].events_dropped["unknown_tag"] = 2
        self._registry = new_registry(ListenerCollector(
            lambda: [SourceView(b, s) for b, s in self.stats.items()], hub.stream_views))

    def not_ready(self) -> Sequence[str]:
        return [b for b, s in self.stats.items() if not s.ready]

    def source_readiness(self, backend: str) -> Mapping[str, Any] | None:
        stats = self.stats.get(backend)
        return None if stats is None else {"backend": backend, "ready": stats.ready}

    def source_stats(self) -> Mapping[str, Mapping[str, Any]]:
        return {b: source_stats_entry(s, blocks_tracked=3, tokens_retained=48, prefixes_live=1)
                for b, s in self.stats.items()}

    def metrics_registry(self) -> CollectorRegistry:
        return self._registry


class Http:
    def __init__(self, hub: StreamHub, status: Status, server: RunningServer,
                 session: aiohttp.ClientSession) -> None:
        self.hub = hub
        self.status = status
        self.server = server
        self.session = session
        self.base = f"http://127.0.0.1:{server.port}"


@pytest.fixture
async def http(request: pytest.FixtureRequest) -> AsyncIterator[Http]:
    """The app served on a free port; `indirect` parametrization passes StreamHub parameters."""
    hub = make_hub(**getattr(request, "param", {}))
    status = Status(hub)
    server = await serve(create_app(hub, status), "127.0.0.1", 0, graceful_timeout_s=2)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT))
    try:
        yield Http(hub, status, server, session)
    finally:
        await session.close()
        await hub.drain(timeout_s=2)
        await server.stop()
        hub.close()


class SseReader:
    """Reads an aiohttp response body as SSE, keeping the raw bytes."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.parser = SseParser()
        self.raw = b""
        self.events: list[SseEvent] = []

    async def until(self, pred: Callable[[SseReader], bool]) -> SseReader:
        async with asyncio.timeout(TIMEOUT):
            while not pred(self):
                chunk = await self.resp.content.readany()
                if not chunk:
                    break
                self.raw += chunk
                self.events += self.parser.feed(chunk)
        return self

    async def events_n(self, n: int) -> list[SseEvent]:
        await self.until(lambda r: len(r.events) >= n)
        return self.events

    async def to_end(self) -> SseReader:
        return await self.until(lambda r: False)


@pytest.mark.parametrize("http", [{"max_sse_clients": 8}], indirect=True)
async def test_http_stream_resync_then_live_bytes(http: Http) -> None:
    async with http.session.get(f"{http.base}/events/{B1}") as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-store"
        reader = SseReader(resp)
        await reader.events_n(1)
        epoch = http.hub.backend(B1).log.epoch
        assert [(e.event, e.id) for e in reader.events] == [("cache_cleared", f"{epoch}-0")]
        records = http.hub.publish(B1, [created(1), created(2, 8, Tier.STORAGE_WARM)])
        resync_bytes = reader.raw
        await reader.events_n(3)
        assert reader.raw == resync_bytes + encode_records(records)
        assert reader.parser.last_event_id == f"{epoch}-2"


async def test_http_resume_by_header_and_by_query(http: Http) -> None:
    records: list[Record] = []
    for i in range(4):
        records += http.hub.publish(B1, [created(i)])
    url = f"{http.base}/events/{B1}"
    async with http.session.get(url, headers={"Last-Event-ID": records[0].id or ""}) as resp:
        r = SseReader(resp)
        await r.events_n(3)
        assert r.raw == encode_records(records[1:])
    async with http.session.get(url, params={"last_event_id": records[2].id or ""}) as resp:
        r = SseReader(resp)
        await r.events_n(1)
        assert r.raw == encode_records(records[3:])
    # Both given: the header (what EventSource sends on reconnect) wins.
    async with http.session.get(url, params={"last_event_id": records[0].id or ""},
                                headers={"Last-Event-ID": records[2].id or ""}) as resp:
        r = SseReader(resp)
        await r.events_n(1)
        assert r.raw == encode_records(records[3:])
    counters = http.hub.backend(B1).counters
    assert counters.resumes == 3
    assert dict(counters.resyncs) == {}


async def test_http_unknown_backend_is_404(http: Http) -> None:
    async with http.session.get(f"{http.base}/events/nope") as resp:
        assert resp.status == 404
        assert (await resp.json())["backend"] == "nope"
    async with http.session.head(f"{http.base}/events/nope") as resp:
        assert resp.status == 404


async def test_http_head_answers_without_opening_a_stream(http: Http) -> None:
    async with http.session.head(f"{http.base}/events/{B1}") as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
    assert http.hub.backend(B1).counters.streams_opened == 0


@pytest.mark.parametrize("http", [{"max_sse_clients": 2}], indirect=True)
async def test_http_503_above_max_sse_clients_and_slot_freed_on_disconnect(http: Http) -> None:
    url = f"{http.base}/events/{B1}"
    first = await http.session.get(url)
    second = await http.session.get(url)
    assert (first.status, second.status) == (200, 200)
    async with http.session.get(url) as third:
        assert third.status == 503
        assert third.headers["retry-after"] == "1"
    first.close()  # the client goes away: its slot must come back
    async with asyncio.timeout(TIMEOUT):
        await http.hub.wait_clients(lambda n: n < 2)
    async with http.session.get(url) as fourth:
        assert fourth.status == 200
    second.close()


def small_rcvbuf_socket(addr_info: Any) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    # A consumer that reads nothing, with little kernel buffer: it falls behind quickly.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


@pytest.mark.parametrize("http", [{"max_lag": 50}], indirect=True)
async def test_http_slow_consumer_overflows_while_fast_one_keeps_up(http: Http) -> None:
    url = f"{http.base}/events/{B1}"
    slow_conn = aiohttp.TCPConnector(socket_factory=small_rcvbuf_socket)
    async with aiohttp.ClientSession(connector=slow_conn) as slow_session, \
            http.session.get(url) as fast_resp, slow_session.get(url) as slow_resp:
        fast = SseReader(fast_resp)
        await fast.events_n(1)
        sent: list[Record] = []
        i = 0
        backend = http.hub.backend(B1)
        # Publish in batches below max_lag, each read in full by the fast consumer, until the
        # slow one (which reads nothing) is cut off.
        async with asyncio.timeout(TIMEOUT * 3):
            while backend.counters.overflows == 0:
                batch = http.hub.publish(B1, [created(i + k, 4096) for k in range(40)])
                i += 40
                sent += batch
                await fast.events_n(1 + len(sent))
        assert [e.id for e in fast.events[1:]] == [r.id for r in sent]
        assert fast.raw.endswith(encode_records(sent))
        # The slow one, once it reads, gets what the transport held, then buffer_overflow, then
        # the end of the stream; it is no longer counted.
        slow = await SseReader(slow_resp).to_end()
        assert slow.events[-1].event == "buffer_overflow"
        assert slow.raw.endswith(encode_control(ControlEvent.BUFFER_OVERFLOW, B1))
        epoch = backend.log.epoch
        got = [e.id for e in slow.events if e.id]
        assert got == [f"{epoch}-0"] + [r.id for r in sent[: len(got) - 1]]
        assert http.hub.clients == 1
        # The fast one is still live.
        more = http.hub.publish(B1, [created(10**6)])
        await fast.events_n(1 + len(sent) + 1)
        assert fast.raw.endswith(encode_records(more))
        # Resuming from the slow one's last ID fills its gap exactly.
        async with http.session.get(url, headers={"Last-Event-ID": slow.parser.last_event_id}) \
                as resumed:
            r = SseReader(resumed)
            missing = [rec for rec in sent + more
                       if int((rec.id or "").rpartition("-")[2])
                       > int(slow.parser.last_event_id.rpartition("-")[2])]
            await r.events_n(len(missing))
            assert r.raw == encode_records(missing)


async def test_http_drain_ends_every_stream_with_draining(http: Http) -> None:
    async with http.session.get(f"{http.base}/events/{B1}") as r1, \
            http.session.get(f"{http.base}/events/{B2}") as r2:
        a, b = SseReader(r1), SseReader(r2)
        await a.events_n(1)
        await b.events_n(1)
        assert await http.hub.drain(timeout_s=TIMEOUT) is True
        await a.to_end()
        await b.to_end()
        assert a.raw.endswith(encode_control(ControlEvent.DRAINING, B1))
        assert b.raw.endswith(encode_control(ControlEvent.DRAINING, B2))
        assert [e.id for e in a.events] == [a.events[0].id, None]
    async with http.session.get(f"{http.base}/events/{B1}") as resp:
        assert resp.status == 503


@pytest.mark.parametrize("http", [{"ping_interval_s": 0.05}], indirect=True)
async def test_http_keepalive_comment(http: Http) -> None:
    async with http.session.get(f"{http.base}/events/{B1}") as resp:
        reader = SseReader(resp)
        await reader.until(lambda r: r.parser.comments >= 1)
        assert PING in reader.raw


async def test_http_health_readiness_stats_metrics(http: Http) -> None:
    async with http.session.get(f"{http.base}/healthz") as resp:
        assert resp.status == 200
    async with http.session.get(f"{http.base}/readyz") as resp:
        assert resp.status == 503
        assert await resp.json() == [B2]
    http.status.stats[B2].ready = True
    async with http.session.get(f"{http.base}/readyz") as resp:
        assert resp.status == 200
        assert await resp.json() == []

    http.hub.publish(B1, [created(1), created(2)])
    async with http.session.get(f"{http.base}/events/{B1}") as stream:
        await SseReader(stream).events_n(3)
        async with http.session.get(f"{http.base}/stats") as resp:
            assert resp.status == 200
            body = await resp.json()
        async with http.session.get(f"{http.base}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/plain")
            metrics = await resp.text()
    entry = body["sources"][B1]
    for key in ("engine", "events_received", "events_dropped", "gaps", "replays", "clears",
                "blocks_tracked", "tokens_retained", "prefixes_live", "detokenize_calls",
                "detokenize_errors", "last_event_at"):
        assert key in entry, key
    assert entry["engine"] == "vllm"
    assert entry["events_received"] == 7
    # the router's format (ISO 8601 UTC), with the epoch seconds beside it
    assert (entry["last_event_at"], entry["last_event_ts"]) == ("2026-03-13T10:24:17Z", 1773397457.5)
    assert body["sources"][B2]["last_event_at"] is None
    assert entry["events_dropped"] == {"unknown_tag": 2}
    assert entry["prefixes_live"] == 1  # the source's own figure wins over the log's
    assert entry["sse_clients"] == 1
    assert entry["records"] == {"cache_created": 2}
    assert entry["last_event_id"] == f"{http.hub.backend(B1).log.epoch}-2"
    assert body["streams"] == {"clients": 1, "max_sse_clients": 8, "draining": False}
    assert body["process"]["asyncio_tasks"] >= 1  # a leak shows as a count that keeps growing
    assert f'continuum_kv_listener_sse_clients{{backend="{B1}"}} 1.0' in metrics
    assert (f'continuum_kv_listener_records_total{{backend="{B1}",event="cache_created"}} 2.0'
            in metrics)
    assert f'continuum_kv_listener_events_received_total{{backend="{B1}"}} 7.0' in metrics


async def test_serve_reports_port_and_stops() -> None:
    hub = make_hub()
    server = await serve(create_app(hub, Status(hub)), "127.0.0.1", 0)
    assert server.port > 0
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://127.0.0.1:{server.port}/healthz") as resp:
        assert resp.status == 200
    await server.stop()
    await server.wait()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    hub.close()


async def test_serve_bind_error_is_an_oserror() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        hub = make_hub()
        with pytest.raises(OSError):
            await serve(create_app(hub, Status(hub)), "127.0.0.1", taken.getsockname()[1])
        hub.close()


async def test_hub_from_config_takes_limits_and_one_backend_per_source() -> None:
    config = ListenerConfig(
        history_size=7, max_lag=3, update_interval_s=0.5, max_sse_clients=4,
        sources=(SourceConfig("vllm-1", Engine.VLLM, "m"),
                 SourceConfig("trt-2", Engine.TRTLLM, "m")),
    )
    hub = StreamHub.from_config(config, ping_interval_s=None)
    assert hub.backends == ["vllm-1", "trt-2"]
    log = hub.backend("trt-2").log
    assert (log.history_size, log.update_interval_s) == (7, 0.5)
    assert (hub.max_lag, hub.max_sse_clients, hub.ping_interval_s) == (3, 4, None)
    assert hub.backend("vllm-1").log.epoch != log.epoch  # per-log epochs, random
    assert len(log.epoch) >= 8 and int(log.epoch, 16) >= 0
    hub.close()
