"""`RedisKvIndex`: the KV index in Redis sorted sets, shared by every router using the same Redis.

Owns: the Redis key layout (SPEC §8), its atomic writes, and the in-memory fallback used while
Redis is unreachable.

Layout (the prefix `cr:kvidx:` is `kv_cache_index.key_prefix`):
- `cr:kvidx:<prefix_hash>`          ZSET backend -> token_count of GPU-hot holders;
- `cr:kvidx:warm:<prefix_hash>`     ZSET backend -> token_count of storage-warm holders;
- `cr:kvidx:backend:<backend>`      SET of the prefix hashes of that backend (for cache_cleared).
Every write is one MULTI/EXEC pipeline that also sets `EXPIRE entry_ttl_seconds` on the keys it
adds to. Reads are `ZREVRANGEBYSCORE <key> +inf -inf WITHSCORES` on both ZSETs (on the GPU one
only when `storage_offloading` is off: such a router never writes a warm holder and its in-memory
twin never reports one, so it does not read them either).

Reads are batched the way a pipelining connection pool batches ("natural batching"): a `query()`
that finds no lookup in flight goes out at once (in a task started for it, so queries of the same
event-loop tick share its round trip); queries that arrive while a lookup round trip is in flight
wait for it and then go out together as one pipeline (`transaction=False`, at most
`LOOKUP_BATCH` prefixes; a larger backlog takes several). Queries of one prefix in a window share
one lookup, and each caller gets its own list. A cancelled caller only drops its own answer. A
failed round trip is one Redis failure (one `_failed`, one `redis_errors`), and every caller of
that batch, and of the batches waiting behind it once the fallback is active, reads the fallback
exactly as a lone failed query does; a command error of one prefix (a foreign key of the wrong
type) fails only that prefix's callers. The raw replies are read in either protocol (redis-py 8
speaks RESP3 by default, older versions RESP2).

Differences from the in-memory index, by design of the layout: the TTL is per prefix key, so a
write for any backend refreshes it for every holder of that prefix (the listener's explicit
`cache_evicted` is what removes a holder; the TTL only bounds what a lost event leaves behind);
`max_entries` does not apply (Redis' own memory policy does). Transitions that need the current
entry (`cache_evicted` as offload, `cache_offloaded` without a token_count) read it under
`WATCH` and retry when another router wrote the entry meanwhile. `cleanup_expired` prunes backend
sets of prefix hashes whose ZSETs have expired.

Fallback (the seed's "automatic fallback"): the first Redis error (connection refused, timeout)
switches the index to an in-memory `InMemoryKvIndex` (`max_entries`, same TTL), sets
`continuum_cache_fallback_active` to 1, and starts a probe that PINGs Redis every
`probe_interval_s` (30 s by default, as in the seed). When Redis answers again the entries written
during the fallback are copied into Redis (upserts with a fresh TTL; writes wait until the copy
is done so a newer event is never overwritten by an older copy), the fallback is emptied, the
gauge returns to 0, and state listeners are told (`add_state_listener`). What the copy cannot
repair: removals that happened during the outage of entries Redis held from before it (Redis kept
them); such entries live until their TTL unless the consumers resync their streams (a resync
starts with `cache_cleared`, which the consumer manager can trigger from the state listener).
With `fallback_to_memory: false` writes raise `IndexUnavailableError` (the consumer counts a drop)
and queries return no holder (the request falls back to the default strategy).

Logs name the Redis by `address` (`host:port` or `unix:<path>`, never the URL: it may hold the
password) and the failure by `error` (class), `errno` and `strerror`: `kv_index_redis_unavailable`
(the switch to the fallback), `kv_index_redis_still_unavailable` (failed probes, at most one line
per `log_repeat_interval_s`, 5 minutes, with `probes_failed` and `outage_s`),
`kv_index_redis_recovered` (`outage_s`, `copied_entries`), `kv_index_redis_recovery_failed`;
without the fallback `kv_index_redis_error` (the first failure, a changed one, then at most one
line per 5 minutes with `suppressed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import structlog
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, WatchError

from kv_listener.config import read_secret
from kv_listener.core.model import Tier
from kv_listener.router.config import (
    DEFAULT_KEY_PREFIX,
    IndexBackend,
    KvCacheIndexConfig,
    RedisConfig,
    RouterConfig,
    StorageOffloadingConfig,
)
from kv_listener.router.index import (
    KEEP,
    PREFIX_HASH_RE,
    REMOVE,
    BackendEntries,
    ClearResult,
    Holder,
    IndexEvent,
    IndexStats,
    InMemoryKvIndex,
    KvIndex,
    Outcome,
    PrefixEventType,
    Upsert,
    _Counters,
    sort_holders,
    transition,
)
from kv_listener.router.metrics import RouterMetrics
from kv_listener.router.oplog import LOG_REPEAT_INTERVAL_S, LogThrottle, error_fields

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
#: own. A result of None means "Redis failed": the caller reads the fallback (`_query`).
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


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisKvIndex(KvIndex):
    def __init__(
        self,
        client: Redis,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        entry_ttl_seconds: int = 600,
        offloading: StorageOffloadingConfig | None = None,
        fallback_to_memory: bool = True,
        max_entries: int = 100000,
        metrics: RouterMetrics | None = None,
        probe_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        log_repeat_interval_s: float = LOG_REPEAT_INTERVAL_S,
    ) -> None:
        self._client = client
        self.key_prefix = key_prefix
        self._hot_key_b = key_prefix.encode()  # + prefix hash: `hot_key`, for the raw lookups
        self._warm_key_b = f"{key_prefix}warm:".encode()
        self.ttl_s = int(entry_ttl_seconds)
        self.offloading = offloading or StorageOffloadingConfig()
        self._fallback: InMemoryKvIndex | None = (
            InMemoryKvIndex(max_entries=max_entries, entry_ttl_seconds=entry_ttl_seconds,
                            offloading=self.offloading, clock=clock)
            if fallback_to_memory else None
        )
        self._metrics = metrics
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self.address = redis_address(client)
        # Failure logs (issue 14, finding 9): where Redis is, why it failed, bounded in number.
        self._error_log = LogThrottle(log_repeat_interval_s, clock)
        self._probe_log = LogThrottle(log_repeat_interval_s, clock)
        self._down_since: float | None = None  # when the fallback took over (its clock)
        self.probes_failed = 0  # failed PINGs of the current outage (readable, like redis_errors)
        self._fallback_active = False
        self._probe_task: asyncio.Task[None] | None = None
        self._copying: asyncio.Event | None = None  # set while fallback entries go back to Redis
        self._healthy = asyncio.Event()
        self._healthy.set()
        self._listeners: list[Callable[[bool], None]] = []
        self._n = _Counters()
        self.redis_errors = 0
        # Prefixes waiting for the next lookup round trip (insertion order = arrival order), and
        # the task sending them; it runs while there is anything to send, one round trip at a time.
        self._waiting: dict[str, _Waiters] = {}
        self._lookup_task: asyncio.Task[None] | None = None
        self.lookup_round_trips = 0  # lookup pipelines sent to Redis (this process)

    @classmethod
    def from_config(
        cls,
        redis_cfg: RedisConfig,
        kv_cfg: KvCacheIndexConfig,
        *,
        metrics: RouterMetrics | None = None,
        probe_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        log_repeat_interval_s: float = LOG_REPEAT_INTERVAL_S,
    ) -> RedisKvIndex:
        """Build the client from `response_cache.redis`. Raises ConfigError (password file)."""
        url = redis_cfg.url
        if redis_cfg.tls and url.startswith("redis://"):
            url = "rediss://" + url.removeprefix("redis://")
        kwargs: dict[str, Any] = {
            "max_connections": redis_cfg.pool_size,
            # Waiting for a pooled connection is bounded like connecting.
            "timeout": redis_cfg.connect_timeout_ms / 1000,
            "socket_connect_timeout": redis_cfg.connect_timeout_ms / 1000,
            "socket_timeout": redis_cfg.command_timeout_ms / 1000,
            # One immediate retry covers a pooled connection Redis closed (restart); anything
            # more would delay the switch to the fallback by redis-py's default backoff.
            "retry": Retry(NoBackoff(), 1),
            "decode_responses": True,
        }
        if redis_cfg.use_tls and redis_cfg.ca_file is not None:
            kwargs["ssl_ca_certs"] = redis_cfg.ca_file
        if redis_cfg.username is not None:
            kwargs["username"] = redis_cfg.username
        password = read_secret(redis_cfg.password_file, redis_cfg.password_env)
        if password is not None:
            kwargs["password"] = password.decode("utf-8")
        pool = BlockingConnectionPool.from_url(url, **kwargs)
        return cls(
            Redis.from_pool(pool), key_prefix=kv_cfg.key_prefix,
            entry_ttl_seconds=kv_cfg.entry_ttl_seconds, offloading=kv_cfg.storage_offloading,
            fallback_to_memory=redis_cfg.fallback_to_memory, max_entries=kv_cfg.max_entries,
            metrics=metrics, probe_interval_s=probe_interval_s, clock=clock,
            log_repeat_interval_s=log_repeat_interval_s,
        )

    # --- keys ------------------------------------------------------------------------------

    def hot_key(self, prefix_hash: str) -> str:
        return f"{self.key_prefix}{prefix_hash}"

    def warm_key(self, prefix_hash: str) -> str:
        return f"{self.key_prefix}warm:{prefix_hash}"

    def backend_key(self, backend: str) -> str:
        return f"{self.key_prefix}backend:{backend}"

    # --- state -------------------------------------------------------------------------------

    @property
    def fallback_active(self) -> bool:
        return self._fallback_active

    def add_state_listener(self, callback: Callable[[bool], None]) -> None:
        """`callback(fallback_active)` on every switch to and from the fallback."""
        self._listeners.append(callback)

    async def wait_recovered(self) -> None:
        """Return once the index is on Redis (at once when it is)."""
        await self._healthy.wait()

    async def ping(self) -> bool:
        return await self._ping() is None

    async def _ping(self) -> BaseException | None:
        try:
            await self._client.ping()
        except REDIS_ERRORS as exc:
            return exc
        return None

    def _failed(self, exc: BaseException, op: str) -> None:
        self.redis_errors += 1
        fields = error_fields(exc)
        if self._fallback is None:
            # Every write fails while Redis is down: the first failure, a changed one, then
            # one line per log_repeat_interval_s with the failures since the last line.
            held = self._error_log.check((op, fields["error"], fields.get("errno")))
            if held is not None:
                log.warning("kv_index_redis_error", op=op, address=self.address,
                            redis_errors=self.redis_errors, suppressed=held, **fields)
            return
        if self._fallback_active:
            return
        self._fallback_active = True
        self._healthy.clear()
        self._down_since = self._clock()
        self.probes_failed = 0
        self._probe_log.reset()
        if self._metrics is not None:
            self._metrics.set_fallback_active(True)
        log.warning("kv_index_redis_unavailable", op=op, address=self.address, fallback="memory",
                    probe_interval_s=self.probe_interval_s, **fields)
        self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())
        self._notify(True)

    def _outage_s(self) -> float | None:
        return None if self._down_since is None else round(self._clock() - self._down_since, 3)

    def _notify(self, active: bool) -> None:
        for cb in self._listeners:
            try:
                cb(active)
            except Exception as exc:  # a listener's bug must not break the index
                log.warning("kv_index_state_listener_failed", error=type(exc).__name__)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)  # the seed's periodic health probe
            failure = await self._ping()
            if failure is None:
                if await self._recover():
                    return
                continue
            self.probes_failed += 1
            fields = error_fields(failure)
            # Still down: at most one line per log_repeat_interval_s (or when the error changes).
            held = self._probe_log.check((fields["error"], fields.get("errno")))
            if held is not None:
                log.warning("kv_index_redis_still_unavailable", address=self.address,
                            probes_failed=self.probes_failed, outage_s=self._outage_s(),
                            next_probe_in_s=self.probe_interval_s, suppressed=held, **fields)

    async def _recover(self) -> bool:
        fallback = self._fallback
        assert fallback is not None
        # Take the fallback's entries and switch back in one synchronous step, then hold
        # writes until the copy is in Redis, so no newer write lands before an older copy.
        snapshot = fallback.entries()
        fallback.clear_now()
        self._fallback_active = False
        copying = self._copying = asyncio.Event()
        try:
            for i in range(0, len(snapshot), _BATCH):
                async with self._client.pipeline(transaction=True) as pipe:
                    for ph, backend, tier, tokens, _age in snapshot[i:i + _BATCH]:
                        self._queue(pipe, ph, backend, Upsert(tier, tokens))
                    await pipe.execute()
        except REDIS_ERRORS as exc:
            now = self._clock()
            for ph, backend, tier, tokens, age in snapshot:  # oldest first: keeps the order
                fallback.upsert(ph, backend, tier, tokens, now - age)
            self._fallback_active = True
            log.warning("kv_index_redis_recovery_failed", address=self.address,
                        outage_s=self._outage_s(), **error_fields(exc))
            return False
        finally:
            self._copying = None
            copying.set()
        self._healthy.set()
        if self._metrics is not None:
            self._metrics.set_fallback_active(False)
        log.info("kv_index_redis_recovered", address=self.address, copied_entries=len(snapshot),
                 outage_s=self._outage_s(), probes_failed=self.probes_failed)
        self._down_since = None
        self._notify(False)
        return True

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

    async def apply(self, event: IndexEvent) -> None:
        if self._copying is not None:
            await self._copying.wait()
        if not self._fallback_active:
            try:
                await self._apply_redis(event)
                return
            except REDIS_ERRORS as exc:
                self._failed(exc, "apply")
                if self._fallback is None:
                    raise IndexUnavailableError(str(exc)) from exc
        assert self._fallback is not None
        self._fallback.apply_now(event)

    async def _apply_redis(self, event: IndexEvent) -> None:
        if event.type is PrefixEventType.CACHE_CLEARED:
            await self._clear_backend(event.backend)
            return
        ph = event.prefix_hash
        assert ph is not None
        off = self.offloading
        needs_current = (
            (event.type is PrefixEventType.CACHE_EVICTED and off.enabled
             and off.treat_eviction_as_offload)
            or (event.type is PrefixEventType.CACHE_OFFLOADED and off.enabled
                and event.token_count == 0)
        )
        if not needs_current:
            outcome = transition(event.type, event.token_count, None, off)
            async with self._client.pipeline(transaction=True) as pipe:
                self._queue(pipe, ph, event.backend, outcome)
                await pipe.execute()
            return
        await self._apply_watched(event, ph)

    async def _apply_watched(self, event: IndexEvent, ph: str) -> None:
        """A transition that depends on the current entry: read it under WATCH, write in MULTI."""
        off = self.offloading
        hot, warm = self.hot_key(ph), self.warm_key(ph)
        pipe: Any
        async with self._client.pipeline(transaction=True) as pipe:
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
                    outcome = transition(event.type, event.token_count, current, off)
                    if outcome is KEEP:
                        await pipe.reset()
                        return
                    pipe.multi()
                    self._queue(pipe, ph, event.backend, outcome)
                    await pipe.execute()
                    return
                except WatchError:
                    continue  # another router wrote this prefix meanwhile: read it again
        log.warning("kv_index_watch_contention", backend=event.backend, event=event.type.value)

    async def _clear_backend(self, backend: str) -> None:
        bset = self.backend_key(backend)
        pipe: Any
        async with self._client.pipeline(transaction=True) as pipe:
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
        self._n.queries += 1
        holders = await self._query(prefix_hash)
        if holders:
            self._n.hits += 1
        return holders

    async def _query(self, prefix_hash: str) -> list[Holder]:
        if not PREFIX_HASH_RE.match(prefix_hash):
            return []  # never build a key from something that is not a prefix hash
        if not self._fallback_active:
            holders = await self._lookup(prefix_hash)
            if holders is not None:
                return holders
            if self._fallback is None:
                return []
        assert self._fallback is not None
        return self._fallback.query_now(prefix_hash)

    def _lookup(self, prefix_hash: str) -> asyncio.Future[list[Holder] | None]:
        """The holders of `prefix_hash` from the next lookup round trip; None when it failed."""
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
            if not self._fallback_active:
                async with self._client.pipeline(transaction=False) as pipe:
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
            self._failed(exc, "query")
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
                    self._failed(failed, "query")  # only this prefix's callers miss Redis
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
        if PREFIX_HASH_RE.match(rest):
            return "hot", rest
        if rest.startswith("warm:") and PREFIX_HASH_RE.match(rest[5:]):
            return "warm", rest[5:]
        if rest.startswith("backend:"):
            return "backend", rest[8:]
        return None

    async def _scan(self, pattern_suffix: str = "*") -> AsyncIterator[list[str]]:
        """Keys under the key prefix in batches, streamed (SCAN tolerates deletes meanwhile)."""
        keys: list[str] = []
        match = _glob_escape(self.key_prefix) + pattern_suffix
        async for key in self._client.scan_iter(match=match, count=1000):
            keys.append(_str(key))
            if len(keys) >= _BATCH:
                yield keys
                keys = []
        if keys:
            yield keys

    async def _redis_stats(self) -> IndexStats:
        per_backend: dict[str, list[int]] = {}
        prefixes: set[str] = set()
        entries = 0
        async for batch in self._scan():
            zsets = [(k, c) for k in batch if (c := self._classify(k)) and c[0] != "backend"]
            if not zsets:
                continue
            async with self._client.pipeline(transaction=False) as pipe:
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
            queries=self._n.queries, hits=self._n.hits, expired=self._n.expired,
        )

    async def stats(self) -> IndexStats:
        """Counts come from a SCAN of the key prefix: O(entries), meant for the admin API."""
        if not self._fallback_active:
            try:
                return await self._redis_stats()
            except REDIS_ERRORS as exc:
                self._failed(exc, "stats")
                if self._fallback is None:
                    raise IndexUnavailableError(str(exc)) from exc
        assert self._fallback is not None
        fb = self._fallback.stats_now()
        return replace(fb, kind="redis", fallback_active=True, queries=self._n.queries,
                       hits=self._n.hits)

    async def clear(self) -> ClearResult:
        """Delete every key under the key prefix, which other routers sharing this Redis use too:
        they lose their index as well (it refills from the event streams). Also empties the
        fallback."""
        fb = self._fallback.clear_now() if self._fallback is not None else ClearResult(0, 0)
        if self._fallback_active:
            return fb
        try:
            before = (await self._redis_stats()).entries
            cleared = 0
            async for batch in self._scan():
                zsets = [k for k in batch if (c := self._classify(k)) and c[0] != "backend"]
                async with self._client.pipeline(transaction=True) as pipe:
                    for k in zsets:
                        pipe.zcard(k)
                    pipe.unlink(*batch)
                    results = await pipe.execute()
                cleared += sum(int(n) for n in results[:-1])
        except REDIS_ERRORS as exc:
            self._failed(exc, "clear")
            if self._fallback is None:
                raise IndexUnavailableError(str(exc)) from exc
            return fb
        log.info("kv_index_cleared", backend="redis", entries=cleared, key_prefix=self.key_prefix)
        return ClearResult(entries_before_clear=before + fb.entries_before_clear,
                           cleared_entries=cleared + fb.cleared_entries)

    async def cleanup_expired(self) -> int:
        """Prune backend-set members whose prefix ZSETs no longer hold that backend (expired by
        TTL). A create racing the prune can lose its set membership: the entry then survives a
        `cache_cleared` until its TTL; rare and bounded, so no WATCH here."""
        if self._fallback_active:
            assert self._fallback is not None
            return self._fallback.cleanup_now()
        pruned = 0
        try:
            async for batch in self._scan("backend:*"):
                for key in batch:
                    c = self._classify(key)
                    if c is None or c[0] != "backend":
                        continue
                    backend = c[1]
                    async for chunk in self._sscan_chunks(key):
                        async with self._client.pipeline(transaction=False) as pipe:
                            for ph in chunk:
                                pipe.zscore(self.hot_key(ph), backend)
                                pipe.zscore(self.warm_key(ph), backend)
                            scores = await pipe.execute()
                        stale = [ph for i, ph in enumerate(chunk)
                                 if scores[2 * i] is None and scores[2 * i + 1] is None]
                        if stale:
                            await self._client.srem(key, *stale)
                            pruned += len(stale)
        except REDIS_ERRORS as exc:
            self._failed(exc, "cleanup")
            return pruned
        self._n.expired += pruned
        return pruned

    async def _sscan_chunks(self, key: str) -> AsyncIterator[list[str]]:
        chunk: list[str] = []
        async for member in self._client.sscan_iter(key, count=_BATCH):
            chunk.append(_str(member))
            if len(chunk) >= _BATCH:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    async def close(self) -> None:
        if self._lookup_task is not None:
            await self._lookup_task  # answer the queries already waiting (bounded by timeouts)
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        await self._client.aclose()


def build_index(config: RouterConfig, *, metrics: RouterMetrics | None = None,
                probe_interval_s: float = 30.0) -> KvIndex:
    """The index `kv_cache_index.backend` asks for (Redis settings from `response_cache.redis`).
    Raises ConfigError when the Redis password file cannot be read."""
    kv = config.kv_cache_index
    if kv.backend is IndexBackend.REDIS:
        if config.redis is None:
            raise ValueError("kv_cache_index.backend is redis but response_cache.redis is unset")
        return RedisKvIndex.from_config(config.redis, kv, metrics=metrics,
                                        probe_interval_s=probe_interval_s)
    return InMemoryKvIndex(max_entries=kv.max_entries, entry_ttl_seconds=kv.entry_ttl_seconds,
                           offloading=kv.storage_offloading)
