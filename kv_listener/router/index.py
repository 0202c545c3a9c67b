"""The router's KV index: which backend holds which prefix, how many tokens of it, in which tier.

Owns: the index contract both implementations honour (`KvIndex`), the tier transition rule of
SPEC §8 (`transition`, shared by the memory and Redis indexes), and `InMemoryKvIndex`. What an
index applies is the one prefix record of `core.records` (`Record`), validated before it gets
here: by `core.records.decode_data` (the consumer), or by `IndexEvent` for a router that builds
its own records, so an index never stores a malformed key.

Tier transitions (SPEC §8; the seed's table is missing):
- `cache_created`   -> GpuHot with the event's token_count (an upsert);
- `cache_offloaded` -> StorageWarm when `storage_offloading.enabled`, else the entry is removed;
- `cache_evicted`   -> removed, except: with `storage_offloading.enabled` and
  `treat_eviction_as_offload`, a GpuHot entry becomes StorageWarm (keeping its token_count) and
  then ages out by TTL; an entry that is already StorageWarm is left as it is, its age not reset;
- `cache_cleared`   -> every entry of that backend removed.

`InMemoryKvIndex` counts `max_entries` in (prefix, backend) entries (the seed's sizing rule:
"max_entries >= unique prefixes x backends x 2"). At capacity it evicts the oldest 10% by last
write (an entry is as fresh as the last event that confirmed it; queries do not refresh it).
Expiry is checked lazily on `query` and proactively by `cleanup_expired` (run it periodically,
see `run_cleanup`). Time comes from an injected monotonic clock.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from kv_listener.configkit import BACKEND_NAME_RE
from kv_listener.core.model import Tier
from kv_listener.core.records import Record, RecordEvent, default_tier, is_prefix_hash, is_token_count
from kv_listener.router.config import StorageOffloadingConfig

log = structlog.get_logger(__name__)

#: Share of `max_entries` evicted at once when the in-memory index is full (seed: 10%).
EVICT_FRACTION = 0.10

#: The four prefix events, by the name the index API has always used for them.
PrefixEventType = RecordEvent


def IndexEvent(type: RecordEvent, backend: str, prefix_hash: str | None = None,
               token_count: int = 0) -> Record:
    """A validated prefix record of `backend` for `KvIndex.apply`, from the four fields an index
    reads (the name and argument order of the index API; `type` is the record's event; the
    upserts get their default tier). Raises ValueError naming the malformed field."""
    if not isinstance(backend, str) or not BACKEND_NAME_RE.match(backend):
        raise ValueError(f"invalid backend name {backend!r}")
    if type is RecordEvent.CACHE_CLEARED:
        return Record(None, type, backend, None, None, None, None)
    if not is_prefix_hash(prefix_hash):
        raise ValueError("prefix_hash must be 64 lowercase hex characters")
    if not is_token_count(token_count):
        raise ValueError("token_count must be a non-negative integer")
    if type is RecordEvent.CACHE_EVICTED:
        return Record(None, type, backend, prefix_hash, None, None, None)
    return Record(None, type, backend, prefix_hash, token_count, default_tier(type), None)


@dataclass(frozen=True, slots=True)
class Holder:
    """A backend holding a prefix: `token_count` cached tokens in `tier`."""

    backend: str
    token_count: int
    tier: Tier


def sort_holders(holders: list[Holder]) -> list[Holder]:
    """Most tokens first; GPU before storage at equal counts; then by name (stable output)."""
    holders.sort(key=lambda h: (-h.token_count, h.tier is not Tier.GPU_HOT, h.backend))
    return holders


@dataclass(frozen=True, slots=True)
class BackendEntries:
    gpu_hot: int = 0
    storage_warm: int = 0

    @property
    def total(self) -> int:
        return self.gpu_hot + self.storage_warm


@dataclass(frozen=True, slots=True)
class IndexStats:
    kind: str  # "memory" | "redis"
    entries: int  # (prefix, backend) entries
    prefixes: int  # distinct prefix hashes
    per_backend: Mapping[str, BackendEntries]
    queries: int = 0  # query() calls (this process)
    hits: int = 0  # queries that found at least one holder
    evictions: int = 0  # entries evicted at capacity
    expired: int = 0  # entries removed by TTL (memory) / stale backend-set members pruned (redis)
    fallback_active: bool = False

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(sorted(self.per_backend))

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.kind,
            "prefix_count": self.prefixes,
            "entry_count": self.entries,
            "total_queries": self.queries,
            "total_hits": self.hits,
            "total_evictions": self.evictions,
            "total_expired": self.expired,
            "fallback_active": self.fallback_active,
            "backends": {b: {"entries": c.total, "gpu_hot": c.gpu_hot,
                             "storage_warm": c.storage_warm}
                         for b, c in sorted(self.per_backend.items())},
        }


@dataclass(frozen=True, slots=True)
class ClearResult:
    entries_before_clear: int  # (prefix, backend) entries before the clear
    cleared_entries: int  # entries the clear removed


# --- The transition rule, shared by both implementations --------------------------------------


class _Keep:
    """Nothing to write (e.g. an eviction of an unknown entry)."""


class _Remove:
    """Delete the (prefix, backend) entry."""


@dataclass(frozen=True, slots=True)
class Upsert:
    tier: Tier
    token_count: int


KEEP = _Keep()
REMOVE = _Remove()
Outcome = Upsert | _Keep | _Remove


def transition(
    event_type: RecordEvent,
    token_count: int,
    current: tuple[Tier, int] | None,
    offloading: StorageOffloadingConfig,
) -> Outcome:
    """What one prefix event does to the (prefix, backend) entry `current` ((tier, tokens) or
    None). `cache_cleared` is per backend, not per entry: callers handle it."""
    if event_type is RecordEvent.CACHE_CREATED:
        return Upsert(Tier.GPU_HOT, token_count)
    if event_type is RecordEvent.CACHE_OFFLOADED:
        if not offloading.enabled:
            return REMOVE  # only GPU data is tracked
        if token_count > 0:
            return Upsert(Tier.STORAGE_WARM, token_count)
        # The seed's token_count is optional: keep the count we know, if any.
        return Upsert(Tier.STORAGE_WARM, current[1]) if current is not None else KEEP
    if event_type is RecordEvent.CACHE_EVICTED:
        if offloading.enabled and offloading.treat_eviction_as_offload:
            if current is not None and current[0] is Tier.GPU_HOT:
                return Upsert(Tier.STORAGE_WARM, current[1])
            return KEEP  # already warm: it ages out by TTL from when it went warm
        return REMOVE
    raise ValueError(f"transition() does not handle {event_type}")


# --- The contract ------------------------------------------------------------------------------


class KvIndex(abc.ABC):
    """prefix_hash -> {backend -> (token_count, tier)}. Async because Redis is."""

    @abc.abstractmethod
    async def apply(self, event: Record) -> None:
        """Apply one validated prefix record (see the module docstring for the tier rule)."""

    @abc.abstractmethod
    async def query(self, prefix_hash: str) -> list[Holder]:
        """Holders of `prefix_hash`, most tokens first (`sort_holders` order); [] when none."""

    @abc.abstractmethod
    async def clear(self) -> ClearResult:
        """Remove every entry (admin)."""

    @abc.abstractmethod
    async def stats(self) -> IndexStats: ...

    @abc.abstractmethod
    async def cleanup_expired(self) -> int:
        """Proactive expiry; returns the number of records removed."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections and background tasks."""


async def run_cleanup(index: KvIndex, interval_s: float) -> None:
    """Periodic `cleanup_expired` until cancelled (one task per router)."""
    while True:
        await asyncio.sleep(interval_s)  # a timer, not a wait for an event
        try:
            removed = await index.cleanup_expired()
        except Exception as exc:  # a failed round must not end the loop
            log.warning("kv_index_cleanup_failed", error=type(exc).__name__)
            continue
        if removed:
            log.debug("kv_index_cleanup", removed=removed)


# --- In memory ---------------------------------------------------------------------------------


class _Entry:
    __slots__ = ("tier", "token_count", "updated_at")

    def __init__(self, tier: Tier, token_count: int, updated_at: float) -> None:
        self.tier = tier
        self.token_count = token_count
        self.updated_at = updated_at


@dataclass(slots=True)
class _Counters:
    queries: int = 0
    hits: int = 0
    evictions: int = 0
    expired: int = 0


class InMemoryKvIndex(KvIndex):
    """The seed's InMemoryKvIndex: bounded, TTL'd, per-router."""

    def __init__(
        self,
        *,
        max_entries: int = 100000,
        entry_ttl_seconds: float = 600.0,
        offloading: StorageOffloadingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        if entry_ttl_seconds <= 0:
            raise ValueError("entry_ttl_seconds must be positive")
        self.max_entries = max_entries
        self.ttl_s = float(entry_ttl_seconds)
        self.offloading = offloading or StorageOffloadingConfig()
        self._clock = clock
        # Write order, oldest first: capacity eviction and cleanup walk it from the front. A
        # write moves its entry to the end, so `updated_at` never decreases along the order.
        self._order: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._by_prefix: dict[str, dict[str, _Entry]] = {}
        self._by_backend: dict[str, set[str]] = {}
        self._n = _Counters()

    def __len__(self) -> int:
        return len(self._order)

    # Synchronous core, also used by the Redis index's fallback.

    def apply_now(self, event: Record) -> None:
        if event.event is RecordEvent.CACHE_CLEARED:
            for cleared in list(self._by_backend.get(event.backend, ())):
                self._remove(cleared, event.backend)
            return
        ph = event.prefix_hash
        assert ph is not None  # validated: core.records.decode_data or IndexEvent
        now = self._clock()
        entry = self._by_prefix.get(ph, {}).get(event.backend)
        if entry is not None and now - entry.updated_at >= self.ttl_s:
            self._remove(ph, event.backend)
            self._n.expired += 1
            entry = None
        current = (entry.tier, entry.token_count) if entry is not None else None
        # token_count is None only where the tier rule does not read it (evicted)
        outcome = transition(event.event, event.token_count or 0, current, self.offloading)
        if isinstance(outcome, Upsert):
            self.upsert(ph, event.backend, outcome.tier, outcome.token_count, now)
        elif outcome is REMOVE and entry is not None:
            self._remove(ph, event.backend)

    def upsert(self, prefix_hash: str, backend: str, tier: Tier, token_count: int,
               now: float | None = None) -> None:
        """Write one entry as of `now` (the Redis index copies entries back through this)."""
        now = self._clock() if now is None else now
        key = (prefix_hash, backend)
        entry = self._order.get(key)
        if entry is None:
            if len(self._order) >= self.max_entries:
                self._evict_oldest()
            entry = _Entry(tier, token_count, now)
            self._order[key] = entry
            self._by_prefix.setdefault(prefix_hash, {})[backend] = entry
            self._by_backend.setdefault(backend, set()).add(prefix_hash)
        else:
            entry.tier, entry.token_count, entry.updated_at = tier, token_count, now
            self._order.move_to_end(key)

    def query_now(self, prefix_hash: str) -> list[Holder]:
        self._n.queries += 1
        holders_map = self._by_prefix.get(prefix_hash)
        if not holders_map:
            return []
        now = self._clock()
        holders: list[Holder] = []
        expired: list[str] = []
        for backend, e in holders_map.items():
            if now - e.updated_at >= self.ttl_s:
                expired.append(backend)
            else:
                holders.append(Holder(backend, e.token_count, e.tier))
        for backend in expired:
            self._remove(prefix_hash, backend)
            self._n.expired += 1
        if holders:
            self._n.hits += 1
        return sort_holders(holders)

    def entries(self) -> list[tuple[str, str, Tier, int, float]]:
        """Every live entry as (prefix_hash, backend, tier, token_count, age_s), oldest first."""
        now = self._clock()
        return [(ph, b, e.tier, e.token_count, now - e.updated_at)
                for (ph, b), e in self._order.items() if now - e.updated_at < self.ttl_s]

    def clear_now(self) -> ClearResult:
        n = len(self._order)
        self._order.clear()
        self._by_prefix.clear()
        self._by_backend.clear()
        return ClearResult(entries_before_clear=n, cleared_entries=n)

    def stats_now(self) -> IndexStats:
        per_backend: dict[str, BackendEntries] = {}
        for backend, prefixes in self._by_backend.items():
            hot = sum(1 for ph in prefixes if self._by_prefix[ph][backend].tier is Tier.GPU_HOT)
            per_backend[backend] = BackendEntries(gpu_hot=hot, storage_warm=len(prefixes) - hot)
        return IndexStats(
            kind="memory", entries=len(self._order), prefixes=len(self._by_prefix),
            per_backend=per_backend, queries=self._n.queries, hits=self._n.hits,
            evictions=self._n.evictions, expired=self._n.expired,
        )

    def cleanup_now(self) -> int:
        now = self._clock()
        removed = 0
        while self._order:
            (ph, backend), entry = next(iter(self._order.items()))
            if now - entry.updated_at < self.ttl_s:
                break  # the rest is younger
            self._remove(ph, backend)
            removed += 1
        self._n.expired += removed
        return removed

    def _evict_oldest(self) -> None:
        n = min(max(1, int(self.max_entries * EVICT_FRACTION)), len(self._order))
        for _ in range(n):
            ph, backend = next(iter(self._order))
            self._remove(ph, backend)
        self._n.evictions += n
        log.debug("kv_index_capacity_eviction", evicted=n, max_entries=self.max_entries)

    def _remove(self, prefix_hash: str, backend: str) -> None:
        self._order.pop((prefix_hash, backend), None)
        holders = self._by_prefix.get(prefix_hash)
        if holders is not None:
            holders.pop(backend, None)
            if not holders:
                del self._by_prefix[prefix_hash]
        prefixes = self._by_backend.get(backend)
        if prefixes is not None:
            prefixes.discard(prefix_hash)
            if not prefixes:
                del self._by_backend[backend]

    # The async contract.

    async def apply(self, event: Record) -> None:
        self.apply_now(event)

    async def query(self, prefix_hash: str) -> list[Holder]:
        return self.query_now(prefix_hash)

    async def clear(self) -> ClearResult:
        return self.clear_now()

    async def stats(self) -> IndexStats:
        return self.stats_now()

    async def cleanup_expired(self) -> int:
        return self.cleanup_now()

