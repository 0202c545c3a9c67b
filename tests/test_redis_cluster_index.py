"""The Redis index on a real local Redis Cluster (tests/support/redis_cluster.py: three masters,
three replicas of redis-server on 127.0.0.1), beyond the shared suite of test_index.py: the key
layout (hash tags, one slot per prefix, one atomic script per write), a master killed in the
middle of traffic and its replica promoted, a slot moved under concurrent reads and writes (ASK,
then MOVED), an outage longer than the failover window (the fallback, then recovery), TLS with
an ACL user from a password file, and the backend set's superset rule. Each fault test checks
the index against an in-memory model index fed the same records."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from kv_listener.core.model import Tier
from kv_listener.core.records import Record, RecordEvent
from kv_listener.router.config import KvCacheIndexConfig, StorageOffloadingConfig
from kv_listener.router.config_redis import RedisConfig
from kv_listener.router.index import Holder, IndexEvent, InMemoryKvIndex
from kv_listener.router.redis_index import RedisKvIndex
from tests.support.closing import closed_after
from tests.support.redis_cluster import ClusterServer, LocalRedisCluster, redis_cluster_fixture, slot_of

redis_cluster = redis_cluster_fixture()

CREATED, EVICTED = RecordEvent.CACHE_CREATED, RecordEvent.CACHE_EVICTED
OFFLOADED, CLEARED = RecordEvent.CACHE_OFFLOADED, RecordEvent.CACHE_CLEARED

BACKENDS = ("vllm-1", "vllm-2", "vllm-3")
WARM = StorageOffloadingConfig(enabled=True, treat_eviction_as_offload=True)


def index(cluster: LocalRedisCluster, *, offloading: StorageOffloadingConfig = WARM,
          probe_interval_s: float = 30.0, **redis: Any) -> RedisKvIndex:
    settings: dict[str, Any] = {"connect_timeout_ms": 1000, "command_timeout_ms": 1000} | redis
    return RedisKvIndex.from_config(
        RedisConfig(url=cluster.url, cluster=True, **settings),
        KvCacheIndexConfig(storage_offloading=offloading), probe_interval_s=probe_interval_s)


@contextlib.asynccontextmanager
async def restarting(cluster: LocalRedisCluster) -> AsyncIterator[Callable[[str], ClusterServer]]:
    """`kill(key)` SIGKILLs the master of `key`'s slot; every node killed so is started again
    (a replica in sync) when the block ends, for the tests after it."""
    killed: list[ClusterServer] = []

    def kill(key: str) -> ClusterServer:
        killed.append(cluster.kill_master_of(key))
        return killed[-1]

    try:
        yield kill
    finally:
        for node in killed:
            await asyncio.to_thread(cluster.restart, node)


def prefix(i: int) -> str:
    return f"{i:064x}"


def traffic(n: int, *, prefixes: int = 120, seed: int = 7) -> list[Record]:
    """A seeded stream of the four record kinds over `prefixes` prefixes and three backends."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        backend = rng.choice(BACKENDS)
        ph = prefix(rng.randrange(prefixes))
        roll = rng.random()
        if roll < 0.6:
            out.append(IndexEvent(CREATED, backend, ph, rng.randrange(16, 4096)))
        elif roll < 0.8:
            out.append(IndexEvent(EVICTED, backend, ph))
        elif roll < 0.98:
            out.append(IndexEvent(OFFLOADED, backend, ph, rng.choice((0, 64))))
        else:
            out.append(IndexEvent(CLEARED, backend))
    return out


class Writer:
    """Applies records to the index under test and to an in-memory model, one at a time, as a
    consumer does; `pause_at` stops before that record until `resume` is set."""

    def __init__(self, idx: RedisKvIndex, records: Sequence[Record], pause_at: int | None = None,
                 offloading: StorageOffloadingConfig = WARM) -> None:
        self.idx, self.records = idx, records
        self.model = InMemoryKvIndex(max_entries=100_000, offloading=offloading)
        self.applied = 0
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()
        self.pause_at = pause_at

    async def run(self) -> None:
        for i, rec in enumerate(self.records):
            if i == self.pause_at:
                self.paused.set()
                await self.resume.wait()
            await self.idx.apply(rec)
            self.model.apply_now(rec)
            self.applied += 1


async def read_while(idx: RedisKvIndex, writer: asyncio.Task[None], prefixes: int) -> int:
    """Queries (several per event-loop tick, so they batch) until the writer is done; every
    query must answer (a list, never an exception). Returns how many were answered."""
    answered = 0
    for i in range(100_000):
        if writer.done():
            return answered
        got = await asyncio.gather(*(idx.query(prefix((i * 7 + k) % prefixes)) for k in range(4)))
        assert all(isinstance(h, list) for h in got)
        answered += len(got)
        await asyncio.sleep(0.005)  # pace the reader: it shares the CPU with the writer
    raise AssertionError("the reader outlived its bound")


async def differences(idx: RedisKvIndex, model: InMemoryKvIndex, prefixes: int) -> list[str]:
    out = []
    for i in range(prefixes):
        got, want = await idx.query(prefix(i)), model.query_now(prefix(i))
        if got != want:
            out.append(f"{prefix(i)[-6:]}: index {got} != model {want}")
    return out


async def replicated(cluster: LocalRedisCluster) -> None:
    """Every master's writes are on its replica (WAIT 1): a kill now loses nothing acknowledged."""
    for m in cluster.masters():
        assert await asyncio.to_thread(cluster.admin(m.node).execute_command, "WAIT", 1, 2000) >= 1


async def test_keys_of_one_prefix_share_a_slot_and_writes_are_one_script_there(
    redis_cluster: LocalRedisCluster,
) -> None:
    redis_cluster.flushall()
    async with closed_after(index(redis_cluster)) as idx:
        p1 = prefix(1)
        await idx.apply(IndexEvent(CREATED, "vllm-1", p1, 512))
        await idx.apply(IndexEvent(OFFLOADED, "vllm-2", p1, 64))
        hot, warm = idx.hot_key(p1), idx.warm_key(p1)
        assert (hot, warm) == (f"cr:kvidx:{{{p1}}}", f"cr:kvidx:warm:{{{p1}}}")
        assert slot_of(hot) == slot_of(warm) == slot_of(p1)
        master = redis_cluster.admin(redis_cluster.master_of(hot).node)
        assert master.zrange(hot, 0, -1, withscores=True) == [("vllm-1", 512.0)]
        assert master.zrange(warm, 0, -1, withscores=True) == [("vllm-2", 64.0)]
        bset = redis_cluster.admin(redis_cluster.master_of("cr:kvidx:backend:vllm-1").node)
        assert bset.smembers("cr:kvidx:backend:vllm-1") == {p1}
        assert 0 < master.ttl(hot) <= 600
        # The prefix's write is one script on its master (atomic, as a MULTI would be).
        monitor = Redis(host="127.0.0.1", port=redis_cluster.master_of(hot).node.port,
                        decode_responses=True)
        try:
            async with monitor.monitor() as m:
                await idx.apply(IndexEvent(CREATED, "vllm-3", p1, 7))
                seen: list[str] = []
                async with asyncio.timeout(5):  # (the backend set's SADD may come first)
                    while not seen or seen[-1] != "EXPIRE" or "ZADD" not in seen:
                        seen.append((await m.next_command())["command"].split()[0].upper())
            start = seen.index("EVALSHA") if "EVALSHA" in seen else seen.index("EVAL")
            assert seen[start + 1:] == ["ZADD", "ZREM", "EXPIRE"]  # run inside the script
        finally:
            await monitor.aclose()
        assert await idx.query(p1) == [Holder("vllm-1", 512, Tier.GPU_HOT),
                                       Holder("vllm-2", 64, Tier.STORAGE_WARM),
                                       Holder("vllm-3", 7, Tier.GPU_HOT)]


async def test_a_master_killed_mid_traffic_fails_over_without_the_fallback(
    redis_cluster: LocalRedisCluster,
) -> None:
    redis_cluster.flushall()
    async with (restarting(redis_cluster) as kill,
                closed_after(index(redis_cluster, failover_wait_ms=20_000)) as idx):
        recovered: list[bool] = []
        idx.add_state_listener(recovered.append)
        writer = Writer(idx, traffic(700), pause_at=200)
        task = asyncio.create_task(writer.run())
        reader = asyncio.create_task(read_while(idx, task, 120))
        async with asyncio.timeout(10):
            await writer.paused.wait()
        await replicated(redis_cluster)
        killed = kill(idx.hot_key(writer.records[200].prefix_hash or ""))
        failover = asyncio.create_task(asyncio.to_thread(redis_cluster.wait_failover, killed))
        writer.resume.set()  # traffic goes on while the replica is promoted
        async with asyncio.timeout(40):
            await task
            answered = await reader
            await failover
        assert writer.applied == 700 and answered > 0
        assert not idx.fallback_active and idx.redis_errors == 0, "the fallback took over"
        assert idx.redis.transient_errors > 0, "the failover was not seen"
        # The router would resync (once per stretch of failures: a success on a healthy master
        # in between ends one).
        assert recovered and set(recovered) == {False}
        assert idx.cluster_outages == len(recovered)
        assert await differences(idx, writer.model, 120) == []


async def test_a_slot_moved_under_concurrent_reads_and_writes(
    redis_cluster: LocalRedisCluster,
) -> None:
    redis_cluster.flushall()
    async with closed_after(index(redis_cluster)) as idx:
        records = traffic(900, prefixes=40, seed=11)
        writer = Writer(idx, records, pause_at=300)
        task = asyncio.create_task(writer.run())
        reader = asyncio.create_task(read_while(idx, task, 40))
        async with asyncio.timeout(10):
            await writer.paused.wait()
        slot = slot_of(records[300].prefix_hash or "")
        source = redis_cluster.master_of_slot(slot).node
        target = next(m.node for m in redis_cluster.masters() if m.node is not source)
        migration = await asyncio.to_thread(redis_cluster.begin_migration, slot, target)
        writer.resume.set()
        await asyncio.to_thread(migration.move_keys, 1)  # half way: ASK for the moved key
        await asyncio.sleep(0.2)  # let traffic run against the half-moved slot
        await asyncio.to_thread(migration.finish)  # then MOVED
        async with asyncio.timeout(40):
            await task
            await reader
        assert redis_cluster.master_of_slot(slot).node is target
        assert not idx.fallback_active and idx.redis_errors == 0
        assert await differences(idx, writer.model, 40) == []


async def test_an_outage_beyond_the_failover_window_takes_the_fallback_and_recovers(
    redis_cluster: LocalRedisCluster,
) -> None:
    redis_cluster.flushall()
    async with (restarting(redis_cluster) as kill,
                closed_after(index(redis_cluster, failover_wait_ms=300, probe_interval_s=0.2)) as idx):
        states: list[bool] = []
        idx.add_state_listener(states.append)
        created = [IndexEvent(CREATED, "vllm-1", prefix(i), 100 + i) for i in range(60)]
        for rec in created[:30]:
            await idx.apply(rec)
        await replicated(redis_cluster)
        killed = kill(idx.hot_key(prefix(0)))
        for rec in created[30:]:  # the dead master's writes fail past 300 ms: the fallback
            await idx.apply(rec)
        assert idx.fallback_active and states == [True]
        await asyncio.to_thread(redis_cluster.wait_failover, killed)
        async with asyncio.timeout(20):
            await idx.wait_recovered()  # the probe PINGs every master, then copies back
        assert states == [True, False] and not idx.fallback_active
        for rec in created:
            assert await idx.query(rec.prefix_hash or "") == [
                Holder("vllm-1", rec.token_count or 0, Tier.GPU_HOT)]


async def test_cache_cleared_misses_nothing_and_cleanup_prunes_a_cut_write(
    redis_cluster: LocalRedisCluster,
) -> None:
    redis_cluster.flushall()
    async with closed_after(index(redis_cluster)) as idx:
        for i in range(300):  # spread over every master
            await idx.apply(IndexEvent(CREATED, "vllm-1", prefix(i), 10))
        await idx.apply(IndexEvent(CREATED, "vllm-2", prefix(5), 20))
        await idx.apply(IndexEvent(CLEARED, "vllm-1"))
        assert (await idx.stats()).entries == 1
        assert await idx.query(prefix(5)) == [Holder("vllm-2", 20, Tier.GPU_HOT)]
        # A write cut between its two steps leaves a set member without an entry: pruned.
        await idx.redis.client.sadd(idx.backend_key("vllm-2"), prefix(77))
        assert await idx.cleanup_expired() == 1
        assert await idx.redis.client.smembers(idx.backend_key("vllm-2")) == {prefix(5)}


async def test_tls_and_an_acl_user_with_a_password_file(tmp_path: Path) -> None:
    with LocalRedisCluster(tmp_path, tls=True, acl=True) as cluster:
        assert cluster.acl is not None and cluster.tls is not None
        assert cluster.url.startswith("rediss://")
        creds: dict[str, Any] = {"ca_file": cluster.tls.ca_file, "username": cluster.acl.user}
        idx = index(cluster, password_file=str(cluster.acl.password_file), **creds)
        try:
            for i in range(20):
                await idx.apply(IndexEvent(CREATED, "vllm-1", prefix(i), i + 1))
            assert [await idx.query(prefix(i)) for i in range(20)] == [
                [Holder("vllm-1", i + 1, Tier.GPU_HOT)] for i in range(20)]
            assert (await idx.stats()).entries == 20 and not idx.fallback_active
        finally:
            await idx.close()
        wrong = tmp_path / "wrong-password"
        wrong.write_text("not-the-password\n")
        bad = index(cluster, password_file=str(wrong), failover_wait_ms=0, **creds)
        try:
            await bad.apply(IndexEvent(CREATED, "vllm-1", prefix(1), 1))
            assert bad.fallback_active and bad.redis_errors == 1  # refused: the fallback holds it
            assert await bad.query(prefix(1)) == [Holder("vllm-1", 1, Tier.GPU_HOT)]
        finally:
            await bad.close()



async def test_a_burst_wider_than_the_pool_waits_for_connections(
    redis_cluster: LocalRedisCluster,
) -> None:
    """More requests at once than `pool_size` connections per node: they wait for a connection,
    as on one server (BlockingConnectionPool). redis-py's cluster client raises
    MaxConnectionsError at once instead (redis/redis-py#3135), a ConnectionError that the index
    took for a lost node: retries, a `kv_index_redis_cluster_retrying` warning, and at the end an
    "outage ridden out" that makes every consumer resync, on a healthy cluster."""
    redis_cluster.flushall()
    async with closed_after(index(redis_cluster, pool_size=2)) as idx:
        writes = [IndexEvent(CREATED, BACKENDS[i % 3], prefix(i), 16 + i) for i in range(200)]
        await asyncio.gather(*(idx.apply(e) for e in writes))
        answers = await asyncio.gather(*(idx.query(prefix(i)) for i in range(200)))
        assert answers == [[Holder(BACKENDS[i % 3], 16 + i, Tier.GPU_HOT)] for i in range(200)]
        assert idx.redis.transient_errors == 0
        assert idx.cluster_outages == 0
        assert not idx.fallback_active
        connections = [len(node._connections)
                       for node in idx.redis.client.nodes_manager.nodes_cache.values()]
        assert max(connections) <= 2, connections


async def test_the_wait_for_a_connection_is_bounded_by_the_connect_timeout(
    redis_cluster: LocalRedisCluster,
) -> None:
    """While every permit is held, a request gives up after `connect_timeout_ms` with the error
    a BlockingConnectionPool gives (a ConnectionError: the failover window's rules apply), and
    goes through once a permit is free."""
    async with closed_after(index(redis_cluster, pool_size=1, connect_timeout_ms=200)) as idx:
        client = idx.redis.client
        held, release = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with client.permit():
                held.set()
                await release.wait()

        holder = asyncio.create_task(hold())
        await held.wait()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await client.ping()
        assert 0.15 <= loop.time() - started < 5.0
        release.set()
        await holder
        assert await client.ping() is True
