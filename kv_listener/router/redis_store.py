"""`RedisOnlyKvIndex`: the KV index in Redis sorted sets, shared by every router using the same
Redis (one server, or a Redis Cluster). Redis only: a failure is raised (writes, stats, clear) or
reported (batched lookups); the in-memory fallback around it is `redis_index.RedisKvIndex`'s.

Owns: the Redis key layout (SPEC §8), its atomic writes, what a cluster changes, and the failover
window; the batched lookups are `redis_lookups.LookupBatcher`'s.

Layout (the prefix `cr:kvidx:` is `kv_cache_index.key_prefix`):
- `cr:kvidx:<prefix_hash>`          ZSET backend -> token_count of GPU-hot holders;
- `cr:kvidx:warm:<prefix_hash>`     ZSET backend -> token_count of storage-warm holders;
- `cr:kvidx:backend:<backend>`      SET of the prefix hashes of that backend (for cache_cleared).
On one server every write is one MULTI/EXEC pipeline that also sets `EXPIRE entry_ttl_seconds` on
the keys it adds to.

On a Redis Cluster (`cluster: true`) the two ZSETs of a prefix carry the prefix hash as a hash tag
(`cr:kvidx:{<prefix_hash>}`, `cr:kvidx:warm:{<prefix_hash>}`): they live in one slot, so a
write of one prefix stays one atomic step there (a Lua script: ZADD, ZREM and EXPIRE, or the two
ZREMs; a tier move is never half done). A backend's set lives
in another slot and cannot join that transaction; it is kept a superset of the backend's entries
instead: an upsert adds to it before its transaction, a removal takes from it after its
transaction, so `cache_cleared` (which removes the holder from every prefix its set lists, then
exactly the members it read, never a member added meanwhile) misses nothing, and a member left
over by a failure between the two steps is pruned by `cleanup_expired`. Slot moves and failover:
redis-py's cluster client follows MOVED and ASK; what still surfaces (a moved slot under
concurrency, a master killed before its replica is promoted: connection errors, CLUSTERDOWN,
TRYAGAIN) is retried with backoff for up to `failover_wait_s` from the first failure of the
outage (writes wait; lookups meanwhile answer None, so requests take the default strategy), and
only a failure beyond that window reaches the caller (the wrapper then takes its fallback).
Every step is idempotent, so a retried step after an unknown outcome is safe.

Differences from the in-memory index, by design of the layout: the TTL is per prefix key, so a
write for any backend refreshes it for every holder of that prefix (the listener's explicit
`cache_evicted` is what removes a holder; the TTL only bounds what a lost event leaves behind);
`max_entries` does not apply (Redis' own memory policy does). Transitions that need the current
entry (`cache_evicted` as offload, `cache_offloaded` without a token_count) read it under
`WATCH` and retry when another router wrote the entry meanwhile (on one server; on a cluster they
read, then write: see `_apply_watched`). `cleanup_expired` prunes backend
sets of prefix hashes whose ZSETs have expired.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import structlog
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    RedisClusterException,
    RedisError,
    TryAgainError,
    WatchError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kv_listener.backoff import Backoff
from kv_listener.core.model import Tier
from kv_listener.core.records import Record, RecordEvent, is_prefix_hash
from kv_listener.router.config import DEFAULT_KEY_PREFIX, StorageOffloadingConfig
from kv_listener.router.index import (
    KEEP,
    REMOVE,
    BackendEntries,
    ClearResult,
    Holder,
    IndexStats,
    KvIndex,
    Outcome,
    Upsert,
    transition,
)
from kv_listener.router.oplog import error_fields
from kv_listener.router.redis_lookups import LOOKUP_BATCH, LookupBatcher, as_str

__all__ = ["LEASE_KEYS", "LOOKUP_BATCH", "REDIS_ERRORS", "IndexUnavailableError", "RedisOnlyKvIndex",
           "redis_address"]

log = structlog.get_logger(__name__)

#: What "Redis is unreachable" looks like (redis-py wraps most, TimeoutError is an OSError; the
#: cluster client raises RedisClusterException, not a RedisError, when it has no node to ask).
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, OSError, RedisClusterException)
#: The writer leases live beside the index: `<key_prefix>lease:<backend>` (router.lease).
LEASE_KEYS = "lease:"
#: What a cluster shows while a slot moves or a master fails over: retried in the failover window.
_CLUSTER_TRANSIENT: tuple[type[Exception], ...] = (
    RedisConnectionError, RedisTimeoutError, OSError, ClusterError, TryAgainError, AskError,
    RedisClusterException)
#: Of those, what may mean a master went away (with writes it had not replicated yet); a slot
#: move (ASK, MOVED, TRYAGAIN) loses nothing.
_NODE_LOST: tuple[type[Exception], ...] = (
    RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, RedisClusterException)
#: A cluster's write of one prefix (KEYS: the ZSET it goes to, the other one, same slot).
_UPSERT_LUA = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
_REMOVE_LUA = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
_WATCH_RETRIES = 8
_BATCH = 256

T = TypeVar("T")


class IndexUnavailableError(Exception):
    """Redis is unreachable and the in-memory fallback is disabled."""


def redis_address(client: Any) -> str:
    """`host:port` (or `unix:<path>`) the client connects to, for logs: never the URL, which
    may carry the password. A cluster client: its first startup node, as `cluster:host:port`."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        nodes = getattr(client.nodes_manager, "startup_nodes", {}) or {"?": None}
        return f"cluster:{next(iter(nodes))}"
    kwargs = pool.connection_kwargs
    if kwargs.get("path"):
        return f"unix:{kwargs['path']}"
    host = str(kwargs.get("host", "localhost"))
    port = kwargs.get("port", 6379)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _batches(members: AsyncIterator[Any]) -> AsyncIterator[list[str]]:
    """A SCAN-family iterator's members as strings, `_BATCH` at a time."""
    batch: list[str] = []
    async for member in members:
        batch.append(as_str(member))
        if len(batch) >= _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


#: Entries as `InMemoryKvIndex.entries()` lists them: (prefix_hash, backend, tier, tokens, age_s).
Entry = tuple[str, str, Tier, int, float]
OnError = Callable[[BaseException, str], None]


class RedisOnlyKvIndex(KvIndex):
    """The index in Redis (one server, or a cluster with `cluster=True`). `on_error(exc, op)`
    hears of each failed lookup round trip (and of a failed cleanup round) instead of the
    callers; without it, `query` raises `IndexUnavailableError` and `cleanup_expired` the Redis
    error. On a cluster, failures inside the failover window are retried or answered None
    without `on_error` (module docstring)."""

    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis, or redis.asyncio.cluster.RedisCluster with cluster
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        entry_ttl_seconds: int = 600,
        offloading: StorageOffloadingConfig | None = None,
        on_error: OnError | None = None,
        cluster: bool = False,
        failover_wait_s: float = 15.0,
        address: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.cluster = cluster
        self._open, self._close = ("{", "}") if cluster else ("", "")
        self.ttl_s = int(entry_ttl_seconds)
        self.offloading = offloading or StorageOffloadingConfig()
        self.address = address or redis_address(client)
        self.on_error = on_error
        #: Called when an outage that looked like a lost master ended inside the window.
        self.on_recovered: Callable[[], None] | None = None
        self.failover_wait_s = failover_wait_s if cluster else 0.0
        self._clock = clock
        self._failing_since: float | None = None  # first failure of a cluster outage (its clock)
        self._node_lost = False  # the current outage looked like a lost master, not a slot move
        self.transient_errors = 0  # cluster failures retried or ridden out (this process)
        self.expired = 0  # stale backend-set members pruned (this process)
        self._upsert_script = client.register_script(_UPSERT_LUA)
        self._remove_script = client.register_script(_REMOVE_LUA)
        end = self._close.encode()
        self._lookups = LookupBatcher(
            client, hot_key=(f"{key_prefix}{self._open}".encode(), end),
            warm_key=(f"{key_prefix}warm:{self._open}".encode(), end),
            warm=self.offloading.enabled, on_error=self._lookup_failed,
            on_success=self._succeeded, errors=REDIS_ERRORS, cluster=cluster)

    # --- keys ------------------------------------------------------------------------------

    def hot_key(self, prefix_hash: str) -> str:
        return f"{self.key_prefix}{self._open}{prefix_hash}{self._close}"

    def warm_key(self, prefix_hash: str) -> str:
        return f"{self.key_prefix}warm:{self._open}{prefix_hash}{self._close}"

    def backend_key(self, backend: str) -> str:
        return f"{self.key_prefix}backend:{backend}"

    def _classify(self, key: str) -> tuple[str, str] | None:
        """('hot'|'warm', prefix_hash) or ('backend', name) for our keys, None for others."""
        rest = key[len(self.key_prefix):]
        kind = "hot"
        if rest.startswith("warm:"):
            kind, rest = "warm", rest[5:]
        elif rest.startswith("backend:"):
            return "backend", rest[8:]
        if self.cluster:
            if not (rest.startswith("{") and rest.endswith("}")):
                return None
            rest = rest[1:-1]
        return (kind, rest) if is_prefix_hash(rest) else None

    # --- the lookups' switches and figures ----------------------------------------------------

    @property
    def paused(self) -> bool:
        """While True no lookup round trip is sent (the wrapper's fallback is active)."""
        return self._lookups.paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._lookups.paused = value

    @property
    def lookup_round_trips(self) -> int:
        return self._lookups.round_trips

    async def ping_error(self) -> BaseException | None:
        """None when Redis answers a PING (every master of a cluster), else what it raised."""
        try:
            await self.client.ping()
        except REDIS_ERRORS as exc:
            return exc
        return None

    async def ping(self) -> bool:
        return await self.ping_error() is None

    def _report(self, exc: BaseException, op: str) -> None:
        if self.on_error is not None:
            self.on_error(exc, op)

    # --- the cluster's failover window --------------------------------------------------------

    def _ride_out(self, exc: BaseException) -> bool:
        """True when `exc` is a cluster's transient failure inside the failover window (counted,
        the first one logged); False when the caller must treat it as a failure."""
        if self.failover_wait_s <= 0 or not isinstance(exc, _CLUSTER_TRANSIENT):
            return False
        now = self._clock()
        self._node_lost = self._node_lost or isinstance(exc, _NODE_LOST)
        if self._failing_since is None:
            self._failing_since = now
            log.warning("kv_index_redis_cluster_retrying", address=self.address,
                        failover_wait_s=self.failover_wait_s, **error_fields(exc))
        self.transient_errors += 1
        return now - self._failing_since < self.failover_wait_s

    def _succeeded(self) -> None:
        if self._failing_since is not None:
            log.info("kv_index_redis_cluster_recovered", address=self.address,
                     outage_s=round(self._clock() - self._failing_since, 3),
                     transient_errors=self.transient_errors)
            self._failing_since = None
            node_lost, self._node_lost = self._node_lost, False
            if node_lost and self.on_recovered is not None:
                # A master that failed over may have lost writes it acknowledged but had not
                # replicated yet (Redis Cluster replicates asynchronously): the wrapper tells the
                # consumers, which resync.
                self.on_recovered()

    def _lookup_failed(self, exc: BaseException) -> None:
        if not self._ride_out(exc):
            self._report(exc, "query")

    async def _retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op` (idempotent); on a cluster, again after a transient failure, with backoff,
        for up to the failover window from this call's first failure (another call's success on
        a healthy node meanwhile does not extend it)."""
        backoff = Backoff(0.05, 1.0, jitter=0.2)
        deadline: float | None = None
        while True:
            try:
                result = await op()
            except REDIS_ERRORS as exc:
                if not self._ride_out(exc):
                    raise
                now = self._clock()
                deadline = now + self.failover_wait_s if deadline is None else deadline
                if now >= deadline:
                    raise
                await asyncio.sleep(min(backoff.next_delay(), deadline - now))
                continue
            self._succeeded()
            return result

    # --- writes ------------------------------------------------------------------------------

    def _queue(self, pipe: Any, ph: str, backend: str, outcome: Outcome, *, zsets: bool = True,
               bset: bool = True) -> None:
        """The commands of one outcome: on one server all of them in one transaction; on a
        cluster the prefix's part (`bset=False`, one slot) and the backend set's part
        (`zsets=False`) go separately."""
        hot, warm, bkey = self.hot_key(ph), self.warm_key(ph), self.backend_key(backend)
        if isinstance(outcome, Upsert):
            dst, other = (hot, warm) if outcome.tier is Tier.GPU_HOT else (warm, hot)
            if zsets:
                pipe.zadd(dst, {backend: outcome.token_count})
                pipe.zrem(other, backend)
            if bset:
                pipe.sadd(bkey, ph)
            if zsets:
                pipe.expire(dst, self.ttl_s)
            if bset:
                pipe.expire(bkey, self.ttl_s)
        elif outcome is REMOVE:
            if zsets:
                pipe.zrem(hot, backend)
                pipe.zrem(warm, backend)
            if bset:
                pipe.srem(bkey, ph)

    async def _write(self, ph: str, backend: str, outcome: Outcome) -> None:
        """One outcome: one transaction on one server; on a cluster the prefix's step (one
        script on its slot: atomic like MULTI) with the backend set's step before (upsert) or
        after (removal) it."""
        if outcome is KEEP:
            return
        if not self.cluster:
            async with self.client.pipeline(transaction=True) as pipe:
                self._queue(pipe, ph, backend, outcome)
                await pipe.execute()
            return
        if isinstance(outcome, Upsert):
            await self._write_set(ph, backend, outcome)
        await self._write_zsets(ph, backend, outcome)
        if outcome is REMOVE:
            await self._write_set(ph, backend, outcome)

    async def _write_zsets(self, ph: str, backend: str, outcome: Outcome) -> None:
        # A script, not a MULTI pipeline: redis-py 8.1's async cluster pipeline runs each
        # command of a transaction through a thread and a new event loop (about 1.3 ms a write
        # here, against 0.13 ms for one command); a script is one atomic command on the slot.
        hot, warm = self.hot_key(ph), self.warm_key(ph)
        if isinstance(outcome, Upsert):
            dst, other = (hot, warm) if outcome.tier is Tier.GPU_HOT else (warm, hot)
            await self._upsert_script(keys=[dst, other], args=[backend, outcome.token_count,
                                                              self.ttl_s])
        elif outcome is REMOVE:
            await self._remove_script(keys=[hot, warm], args=[backend])

    async def _write_set(self, ph: str, backend: str, outcome: Outcome) -> None:
        async with self.client.pipeline(transaction=False) as pipe:  # one key: one connection
            self._queue(pipe, ph, backend, outcome, zsets=False)
            await pipe.execute()

    async def apply(self, event: Record) -> None:
        """Write one record (one transaction on one server). Raises the Redis error."""
        await self._retrying(lambda: self._apply(event))

    async def _apply(self, event: Record) -> None:
        if event.event is RecordEvent.CACHE_CLEARED:
            await self._clear_backend(event.backend)
            return
        ph = event.prefix_hash
        assert ph is not None
        off = self.offloading
        count = event.token_count or 0  # None only for evicted, whose rule does not read it
        needs_current = (
            (event.event is RecordEvent.CACHE_EVICTED and off.enabled
             and off.treat_eviction_as_offload)
            or (event.event is RecordEvent.CACHE_OFFLOADED and off.enabled and count == 0)
        )
        if not needs_current:
            await self._write(ph, event.backend, transition(event.event, count, None, off))
            return
        await self._apply_watched(event, ph, count)

    async def copy_in(self, entries: Iterable[Entry]) -> None:
        """Upsert `entries` with a fresh TTL, in pipelines of a few hundred (transactions on one
        server; on a cluster, whose entries span slots, plain pipelines of idempotent steps).
        Raises."""
        snapshot = list(entries)
        for i in range(0, len(snapshot), _BATCH):
            chunk = snapshot[i:i + _BATCH]

            async def send(chunk: list[Entry] = chunk) -> None:
                async with self.client.pipeline(transaction=not self.cluster) as pipe:
                    for ph, backend, tier, tokens, _age in chunk:
                        self._queue(pipe, ph, backend, Upsert(tier, tokens))
                    await pipe.execute()

            await self._retrying(send)

    @staticmethod
    def _current(hot_score: Any, warm_score: Any) -> tuple[Tier, int] | None:
        if hot_score is not None:
            return (Tier.GPU_HOT, int(hot_score))
        if warm_score is not None:
            return (Tier.STORAGE_WARM, int(warm_score))
        return None

    async def _apply_watched(self, event: Record, ph: str, count: int) -> None:
        """A transition that depends on the current entry: read it under WATCH, write in MULTI.
        On a cluster: read, then `_write` (not under WATCH, which redis-py's cluster pipeline
        serves through a thread per command): the member of one backend is written by that
        backend's one writer (`writer_lease`), or by routers applying the same stream."""
        off = self.offloading
        hot, warm = self.hot_key(ph), self.warm_key(ph)
        if self.cluster:
            async with self.client.pipeline(transaction=False) as read:  # one slot: one node
                read.zscore(hot, event.backend)
                read.zscore(warm, event.backend)
                scores = await read.execute()
            current = self._current(*scores)
            await self._write(ph, event.backend, transition(event.event, count, current, off))
            return
        pipe: Any
        async with self.client.pipeline(transaction=True) as pipe:
            for _ in range(_WATCH_RETRIES):
                try:
                    await pipe.watch(hot, warm)
                    current = self._current(await pipe.zscore(hot, event.backend),
                                            await pipe.zscore(warm, event.backend))
                    outcome = transition(event.event, count, current, off)
                    if outcome is KEEP:
                        await pipe.reset()
                        return
                    pipe.multi()
                    self._queue(pipe, ph, event.backend, outcome)
                    await pipe.execute()
                    return
                except WatchError:
                    continue  # another router wrote this prefix meanwhile: read it again
        log.warning("kv_index_watch_contention", backend=event.backend, event=event.event.value)

    async def _clear_backend(self, backend: str) -> None:
        if self.cluster:
            await self._clear_backend_cluster(backend)
            return
        bset = self.backend_key(backend)
        pipe: Any
        async with self.client.pipeline(transaction=True) as pipe:
            for _ in range(_WATCH_RETRIES):
                try:
                    await pipe.watch(bset)
                    members = [as_str(m) for m in await pipe.smembers(bset)]
                    pipe.multi()
                    for ph in members:
                        pipe.zrem(self.hot_key(ph), backend)
                        pipe.zrem(self.warm_key(ph), backend)
                    pipe.delete(bset)
                    await pipe.execute()
                    return
                except WatchError:
                    continue
        log.warning("kv_index_watch_contention", backend=backend, event="cache_cleared")

    async def _clear_backend_cluster(self, backend: str) -> None:
        """The backend's holders go from every prefix its set lists (slots apart: plain
        pipelines), then exactly those members from the set: one added meanwhile stays."""
        bset = self.backend_key(backend)
        members = [as_str(m) for m in await self.client.smembers(bset)]
        for i in range(0, len(members), _BATCH):
            async with self.client.pipeline(transaction=False) as pipe:
                for ph in members[i:i + _BATCH]:
                    pipe.zrem(self.hot_key(ph), backend)
                    pipe.zrem(self.warm_key(ph), backend)
                await pipe.execute()
            await self.client.srem(bset, *members[i:i + _BATCH])

    # --- reads -------------------------------------------------------------------------------

    async def query(self, prefix_hash: str) -> list[Holder]:
        if not is_prefix_hash(prefix_hash):
            return []  # never build a key from something that is not a prefix hash
        holders = await self.lookup(prefix_hash)
        if holders is None:
            raise IndexUnavailableError("Redis lookup failed")
        return holders

    def lookup(self, prefix_hash: str) -> asyncio.Future[list[Holder] | None]:
        """The holders of `prefix_hash` (a well-formed one) from the next lookup round trip;
        None when it failed or was not sent (`paused`)."""
        return self._lookups.lookup(prefix_hash)

    def _scan(self, pattern_suffix: str = "*") -> AsyncIterator[list[str]]:
        """Keys under the key prefix in batches, streamed (SCAN tolerates deletes meanwhile; on
        a cluster redis-py scans every master)."""
        match = _glob_escape(self.key_prefix) + pattern_suffix
        return _batches(self.client.scan_iter(match=match, count=1000))

    async def stats(self) -> IndexStats:
        """Counts come from a SCAN of the key prefix: O(entries), meant for the admin API.
        `queries` and `hits` are the caller's to count (0 here). Raises the Redis error."""
        per_backend: dict[str, list[int]] = {}
        prefixes: set[str] = set()
        entries = 0
        async for batch in self._scan():
            zsets = [(k, c) for k in batch if (c := self._classify(k)) and c[0] != "backend"]
            if not zsets:
                continue
            async with self.client.pipeline(transaction=False) as pipe:
                for k, _ in zsets:
                    pipe.zrange(k, 0, -1)
                results = await pipe.execute()
            for (_, (kind, ph)), members in zip(zsets, results, strict=True):
                if not members:
                    continue
                prefixes.add(ph)
                entries += len(members)
                for m in members:
                    counts = per_backend.setdefault(as_str(m), [0, 0])
                    counts[0 if kind == "hot" else 1] += 1
        return IndexStats(
            kind="redis", entries=entries, prefixes=len(prefixes),
            per_backend={b: BackendEntries(gpu_hot=c[0], storage_warm=c[1])
                         for b, c in per_backend.items()},
            expired=self.expired,
        )

    async def clear(self) -> ClearResult:
        """Delete every key under the key prefix, which other routers sharing this Redis use too:
        they lose their index as well (it refills from the event streams). The writer leases
        (`<key_prefix>lease:<backend>`, router.lease) stay: they are not index, and deleting
        them would let a standby take a backend over from a live writer. Raises."""
        before = (await self.stats()).entries
        cleared = 0
        leases = self.key_prefix + LEASE_KEYS
        async for found in self._scan():
            if not (batch := [k for k in found if not k.startswith(leases)]):
                continue
            zsets = [k for k in batch if (c := self._classify(k)) and c[0] != "backend"]
            # One server: one transaction per batch; a cluster's keys span slots: plain
            # pipelines, one DEL per key (redis-py's cluster `unlink` is a client-side fan-out
            # that a pipeline does not queue).
            async with self.client.pipeline(transaction=not self.cluster) as pipe:
                for k in zsets:
                    pipe.zcard(k)
                if self.cluster:
                    for k in batch:
                        pipe.delete(k)
                else:
                    pipe.unlink(*batch)
                results = await pipe.execute()
            cleared += sum(int(n) for n in results[:len(zsets)])
        log.info("kv_index_cleared", backend="redis", entries=cleared, key_prefix=self.key_prefix)
        return ClearResult(entries_before_clear=before, cleared_entries=cleared)

    async def cleanup_expired(self) -> int:
        """Prune backend-set members whose prefix ZSETs no longer hold that backend (expired by
        TTL, or left by a cluster write cut between its two steps). A create racing the prune
        can lose its set membership: the entry then survives a `cache_cleared` until its TTL;
        rare and bounded, so no WATCH here."""
        pruned = 0
        try:
            async for batch in self._scan("backend:*"):
                for key in batch:
                    c = self._classify(key)
                    if c is None or c[0] != "backend":
                        continue
                    backend = c[1]
                    async for chunk in self._sscan_chunks(key):
                        async with self.client.pipeline(transaction=False) as pipe:
                            for ph in chunk:
                                pipe.zscore(self.hot_key(ph), backend)
                                pipe.zscore(self.warm_key(ph), backend)
                            scores = await pipe.execute()
                        stale = [ph for i, ph in enumerate(chunk)
                                 if scores[2 * i] is None and scores[2 * i + 1] is None]
                        if stale:
                            await self.client.srem(key, *stale)
                            pruned += len(stale)
        except REDIS_ERRORS as exc:
            if self.on_error is None:
                raise
            self.on_error(exc, "cleanup")  # what was pruned before the failure is not counted
            return pruned
        self.expired += pruned
        return pruned

    def _sscan_chunks(self, key: str) -> AsyncIterator[list[str]]:
        return _batches(self.client.sscan_iter(key, count=_BATCH))

    async def close(self) -> None:
        await self._lookups.drain()  # answer the queries already waiting (bounded by timeouts)
        await self.client.aclose()
