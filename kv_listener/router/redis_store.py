"""`RedisOnlyKvIndex`: the KV index in Redis sorted sets, shared by every router using the same
Redis. Redis only: a failure is raised (writes, stats, clear) or reported (batched lookups); the
in-memory fallback around it is `redis_index.RedisKvIndex`'s.

Owns: the Redis key layout (SPEC §8), its atomic writes, and the batched lookups.

Layout (the prefix `cr:kvidx:` is `kv_cache_index.key_prefix`):
- `cr:kvidx:<prefix_hash>`          ZSET backend -> token_count of GPU-hot holders;
- `cr:kvidx:warm:<prefix_hash>`     ZSET backend -> token_count of storage-warm holders;
- `cr:kvidx:backend:<backend>`      SET of the prefix hashes of that backend (for cache_cleared).
Every write is one MULTI/EXEC pipeline that also sets `EXPIRE entry_ttl_seconds` on the keys it
adds to. Reads are `ZREVRANGEBYSCORE <key> +inf -inf WITHSCORES` on both ZSETs (on the GPU one
only when `storage_offloading` is off: such a router never writes a warm holder and its in-memory
twin never reports one, so it does not read them either).

Reads are batched the way a pipelining connection pool batches ("natural batching"): a `lookup()`
that finds no lookup in flight goes out at once (in a task started for it, so lookups of the same
event-loop tick share its round trip); lookups that arrive while a lookup round trip is in flight
wait for it and then go out together as one pipeline (`transaction=False`, at most
`LOOKUP_BATCH` prefixes; a larger backlog takes several). Lookups of one prefix in a window share
one round trip, and each caller gets its own list. A cancelled caller only drops its own answer.
A failed round trip is one Redis failure (one `on_error` call), and every caller of that batch,
and of the batches waiting behind it while `paused` (the wrapper's fallback is active), gets
None; a command error of one prefix (a foreign key of the wrong type) fails only that prefix's
callers. The raw replies are read in either protocol (redis-py 8 speaks RESP3 by default, older
versions RESP2).

Differences from the in-memory index, by design of the layout: the TTL is per prefix key, so a
write for any backend refreshes it for every holder of that prefix (the listener's explicit
`cache_evicted` is what removes a holder; the TTL only bounds what a lost event leaves behind);
`max_entries` does not apply (Redis' own memory policy does). Transitions that need the current
entry (`cache_evicted` as offload, `cache_offloaded` without a token_count) read it under
`WATCH` and retry when another router wrote the entry meanwhile. `cleanup_expired` prunes backend
sets of prefix hashes whose ZSETs have expired.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError, WatchError

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
    sort_holders,
    transition,
)

log = structlog.get_logger(__name__)

#: What "Redis is unreachable" looks like (redis-py wraps most, TimeoutError is an OSError).
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, OSError)
_WATCH_RETRIES = 8
_BATCH = 256
#: Most prefixes one lookup pipeline carries (2 commands each, 1 without storage offloading):
#: enough for a burst of concurrent requests, small enough that a reply stays well inside one
#: command timeout. A module constant: SPEC §8 names no key for it.
LOOKUP_BATCH = 256

_ZREV = b"ZREVRANGEBYSCORE"
_ALL_WITH_SCORES = (b"+inf", b"-inf", b"WITHSCORES")

#: One prefix's waiting callers: each has its own future, so a cancelled caller cancels only its
#: own. A result of None means "Redis failed" (or was not asked): the wrapper reads its fallback.
_Waiters = list[asyncio.Future[list[Holder] | None]]


class IndexUnavailableError(Exception):
    """Redis is unreachable and the in-memory fallback is disabled."""


def _str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _score_rows(rows: Any) -> Any:
    """`(member, score)` pairs of a raw `... WITHSCORES` reply: RESP3 sends them nested (scores
    as doubles), RESP2 flat (scores as strings)."""
    if rows and not isinstance(rows[0], list | tuple):
        return zip(rows[::2], map(float, rows[1::2]), strict=True)
    return rows


def _holders(hot_rows: Any, warm_rows: Any) -> list[Holder]:
    """Holders from the raw replies of the GPU and the warm ZSET."""
    found: dict[str, Holder] = {}
    for member, score in _score_rows(hot_rows):
        name = _str(member)
        found[name] = Holder(name, int(score), Tier.GPU_HOT)
    for member, score in _score_rows(warm_rows):
        name = _str(member)
        # Both ZSETs can name a backend only for a moment between two routers' writes; GPU
        # wins, as it would after the second write.
        if name not in found:
            found[name] = Holder(name, int(score), Tier.STORAGE_WARM)
    return sort_holders(list(found.values()))


def _cancel_all(batch: dict[str, _Waiters]) -> None:
    for waiters in batch.values():
        for fut in waiters:
            fut.cancel()


def redis_address(client: Redis) -> str:
    """`host:port` (or `unix:<path>`) the client connects to, for logs: never the URL, which
    may carry the password."""
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("path"):
        return f"unix:{kwargs['path']}"
    host = str(kwargs.get("host", "localhost"))
    port = kwargs.get("port", 6379)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _batches(members: AsyncIterator[Any]) -> AsyncIterator[list[str]]:
    """A SCAN-family iterator's members as strings, `_BATCH` at a time."""
    batch: list[str] = []
    async for member in members:
        batch.append(_str(member))
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
    """The index in Redis. `on_error(exc, op)` hears of each failed lookup round trip (and of
    a failed cleanup round) instead of the callers; without it, `query` raises
    `IndexUnavailableError` and `cleanup_expired` the Redis error."""

    def __init__(
        self,
        client: Redis,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        entry_ttl_seconds: int = 600,
        offloading: StorageOffloadingConfig | None = None,
        on_error: OnError | None = None,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self._hot_key_b = key_prefix.encode()  # + prefix hash: `hot_key`, for the raw lookups
        self._warm_key_b = f"{key_prefix}warm:".encode()
        self.ttl_s = int(entry_ttl_seconds)
        self.offloading = offloading or StorageOffloadingConfig()
        self.address = redis_address(client)
        self.on_error = on_error
        #: While True no lookup round trip is sent: waiting callers get None at once (the
        #: wrapper's fallback serves them; a lone lookup would not go to Redis either).
        self.paused = False
        self.expired = 0  # stale backend-set members pruned (this process)
        # Prefixes waiting for the next lookup round trip (insertion order = arrival order), and
        # the task sending them; it runs while there is anything to send, one round trip at a time.
        self._waiting: dict[str, _Waiters] = {}
        self._lookup_task: asyncio.Task[None] | None = None
        self.lookup_round_trips = 0  # lookup pipelines sent to Redis (this process)

    # --- keys ------------------------------------------------------------------------------

    def hot_key(self, prefix_hash: str) -> str:
        return f"{self.key_prefix}{prefix_hash}"

    def warm_key(self, prefix_hash: str) -> str:
        return f"{self.key_prefix}warm:{prefix_hash}"

    def backend_key(self, backend: str) -> str:
        return f"{self.key_prefix}backend:{backend}"

    async def ping_error(self) -> BaseException | None:
        """None when Redis answers a PING, else what it raised."""
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

    # --- writes ------------------------------------------------------------------------------

    def _queue(self, pipe: Any, ph: str, backend: str, outcome: Outcome) -> None:
        hot, warm, bset = self.hot_key(ph), self.warm_key(ph), self.backend_key(backend)
        if isinstance(outcome, Upsert):
            dst, other = (hot, warm) if outcome.tier is Tier.GPU_HOT else (warm, hot)
            pipe.zadd(dst, {backend: outcome.token_count})
            pipe.zrem(other, backend)
            pipe.sadd(bset, ph)
            pipe.expire(dst, self.ttl_s)
            pipe.expire(bset, self.ttl_s)
        elif outcome is REMOVE:
            pipe.zrem(hot, backend)
            pipe.zrem(warm, backend)
            pipe.srem(bset, ph)

    async def apply(self, event: Record) -> None:
        """Write one record in one transaction. Raises the Redis error."""
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
            outcome = transition(event.event, count, None, off)
            async with self.client.pipeline(transaction=True) as pipe:
                self._queue(pipe, ph, event.backend, outcome)
                await pipe.execute()
            return
        await self._apply_watched(event, ph, count)

    async def copy_in(self, entries: Iterable[Entry]) -> None:
        """Upsert `entries` with a fresh TTL, in transactions of a few hundred. Raises."""
        snapshot = list(entries)
        for i in range(0, len(snapshot), _BATCH):
            async with self.client.pipeline(transaction=True) as pipe:
                for ph, backend, tier, tokens, _age in snapshot[i:i + _BATCH]:
                    self._queue(pipe, ph, backend, Upsert(tier, tokens))
                await pipe.execute()

    async def _apply_watched(self, event: Record, ph: str, count: int) -> None:
        """A transition that depends on the current entry: read it under WATCH, write in MULTI."""
        off = self.offloading
        hot, warm = self.hot_key(ph), self.warm_key(ph)
        pipe: Any
        async with self.client.pipeline(transaction=True) as pipe:
            for _ in range(_WATCH_RETRIES):
                try:
                    await pipe.watch(hot, warm)
                    hot_score = await pipe.zscore(hot, event.backend)
                    warm_score = await pipe.zscore(warm, event.backend)
                    current: tuple[Tier, int] | None = None
                    if hot_score is not None:
                        current = (Tier.GPU_HOT, int(hot_score))
                    elif warm_score is not None:
                        current = (Tier.STORAGE_WARM, int(warm_score))
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
        bset = self.backend_key(backend)
        pipe: Any
        async with self.client.pipeline(transaction=True) as pipe:
            for _ in range(_WATCH_RETRIES):
                try:
                    await pipe.watch(bset)
                    members = [_str(m) for m in await pipe.smembers(bset)]
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
        fut: asyncio.Future[list[Holder] | None] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.get(prefix_hash)
        if waiters is None:
            self._waiting[prefix_hash] = [fut]
        else:
            waiters.append(fut)
        if self._lookup_task is None:
            self._lookup_task = asyncio.get_running_loop().create_task(self._send_lookups())
        return fut

    async def _send_lookups(self) -> None:
        """Send what is waiting, one round trip at a time, until nothing is. Its own task, so a
        cancelled caller never cancels a round trip other callers wait for."""
        try:
            while self._waiting:
                if len(self._waiting) <= LOOKUP_BATCH:
                    batch, self._waiting = self._waiting, {}
                else:
                    batch = {ph: self._waiting.pop(ph)
                             for ph in list(itertools.islice(self._waiting, LOOKUP_BATCH))}
                await self._lookup_batch(batch)
        except BaseException:  # cancelled (loop shutdown): nobody may wait forever
            _cancel_all(self._waiting)
            self._waiting = {}
            raise
        finally:
            self._lookup_task = None

    async def _lookup_batch(self, batch: dict[str, _Waiters]) -> None:
        # Prefixes whose every caller was cancelled meanwhile are not looked up.
        prefixes = [ph for ph, waiters in batch.items() if not all(f.done() for f in waiters)]
        if not prefixes:
            return
        warm = self.offloading.enabled
        results: list[Any] | None = None
        try:
            # The round trip before this one failed: its callers and these read the fallback
            # (a single query does not go to Redis while the fallback is active either).
            if not self.paused:
                async with self.client.pipeline(transaction=False) as pipe:
                    # Raw commands, pre-encoded: no response callback re-shapes the rows
                    # (redis-py's re-encodes every RESP3 score to bytes and parses it again), and
                    # no argument is encoded per call. `_holders` reads either protocol's rows.
                    hot, warm_prefix = self._hot_key_b, self._warm_key_b
                    for ph in prefixes:
                        key = ph.encode()
                        pipe.execute_command(_ZREV, hot + key, *_ALL_WITH_SCORES)
                        if warm:
                            pipe.execute_command(_ZREV, warm_prefix + key, *_ALL_WITH_SCORES)
                    self.lookup_round_trips += 1
                    results = await pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            self._report(exc, "query")
        except asyncio.CancelledError:
            _cancel_all(batch)
            raise
        except Exception as exc:  # a bug: every caller raises it, as one query would
            for waiters in batch.values():
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(exc)
            return
        step = 2 if warm else 1
        for i, ph in enumerate(prefixes):
            holders = None
            if results is not None:
                hot_rows = results[i * step]
                warm_rows = results[i * step + 1] if warm else ()
                failed = next((r for r in (hot_rows, warm_rows) if isinstance(r, Exception)), None)
                if failed is not None:
                    self._report(failed, "query")  # only this prefix's callers miss Redis
                else:
                    holders = _holders(hot_rows, warm_rows)
            first = True
            for fut in batch[ph]:
                if not fut.done():
                    # Each caller owns its list (callers may sort or extend theirs).
                    fut.set_result(holders if first or holders is None else list(holders))
                    first = False

    def _classify(self, key: str) -> tuple[str, str] | None:
        """('hot'|'warm', prefix_hash) or ('backend', name) for our keys, None for others."""
        rest = key[len(self.key_prefix):]
        if is_prefix_hash(rest):
            return "hot", rest
        if rest.startswith("warm:") and is_prefix_hash(rest[5:]):
            return "warm", rest[5:]
        if rest.startswith("backend:"):
            return "backend", rest[8:]
        return None

    def _scan(self, pattern_suffix: str = "*") -> AsyncIterator[list[str]]:
        """Keys under the key prefix in batches, streamed (SCAN tolerates deletes meanwhile)."""
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
                    counts = per_backend.setdefault(_str(m), [0, 0])
                    counts[0 if kind == "hot" else 1] += 1
        return IndexStats(
            kind="redis", entries=entries, prefixes=len(prefixes),
            per_backend={b: BackendEntries(gpu_hot=c[0], storage_warm=c[1])
                         for b, c in per_backend.items()},
            expired=self.expired,
        )

    async def clear(self) -> ClearResult:
        """Delete every key under the key prefix, which other routers sharing this Redis use too:
        they lose their index as well (it refills from the event streams). Raises."""
        before = (await self.stats()).entries
        cleared = 0
        async for batch in self._scan():
            zsets = [k for k in batch if (c := self._classify(k)) and c[0] != "backend"]
            async with self.client.pipeline(transaction=True) as pipe:
                for k in zsets:
                    pipe.zcard(k)
                pipe.unlink(*batch)
                results = await pipe.execute()
            cleared += sum(int(n) for n in results[:-1])
        log.info("kv_index_cleared", backend="redis", entries=cleared, key_prefix=self.key_prefix)
        return ClearResult(entries_before_clear=before, cleared_entries=cleared)

    async def cleanup_expired(self) -> int:
        """Prune backend-set members whose prefix ZSETs no longer hold that backend (expired by
        TTL). A create racing the prune can lose its set membership: the entry then survives a
        `cache_cleared` until its TTL; rare and bounded, so no WATCH here."""
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
        if self._lookup_task is not None:
            await self._lookup_task  # answer the queries already waiting (bounded by timeouts)
        await self.client.aclose()

