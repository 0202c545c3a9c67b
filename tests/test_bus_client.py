"""Listener side of push mode (SPEC §7), over real TLS sockets on 127.0.0.1.

Against the real `EventBusServer`: the golden byte sequence pushed through the real stream hub is
the golden file and what `GET /events/{backend}` serves; unsubscribe ends the body within 1 s;
forbidden after a reload; reconnect and resume with the last event ID after a router restart;
drain; reload with new sources; mTLS and `tls_server_name`.

Against `ScriptedRouter`, a real HTTP/2 server (h2, server side) driven step by step by the
test: flow-control windows, PINGs both ways and the PING timeout, GOAWAY, RST_STREAM, a refused
stream, malformed and unknown session lines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from kv_listener.backoff import Backoff
from kv_listener.config import EventBusConfig
from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import Subscribe, Unsubscribe
from kv_listener.core.model import PrefixTransition, Tier, TransitionKind
from kv_listener.core.sse import SseEvent, SseParser
from kv_listener.outputs.bus_client import BACKOFF_JITTER, BusClient, BusFailure, PushEnd
from kv_listener.outputs.sse_server import NoSources, create_app, serve
from kv_listener.outputs.streams import StreamHub
from kv_listener.router.bus_server import NoSession, StreamEndReason
from tests.support.bus import (
    TOKEN_A,
    brokers,
    listener_config,
    running_server,
    write_token,
)
from tests.support.golden import golden
from tests.support.scripted_router import Chunks, scripted
from tests.support.tasks import running_task
from tests.support.tls import TlsMaterial

A = "a" * 64
B = "b" * 64


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return TlsMaterial.create(tmp_path_factory.mktemp("bus-client-tls"))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    return write_token(tmp_path, TOKEN_A)


def make_hub(backends: Sequence[str] = ("vllm-1", "vllm-2"), **kwargs: Any) -> StreamHub:
    hub = StreamHub(history_size=1000, max_lag=1000, update_interval_s=0.0, max_sse_clients=64,
                    ping_interval_s=None, **kwargs)
    for b in backends:
        hub.add_backend(b)
    return hub


class RecordingOpen:
    """`open_stream` for the client: the hub's own `open`, with the calls recorded."""

    def __init__(self, hub: StreamHub) -> None:
        self.hub = hub
        self.calls: list[tuple[str, str | None]] = []
        self.changed = asyncio.Event()

    def __call__(self, backend: str, last_event_id: str | None) -> AsyncIterator[bytes]:
        self.calls.append((backend, last_event_id))
        self.changed.set()
        self.changed = asyncio.Event()
        return self.hub.open(backend, last_event_id)

    async def wait_calls(self, n: int, timeout_s: float = 10.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while len(self.calls) < n:
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"{len(self.calls)} streams opened, not {n}, within "
                                 f"{timeout_s} s") from None


def created(prefix: str, tokens: int) -> list[PrefixTransition]:
    return [PrefixTransition(TransitionKind.CREATED, prefix, tokens, Tier.GPU_HOT)]


async def read_all(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in stream])


# --- against the real event-bus server ----------------------------------------------------------


async def test_pushed_bytes_are_the_golden_file_and_what_sse_serves(
        tls: TlsMaterial, token_file: Path) -> None:
    clock = golden.ScriptClock()
    hub = golden.make_hub(clock)
    async with running_server(tls) as server:
        client = BusClient(listener_config(server.port, tls, token_file),
                           lambda: [golden.BACKEND], hub.open)
        http = await serve(create_app(hub, NoSources()), "127.0.0.1", 0)
        try:
            async with running_task(client.run()) as run_task, aiohttp.ClientSession() as session:
                await server.wait_announced(golden.BACKEND)
                pushed = await server.open_announced_stream(golden.BACKEND, golden.RESUME_FROM)
                resp = await session.get(f"http://127.0.0.1:{http.port}/events/{golden.BACKEND}",
                                         headers={"Last-Event-ID": golden.RESUME_FROM})
                await hub.wait_clients(lambda n: n == 2)  # both consumers registered
                push_bytes, sse_bytes, _ = await asyncio.gather(
                    read_all(pushed), resp.content.read(), golden.play(hub, clock))
                resp.release()
                await client.drain()
                await asyncio.wait_for(run_task, 5)  # run() returns after drain()
        finally:
            await http.stop()
    assert push_bytes == golden.GOLDEN.read_bytes()
    assert sse_bytes == push_bytes
    assert pushed.end_reason is StreamEndReason.DRAINING
    assert client.stats.streams_ended[PushEnd.COMPLETED.value] == 1
    assert client.stats.bytes_pushed == len(push_bytes)


async def test_unsubscribe_ends_the_request_body_within_a_second(
        tls: TlsMaterial, token_file: Path) -> None:
    hub = make_hub()
    async with running_server(tls) as server:
        client = BusClient(listener_config(server.port, tls, token_file), lambda: ["vllm-1"], hub.open)
        async with running_task(client.run()):
            await server.wait_announced("vllm-1")
            stream = await server.open_announced_stream("vllm-1", None)
            hub.publish("vllm-1", created(A, 16))
            first = await anext(stream)  # resync, then the record
            assert b"cache_cleared" in first or b"cache_created" in first
            await stream.aclose()  # the consumer gives up: the router sends `unsubscribe`
            async with asyncio.timeout(1.0):
                await hub.wait_clients(lambda n: n == 0)  # the hub stream was closed
                await client.wait_stats(lambda s: s.streams_ended[PushEnd.UNSUBSCRIBED.value] == 1)
            assert server.sessions()  # the session lives on
            hub.publish("vllm-1", created(B, 32))
            again = await server.open_announced_stream("vllm-1", None)
            parser = SseParser()
            seen: set[str] = set()
            while B not in seen:  # a new stream on the same session: resync with A and B
                seen.update(json.loads(e.data).get("prefix_hash", "")
                            for e in parser.feed(await anext(again)))
            assert A in seen


async def test_resume_with_last_id_after_router_restart(tls: TlsMaterial, token_file: Path) -> None:
    hub = make_hub()
    opener = RecordingOpen(hub)
    async with running_server(tls) as server:
        port = server.port
        client = BusClient(listener_config(port, tls, token_file), lambda: ["vllm-1"], opener)
        async with running_task(client.run()):
            await server.wait_announced("vllm-1")
            hub.publish("vllm-1", created(A, 16))
            stream = await server.open_announced_stream("vllm-1", None)
            parser = SseParser()
            events: list[SseEvent] = []
            while not events or events[-1].id is None:  # the resync ends with a numbered record
                events.extend(parser.feed(await anext(stream)))
            last_id = parser.last_event_id
            assert last_id.endswith("-1")
            await server.close()
            assert [c async for c in stream] == []
            await client.wait_stats(lambda s: s.failures[BusFailure.SESSION_ENDED.value] >= 1)
            hub.publish("vllm-1", created(B, 32))  # published while the router is away
            async with running_server(tls, port=port) as server2:
                await server2.wait_announced("vllm-1")  # the client reconnected by itself
                resumed = await server2.open_announced_stream("vllm-1", last_id)
                await opener.wait_calls(2)
                assert opener.calls == [("vllm-1", None), ("vllm-1", last_id)]
                parser2 = SseParser(last_event_id=last_id)
                got: list[SseEvent] = []
                while not got:
                    got.extend(parser2.feed(await anext(resumed)))
                # A replay from the history: B's record, no resync (`cache_cleared`) first.
                assert [e.event for e in got] == ["cache_created"]
                assert json.loads(got[0].data)["prefix_hash"] == B
                assert got[0].id is not None and got[0].id.endswith("-2")
    assert client.stats.sessions == 2


async def test_forbidden_after_reload_shrinks_the_allow_list(tls: TlsMaterial, token_file: Path) -> None:
    hub = make_hub()
    async with running_server(tls) as server:
        client = BusClient(listener_config(server.port, tls, token_file),
                           lambda: ["vllm-1", "vllm-2"], hub.open)
        async with running_task(client.run()):
            await server.wait_announced("vllm-2")
            stream = await server.open_announced_stream("vllm-2", None)
            await client.wait_stats(lambda s: s.streams_opened == 1)
            server.update_brokers(brokers(("vllm-1",)))
            rest = [c async for c in stream]  # a revoked credential's bytes are withheld
            assert (rest, stream.end_reason) == ([], StreamEndReason.FORBIDDEN)
            # The `forbidden` line ends the session; the new hello (same sources) is refused
            # with 403, and the client keeps backing off.
            await client.wait_stats(lambda s: s.failures[BusFailure.FORBIDDEN.value] >= 2)
            assert not client.stats.connected
            assert client.stats.next_retry_in_s is not None
            await hub.wait_clients(lambda n: n == 0)  # the pushed stream was given up
    assert server.stats.security_failures["revoked"] == 1
    assert server.stats.security_failures["backend_not_allowed"] >= 1


async def test_drain_sends_draining_on_every_stream_then_returns(
        tls: TlsMaterial, token_file: Path) -> None:
    hub = make_hub()
    async with running_server(tls) as server:
        client = BusClient(listener_config(server.port, tls, token_file, drain_deadline_s=5.0),
                           lambda: ["vllm-1", "vllm-2"], hub.open)
        async with running_task(client.run()) as run_task:
            await server.wait_announced("vllm-2")
            s1 = await server.open_announced_stream("vllm-1", None)
            s2 = await server.open_announced_stream("vllm-2", None)
            await hub.wait_clients(lambda n: n == 2)
            hub.publish("vllm-1", created(A, 16))
            drained, _ = await asyncio.gather(hub.drain(timeout_s=5.0), client.drain())
            assert drained
            await asyncio.wait_for(run_task, 5)
            b1, b2 = await read_all(s1), await read_all(s2)
    for data, backend in ((b1, "vllm-1"), (b2, "vllm-2")):
        assert data.endswith(b'event: draining\ndata: {"event":"draining","backend":"%s"}\n\n'
                             % backend.encode())
    assert A.encode() in b1
    assert s1.end_reason is s2.end_reason is StreamEndReason.DRAINING


async def test_reload_announces_the_new_sources(tls: TlsMaterial, token_file: Path) -> None:
    hub = make_hub()
    sources = ["vllm-1"]
    async with running_server(tls) as server:
        client = BusClient(listener_config(server.port, tls, token_file), lambda: list(sources),
                           hub.open)
        async with running_task(client.run()):
            await client.wait_stats(lambda s: s.connected)
            client.sources_changed()  # unchanged: the session stays
            assert client.stats.sessions == 1
            sources.append("vllm-2")
            client.sources_changed()
            await client.wait_stats(lambda s: s.sessions == 2 and s.connected)
            assert client.announced == ("vllm-1", "vllm-2")
            await server.wait_announced("vllm-2")
            assert ("vllm-1", "vllm-2") in [s.sources for s in server.sessions()]
            assert client.stats.failures.total() == 0  # a reload is not a failure


async def test_mtls_and_tls_server_name(tls: TlsMaterial) -> None:
    """No token: the client certificate (DNS SAN = broker id) is the credential; the URL names
    an IP while the certificate is checked against `tls_server_name`."""
    cert = tls.client_cert("kv-listener-c")
    hub = make_hub()
    async with running_server(tls) as server:
        cfg = listener_config(server.port, tls, None, client_id="kv-listener-c", cert=cert,
                              server_name="bus.test")
        client = BusClient(cfg, lambda: ["vllm-1"], hub.open)
        async with running_task(client.run()):
            await server.wait_announced("vllm-1")
            assert server.sessions()[0].client_id == "kv-listener-c"


@pytest.mark.parametrize("case", ["wrong_name", "untrusted_server"])
async def test_tls_failures_are_counted_and_retried(tls: TlsMaterial, token_file: Path,
                                                    tmp_path: Path, case: str) -> None:
    material = tls
    if case == "untrusted_server":
        rogue = tls.untrusted_server()
        material = TlsMaterial(tls.directory, tls.ca, tls.ca_file, rogue)
    async with running_server(material) as server:
        cfg = listener_config(server.port, tls, token_file,
                              server_name="other.test" if case == "wrong_name" else None)
        client = BusClient(cfg, lambda: ["vllm-1"], make_hub().open)
        async with running_task(client.run()):
            await client.wait_stats(lambda s: s.failures[BusFailure.TLS.value] >= 2)
    assert server.stats.sessions_opened == 0


async def test_unreadable_credential_and_wrong_token(tls: TlsMaterial, tmp_path: Path) -> None:
    async with running_server(tls) as server:
        missing = BusClient(listener_config(server.port, tls, tmp_path / "nope"), lambda: ["vllm-1"],
                            make_hub().open)
        async with running_task(missing.run()):
            await missing.wait_stats(lambda s: s.failures[BusFailure.CONFIG.value] >= 1)
        wrong = BusClient(listener_config(server.port, tls, write_token(tmp_path, b"wrong", "w")),
                          lambda: ["vllm-1"], make_hub().open)
        async with running_task(wrong.run()):
            await wrong.wait_stats(lambda s: s.failures[BusFailure.UNAUTHORIZED.value] >= 2)
    assert missing.stats.connects == 0  # nothing is sent without the credential


class StepClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("welcome_for_s", "reset"), [(31.0, True), (1.0, False)])
async def test_backoff_resets_after_a_session_welcome_for_30_s(
        tls: TlsMaterial, tmp_path: Path, welcome_for_s: float, reset: bool) -> None:
    token_file = write_token(tmp_path, b"wrong")
    clock = StepClock()
    async with running_server(tls) as server:
        cfg = listener_config(server.port, tls, token_file, initial_s=0.01, max_s=10.0)
        client = BusClient(cfg, lambda: ["vllm-1"], make_hub().open, clock=clock, rng=lambda: 0.0)
        async with running_task(client.run()):
            # Four refusals: the delay has doubled to 0.08 s.
            await client.wait_stats(lambda s: s.failures[BusFailure.UNAUTHORIZED.value] >= 4)
            write_token(tmp_path, TOKEN_A)
            await client.wait_stats(lambda s: s.connected)
            clock.now += welcome_for_s
            server.update_brokers([b for b in brokers() if b.id != "kv-listener-a"])
            await client.wait_stats(lambda s: s.failures[BusFailure.FORBIDDEN.value] >= 1)
            await client.wait_stats(lambda s: s.next_retry_in_s is not None)
            delay = client.stats.next_retry_in_s
    assert delay is not None
    if reset:
        assert delay == pytest.approx(0.01)
    else:
        assert delay >= 0.16 - 1e-9


def test_backoff_doubles_to_max_with_jitter_below() -> None:
    b = Backoff(1.0, 8.0, jitter=BACKOFF_JITTER, rng=lambda: 0.0)
    assert [b.next_delay() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    b.reset()
    assert b.next_delay() == 1.0
    worst = Backoff(1.0, 8.0, jitter=BACKOFF_JITTER, rng=lambda: 1.0)
    assert [worst.next_delay() for _ in range(5)] == pytest.approx([0.8, 1.6, 3.2, 6.4, 6.4])


def test_only_https_urls() -> None:
    with pytest.raises(ValueError, match="https"):
        BusClient(EventBusConfig(url="http://router:9443"), list, make_hub)  # type: ignore[arg-type]


# --- against a scripted HTTP/2 router -----------------------------------------------------------


async def test_flow_control_windows_are_respected(tls: TlsMaterial, token_file: Path) -> None:
    """The router grants 1000 bytes per stream and acknowledges nothing by itself: the client
    sends exactly up to the window, waits for each WINDOW_UPDATE, and the router's own h2 state
    machine (which raises on any excess) sees no violation."""
    payload = bytes(range(256)) * 20  # 5120 bytes in one chunk
    source = Chunks(payload, end=True)
    async with scripted(tls, token_file, source, initial_window=1000, auto_ack=False) as (
            _, client, conn):
        session = await conn.welcome()
        sid = await conn.subscribe(session, "st-1")
        granted = 1000
        while len(conn.received.get(sid, b"")) < len(payload):
            await conn.next(h2.events.DataReceived, sid)
            got = len(conn.received[sid])
            assert got <= granted
            if got == granted:  # window used up: grant the next 1000 bytes
                conn.h2.increment_flow_control_window(1000, sid)
                conn.h2.increment_flow_control_window(1000)
                conn.flush()
                granted += 1000
        await conn.next(h2.events.StreamEnded, sid)
        assert bytes(conn.received[sid]) == payload
        assert conn.error is None
        conn.h2.end_stream(sid)  # the router's response ends with the body
        conn.flush()
        await client.wait_stats(lambda s: s.streams_ended[PushEnd.COMPLETED.value] == 1)


async def test_pings_both_ways_and_ping_timeout(tls: TlsMaterial, token_file: Path) -> None:
    async with scripted(tls, token_file, Chunks(), ping_interval_s=0.05, ping_timeout_s=0.2) as (
            router, client, conn):
        await conn.welcome()
        # The router's PING is answered.
        conn.h2.ping(b"router!!")
        conn.flush()
        ack = await conn.next(h2.events.PingAckReceived)
        assert ack.ping_data == b"router!!"
        # The client's keep-alive PING arrives (and h2 answers it).
        await conn.next(h2.events.PingReceived)
        # The router goes silent: no ACK, the client declares the connection dead.
        conn.silent = True
        await client.wait_stats(lambda s: s.failures[BusFailure.PING_TIMEOUT.value] == 1)
        second = await router.connections.get()  # and reconnects
        await second.welcome()
        await client.wait_stats(lambda s: s.sessions == 2)


async def test_goaway_ends_the_session_and_the_client_reconnects(tls: TlsMaterial,
                                                                 token_file: Path) -> None:
    async with scripted(tls, token_file, Chunks()) as (router, client, conn):
        await conn.welcome()
        conn.h2.close_connection()
        conn.flush()
        await client.wait_stats(lambda s: s.failures[BusFailure.GOAWAY.value] == 1)
        await (await router.connections.get()).welcome()
        await client.wait_stats(lambda s: s.sessions == 2)


async def test_stream_reset_refusal_and_odd_lines(tls: TlsMaterial, token_file: Path) -> None:
    """A pushed stream reset by the router, or refused with 404, ends alone (its iterator is
    closed); unknown and malformed session lines are counted and skipped; the session lives."""
    first, second = Chunks(b"data: 1\n\n"), Chunks(b"data: 2\n\n")
    sources = iter([first, second])

    def open_stream(backend: str, last_event_id: str | None) -> AsyncIterator[bytes]:
        return next(sources)(backend, last_event_id)  # a new source per subscribe

    async with scripted(tls, token_file, open_stream) as (_, client, conn):
        session = await conn.welcome()
        sid = await conn.subscribe(session, "st-1", "e-7",
                                   before=b'{"type":"gossip","x":1}\nnot json\n')
        await conn.next(h2.events.DataReceived, sid)
        conn.h2.reset_stream(sid, 8)
        conn.flush()
        await first.closed.wait()
        await client.wait_stats(lambda s: s.streams_ended[PushEnd.RESET_BY_ROUTER.value] == 1)
        assert first.opened == [("vllm-1", "e-7")]

        conn.send(session, bp.encode_message(Subscribe("st-2", "vllm-9", None)))  # not announced
        conn.send(session, bp.encode_message(Subscribe("st-3", "vllm-1", None)))
        sid3 = await conn.request("/bus/v1/streams/st-3")
        conn.respond(sid3, 404, b'{"type":"not_found","reason":"unknown_stream"}\n', end=True)
        await conn.next(h2.events.StreamReset, sid3)  # the client gives the stream up
        await second.closed.wait()
        await client.wait_stats(lambda s: s.streams_ended[PushEnd.REFUSED.value] == 1)
        assert client.stats.protocol_errors["unknown_type"] == 1
        assert client.stats.protocol_errors["not_json"] == 1
        assert client.stats.protocol_errors["unannounced_source"] == 1
        assert client.stats.connected and client.stats.sessions == 1


async def test_unsubscribe_from_a_stalled_window_still_ends_the_body(
        tls: TlsMaterial, token_file: Path) -> None:
    """The router stops granting window, then unsubscribes: the body still ends at once (an
    empty END_STREAM frame needs no window)."""
    source = Chunks(b"x" * 3000)
    async with scripted(tls, token_file, source, initial_window=1000, auto_ack=False) as (
            _, _, conn):
        session = await conn.welcome()
        sid = await conn.subscribe(session, "st-1")
        while len(conn.received.get(sid, b"")) < 1000:
            await conn.next(h2.events.DataReceived, sid)
        conn.send(session, bp.encode_message(Unsubscribe("st-1")))
        async with asyncio.timeout(1.0):
            await conn.next(h2.events.StreamEnded, sid)
        assert len(conn.received[sid]) == 1000
        await source.closed.wait()
        assert conn.error is None


@pytest.mark.parametrize(("status", "failure"), [(401, BusFailure.UNAUTHORIZED),
                                                 (403, BusFailure.FORBIDDEN),
                                                 (503, BusFailure.REJECTED)])
async def test_session_refusals(tls: TlsMaterial, token_file: Path, status: int,
                                failure: BusFailure) -> None:
    async with scripted(tls, token_file, Chunks()) as (router, client, conn):
        sid = await conn.request(bp.SESSION_PATH)
        conn.respond(sid, status, b'{"type":"x","reason":"because"}\n', end=True)
        await client.wait_stats(lambda s: s.failures[failure.value] == 1)
        await router.connections.get()  # backed off, then tried again


async def test_a_session_must_start_with_welcome(tls: TlsMaterial, token_file: Path) -> None:
    async with scripted(tls, token_file, Chunks()) as (_, client, conn):
        sid = await conn.request(bp.SESSION_PATH)
        conn.respond(sid, 200, bp.encode_message(Subscribe("s", "vllm-1", None)))
        await client.wait_stats(lambda s: s.failures[BusFailure.PROTOCOL.value] == 1)
        assert client.stats.streams_opened == 0


async def test_no_session_while_the_listener_is_away(tls: TlsMaterial) -> None:
    async with running_server(tls) as server:
        with pytest.raises(NoSession):
            await server.open_announced_stream("vllm-1", None)
