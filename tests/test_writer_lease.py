"""The writer lease (router/lease.py) against a real `redis-server` (and once against the local
Redis Cluster): acquire, a second holder refused, renew, expiry and takeover, release by the
holder only; the keeper's state table; keepers taking over from a dead writer, losing the lease
to another holder, and riding out a hung or stopped Redis for the lease's validity, never longer.
What the consumer manager does with the lease: tests/test_consumer_lease.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from structlog.testing import capture_logs

from kv_listener.core.model import Tier
from kv_listener.core.records import Record, RecordEvent
from kv_listener.router.config import IndexBackend, KvCacheIndexConfig
from kv_listener.router.config_redis import RedisConfig, WriterLeaseConfig
from kv_listener.router.index import Holder
from kv_listener.router.lease import (
    TRANSITIONS,
    LeaseEvent,
    LeaseKeeper,
    LeaseResult,
    LeaseState,
    LeaseStateError,
    WriterLease,
    step,
)
from kv_listener.router.redis_index import RedisKvIndex
from tests.support.redis_cluster import LocalRedisCluster, redis_cluster_fixture, slot_of
from tests.support.redis_server import RedisServer
from tests.support.waits import until

B = "vllm-1"
P1 = "1" * 64
PREFIX = "cr:kvidx:"
TIMEOUT_S = 10.0

redis_cluster = redis_cluster_fixture()


def lease_for(client: Any, holder: str, *, ttl_ms: int = 10_000,
              renew_ms: int = 100) -> WriterLease:
    return WriterLease(client, key_prefix=PREFIX, holder_id=holder, ttl_ms=ttl_ms,
                       renew_interval_ms=renew_ms)


async def expired(client: Redis, key: str) -> None:
    """Await the key's expiry (the test server notifies `Ex` events): no sleeping for it."""
    pubsub = client.pubsub()
    await pubsub.subscribe("__keyevent@0__:expired")
    try:
        async with asyncio.timeout(TIMEOUT_S):
            while await client.exists(key):
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                if msg is not None and msg["data"] == key:
                    break
    finally:
        await pubsub.aclose()


# --- the lease in Redis --------------------------------------------------------------------------


async def test_acquire_refuses_a_second_holder_renew_and_release_by_the_holder_only(
    lease_redis: Redis,
) -> None:
    a, b = lease_for(lease_redis, "router-a"), lease_for(lease_redis, "router-b")
    key = a.key(B)
    assert key == "cr:kvidx:lease:vllm-1"
    assert await a.holder(B) is None
    assert (await a.acquire(B)).held
    assert await lease_redis.get(key) == "router-a"
    assert 9_000 < await lease_redis.pttl(key) <= 10_000
    refused = await b.acquire(B)
    assert (refused.held, refused.holder) == (False, "router-a")
    assert (await b.renew(B)).held is False
    assert await b.release(B) is False  # not b's to give back
    assert await b.holder(B) == "router-a"
    await lease_redis.pexpire(key, 2_000)
    renewed = await a.renew(B)
    assert (renewed.held, renewed.holder) == (True, "router-a")
    assert await lease_redis.pttl(key) > 9_000
    again = await a.acquire(B)  # the holder acquiring again: a renewal
    assert (again.held, again.holder) == (True, "router-a")
    assert await a.release(B) is True
    assert await lease_redis.exists(key) == 0
    assert (await b.acquire(B)).held
    assert await a.holder(B) == "router-b"
    other = lease_for(lease_redis, "router-a")  # backends are independent
    assert (await other.acquire("vllm-2")).held
    assert await lease_redis.get(other.key("vllm-2")) == "router-a"


async def test_expired_lease_is_taken_over(lease_redis: Redis) -> None:
    a, b = lease_for(lease_redis, "router-a", ttl_ms=300), lease_for(lease_redis, "router-b", ttl_ms=300)
    assert (await a.acquire(B)).held
    assert not (await b.acquire(B)).held
    await expired(lease_redis, a.key(B))
    assert (await b.acquire(B)).held
    lost = await a.renew(B)  # the old holder finds the new one
    assert (lost.held, lost.holder) == (False, "router-b")


async def test_renewing_a_vanished_key_sets_it_again(lease_redis: Redis) -> None:
    """A clear of the key prefix (or a Redis restarted empty) took the key: nobody else holds
    it, the writer keeps it."""
    a = lease_for(lease_redis, "router-a")
    assert (await a.acquire(B)).held
    await lease_redis.delete(a.key(B))
    assert (await a.renew(B)).held
    assert await lease_redis.get(a.key(B)) == "router-a"
    assert await lease_redis.pttl(a.key(B)) > 9_000


async def test_on_a_redis_cluster(redis_cluster: LocalRedisCluster) -> None:
    redis_cluster.flushall()
    rc = RedisCluster.from_url(redis_cluster.url, decode_responses=True,
                               **redis_cluster.client_kwargs())
    try:
        a, b = lease_for(rc, "router-a", ttl_ms=5_000), lease_for(rc, "router-b", ttl_ms=5_000)
        backends = [f"vllm-{i}" for i in range(12)]
        masters = {redis_cluster.master_of_slot(slot_of(a.key(n))).node.port for n in backends}
        assert len(masters) == 3  # the leases live on every master
        for name in backends:
            assert (await a.acquire(name)).held
            assert (await b.acquire(name)).holder == "router-a"
            assert (await a.renew(name)).held
            assert await b.release(name) is False
            assert await a.release(name) is True
            assert (await b.acquire(name)).held
            assert await a.holder(name) == "router-b"
    finally:
        await rc.aclose()


# --- the state table --------------------------------------------------------------------------


def test_every_listed_transition_and_nothing_else() -> None:
    assert step(LeaseState.STANDBY, LeaseEvent.ATTEMPT) is LeaseState.ACQUIRING
    assert step(LeaseState.ACQUIRING, LeaseEvent.GRANTED) is LeaseState.WRITER
    for lost in (LeaseEvent.TAKEN, LeaseEvent.EXPIRED, LeaseEvent.RELEASED):
        assert step(LeaseState.WRITER, lost) is LeaseState.STANDBY
    assert step(LeaseState.WRITER, LeaseEvent.RENEW_FAILED) is LeaseState.WRITER
    for state in LeaseState:
        for event in LeaseEvent:
            if (state, event) in TRANSITIONS:
                continue
            with pytest.raises(LeaseStateError):
                step(state, event)
    # A standby never writes without asking first, a writer never "acquires" again.
    assert (LeaseState.STANDBY, LeaseEvent.GRANTED) not in TRANSITIONS
    assert (LeaseState.WRITER, LeaseEvent.GRANTED) not in TRANSITIONS


# --- keepers -------------------------------------------------------------------------------------


class Writes:
    """The keeper's callbacks: whether this keeper's router writes now, and every change."""

    def __init__(self) -> None:
        self.writing = False
        self.changes: asyncio.Queue[bool] = asyncio.Queue()

    async def acquired(self) -> None:
        self.writing = True
        self.changes.put_nowait(True)

    async def lost(self) -> None:
        self.writing = False
        self.changes.put_nowait(False)

    async def next(self, timeout_s: float = TIMEOUT_S) -> bool:
        return await asyncio.wait_for(self.changes.get(), timeout_s)


_STARTED: list[LeaseKeeper] = []


@pytest.fixture(autouse=True)
async def _close_keepers() -> AsyncIterator[None]:
    """A test that failed half way still stops its keepers (before its Redis stops)."""
    yield
    while _STARTED:
        k = _STARTED.pop()
        if k.task is not None:
            k.task.cancel()
            await asyncio.gather(k.task, return_exceptions=True)
            k.task = None


def keeper(lease: WriterLease, writes: Writes, **kwargs: Any) -> LeaseKeeper:
    k = LeaseKeeper(lease, B, on_acquired=writes.acquired, on_lost=writes.lost, **kwargs)
    k.start()
    _STARTED.append(k)
    return k


async def test_one_writer_and_takeover_when_the_writer_dies(lease_redis: Redis) -> None:
    wa, wb = Writes(), Writes()
    with capture_logs() as logs:
        ka = keeper(lease_for(lease_redis, "router-a", ttl_ms=600, renew_ms=150), wa)
        assert await wa.next() is True
        kb = keeper(lease_for(lease_redis, "router-b", ttl_ms=600, renew_ms=150), wb)
        await until(lambda: kb.holder == "router-a", "b sees a holding the lease")
        assert kb.state is not LeaseState.WRITER and not wb.writing
        assert ka.is_writer and not wb.writing
        # a dies: no release, its key just stops being renewed
        assert ka.task is not None
        ka.task.cancel()
        died = time.monotonic()
        assert await wb.next() is True
        took = time.monotonic() - died
        assert kb.is_writer and kb.holder == "router-b"
        assert await lease_redis.get("cr:kvidx:lease:vllm-1") == "router-b"
        assert 0.3 < took < 0.6 + 0.15 + 0.5, took  # within ttl + renew interval (+ slack)
        await kb.close("shutdown")
        assert await wb.next() is False
        assert await lease_redis.exists("cr:kvidx:lease:vllm-1") == 0
    acquired = [r for r in logs if r["event"] == "kv_writer_lease_acquired"]
    assert [(r["holder_id"], r["previous_holder"]) for r in acquired] == [
        ("router-a", None), ("router-b", "router-a")]
    assert all(r["backend"] == B for r in acquired)
    released = [r for r in logs if r["event"] == "kv_writer_lease_released"]
    assert [(r["holder_id"], r["reason"]) for r in released] == [("router-b", "shutdown")]


KEY = f"{PREFIX}lease:{B}"


class CountingLease(WriterLease):
    """The real lease, counting its acquire attempts (a standby's asking is otherwise unseen)."""

    acquires = 0

    async def acquire(self, backend: str) -> LeaseResult:
        self.acquires += 1
        return await super().acquire(backend)


async def test_a_writer_whose_lease_another_holder_took_stops_at_its_next_renewal(
    lease_redis: Redis,
) -> None:
    """A failover that lost the key, or an operator, lets another router hold it: the writer
    stops writing at its next renewal (not at the end of its ttl) and stays a standby while the
    other holds it."""
    w = Writes()
    with capture_logs() as logs:
        lease = CountingLease(lease_redis, key_prefix=PREFIX, holder_id="router-a",
                              ttl_ms=5_000, renew_interval_ms=100)
        k = keeper(lease, w)
        assert await w.next() is True
        await lease_redis.set(KEY, "router-x", px=5_000)
        taken = time.monotonic()
        assert await w.next() is False
        assert time.monotonic() - taken < 0.1 + 0.5  # one renew interval (+ slack), not the ttl
        await until(lambda: k.holder == "router-x" and k.state is LeaseState.STANDBY,
                    "a standby that saw router-x")
        asked = lease.acquires
        await until(lambda: lease.acquires >= asked + 2, "a goes on asking")
        assert not w.writing and k.state is not LeaseState.WRITER  # ... and is refused
        assert await lease_redis.get(KEY) == "router-x"
    lost = [r for r in logs if r["event"] == "kv_writer_lease_lost"]
    assert [(r["reason"], r["holder"]) for r in lost] == [("taken", "router-x")]


async def test_a_hung_redis_stops_the_writer_before_its_lease_can_expire_then_it_takes_it_again(
    lease_redis: Redis, redis_server: RedisServer,
) -> None:
    """Redis stops answering (`CLIENT PAUSE`: connections stay open, commands hang): renewals
    time out, the writer goes on writing for what is left of its lease's validity (never longer:
    the key may expire in Redis at the ttl), stops, and takes the lease again once Redis answers.
    Nothing hangs: every wait is bounded by the lease's own times."""
    w = Writes()
    admin = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        with capture_logs() as logs:
            k = keeper(lease_for(lease_redis, "router-a", ttl_ms=1_000, renew_ms=100), w)
            assert await w.next() is True
            await admin.execute_command("CLIENT", "PAUSE", 2_500, "ALL")
            paused = time.monotonic()
            assert await w.next(timeout_s=3.0) is False
            stopped = time.monotonic() - paused
            # The last good renewal was sent at most one renew interval before the pause.
            assert 1.0 * 0.99 - 0.1 - 0.05 < stopped < 1.0, stopped
            assert k.state is not LeaseState.WRITER
            assert await w.next(timeout_s=5.0) is True  # Redis answers again: ours again
            assert time.monotonic() - paused >= 2.4
            assert await lease_redis.get(KEY) == "router-a"
        lost = [r for r in logs if r["event"] == "kv_writer_lease_lost"]
        assert [r["reason"] for r in lost] == ["expired"]
        assert any(r["event"] == "kv_writer_lease_redis_error" and r["op"] == "renew"
                   for r in logs)
    finally:
        await admin.aclose()


async def test_a_stopped_redis_ends_the_lease_at_its_validity_and_an_empty_one_is_taken_again(
    lease_redis: Redis, redis_server: RedisServer,
) -> None:
    """Connections refused (Redis stopped): the same as a hung one, with errors at once instead
    of timeouts; the Redis that comes back empty has no key, so the lease is taken again."""
    w = Writes()
    with capture_logs() as logs:
        keeper(lease_for(lease_redis, "router-a", ttl_ms=800, renew_ms=100), w)
        assert await w.next() is True
        await asyncio.to_thread(redis_server.stop)
        stopped_at = time.monotonic()
        assert await w.next(timeout_s=3.0) is False
        assert 0.8 * 0.99 - 0.1 - 0.05 < time.monotonic() - stopped_at < 0.8, (
            time.monotonic() - stopped_at)
        await asyncio.to_thread(redis_server.start)
        assert await w.next(timeout_s=5.0) is True
        assert await lease_redis.get(KEY) == "router-a"
    errors = [r for r in logs if r["event"] == "kv_writer_lease_redis_error"]
    assert errors and len(errors) < 5, "an unchanged error is logged once, then throttled"


async def test_with_the_lease_a_recovered_fallback_is_not_copied_into_redis(
    redis_server: RedisServer, lease_redis: Redis,
) -> None:
    """A router in its fallback holds no lease (router.consumer); the writers kept Redis right.
    Its fallback, filled from its own stream, may lag theirs: copied back, it would bring back
    entries they had just removed, which nobody would remove again. So it is dropped."""
    kv = KvCacheIndexConfig(backend=IndexBackend.REDIS,
                            writer_lease=WriterLeaseConfig(enabled=True))
    idx = RedisKvIndex.from_config(
        RedisConfig(url=redis_server.url, connect_timeout_ms=500, command_timeout_ms=500), kv,
        probe_interval_s=0.05)
    try:
        assert not idx.copy_on_recovery
        await asyncio.to_thread(redis_server.stop)
        # This router's stream, lagging: P1 still there (its writer has removed it since).
        await idx.apply(Record(None, RecordEvent.CACHE_CREATED, B, P1, 64, Tier.GPU_HOT, 0.0))
        assert idx.fallback_active
        assert await idx.query(P1) == [Holder(B, 64, Tier.GPU_HOT)]
        with capture_logs() as logs:
            await asyncio.to_thread(redis_server.start)
            await asyncio.wait_for(idx.wait_recovered(), TIMEOUT_S)
        assert not idx.fallback_active
        assert await lease_redis.exists(f"{PREFIX}{P1}") == 0 and await idx.query(P1) == []
        recovered = [r for r in logs if r["event"] == "kv_index_redis_recovered"]
        assert [r["copied_entries"] for r in recovered] == [0]
    finally:
        await idx.close()


async def test_clearing_the_index_keeps_the_leases(redis_server: RedisServer,
                                                   lease_redis: Redis) -> None:
    """`POST /admin/kv-index/clear` empties the index, not the leases: a live writer keeps its
    backend (deleting the key would let a standby take it over, with a resync, for nothing)."""
    lease = lease_for(lease_redis, "router-a")
    assert (await lease.acquire(B)).held
    idx = RedisKvIndex.from_config(
        RedisConfig(url=redis_server.url, connect_timeout_ms=500, command_timeout_ms=500),
        KvCacheIndexConfig(backend=IndexBackend.REDIS,
                           writer_lease=WriterLeaseConfig(enabled=True)))
    try:
        await idx.apply(Record(None, RecordEvent.CACHE_CREATED, B, P1, 64, Tier.GPU_HOT, 0.0))
        result = await idx.clear()
        assert (result.entries_before_clear, result.cleared_entries) == (1, 1)
        assert await idx.query(P1) == []
        assert await lease_redis.get(KEY) == "router-a"
        assert await lease_redis.keys(f"{PREFIX}*") == [KEY]
    finally:
        await idx.close()


async def test_a_cancellation_an_await_swallowed_still_stops_the_keeper(lease_redis: Redis) -> None:
    """An await inside the loop that swallows the cancellation (CPython 3.11's `asyncio.wait_for`
    does when the renewal completes as the cancel arrives; seen in the suite as a router stop
    that never returned) must not keep the keeper running: `close()` returns within a renew
    interval and the lease is given back."""
    swallowed: list[bool] = []

    async def sleep_swallowing_one_cancel(delay_s: float) -> None:
        try:
            await asyncio.sleep(delay_s)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)  # the first cancellation goes no further

    w = Writes()
    k = keeper(lease_for(lease_redis, "router-a", ttl_ms=2_000, renew_ms=100), w,
               sleep=sleep_swallowing_one_cancel)
    assert await w.next() is True
    await asyncio.sleep(0.03)  # inside the holding sleep (renew interval 100 ms)
    await asyncio.wait_for(k.close("shutdown"), TIMEOUT_S)
    assert swallowed == [True]
    assert k.task is None and not w.writing
    assert await lease_redis.exists(KEY) == 0
