"""RedisKvIndex lookups batched across concurrent queries ("natural batching"), against a real
redis-server: one pipeline for the queries that wait behind a round trip in flight, one lookup per
distinct prefix, round trips counted by Redis itself (`INFO stats` read events, `INFO commandstats`
calls), a Redis that stops while a batch is in flight, cancelled callers, and the batch bound.

A round trip is held "in flight" by a small TCP proxy between the index and Redis: it tells when
the index's bytes arrived and forwards them only when released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from kv_listener.core.model import Tier
from kv_listener.router.config import KvCacheIndexConfig, StorageOffloadingConfig
from kv_listener.router.config_redis import RedisConfig
from kv_listener.router.index import Holder, IndexEvent, PrefixEventType
from kv_listener.router.metrics import RouterMetrics
from kv_listener.router.redis_index import LOOKUP_BATCH, RedisKvIndex
from tests.support.closing import closed_after
from tests.support.redis_server import RedisServer

CREATED = PrefixEventType.CACHE_CREATED
OFFLOADED = PrefixEventType.CACHE_OFFLOADED
OFF = StorageOffloadingConfig(enabled=False)
WARM = StorageOffloadingConfig(enabled=True, treat_eviction_as_offload=True)


def prefix(i: int) -> str:
    return f"{i:064x}"


P1, P2, P3 = prefix(1), prefix(2), prefix(3)


class HoldingProxy:
    """TCP proxy to Redis. `hold()` keeps what the clients send from reaching Redis (a round trip
    stays in flight) until `release()`; `arrived` is set when client bytes reached the proxy."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.arrived = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self._open.clear()
        self.arrived.clear()

    def release(self) -> None:
        self._open.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        for src, dst, held in ((reader, up_writer, True), (up_reader, writer, False)):
            task = asyncio.get_running_loop().create_task(self._pump(src, dst, held))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, held: bool) -> None:
        try:
            while data := await src.read(65536):
                if held:
                    self.arrived.set()
                    await self._open.wait()
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.close()

    async def close(self) -> None:
        """Stop listening and drop every connection (the clients see Redis go away)."""
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._writers:
            with contextlib.suppress(OSError):
                await w.wait_closed()
        await self._server.wait_closed()


@dataclass(frozen=True)
class RedisCounters:
    """What Redis itself counted: read events (one per round trip of a small pipeline; a large
    one may take a few) and ZREVRANGEBYSCORE calls (one per ZSET looked up)."""

    reads: int
    lookups: int

    @classmethod
    async def read(cls, raw: Redis) -> RedisCounters:
        info = await raw.info("stats", "commandstats")
        return cls(int(info["total_reads_processed"]),
                   int(info.get("cmdstat_zrevrangebyscore", {}).get("calls", 0)))

    def since(self, before: RedisCounters) -> RedisCounters:
        # The INFO that read `self` is one read event of its own.
        return RedisCounters(self.reads - before.reads - 1, self.lookups - before.lookups)


@pytest.fixture
async def proxy(redis_server: RedisServer) -> AsyncIterator[HoldingProxy]:
    p = HoldingProxy(redis_server.port)
    await p.start()
    yield p
    await p.close()


def make_index(url: str, *, offloading: StorageOffloadingConfig = WARM, fallback: bool = True,
               metrics: RouterMetrics | None = None) -> RedisKvIndex:
    return RedisKvIndex.from_config(
        RedisConfig(url=url, fallback_to_memory=fallback, connect_timeout_ms=2000,
                    command_timeout_ms=2000),
        KvCacheIndexConfig(storage_offloading=offloading), metrics=metrics)



async def hold_after_a_query(idx: RedisKvIndex, proxy: HoldingProxy, raw_redis: Redis,
                             n: int) -> tuple[dict[str, list[Holder]], RedisCounters]:
    """`n` prefixes written, one query answered (the connection is up), the counters read, then
    the proxy holds Redis's replies: the next query stays in flight until `proxy.release()`."""
    expected = await fill(idx, n)
    await idx.query(P1)
    before = await RedisCounters.read(raw_redis)
    proxy.hold()
    return expected, before

async def settle() -> None:
    """Let the tasks just created run up to their first await (each queues its lookup)."""
    await asyncio.sleep(0)


async def fill(idx: RedisKvIndex, n: int) -> dict[str, list[Holder]]:
    """n prefixes: vllm-1 holds prefix i on GPU with i + 1 tokens, vllm-2 the odd ones warm."""
    expected: dict[str, list[Holder]] = {}
    for i in range(n):
        ph = prefix(i)
        await idx.apply(IndexEvent(CREATED, "vllm-1", ph, i + 1))
        holders = [Holder("vllm-1", i + 1, Tier.GPU_HOT)]
        if i % 2:
            await idx.apply(IndexEvent(OFFLOADED, "vllm-2", ph, 1000))
            holders.insert(0, Holder("vllm-2", 1000, Tier.STORAGE_WARM))
        expected[ph] = holders
    return expected


async def test_concurrent_queries_share_round_trips_and_lookups(
    redis_server: RedisServer, raw_redis: Redis,
) -> None:
    async with closed_after(make_index(redis_server.url)) as idx:
        expected = await fill(idx, 50)
        await idx.query(P1)  # the lookup connection exists before counting
        keys = [prefix(i % 50) for i in range(200)]  # 200 requests, 50 distinct prefixes
        before = await RedisCounters.read(raw_redis)
        results = await asyncio.gather(*(idx.query(k) for k in keys))
        spent = (await RedisCounters.read(raw_redis)).since(before)
        assert results == [expected[k] for k in keys]
        assert spent.lookups == 50 * 2  # one lookup per distinct prefix (GPU and warm ZSET)
        assert spent.reads <= 3, spent  # one pipeline (a few reads at most), not 200 round trips
        assert len({id(r) for r in results}) == 200  # every caller owns its list
        assert (await idx.stats()).queries == 201


async def test_first_query_goes_out_at_once_and_the_rest_follow_in_one_batch(
    proxy: HoldingProxy, raw_redis: Redis,
) -> None:
    async with closed_after(make_index(proxy.url)) as idx:
        expected, before = await hold_after_a_query(idx, proxy, raw_redis, 40)
        first = asyncio.create_task(idx.query(P1))
        await proxy.arrived.wait()  # sent alone: it waited for no company
        rest = [asyncio.create_task(idx.query(prefix(i))) for i in range(40)]
        await settle()
        proxy.release()
        assert await first == expected[P1]
        assert [await t for t in rest] == [expected[prefix(i)] for i in range(40)]
        spent = (await RedisCounters.read(raw_redis)).since(before)
        assert spent.lookups == (1 + 40) * 2  # P1 again in the second window: its own lookup
        assert spent.reads <= 4, spent  # two pipelines, not 41 round trips
        assert idx.lookup_round_trips == 3  # the warm-up query, then `first`, then the rest


async def test_batches_are_bounded(redis_server: RedisServer, raw_redis: Redis) -> None:
    async with closed_after(make_index(redis_server.url, offloading=OFF)) as idx:
        n = 2 * LOOKUP_BATCH + 10
        async with raw_redis.pipeline(transaction=False) as pipe:
            for i in range(n):
                pipe.zadd(f"cr:kvidx:{prefix(i)}", {"vllm-1": i + 1})
            await pipe.execute()
        results = await asyncio.gather(*(idx.query(prefix(i)) for i in range(n)))
        assert results == [[Holder("vllm-1", i + 1, Tier.GPU_HOT)] for i in range(n)]
        assert idx.lookup_round_trips == 3


async def test_without_offloading_only_the_gpu_zset_is_read(
    redis_server: RedisServer, raw_redis: Redis,
) -> None:
    warm_router, gpu_router = make_index(redis_server.url), make_index(redis_server.url,
                                                                       offloading=OFF)
    try:
        await warm_router.apply(IndexEvent(CREATED, "vllm-1", P1, 10))
        await warm_router.apply(IndexEvent(OFFLOADED, "vllm-2", P1, 20))
        before = await RedisCounters.read(raw_redis)
        # Like its in-memory twin, a router that tracks only GPU data reports only GPU holders.
        assert await gpu_router.query(P1) == [Holder("vllm-1", 10, Tier.GPU_HOT)]
        assert (await RedisCounters.read(raw_redis)).since(before).lookups == 1
        assert await warm_router.query(P1) == [Holder("vllm-2", 20, Tier.STORAGE_WARM),
                                               Holder("vllm-1", 10, Tier.GPU_HOT)]
    finally:
        await warm_router.close()
        await gpu_router.close()


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no_fallback"])
async def test_redis_stopped_mid_batch_every_caller_gets_the_single_query_outcome(
    redis_server: RedisServer, proxy: HoldingProxy, fallback: bool,
) -> None:
    registry = CollectorRegistry()
    idx = make_index(proxy.url, fallback=fallback, metrics=RouterMetrics(registry))
    changes: list[bool] = []
    idx.add_state_listener(changes.append)
    try:
        await idx.apply(IndexEvent(CREATED, "vllm-1", P1, 100))
        assert await idx.query(P1) == [Holder("vllm-1", 100, Tier.GPU_HOT)]
        proxy.hold()
        in_flight = [asyncio.create_task(idx.query(p)) for p in (P1, P2, P1)]
        await proxy.arrived.wait()
        waiting = [asyncio.create_task(idx.query(p)) for p in (P1, P3, P3)]
        await settle()
        redis_server.stop()
        await proxy.close()  # Redis is gone: the connection drops, reconnecting is refused

        results = await asyncio.gather(*in_flight, *waiting)
        # A single query against a Redis gone away returns no holder (the fallback is empty:
        # Redis' entries are out of reach), and so does every caller here; none raises.
        assert results == [[]] * 6
        assert idx.fallback_active is fallback
        if fallback:
            # One failed round trip, one switch; the waiting batch read the fallback, as every
            # query does while it is active, without a round trip of its own.
            assert idx.redis_errors == 1
            assert changes == [True]
            assert registry.get_sample_value("continuum_cache_fallback_active") == 1
        else:
            assert idx.redis_errors == 2  # the waiting batch tried Redis too, as queries do
            assert changes == []
        assert await idx.query(P1) == []  # what a lone query returns now
        if fallback:
            await idx.apply(IndexEvent(CREATED, "vllm-2", P2, 7))  # the fallback serves reads
            assert await idx.query(P2) == [Holder("vllm-2", 7, Tier.GPU_HOT)]
    finally:
        await idx.close()


async def test_a_cancelled_caller_does_not_hurt_the_others(
    proxy: HoldingProxy, raw_redis: Redis,
) -> None:
    async with closed_after(make_index(proxy.url)) as idx:
        expected, before = await hold_after_a_query(idx, proxy, raw_redis, 4)
        shared_cancelled, shared = (asyncio.create_task(idx.query(P1)) for _ in range(2))
        alone_cancelled = asyncio.create_task(idx.query(P2))  # the only caller of P2
        other = asyncio.create_task(idx.query(P3))
        await proxy.arrived.wait()  # P1, P2, P3 in flight
        late = asyncio.create_task(idx.query(P2))
        late_cancelled = asyncio.create_task(idx.query(prefix(0)))  # P0's only caller, waiting
        await settle()
        for task in (shared_cancelled, alone_cancelled, late_cancelled):
            task.cancel()
        proxy.release()

        assert await shared == expected[P1]
        assert await other == expected[P3]
        assert await late == expected[P2]
        for task in (shared_cancelled, alone_cancelled, late_cancelled):
            with pytest.raises(asyncio.CancelledError):
                await task
        spent = (await RedisCounters.read(raw_redis)).since(before)
        assert spent.lookups == (3 + 1) * 2  # the next batch skipped P0: nobody waits for it
        assert not idx.fallback_active
        assert await idx.query(prefix(0)) == expected[prefix(0)]  # the index goes on


async def test_a_command_error_fails_only_that_prefixs_callers(
    redis_server: RedisServer, raw_redis: Redis,
) -> None:
    async with closed_after(make_index(redis_server.url)) as idx:
        expected = await fill(idx, 2)
        await raw_redis.set(f"cr:kvidx:warm:{P2}", "not a zset")  # WRONGTYPE for P2's lookup
        p0, p2, p1 = await asyncio.gather(idx.query(prefix(0)), idx.query(P2), idx.query(P1))
        assert (p0, p1) == (expected[prefix(0)], expected[P1])  # their rows came from Redis
        # P2's callers get what a single query on that key gets: the error switches the index to
        # the fallback, which knows nothing of P2.
        assert p2 == []
        assert idx.fallback_active
        assert idx.redis_errors == 1


@pytest.mark.parametrize("protocol", [2, 3])
async def test_lookups_read_either_protocol(redis_server: RedisServer, protocol: int) -> None:
    # redis-py 8 speaks RESP3 by default (nested pairs, double scores); 5 to 7 RESP2 (flat).
    writer = make_index(redis_server.url)
    client = Redis.from_url(redis_server.url, protocol=protocol)  # bytes replies, too
    idx = RedisKvIndex(client, offloading=WARM)
    try:
        expected = await fill(writer, 3)
        results = await asyncio.gather(*(idx.query(prefix(i)) for i in range(3)))
        assert results == [expected[prefix(i)] for i in range(3)]
    finally:
        await idx.close()
        await writer.close()
