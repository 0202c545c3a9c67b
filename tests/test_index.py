"""KV index: one shared suite run against both implementations (in memory, and a real
redis-server), then what only one of them has (capacity eviction; the Redis key layout, atomic
pipelines, TLS, and the in-memory fallback while Redis is down)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from kv_listener.core.model import Tier
from kv_listener.router.config import (
    IndexBackend,
    KvCacheIndexConfig,
    RedisConfig,
    RouterConfig,
    StorageOffloadingConfig,
)
from kv_listener.router.index import (
    ClearResult,
    Holder,
    IndexEvent,
    InMemoryKvIndex,
    KvIndex,
    PrefixEventType,
)
from kv_listener.router.metrics import RouterMetrics
from kv_listener.router.redis_index import IndexUnavailableError, RedisKvIndex, build_index
from tests.support import ManualClock
from tests.support.redis_cluster import LocalRedisCluster, redis_cluster_fixture
from tests.support.redis_server import RedisServer, TlsFiles

CREATED = PrefixEventType.CACHE_CREATED
OFFLOADED = PrefixEventType.CACHE_OFFLOADED
EVICTED = PrefixEventType.CACHE_EVICTED
CLEARED = PrefixEventType.CACHE_CLEARED

P1 = "11" * 32
P2 = "22" * 32
P3 = "33" * 32

OFF = StorageOffloadingConfig(enabled=False)
WARM = StorageOffloadingConfig(enabled=True, treat_eviction_as_offload=True)
WARM_NO_EVICT = StorageOffloadingConfig(enabled=True, treat_eviction_as_offload=False)


def ev(kind: PrefixEventType, backend: str, prefix: str | None = None, tokens: int = 0) -> IndexEvent:
    return IndexEvent(kind, backend, prefix, tokens)


def redis_index(server: RedisServer, *, offloading: StorageOffloadingConfig = OFF,
                ttl: int = 600, key_prefix: str = "cr:kvidx:", fallback: bool = True,
                metrics: RouterMetrics | None = None, probe_interval_s: float = 30.0,
                ) -> RedisKvIndex:
    return RedisKvIndex.from_config(
        RedisConfig(url=server.url, fallback_to_memory=fallback, connect_timeout_ms=2000,
                    command_timeout_ms=2000),
        KvCacheIndexConfig(key_prefix=key_prefix, entry_ttl_seconds=ttl,
                           storage_offloading=offloading),
        metrics=metrics, probe_interval_s=probe_interval_s,
    )


@dataclass
class Harness:
    """Builds an index of one kind and lets a test make its entries expire."""

    kind: str
    make: Callable[..., KvIndex]
    expire: Callable[[KvIndex, str], Awaitable[None]]


redis_cluster = redis_cluster_fixture()


def cluster_index(cluster: LocalRedisCluster, *, offloading: StorageOffloadingConfig = OFF,
                  ttl: int = 600, **redis: Any) -> RedisKvIndex:
    return RedisKvIndex.from_config(
        RedisConfig(url=cluster.url, cluster=True, connect_timeout_ms=2000,
                    command_timeout_ms=2000, **redis),
        KvCacheIndexConfig(entry_ttl_seconds=ttl, storage_offloading=offloading))


@asynccontextmanager
async def expiry_watch(clients: dict[int, Redis]) -> AsyncIterator[Callable[[KvIndex, str], Awaitable[None]]]:
    """`expire(idx, prefix_hash)`: await Redis' own expiry of the prefix's keys (keyspace
    notifications from the server, or the cluster master, that holds them), no sleeping.
    `clients` maps a port to the watcher of that server (one, or each cluster master)."""
    subs = {port: c.pubsub() for port, c in clients.items()}
    for sub in subs.values():
        await sub.subscribe("__keyevent@0__:expired")

    async def expire(idx: KvIndex, prefix_hash: str) -> None:
        assert isinstance(idx, RedisKvIndex)
        pending: dict[int, set[str]] = {}
        for key in (idx.hot_key(prefix_hash), idx.warm_key(prefix_hash)):
            port = (next(iter(clients)) if len(clients) == 1
                    else idx.redis.client.get_node_from_key(key).port)
            if await clients[port].exists(key):
                pending.setdefault(port, set()).add(key)
        async with asyncio.timeout(10):
            for port, keys in pending.items():
                while keys:
                    msg = await subs[port].get_message(ignore_subscribe_messages=True, timeout=5)
                    if msg is not None:
                        keys.discard(msg["data"])

    try:
        yield expire
    finally:
        for sub in subs.values():
            await sub.aclose()
        for c in clients.values():
            await c.aclose()


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    made: list[KvIndex] = []
    if request.param == "redis-cluster":
        cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()

        def make_cluster(offloading: StorageOffloadingConfig = OFF, ttl: int = 600) -> KvIndex:
            idx = cluster_index(cluster, offloading=offloading, ttl=ttl)
            made.append(idx)
            return idx

        watchers = {m.node.port: Redis(host="127.0.0.1", port=m.node.port, decode_responses=True)
                    for m in cluster.masters()}
        async with expiry_watch(watchers) as expire:
            yield Harness("redis", make_cluster, expire)
    elif request.param == "memory":
        clock = ManualClock()

        def make_memory(offloading: StorageOffloadingConfig = OFF, ttl: int = 600) -> KvIndex:
            idx = InMemoryKvIndex(max_entries=1000, entry_ttl_seconds=ttl,
                                  offloading=offloading, clock=clock)
            made.append(idx)
            return idx

        async def expire_memory(idx: KvIndex, prefix_hash: str) -> None:
            assert isinstance(idx, InMemoryKvIndex)
            clock.advance(idx.ttl_s)

        yield Harness("memory", make_memory, expire_memory)
    else:
        server = RedisServer(tmp_path)
        server.start()

        def make_redis(offloading: StorageOffloadingConfig = OFF, ttl: int = 600) -> KvIndex:
            idx = redis_index(server, offloading=offloading, ttl=ttl)
            made.append(idx)
            return idx

        try:
            watcher = Redis.from_url(server.url, decode_responses=True)
            async with expiry_watch({server.port: watcher}) as expire:
                yield Harness("redis", make_redis, expire)
        finally:
            for idx in made:
                await idx.close()
            made.clear()
            server.stop()
    for idx in made:
        await idx.close()


# --- The shared suite --------------------------------------------------------------------------


async def test_created_is_gpu_hot_and_holders_sort_by_tokens(harness: Harness) -> None:
    idx = harness.make()
    assert await idx.query(P1) == []
    await idx.apply(ev(CREATED, "vllm-1", P1, 512))
    await idx.apply(ev(CREATED, "vllm-2", P1, 2048))
    await idx.apply(ev(CREATED, "vllm-3", P2, 64))
    assert await idx.query(P1) == [Holder("vllm-2", 2048, Tier.GPU_HOT),
                                   Holder("vllm-1", 512, Tier.GPU_HOT)]
    assert await idx.query(P2) == [Holder("vllm-3", 64, Tier.GPU_HOT)]
    assert await idx.query(P3) == []


async def test_created_is_an_upsert_up_and_down(harness: Harness) -> None:
    idx = harness.make()
    await idx.apply(ev(CREATED, "vllm-1", P1, 512))
    await idx.apply(ev(CREATED, "vllm-1", P1, 4096))
    assert await idx.query(P1) == [Holder("vllm-1", 4096, Tier.GPU_HOT)]
    await idx.apply(ev(CREATED, "vllm-1", P1, 128))
    assert await idx.query(P1) == [Holder("vllm-1", 128, Tier.GPU_HOT)]


async def test_offloaded_removes_when_storage_offloading_is_off(harness: Harness) -> None:
    idx = harness.make(OFF)
    await idx.apply(ev(CREATED, "vllm-1", P1, 512))
    await idx.apply(ev(CREATED, "vllm-2", P1, 256))
    await idx.apply(ev(OFFLOADED, "vllm-1", P1, 512))
    assert await idx.query(P1) == [Holder("vllm-2", 256, Tier.GPU_HOT)]
    # An offload of something never seen does not create anything either.
    await idx.apply(ev(OFFLOADED, "vllm-3", P2, 100))
    assert await idx.query(P2) == []


async def test_offloaded_is_storage_warm_and_created_moves_it_back(harness: Harness) -> None:
    idx = harness.make(WARM)
    await idx.apply(ev(CREATED, "vllm-1", P1, 512))
    await idx.apply(ev(OFFLOADED, "vllm-1", P1, 480))
    assert await idx.query(P1) == [Holder("vllm-1", 480, Tier.STORAGE_WARM)]
    await idx.apply(ev(CREATED, "vllm-1", P1, 512))
    assert await idx.query(P1) == [Holder("vllm-1", 512, Tier.GPU_HOT)]
    # An offload without a token_count (optional in the seed) keeps the known count.
    await idx.apply(ev(OFFLOADED, "vllm-1", P1, 0))
    assert await idx.query(P1) == [Holder("vllm-1", 512, Tier.STORAGE_WARM)]
    # ... and of an unknown entry creates nothing.
    await idx.apply(ev(OFFLOADED, "vllm-2", P2, 0))
    assert await idx.query(P2) == []


async def test_gpu_holder_ranks_before_warm_holder_at_equal_tokens(harness: Harness) -> None:
    idx = harness.make(WARM)
    await idx.apply(ev(OFFLOADED, "a-warm", P1, 1000))
    await idx.apply(ev(CREATED, "z-hot", P1, 1000))
    assert await idx.query(P1) == [Holder("z-hot", 1000, Tier.GPU_HOT),
                                   Holder("a-warm", 1000, Tier.STORAGE_WARM)]


@pytest.mark.parametrize("offloading", [OFF, WARM_NO_EVICT], ids=["offloading-off", "no-treat"])
async def test_evicted_removes(harness: Harness, offloading: StorageOffloadingConfig) -> None:
    idx = harness.make(offloading)
    await idx.apply(ev(CREATED, "vllm-1", P1, 512))
    await idx.apply(ev(CREATED, "vllm-2", P1, 512))
    await idx.apply(ev(EVICTED, "vllm-1", P1))
    assert await idx.query(P1) == [Holder("vllm-2", 512, Tier.GPU_HOT)]
    await idx.apply(ev(EVICTED, "vllm-9", P1))  # unknown: ignored
    assert await idx.query(P1) == [Holder("vllm-2", 512, Tier.GPU_HOT)]


async def test_evicted_as_offload_turns_gpu_entry_warm(harness: Harness) -> None:
    idx = harness.make(WARM)
    await idx.apply(ev(CREATED, "vllm-1", P1, 512))
    await idx.apply(ev(EVICTED, "vllm-1", P1))
    assert await idx.query(P1) == [Holder("vllm-1", 512, Tier.STORAGE_WARM)]
    await idx.apply(ev(EVICTED, "vllm-1", P1))  # already warm: stays warm
    assert await idx.query(P1) == [Holder("vllm-1", 512, Tier.STORAGE_WARM)]
    await idx.apply(ev(EVICTED, "vllm-2", P2))  # unknown: nothing to keep
    assert await idx.query(P2) == []


async def test_cache_cleared_removes_only_that_backend(harness: Harness) -> None:
    idx = harness.make(WARM)
    await idx.apply(ev(CREATED, "vllm-1", P1, 100))
    await idx.apply(ev(OFFLOADED, "vllm-1", P2, 200))
    await idx.apply(ev(CREATED, "vllm-2", P1, 300))
    await idx.apply(ev(CREATED, "vllm-2", P3, 400))
    await idx.apply(ev(CLEARED, "vllm-1"))
    assert await idx.query(P1) == [Holder("vllm-2", 300, Tier.GPU_HOT)]
    assert await idx.query(P2) == []
    assert await idx.query(P3) == [Holder("vllm-2", 400, Tier.GPU_HOT)]
    st_ = await idx.stats()
    assert st_.backends == ("vllm-2",)
    # The backend starts over after a clear.
    await idx.apply(ev(CREATED, "vllm-1", P2, 50))
    assert await idx.query(P2) == [Holder("vllm-1", 50, Tier.GPU_HOT)]
    await idx.apply(ev(CLEARED, "vllm-3"))  # a backend with nothing: no error


async def test_stats_count_entries_prefixes_and_tiers(harness: Harness) -> None:
    idx = harness.make(WARM)
    await idx.apply(ev(CREATED, "vllm-1", P1, 100))
    await idx.apply(ev(CREATED, "vllm-1", P2, 100))
    await idx.apply(ev(OFFLOADED, "vllm-1", P3, 100))
    await idx.apply(ev(CREATED, "vllm-2", P1, 100))
    await idx.query(P1)
    await idx.query("44" * 32)
    s = await idx.stats()
    assert (s.kind, s.entries, s.prefixes) == (harness.kind, 4, 3)
    assert s.backends == ("vllm-1", "vllm-2")
    assert (s.per_backend["vllm-1"].gpu_hot, s.per_backend["vllm-1"].storage_warm) == (2, 1)
    assert (s.per_backend["vllm-2"].gpu_hot, s.per_backend["vllm-2"].storage_warm) == (1, 0)
    assert (s.queries, s.hits) == (2, 1)
    assert s.to_json()["entry_count"] == 4
    assert s.to_json()["backends"]["vllm-1"] == {"entries": 3, "gpu_hot": 2, "storage_warm": 1}


async def test_clear_reports_counts_and_empties(harness: Harness) -> None:
    idx = harness.make()
    await idx.apply(ev(CREATED, "vllm-1", P1, 100))
    await idx.apply(ev(CREATED, "vllm-2", P1, 100))
    await idx.apply(ev(CREATED, "vllm-2", P2, 100))
    assert await idx.clear() == ClearResult(entries_before_clear=3, cleared_entries=3)
    assert await idx.query(P1) == []
    s = await idx.stats()
    assert (s.entries, s.prefixes, s.backends) == (0, 0, ())
    assert await idx.clear() == ClearResult(0, 0)


async def test_entries_expire_after_ttl(harness: Harness) -> None:
    idx = harness.make(ttl=1)
    await idx.apply(ev(CREATED, "vllm-1", P1, 100))
    assert await idx.query(P1) == [Holder("vllm-1", 100, Tier.GPU_HOT)]
    await harness.expire(idx, P1)
    assert await idx.query(P1) == []
    assert (await idx.stats()).entries == 0
    # Cleanup prunes what the expiry left behind (memory: nothing left; redis: the backend set).
    await idx.cleanup_expired()
    await idx.apply(ev(CLEARED, "vllm-1"))
    assert (await idx.stats()).entries == 0


# --- In memory only ----------------------------------------------------------------------------


async def test_memory_ttl_is_lazy_on_query_and_proactive_on_cleanup() -> None:
    clock = ManualClock()
    idx = InMemoryKvIndex(max_entries=1000, entry_ttl_seconds=10, clock=clock)
    await idx.apply(ev(CREATED, "b1", P1, 1))
    clock.advance(5)
    await idx.apply(ev(CREATED, "b2", P2, 1))
    await idx.apply(ev(CREATED, "b3", P3, 1))
    clock.advance(4.999)
    assert len(await idx.query(P1)) == 1  # 9.999 s old: still live
    clock.advance(0.001)
    assert len(idx) == 3  # nothing removed before it is looked at or cleaned up
    assert await idx.query(P1) == []  # 10 s old: expired, removed lazily
    assert len(idx) == 2
    await idx.apply(ev(CREATED, "b3", P3, 2))  # refreshed: lives 10 s from now
    clock.advance(5)
    assert await idx.cleanup_expired() == 1  # P2 went; P3 was refreshed
    assert (await idx.query(P3))[0].token_count == 2
    assert (await idx.stats()).expired == 2


async def test_memory_capacity_evicts_oldest_tenth() -> None:
    clock = ManualClock()
    idx = InMemoryKvIndex(max_entries=100, entry_ttl_seconds=600, clock=clock)
    prefixes = [f"{i:064x}" for i in range(101)]
    for ph in prefixes[:100]:
        clock.advance(0.01)
        await idx.apply(ev(CREATED, "b", ph, 10))
    await idx.apply(ev(CREATED, "b", prefixes[0], 20))  # a write makes the oldest the newest
    assert len(idx) == 100
    await idx.apply(ev(CREATED, "b", prefixes[100], 10))  # the 101st entry
    assert len(idx) == 91
    assert await idx.query(prefixes[0]) != []  # refreshed, survived
    for ph in prefixes[1:11]:
        assert await idx.query(ph) == []  # the ten oldest writes went
    assert await idx.query(prefixes[11]) != []
    assert await idx.query(prefixes[100]) != []
    assert (await idx.stats()).evictions == 10


def test_index_event_validation() -> None:
    with pytest.raises(ValueError, match="prefix_hash"):
        IndexEvent(CREATED, "vllm-1", "AB" * 32, 1)  # uppercase
    with pytest.raises(ValueError, match="prefix_hash"):
        IndexEvent(CREATED, "vllm-1", "ab" * 31, 1)
    with pytest.raises(ValueError, match="prefix_hash"):
        IndexEvent(EVICTED, "vllm-1", None)
    with pytest.raises(ValueError, match="token_count"):
        IndexEvent(CREATED, "vllm-1", P1, -1)
    with pytest.raises(ValueError, match="token_count"):
        IndexEvent(CREATED, "vllm-1", P1, True)
    with pytest.raises(ValueError, match="backend"):
        IndexEvent(CREATED, "vllm 1", P1, 1)
    with pytest.raises(ValueError, match="backend"):
        IndexEvent(CLEARED, "x" * 65)
    assert IndexEvent(CLEARED, "vllm-1").prefix_hash is None


_events = st.lists(
    st.tuples(st.sampled_from(list(PrefixEventType)), st.sampled_from(["b1", "b2"]),
              st.sampled_from([P1, P2]), st.integers(0, 3000)),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=_events, offloading=st.sampled_from([OFF, WARM, WARM_NO_EVICT]))
def test_memory_index_matches_the_tier_rule(
    events: list[tuple[PrefixEventType, str, str, int]], offloading: StorageOffloadingConfig,
) -> None:
    """A reference model written straight from SPEC §8's rule, against the index."""
    idx = InMemoryKvIndex(max_entries=1000, entry_ttl_seconds=600, offloading=offloading,
                          clock=ManualClock())
    model: dict[tuple[str, str], tuple[Tier, int]] = {}
    for kind, backend, ph, tokens in events:
        idx.apply_now(IndexEvent(kind, backend, None if kind is CLEARED else ph, tokens))
        key = (ph, backend)
        cur = model.get(key)
        if kind is CLEARED:
            for k in [k for k in model if k[1] == backend]:
                del model[k]
        elif kind is CREATED:
            model[key] = (Tier.GPU_HOT, tokens)
        elif kind is OFFLOADED:
            if not offloading.enabled:
                model.pop(key, None)
            elif tokens > 0:
                model[key] = (Tier.STORAGE_WARM, tokens)
            elif cur is not None:
                model[key] = (Tier.STORAGE_WARM, cur[1])
        elif offloading.enabled and offloading.treat_eviction_as_offload:
            if cur is not None:
                model[key] = (Tier.STORAGE_WARM, cur[1])
        else:
            model.pop(key, None)
    for ph in (P1, P2):
        got = {(h.backend, h.tier, h.token_count) for h in idx.query_now(ph)}
        want = {(b, t, n) for (p, b), (t, n) in model.items() if p == ph}
        assert got == want
    assert len(idx) == len(model)


# --- Redis only --------------------------------------------------------------------------------


async def test_redis_key_layout_and_ttl(redis_server: RedisServer, raw_redis: Redis) -> None:
    idx = redis_index(redis_server, offloading=WARM, ttl=300, key_prefix="t1:kv:")
    try:
        await idx.apply(ev(CREATED, "vllm-1", P1, 2048))
        await idx.apply(ev(CREATED, "vllm-2", P1, 512))
        await idx.apply(ev(OFFLOADED, "vllm-1", P2, 99))
        assert await raw_redis.zrevrangebyscore(f"t1:kv:{P1}", "+inf", "-inf", withscores=True) \
            == [("vllm-1", 2048.0), ("vllm-2", 512.0)]
        assert await raw_redis.zrange(f"t1:kv:warm:{P2}", 0, -1, withscores=True) \
            == [("vllm-1", 99.0)]
        assert not await raw_redis.exists(f"t1:kv:{P2}")
        assert await raw_redis.smembers("t1:kv:backend:vllm-1") == {P1, P2}
        assert await raw_redis.smembers("t1:kv:backend:vllm-2") == {P1}
        for key in (f"t1:kv:{P1}", f"t1:kv:warm:{P2}", "t1:kv:backend:vllm-1"):
            assert 0 < await raw_redis.ttl(key) <= 300
        assert sorted(await raw_redis.keys("*")) == sorted(
            [f"t1:kv:{P1}", f"t1:kv:warm:{P2}", "t1:kv:backend:vllm-1", "t1:kv:backend:vllm-2"])
    finally:
        await idx.close()


async def test_redis_writes_are_one_multi_exec_with_expire(redis_server: RedisServer) -> None:
    idx = redis_index(redis_server)
    monitor_client = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        async with monitor_client.monitor() as m:
            await idx.apply(ev(CREATED, "vllm-1", P1, 7))
            seen: list[str] = []
            async with asyncio.timeout(5):
                while "EXEC" not in seen:
                    cmd = (await m.next_command())["command"]
                    seen.append(cmd.split()[0].upper())
        writes = seen[seen.index("MULTI"):]
        assert writes == ["MULTI", "ZADD", "ZREM", "SADD", "EXPIRE", "EXPIRE", "EXEC"]
    finally:
        await monitor_client.aclose()
        await idx.close()


async def test_redis_indexes_are_shared_between_routers(redis_server: RedisServer) -> None:
    a, b = redis_index(redis_server), redis_index(redis_server)
    try:
        await a.apply(ev(CREATED, "vllm-1", P1, 10))
        assert await b.query(P1) == [Holder("vllm-1", 10, Tier.GPU_HOT)]
        await b.apply(ev(CLEARED, "vllm-1"))
        assert await a.query(P1) == []
    finally:
        await a.close()
        await b.close()


async def test_redis_clear_removes_every_key_under_the_prefix_only(
    redis_server: RedisServer, raw_redis: Redis,
) -> None:
    idx = redis_index(redis_server, key_prefix="cr:kvidx:")
    try:
        await idx.apply(ev(CREATED, "vllm-1", P1, 10))
        await idx.apply(ev(CREATED, "vllm-2", P1, 10))
        await raw_redis.set("cr:kvidx:foreign", "x")  # under the prefix: goes too (documented)
        await raw_redis.set("cr:resp:other", "x")  # another namespace: stays
        assert await idx.clear() == ClearResult(entries_before_clear=2, cleared_entries=2)
        assert await raw_redis.keys("*") == ["cr:resp:other"]
    finally:
        await idx.close()


async def test_redis_cleanup_prunes_backend_set_of_expired_prefixes(
    redis_server: RedisServer, raw_redis: Redis,
) -> None:
    idx = redis_index(redis_server)
    try:
        await idx.apply(ev(CREATED, "vllm-1", P1, 10))
        await idx.apply(ev(CREATED, "vllm-1", P2, 10))
        await raw_redis.delete(f"cr:kvidx:{P1}")  # what an expiry of P1's key leaves behind
        assert await idx.cleanup_expired() == 1
        assert await raw_redis.smembers("cr:kvidx:backend:vllm-1") == {P2}
        assert await idx.cleanup_expired() == 0
    finally:
        await idx.close()


async def test_redis_query_refuses_non_hash_keys(redis_server: RedisServer, raw_redis: Redis) -> None:
    idx = redis_index(redis_server)
    try:
        await raw_redis.zadd("cr:kvidx:backend:x", {"evil": 1})
        assert await idx.query("backend:x") == []
    finally:
        await idx.close()


async def test_redis_fallback_activates_and_recovers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    changes: list[bool] = []
    idx = redis_index(server, metrics=metrics, probe_interval_s=0.05)
    idx.add_state_listener(changes.append)
    try:
        await idx.apply(ev(CREATED, "vllm-1", P1, 100))  # in Redis before the outage
        assert registry.get_sample_value("continuum_cache_fallback_active") == 0
        server.stop()

        await idx.apply(ev(CREATED, "vllm-2", P2, 200))  # fails over, lands in memory
        assert idx.fallback_active
        assert registry.get_sample_value("continuum_cache_fallback_active") == 1
        assert changes == [True]
        assert await idx.query(P2) == [Holder("vllm-2", 200, Tier.GPU_HOT)]
        assert await idx.query(P1) == []  # Redis' entries are out of reach meanwhile
        s = await idx.stats()
        assert (s.kind, s.fallback_active, s.entries) == ("redis", True, 1)

        server.start()  # same port, empty (no persistence)
        await asyncio.wait_for(idx.wait_recovered(), 10)
        assert not idx.fallback_active
        assert registry.get_sample_value("continuum_cache_fallback_active") == 0
        assert changes == [True, False]
        # The fallback's entries were copied into Redis; the fallback is empty again.
        check = Redis.from_url(server.url, decode_responses=True)
        try:
            assert await check.zscore(f"cr:kvidx:{P2}", "vllm-2") == 200
            assert await check.smembers("cr:kvidx:backend:vllm-2") == {P2}
        finally:
            await check.aclose()
        assert await idx.query(P2) == [Holder("vllm-2", 200, Tier.GPU_HOT)]
        await idx.apply(ev(CREATED, "vllm-3", P3, 5))
        assert (await idx.stats()).entries == 2
    finally:
        await idx.close()
        server.stop()


async def test_redis_without_fallback_raises_on_write_and_misses_on_read(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    idx = redis_index(server, fallback=False)
    try:
        await idx.apply(ev(CREATED, "vllm-1", P1, 100))
        server.stop()
        with pytest.raises(IndexUnavailableError):
            await idx.apply(ev(CREATED, "vllm-1", P2, 100))
        assert await idx.query(P1) == []
        assert not idx.fallback_active
        assert idx.redis_errors == 2
    finally:
        await idx.close()
        server.stop()


async def test_redis_over_tls(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file, ca_file = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(cert_file)
    cert.private_key_pem.write_to_path(key_file)
    ca.cert_pem.write_to_path(ca_file)
    server = RedisServer(tmp_path, tls=TlsFiles(cert_file, key_file))
    server.start()
    plain_url = server.url.replace("rediss://", "redis://")
    kv = KvCacheIndexConfig()
    good = RedisKvIndex.from_config(RedisConfig(url=plain_url, tls=True, ca_file=str(ca_file),
                                                fallback_to_memory=False), kv)
    untrusted = RedisKvIndex.from_config(RedisConfig(url=server.url, fallback_to_memory=False), kv)
    try:
        await good.apply(ev(CREATED, "vllm-1", P1, 3))
        assert await good.query(P1) == [Holder("vllm-1", 3, Tier.GPU_HOT)]
        assert not await untrusted.ping()  # system roots do not trust the test CA
    finally:
        await good.close()
        await untrusted.close()
        server.stop()


async def test_build_index_follows_the_config(redis_server: RedisServer) -> None:
    kv = KvCacheIndexConfig(max_entries=500, entry_ttl_seconds=42, storage_offloading=WARM)
    mem = build_index(RouterConfig(kv_cache_index=kv))
    assert isinstance(mem, InMemoryKvIndex)
    assert (mem.max_entries, mem.ttl_s, mem.offloading) == (500, 42, WARM)
    rkv = KvCacheIndexConfig(backend=IndexBackend.REDIS, key_prefix="x:", entry_ttl_seconds=42)
    red = build_index(RouterConfig(kv_cache_index=rkv, redis=RedisConfig(url=redis_server.url)))
    try:
        assert isinstance(red, RedisKvIndex)
        await red.apply(ev(CREATED, "vllm-1", P1, 1))
        assert red.hot_key(P1) == f"x:{P1}"
        assert await red.query(P1) == [Holder("vllm-1", 1, Tier.GPU_HOT)]
    finally:
        await red.close()
    with pytest.raises(ValueError, match=r"response_cache\.redis"):
        build_index(RouterConfig(kv_cache_index=rkv))
