"""The consumer manager with the writer lease (router/consumer.py + router/lease.py, issue 16),
against a real `redis-server` and a scripted SSE server on 127.0.0.1 that records the
Last-Event-ID of every connection (tests/test_consumer.py's): only the writer consumes; a writer
that regains its lease resyncs; a writer that stops or loses its source gives the lease back at
once; the in-memory fallback makes every router consume; a hung Redis stops the writer within
its lease; an event-bus source is contended only while a session announces it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis
from structlog.testing import capture_logs

from kv_listener.core.bus_protocol import NoSessionError
from kv_listener.router.config import Transport
from kv_listener.router.consumer import KvEventConsumerManager
from kv_listener.router.lease import LeaseState, WriterLease
from tests.support.redis_server import RedisServer
from tests.support.waits import until
from tests.test_consumer import HOLD, P1, P2, P3, Applied, Conn, ScriptedServer, created, source

B = "vllm-1"
KEY = f"cr:kvidx:lease:{B}"
TIMEOUT_S = 10.0
RENEW_MS = 100


def router(client: Redis, holder: str, url: str | None, applied: Applied, *, ttl_ms: int = 5_000,
           **kwargs: Any) -> KvEventConsumerManager:
    lease = WriterLease(client, key_prefix="cr:kvidx:", holder_id=holder, ttl_ms=ttl_ms,
                        renew_interval_ms=RENEW_MS)
    cfg = kwargs.pop("cfg", None) or source(url, interval_ms=50)
    return KvEventConsumerManager([cfg], applied, lease=lease, **kwargs)


def running(m: KvEventConsumerManager) -> bool:
    return bool(m.stats()[B]["running"])


def role(m: KvEventConsumerManager) -> str:
    return m.lease_status(B)[0]


async def test_only_the_writer_consumes_and_a_regained_lease_resyncs(lease_redis: Redis) -> None:
    """Router a consumes (ids 1-1, 1-2); b, a standby, never connects. The lease taken by someone
    else stops a's consumer; regained, a connects WITHOUT its last event ID: the listener
    resyncs, so the shared index is right whatever the other writer did meanwhile."""
    applied_a, applied_b = Applied(), Applied()
    async with ScriptedServer([Conn([created(P1, "1-1"), created(P2, "1-2"), HOLD])]) as server:
        async with router(lease_redis, "router-a", server.url(), applied_a) as a:
            assert await server.next_request() is None
            assert [r.id for r in await applied_a.take(2)] == ["1-1", "1-2"]
            assert role(a) == "writer" and a.state(B).last_event_id == "1-2"
            async with router(lease_redis, "router-b", server.url(), applied_b) as b:
                await until(lambda: b.lease_status(B) == ("standby", "router-a"), "b standby")
                assert not running(b) and server.requests.empty() and not applied_b.records
                await lease_redis.set(KEY, "router-x", px=5_000)
                await until(lambda: not running(a), "a stops when its lease is taken")
                assert a.lease_status(B) == ("standby", "router-x")
                await b.stop()  # only a contends from here
            await lease_redis.delete(KEY)
            assert await server.next_request() is None  # not "1-2": a full resync
            await until(lambda: role(a) == "writer" and running(a), "a writes again")
            assert await lease_redis.get(KEY) == "router-a"


async def test_a_stopped_writer_hands_over_at_once_and_its_successor_resyncs(
    lease_redis: Redis,
) -> None:
    """stop() gives the lease back (no wait for the 5 s ttl): the standby takes over within a
    renew interval or so and reads the stream from a resync."""
    applied_a, applied_b = Applied(), Applied()
    scripts = [Conn([created(P1, "1-1"), HOLD]), Conn([created(P2), HOLD])]
    async with ScriptedServer(scripts) as server:
        a = router(lease_redis, "router-a", server.url(), applied_a)
        b = router(lease_redis, "router-b", server.url(), applied_b)
        try:
            a.start()
            assert await server.next_request() is None
            await applied_a.take(1)
            b.start()
            await until(lambda: b.lease_status(B) == ("standby", "router-a"), "b standby")
            with capture_logs() as logs:
                stopped = time.monotonic()
                await a.stop()
                assert await server.next_request() is None
                took = time.monotonic() - stopped
                assert [r.prefix_hash for r in await applied_b.take(1)] == [P2]
            assert took < 5.0 / 2, f"took {took:.2f} s: the ttl, not the release"
            assert b.lease_status(B) == ("writer", "router-b") and running(b)
            assert any(r["event"] == "kv_writer_lease_released" and r["reason"] == "shutdown"
                       and r["holder_id"] == "router-a" for r in logs)
        finally:
            await a.stop()
            await b.stop()


async def test_removing_the_source_releases_its_lease(lease_redis: Redis) -> None:
    applied_a, applied_b = Applied(), Applied()
    async with ScriptedServer() as server:
        async with router(lease_redis, "router-a", server.url(), applied_a) as a, \
                router(lease_redis, "router-b", server.url(), applied_b) as b:
            await until(lambda: role(a) == "writer" or role(b) == "writer", "a writer")
            writer, other = (a, b) if role(a) == "writer" else (b, a)
            holder = writer.lease.holder_id if writer.lease is not None else ""
            assert await lease_redis.get(KEY) == holder
            assert await writer.remove_source(B)
            await until(lambda: role(other) == "writer", "the other router takes over")
            assert await lease_redis.get(KEY) != holder


async def test_the_fallback_makes_every_router_consume_then_the_lease_rule_returns(
    lease_redis: Redis,
) -> None:
    """`consume_all(True)` (the Redis index fell back to memory: each router's own copy starts
    empty) runs the standby's consumer too, from a resync; `consume_all(False)` stops it again
    and leaves the writer alone."""
    applied_a, applied_b = Applied(), Applied()
    scripts = [Conn([created(P1, "1-1"), HOLD]), Conn([created(P1), created(P3), HOLD])]
    async with ScriptedServer(scripts) as server:
        async with router(lease_redis, "router-a", server.url(), applied_a) as a:
            assert await server.next_request() is None
            await applied_a.take(1)
            async with router(lease_redis, "router-b", server.url(), applied_b) as b:
                await until(lambda: role(b) == "standby" and b.lease_status(B)[1] == "router-a",
                            "b standby")
                await b.consume_all(True)
                assert await server.next_request() is None
                assert [r.prefix_hash for r in await applied_b.take(2)] == [P1, P3]
                assert running(b) and role(b) == "standby"
                await b.consume_all(False)
                assert not running(b)
                assert running(a) and role(a) == "writer"
                assert server.requests.empty()  # a's stream was never cut


async def test_a_writer_whose_index_fell_back_hands_its_lease_to_a_router_that_can_write(
    lease_redis: Redis,
) -> None:
    """The writer's index falls back to memory (its own Redis connection failed) while Redis
    serves the others: it keeps consuming into its fallback, but gives the lease back and does
    not contend until its index is Redis again, so another router keeps the shared index
    right (seen with three routers and a cluster failover: the shared index went 30 s stale,
    the fallback's probe interval)."""
    applied_a, applied_b = Applied(), Applied()
    scripts = [Conn([created(P1, "1-1"), HOLD]), Conn([created(P1), HOLD]),
               Conn([created(P1), created(P3), HOLD])]
    async with ScriptedServer(scripts) as server:
        async with router(lease_redis, "router-a", server.url(), applied_a) as a:
            assert await server.next_request() is None
            await applied_a.take(1)
            async with router(lease_redis, "router-b", server.url(), applied_b) as b:
                await until(lambda: b.lease_status(B) == ("standby", "router-a"), "b standby")
                with capture_logs() as logs:
                    await a.consume_all(True)
                    assert await server.next_request() is None  # a's fallback: a resync
                    took = await until(lambda: role(b) == "writer", "b takes the lease over")
                assert took < 5.0 / 2, f"{took:.2f} s: the ttl, not the release"
                assert await server.next_request() is None  # b's stream: a resync
                assert [r.prefix_hash for r in await applied_b.take(2)] == [P1, P3]
                assert running(a) and role(a) == "standby"  # a still fills its fallback
                assert any(r["event"] == "kv_writer_lease_released"
                           and r["reason"] == "index_fallback" for r in logs)
                await a.consume_all(False)
                assert not running(a)
                await until(lambda: a.lease_status(B) == ("standby", "router-b"),
                            "a contends again and is refused")
                assert role(b) == "writer" and await lease_redis.get(KEY) == "router-b"


async def test_a_hung_redis_stops_the_writers_consumer_within_its_lease_and_it_resumes(
    lease_redis: Redis, redis_server: RedisServer,
) -> None:
    """`CLIENT PAUSE` (commands hang): a stops consuming before its 1 s lease could expire in
    Redis, so no two routers ever write together; once Redis answers it takes the lease again
    and reads from a resync."""
    applied = Applied()
    admin = Redis.from_url(redis_server.url, decode_responses=True)
    scripts = [Conn([created(P1, "1-1"), HOLD]), Conn([created(P2), HOLD])]
    try:
        async with ScriptedServer(scripts) as server:
            async with router(lease_redis, "router-a", server.url(), applied, ttl_ms=1_000) as a:
                assert await server.next_request() is None
                await applied.take(1)
                await admin.execute_command("CLIENT", "PAUSE", 2_000, "ALL")
                took = await until(lambda: not running(a), "a stops", timeout_s=3.0)
                # The writer stops at most its validity (ttl - 1 % - 2 ms = 0.988 s) after its
                # last good renewal, which came before the pause; `took` adds until()'s 10 ms
                # polling and the loop's lag on a loaded machine (1.0008 s seen with 3 workers).
                assert took < 1.0 + 0.05, took
                assert await server.next_request() is None  # after the pause: a resync
                assert [r.prefix_hash for r in await applied.take(1)] == [P2]
                assert role(a) == "writer"
    finally:
        await admin.aclose()


class Announcer:
    """The part of the event-bus server the gate asks: which backends a live session announces."""

    def __init__(self) -> None:
        self.backends: set[str] = set()
        self.changed = asyncio.Condition()

    def announced_backends(self) -> set[str]:
        return set(self.backends)

    async def wait_announced(self, backend: str) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: backend in self.backends)

    async def set(self, *backends: str) -> None:
        async with self.changed:
            self.backends = set(backends)
            self.changed.notify_all()


async def test_an_event_bus_source_is_contended_only_while_a_session_announces_it(
    lease_redis: Redis,
) -> None:
    """Push mode: only a router a listener's session is attached to can read the stream, so only
    it contends; when the session goes, it gives the lease back at once (not after the ttl),
    so that the router the listener reconnected to can take it."""
    opened: asyncio.Queue[str | None] = asyncio.Queue()
    bus = Announcer()

    async def stream(last_event_id: str | None) -> AsyncIterator[bytes]:
        opened.put_nowait(last_event_id)
        yield created(P1, "bus-1")
        await asyncio.Event().wait()

    def open_announced_stream(backend: str, last_event_id: str | None) -> AsyncIterator[bytes]:
        if backend not in bus.backends:
            raise NoSessionError(backend)
        return stream(last_event_id)

    applied = Applied()
    cfg = source(None, interval_ms=50, transport=Transport.EVENT_BUS)
    async with router(lease_redis, "router-a", None, applied, cfg=cfg, announcer=bus,
                      open_announced_stream=open_announced_stream) as a:
        # Nothing announces it: no contention at all (the absence is watched for 5 intervals).
        await asyncio.sleep(5 * RENEW_MS / 1000)
        assert a._keepers[B].state is LeaseState.STANDBY and await lease_redis.exists(KEY) == 0
        await bus.set(B)
        assert await asyncio.wait_for(opened.get(), TIMEOUT_S) is None
        assert [r.id for r in await applied.take(1)] == ["bus-1"]
        assert await lease_redis.get(KEY) == "router-a"
        with capture_logs() as logs:
            await bus.set()
            # release() stops the consumer, then deletes the key: wait for both (the log line
            # comes after the delete), or the check below can fall between the two.
            took = await until(lambda: not running(a) and any(
                r["event"] == "kv_writer_lease_released" for r in logs), "the lease given back")
            assert await lease_redis.exists(KEY) == 0
        assert took < 5.0 / 2, took  # the gate's poll, not the ttl
        assert any(r["event"] == "kv_writer_lease_released" and r["reason"] == "no_session"
                   for r in logs)
        await bus.set(B)  # a session announces it again: contended, taken, read from a resync
        assert await asyncio.wait_for(opened.get(), TIMEOUT_S) is None
