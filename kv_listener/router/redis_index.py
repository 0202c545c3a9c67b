"""`RedisKvIndex`: the Redis index of SPEC §8 as the router runs it: a `RedisOnlyKvIndex`
(`redis_store`: key layout, atomic writes, batched lookups) wrapped with an in-memory fallback.

Owns: the fallback policy, the Redis connection built from `response_cache.redis`
(`from_config`), and the choice of index a router's config asks for (`build_index`).

Fallback (the seed's "automatic fallback"): the first Redis error (connection refused, timeout)
switches the index to an in-memory `InMemoryKvIndex` (`max_entries`, same TTL), sets
`continuum_cache_fallback_active` to 1, and starts a probe that PINGs Redis every
`probe_interval_s` (`response_cache.redis.probe_interval_ms`, 30 s by default, as in the seed).
When Redis answers again the entries written during the fallback are copied into Redis (upserts
with a fresh TTL; writes wait until the copy is done so a newer event is never overwritten by an
older copy), the fallback is emptied, the
gauge returns to 0, and state listeners are told (`add_state_listener`). What the copy cannot
repair: removals that happened during the outage of entries Redis held from before it (Redis kept
them); such entries live until their TTL unless the consumers resync their streams (a resync
starts with `cache_cleared`; the router does it from the state listener, `Router.
_index_state_changed`). With the writer lease nothing is copied back (`copy_on_recovery`):
the writers on the other routers kept Redis right meanwhile. On a Redis Cluster the first error
does not switch: transient failures are retried (writes) or answered without Redis (lookups) for
`failover_wait_ms`, and only then the fallback takes over; an outage ridden out inside that window
also tells the state listeners `False` ("on Redis"), since a failed-over master may have lost
writes it had acknowledged.
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
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import structlog
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff

from kv_listener.configkit import read_secret
from kv_listener.core.records import Record, is_prefix_hash
from kv_listener.router.config import (
    DEFAULT_KEY_PREFIX,
    IndexBackend,
    KvCacheIndexConfig,
    RouterConfig,
    StorageOffloadingConfig,
)
from kv_listener.router.config_redis import RedisConfig
from kv_listener.router.index import ClearResult, Holder, IndexStats, InMemoryKvIndex, KvIndex, _Counters
from kv_listener.router.metrics import RouterMetrics
from kv_listener.router.oplog import LOG_REPEAT_INTERVAL_S, LogThrottle, error_fields
from kv_listener.router.redis_pool import WaitingRedisCluster
from kv_listener.router.redis_store import (
    LOOKUP_BATCH,
    REDIS_ERRORS,
    IndexUnavailableError,
    RedisOnlyKvIndex,
    redis_address,
)

# The Redis-only index's names its users know from here.
__all__ = [
    "LOOKUP_BATCH", "REDIS_ERRORS", "IndexUnavailableError", "RedisKvIndex", "RedisOnlyKvIndex",
    "build_index", "redis_address",
]

log = structlog.get_logger(__name__)


class RedisKvIndex(KvIndex):
    """`RedisOnlyKvIndex` with the in-memory fallback (the module docstring); `fallback_to_memory`
    off: Redis failures reach the caller as `IndexUnavailableError`, and queries find nothing."""

    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis, or a RedisCluster with `cluster`
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
        cluster: bool = False,
        failover_wait_s: float = 15.0,
        address: str | None = None,
        copy_on_recovery: bool = True,
    ) -> None:
        self.redis = RedisOnlyKvIndex(client, key_prefix=key_prefix,
                                      entry_ttl_seconds=entry_ttl_seconds, offloading=offloading,
                                      on_error=self._failed, cluster=cluster,
                                      failover_wait_s=failover_wait_s, address=address,
                                      clock=clock)
        self.redis.on_recovered = self._outage_ridden_out
        self.offloading = self.redis.offloading
        self._fallback: InMemoryKvIndex | None = (
            InMemoryKvIndex(max_entries=max_entries, entry_ttl_seconds=entry_ttl_seconds,
                            offloading=self.offloading, clock=clock)
            if fallback_to_memory else None
        )
        self._metrics = metrics
        self.probe_interval_s = probe_interval_s
        #: Copy the fallback's entries into Redis at recovery. Off with the writer lease: this
        #: router held no lease meanwhile (router.consumer), the writers kept Redis right, and a
        #: copy from a stream that lags theirs could bring back entries they had just removed,
        #: with nobody to remove them again.
        self.copy_on_recovery = copy_on_recovery
        self._clock = clock
        self.address = self.redis.address
        # Failure logs (issue 14, finding 9): where Redis is, why it failed, bounded in number.
        self._error_log = LogThrottle(log_repeat_interval_s, clock)
        self._probe_log = LogThrottle(log_repeat_interval_s, clock)
        self._down_since: float | None = None  # when the fallback took over (its clock)
        self.probes_failed = 0  # failed PINGs of the current outage (readable, like redis_errors)
        self._probe_task: asyncio.Task[None] | None = None
        self._copying: asyncio.Event | None = None  # set while fallback entries go back to Redis
        self._healthy = asyncio.Event()
        self._healthy.set()
        self._listeners: list[Callable[[bool], None]] = []
        self._n = _Counters()
        self.redis_errors = 0
        self.cluster_outages = 0  # cluster outages ridden out without the fallback

    @classmethod
    def from_config(
        cls,
        redis_cfg: RedisConfig,
        kv_cfg: KvCacheIndexConfig,
        *,
        metrics: RouterMetrics | None = None,
        probe_interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_repeat_interval_s: float = LOG_REPEAT_INTERVAL_S,
    ) -> RedisKvIndex:
        """Build the client from `response_cache.redis` (a cluster client with `cluster: true`;
        `probe_interval_s` None: its `probe_interval_ms`). Raises ConfigError (password file)."""
        url = redis_cfg.url
        if redis_cfg.tls and url.startswith("redis://"):
            url = "rediss://" + url.removeprefix("redis://")
        kwargs: dict[str, Any] = {
            "max_connections": redis_cfg.pool_size,
            "socket_connect_timeout": redis_cfg.connect_timeout_ms / 1000,
            "socket_timeout": redis_cfg.command_timeout_ms / 1000,
            "decode_responses": True,
        }
        if redis_cfg.use_tls and redis_cfg.ca_file is not None:
            kwargs["ssl_ca_certs"] = redis_cfg.ca_file
        if redis_cfg.username is not None:
            kwargs["username"] = redis_cfg.username
        password = read_secret(redis_cfg.password_file, redis_cfg.password_env)
        if password is not None:
            kwargs["password"] = password.decode("utf-8")
        client: Any
        if redis_cfg.cluster:
            # The cluster client follows MOVED/ASK and refreshes its slot map itself; two quick
            # retries of its own, then the store's failover window (redis_store) takes over.
            kwargs["retry"] = Retry(ExponentialBackoff(cap=0.5, base=0.05), 2)
            client = WaitingRedisCluster.from_url(url, **kwargs)
            # A burst wider than the pool waits for a connection, bounded like connecting
            # (redis_pool: redis-py's cluster client would raise MaxConnectionsError at once).
            client.limit(redis_cfg.pool_size, redis_cfg.connect_timeout_ms / 1000)
        else:
            # Waiting for a pooled connection is bounded like connecting. One immediate retry
            # covers a pooled connection Redis closed (restart); anything more would delay the
            # switch to the fallback by redis-py's default backoff.
            kwargs["timeout"] = redis_cfg.connect_timeout_ms / 1000
            kwargs["retry"] = Retry(NoBackoff(), 1)
            client = Redis.from_pool(BlockingConnectionPool.from_url(url, **kwargs))
        split = urlsplit(url)
        return cls(
            client, key_prefix=kv_cfg.key_prefix,
            entry_ttl_seconds=kv_cfg.entry_ttl_seconds, offloading=kv_cfg.storage_offloading,
            fallback_to_memory=redis_cfg.fallback_to_memory, max_entries=kv_cfg.max_entries,
            metrics=metrics, clock=clock,
            probe_interval_s=(redis_cfg.probe_interval_ms / 1000 if probe_interval_s is None
                              else probe_interval_s),
            log_repeat_interval_s=log_repeat_interval_s, cluster=redis_cfg.cluster,
            failover_wait_s=redis_cfg.failover_wait_ms / 1000,
            copy_on_recovery=not kv_cfg.writer_lease.enabled,
            address=(f"cluster:{split.hostname}:{split.port or 6379}" if redis_cfg.cluster
                     else None),
        )

    # --- the Redis-only index's keys and figures -------------------------------------------

    @property
    def key_prefix(self) -> str:
        return self.redis.key_prefix

    @property
    def ttl_s(self) -> int:
        return self.redis.ttl_s

    @property
    def lookup_round_trips(self) -> int:
        return self.redis.lookup_round_trips

    def hot_key(self, prefix_hash: str) -> str:
        return self.redis.hot_key(prefix_hash)

    def warm_key(self, prefix_hash: str) -> str:
        return self.redis.warm_key(prefix_hash)

    def backend_key(self, backend: str) -> str:
        return self.redis.backend_key(backend)

    # --- state -------------------------------------------------------------------------------

    @property
    def fallback_active(self) -> bool:
        # The Redis-only index holds its lookups back (`paused`) exactly while the fallback
        # serves: switching to and from the fallback sets `self.redis.paused`.
        return self.redis.paused

    def add_state_listener(self, callback: Callable[[bool], None]) -> None:
        """`callback(fallback_active)` on every switch to and from the fallback, and
        `callback(False)` when a cluster outage ended without it."""
        self._listeners.append(callback)

    async def wait_recovered(self) -> None:
        """Return once the index is on Redis (at once when it is)."""
        await self._healthy.wait()

    async def ping(self) -> bool:
        return await self.redis.ping()

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
        if self.fallback_active:
            return
        self.redis.paused = True
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

    def _outage_ridden_out(self) -> None:
        """A cluster outage ended inside the failover window: no fallback was needed, but a
        failed-over master may have lost acknowledged writes, so the listeners hear "on Redis"
        (the router resyncs its streams, as after a fallback). Not while the fallback is active
        or its entries are being copied back: the recovery tells the listeners itself."""
        if self.fallback_active or self._copying is not None:
            return
        self.cluster_outages += 1
        self._notify(False)

    def _redis_failed(self, exc: Exception, op: str) -> None:
        """A failed call the caller waits on: counted; without the fallback the caller gets
        `IndexUnavailableError` (with it, the caller goes on to the fallback)."""
        self._failed(exc, op)
        if self._fallback is None:
            raise IndexUnavailableError(str(exc)) from exc

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
            failure = await self.redis.ping_error()
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
        snapshot = fallback.entries() if self.copy_on_recovery else []
        fallback.clear_now()
        self.redis.paused = False
        copying = self._copying = asyncio.Event()
        try:
            await self.redis.copy_in(snapshot)
        except REDIS_ERRORS as exc:
            now = self._clock()
            for ph, backend, tier, tokens, age in snapshot:  # oldest first: keeps the order
                fallback.upsert(ph, backend, tier, tokens, now - age)
            self.redis.paused = True
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

    # --- the index ---------------------------------------------------------------------------

    async def apply(self, event: Record) -> None:
        if self._copying is not None:
            await self._copying.wait()
        if not self.fallback_active:
            try:
                await self.redis.apply(event)
                return
            except REDIS_ERRORS as exc:
                self._redis_failed(exc, "apply")
        assert self._fallback is not None
        self._fallback.apply_now(event)

    async def query(self, prefix_hash: str) -> list[Holder]:
        self._n.queries += 1
        holders = await self._query(prefix_hash)
        if holders:
            self._n.hits += 1
        return holders

    async def _query(self, prefix_hash: str) -> list[Holder]:
        if not is_prefix_hash(prefix_hash):
            return []  # never build a key from something that is not a prefix hash
        if not self.fallback_active:
            # None: the round trip failed (counted through `_failed`) or the fallback took over
            holders = await self.redis.lookup(prefix_hash)
            if holders is not None:
                return holders
            if self._fallback is None:
                return []
        assert self._fallback is not None
        return self._fallback.query_now(prefix_hash)

    async def stats(self) -> IndexStats:
        """Counts come from a SCAN of the key prefix: O(entries), meant for the admin API."""
        if not self.fallback_active:
            try:
                s = await self.redis.stats()
            except REDIS_ERRORS as exc:
                self._redis_failed(exc, "stats")
            else:
                return replace(s, queries=self._n.queries, hits=self._n.hits)
        assert self._fallback is not None
        fb = self._fallback.stats_now()
        return replace(fb, kind="redis", fallback_active=True, queries=self._n.queries,
                       hits=self._n.hits)

    async def clear(self) -> ClearResult:
        """Delete every key under the key prefix (`RedisOnlyKvIndex.clear`: other routers sharing
        this Redis lose their index too). Also empties the fallback."""
        fb = self._fallback.clear_now() if self._fallback is not None else ClearResult(0, 0)
        if self.fallback_active:
            return fb
        try:
            redis = await self.redis.clear()
        except REDIS_ERRORS as exc:
            self._redis_failed(exc, "clear")
            return fb
        return ClearResult(
            entries_before_clear=redis.entries_before_clear + fb.entries_before_clear,
            cleared_entries=redis.cleared_entries + fb.cleared_entries)

    async def cleanup_expired(self) -> int:
        if self.fallback_active:
            assert self._fallback is not None
            return self._fallback.cleanup_now()
        return await self.redis.cleanup_expired()  # a failure reaches `_failed`

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        await self.redis.close()


def build_index(config: RouterConfig, *, metrics: RouterMetrics | None = None,
                probe_interval_s: float | None = None) -> KvIndex:
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
