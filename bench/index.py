"""Benchmark of the router's KV index and scorer. Prints figures; asserts nothing.

    .venv/bin/python bench/index.py [--prefixes 20000] [--backends 4]

- query latency p50/p99 of `InMemoryKvIndex` and `RedisKvIndex` (a real redis-server started on
  a free port for the run), apply latency, and memory bytes per (prefix, backend) entry;
- scorer time per 1,000 scoring calls (the seed's bound: 100 ms; aim: 10 ms): `score()` reads of
  a prepared prefix, and full `select()` calls (prepare = one index query per new prefix, then
  every candidate scored) over the memory and the Redis index: one after the other (concurrency
  1), and from 16 or 64 concurrent requests (workers each awaiting one `select()` at a time),
  where the Redis index batches the lookups of queries that wait behind a round trip in flight.
  Each concurrent figure is the median of 7 runs of 1,000 fresh prefixes (none prepared before),
  with the lookup round trips they took;
- the same index on a Redis Cluster (three masters and three replicas of redis-server on
  127.0.0.1, tests/support/redis_cluster.py; skipped with --no-cluster): apply and query latency
  p50/p99, writes/s from one consumer per backend writing at once, and the masters' memory per
  (prefix, backend) entry (INFO used_memory before and after, replicas not counted), next to the
  single server's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import structlog
from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quiet import quiet_libraries

from kv_listener.core.records import Record
from kv_listener.router.config import KvCacheIndexConfig, StorageOffloadingConfig
from kv_listener.router.config_redis import RedisConfig
from kv_listener.router.index import IndexEvent, InMemoryKvIndex, KvIndex, PrefixEventType
from kv_listener.router.redis_index import RedisKvIndex
from kv_listener.router.scorer import KvOverlapScorer
from tests.support.redis_cluster import LocalRedisCluster
from tests.support.redis_server import RedisServer

CREATED = PrefixEventType.CACHE_CREATED
RUNS = 7  # runs of each concurrent select() figure (median printed)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def fmt_us(samples: list[float]) -> str:
    return (f"p50 {pct(samples, 0.50) * 1e6:8.1f} us   p99 {pct(samples, 0.99) * 1e6:8.1f} us   "
            f"mean {statistics.fmean(samples) * 1e6:8.1f} us")


def events(prefixes: list[str], backends: list[str], rng: random.Random) -> list[Record]:
    return [IndexEvent(CREATED, b, ph, rng.randrange(16, 8192))
            for ph in prefixes for b in backends if rng.random() < 0.75]


T = TypeVar("T")


async def timed(call: Callable[[T], Awaitable[object]], items: Sequence[T]) -> list[float]:
    """Each call's own wall time, one item at a time (`index.apply` of events, `index.query`)."""
    out = []
    for item in items:
        t0 = time.perf_counter()
        await call(item)
        out.append(time.perf_counter() - t0)
    return out


async def scorer_figures(name: str, index: KvIndex, prefixes: list[str], backends: list[str],
                         rng: random.Random) -> None:
    scorer = KvOverlapScorer(index)
    for b in backends[:2]:
        scorer.in_flight.start(b)
    # 1,000 score() calls on one prepared prefix (the seed's sync read).
    ph = prefixes[0]
    await scorer.prepare(ph)
    runs = []
    for _ in range(20):
        t0 = time.perf_counter()
        for i in range(1000):
            scorer.score(ph, backends[i % len(backends)])
        runs.append(time.perf_counter() - t0)
    print(f"  {name:6s} 1,000 score() calls (prepared):      median {statistics.median(runs) * 1e3:7.3f} ms")
    # 1,000 select() calls, each on a prefix not prepared yet (cold: one index query each).
    sample = rng.sample(prefixes, 1000)
    t0 = time.perf_counter()
    for p in sample:
        await scorer.select(p, backends)
    cold = time.perf_counter() - t0
    kv_aware, fallback = scorer.stats.kv_aware, scorer.stats.fallback
    # 1,000 select() calls over 10 prefixes prepared just before (within the 100 ms window).
    hot = sample[:10]
    for p in hot:
        scorer.invalidate(p)
        await scorer.prepare(p)
    queries_before = scorer.stats.index_queries
    t0 = time.perf_counter()
    for i in range(1000):
        await scorer.select(hot[i % 10], backends)
    warm = time.perf_counter() - t0
    assert scorer.stats.index_queries == queries_before, "the window expired: machine too slow"
    print(f"  {name:6s} 1,000 select() calls, cold prepare, sequential (concurrency 1): "
          f"{cold * 1e3:9.3f} ms ({kv_aware} kv_aware, {fallback} fallback)")
    print(f"  {name:6s} 1,000 select() calls, cached prepare: {warm * 1e3:8.3f} ms")
    for concurrency in (1, 16, 64):
        times, trips = [], []
        for _ in range(RUNS):
            run_ms, run_trips = await concurrent_selects(index, rng.sample(prefixes, 1000),
                                                         backends, concurrency)
            times.append(run_ms)
            trips.append(run_trips)
        trips_text = (f", {statistics.median(trips):.0f} lookup round trips"
                      if isinstance(index, RedisKvIndex) else "")
        print(f"  {name:6s} 1,000 select() calls, fresh prefixes, concurrency {concurrency:2d}: "
              f"median {statistics.median(times):8.3f} ms (runs {min(times):.1f}-{max(times):.1f})"
              f"{trips_text}")


async def concurrent_selects(index: KvIndex, sample: list[str], backends: list[str],
                             concurrency: int) -> tuple[float, int]:
    """`concurrency` requests at a time, each one `select()` on a prefix no request prepared
    before (a new scorer: empty prepare cache): ms for the 1,000 calls and the lookup round
    trips to Redis they took (0 for the memory index)."""
    scorer = KvOverlapScorer(index)
    todo = iter(sample)

    async def request_loop() -> None:
        for p in todo:  # shared: each worker takes the next prefix when its request is done
            await scorer.select(p, backends)

    def trips() -> int:
        return index.lookup_round_trips if isinstance(index, RedisKvIndex) else 0

    trips_before = trips()
    t0 = time.perf_counter()
    await asyncio.gather(*(request_loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    assert scorer.stats.index_queries == len(sample)
    return elapsed * 1e3, trips() - trips_before


def used_memory(clients: Sequence[Redis]) -> int:
    return sum(int(c.info("memory")["used_memory"]) for c in clients)


async def writes_per_s(index: KvIndex, evs: list[Record]) -> float:
    """Records/s with one writer per backend (a router's consumers), each in order."""
    by_backend: dict[str, list[Record]] = {}
    for e in evs:
        by_backend.setdefault(e.backend, []).append(e)

    async def consume(mine: list[Record]) -> None:
        for e in mine:
            await index.apply(e)

    started = time.perf_counter()
    await asyncio.gather(*(consume(m) for m in by_backend.values()))
    return len(evs) / (time.perf_counter() - started)


def memory_line(name: str, used: int, entries: int) -> str:
    return (f"  memory: {used / entries:.0f} B per (prefix, backend) entry ({name}; "
            f"{2**30 / (used / entries) / 1e6:.1f} M entries per GiB)")


async def cluster_figures(evs: list[Record], keys: list[str], backends: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp, LocalRedisCluster(Path(tmp)) as cluster:
        masters = [cluster.admin(m.node) for m in cluster.masters()]
        before = used_memory(masters)
        idx = RedisKvIndex.from_config(
            RedisConfig(url=cluster.url, cluster=True, pool_size=8),
            KvCacheIndexConfig(storage_offloading=StorageOffloadingConfig(enabled=True)))
        try:
            apply_c = await timed(idx.apply, evs)
            used = used_memory(masters) - before
            q_c = await timed(idx.query, keys[:5000])
            wps = await writes_per_s(idx, evs[:20000])
            print(f"redis cluster index (3 masters + 3 replicas on 127.0.0.1, "
                  f"{len(backends)} backends)")
            print(f"  apply (SADD, then MULTI/EXEC on the prefix's slot): {fmt_us(apply_c)}")
            print(f"  query (2x ZREVRANGEBYSCORE): {fmt_us(q_c)}")
            print(f"  writes/s, one writer per backend at once: {wps:,.0f}")
            print(memory_line("the masters' used_memory", used, len(evs)))
        finally:
            await idx.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=20000,
                    help="at least 1000: the scorer figures sample 1,000 of them (20000)")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--queries", type=int, default=20000)
    ap.add_argument("--no-cluster", action="store_true", help="skip the Redis Cluster figures")
    args = ap.parse_args()
    if args.prefixes < 1000:
        ap.error("--prefixes must be at least 1000 (the scorer figures sample 1,000 of them)")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    rng = random.Random(7)
    prefixes = [f"{rng.getrandbits(256):064x}" for _ in range(args.prefixes)]
    backends = [f"vllm-{i}" for i in range(args.backends)]
    evs = events(prefixes, backends, rng)
    misses = [f"{rng.getrandbits(256):064x}" for _ in range(args.queries // 4)]
    keys = [rng.choice(prefixes) for _ in range(args.queries)] + misses
    rng.shuffle(keys)
    print(f"{len(prefixes)} prefixes x {len(backends)} backends -> {len(evs)} entries; "
          f"{len(keys)} queries (20% misses)")

    # --- memory ---
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem = InMemoryKvIndex(max_entries=10_000_000, offloading=StorageOffloadingConfig(enabled=True))
    for e in evs:
        mem.apply_now(e)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    apply_mem = await timed(mem.apply, evs[:20000])  # upserts of existing entries
    q_mem = await timed(mem.query, keys)
    print("memory index")
    print(f"  bytes per (prefix, backend) entry: {used / len(mem):.0f}")
    print(f"  apply: {fmt_us(apply_mem)}")
    print(f"  query: {fmt_us(q_mem)}")

    # --- redis ---
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            red = RedisKvIndex.from_config(
                RedisConfig(url=server.url, pool_size=8),
                KvCacheIndexConfig(storage_offloading=StorageOffloadingConfig(enabled=True)))
            try:
                admin = Redis.from_url(server.url)
                before = used_memory([admin])
                apply_red = await timed(red.apply, evs)
                used = used_memory([admin]) - before
                admin.close()
                q_red = await timed(red.query, keys[:5000])
                wps = await writes_per_s(red, evs[:20000])
                print(f"redis index (redis-server on 127.0.0.1, {server.url})")
                print(f"  apply (MULTI/EXEC): {fmt_us(apply_red)}")
                print(f"  query (2x ZREVRANGEBYSCORE, one round trip): {fmt_us(q_red)}")
                print(f"  writes/s, one writer per backend at once: {wps:,.0f}")
                print(memory_line("used_memory", used, len(evs)))
                print("scorer (seed bound: 1,000 scoring calls < 100 ms; aim 10 ms); concurrency N ="
                      " N requests in flight, each awaiting one select() at a time")
                await scorer_figures("memory", mem, prefixes, backends, rng)
                await scorer_figures("redis", red, prefixes, backends, rng)
            finally:
                await red.close()
        finally:
            server.stop()
    if not args.no_cluster:
        await cluster_figures(evs, keys, backends)


if __name__ == "__main__":
    quiet_libraries()
    asyncio.run(main())
