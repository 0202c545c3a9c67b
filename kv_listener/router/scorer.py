"""KV-overlap scoring of backends for one request prefix: the seed's `KvOverlapScorer`.

Owns: the formula, its thresholds, the 100 ms prepare cache, and the two live inputs the
embedding router feeds (`InFlightTracker`, `HealthTracker`).

    final_score = overlap_weight * (raw_overlap * tier_multiplier)
                + load_weight    * (1.0 - load_ratio)
                + health_weight  * health_score

- `raw_overlap` = the backend's token_count / the largest token_count among the prefix's holders
  (every holder the index returned: the best holder has 1.0). When every holder reports 0 tokens
  (the seed's token_count is optional) each holder gets 1.0: they are equally unknown.
- `tier_multiplier` = `gpu_tier_weight` for GpuHot, `storage_tier_weight` for StorageWarm.
- `min_overlap_threshold` applies to `raw_overlap * tier_multiplier`: a holder below it scores 0.0,
  like a backend without the prefix (at the threshold passes: the seed's `>=`).
- Only holders are scored: a backend the index does not list for the prefix scores 0.0 whatever
  its load and health, so an idle backend without the cache cannot reach the pool threshold on
  `load_weight + health_weight` alone.
- `load_ratio` = the backend's in-flight requests / the largest in-flight count of any backend in
  the snapshot; 0 when every backend has 0 in flight. `health_score` = its recent success rate,
  1.0 without data. With no traffic the best GPU holder therefore scores exactly 1.0.
- Selection: the pool picks the best composite when it is above 0.3 (`POOL_THRESHOLD`, strictly
  greater); otherwise the decision is `fallback` (the configured strategy picks). Ties: the seed
  names no tie rule; the pool's scoring loop keeps the first best, so the earliest backend in the
  caller's candidate order wins (without candidates: the index's order, most tokens first, GPU
  before storage, then by name).

`prepare(prefix_hash)` is the async half: it queries the index once per prefix per 100 ms window
(concurrent prepares of one prefix share one query) and captures the in-flight snapshot with it,
so every candidate of one scoring pass is compared on the same load. `score()` and
`score_with_tier()` are synchronous reads of that cache; health is read at score time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import structlog

from kv_listener.core.model import Tier
from kv_listener.router.config import POOL_THRESHOLD, ScoringConfig
from kv_listener.router.index import Holder, KvIndex
from kv_listener.router.metrics import Decision, RouterMetrics, TierLabel

log = structlog.get_logger(__name__)

#: The seed's prepare cache window.
PREPARE_TTL_S = 0.1
#: Float slack for the two threshold comparisons (weights like 0.6 + 0.3 + 0.1 are not exact in
#: binary; a score that is the threshold on paper must compare as the threshold).
_EPS = 1e-9
#: Prepared prefixes kept before expired ones are swept (the 100 ms window keeps it small).
_SWEEP_AT = 4096


class InFlightTracker:
    """Requests in flight per backend; the embedding router calls `start`/`finish` (or `track`)."""

    def __init__(self) -> None:
        self._n: dict[str, int] = {}

    def start(self, backend: str) -> None:
        self._n[backend] = self._n.get(backend, 0) + 1

    def finish(self, backend: str) -> None:
        n = self._n.get(backend, 0)
        if n <= 1:
            self._n.pop(backend, None)  # never below 0, even on an unmatched finish
        else:
            self._n[backend] = n - 1

    @contextlib.contextmanager
    def track(self, backend: str) -> Iterator[None]:
        self.start(backend)
        try:
            yield
        finally:
            self.finish(backend)

    def in_flight(self, backend: str) -> int:
        return self._n.get(backend, 0)

    def snapshot(self) -> dict[str, int]:
        return dict(self._n)


class HealthTracker:
    """Success rate of each backend's last `window` requests; 1.0 with no data."""

    def __init__(self, window: int = 100) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self.window = window
        self._outcomes: dict[str, collections.deque[bool]] = {}
        self._ok: dict[str, int] = {}

    def record(self, backend: str, success: bool) -> None:
        q = self._outcomes.get(backend)
        if q is None:
            q = self._outcomes[backend] = collections.deque(maxlen=self.window)
            self._ok[backend] = 0
        if len(q) == self.window and q[0]:
            self._ok[backend] -= 1
        q.append(success)
        if success:
            self._ok[backend] += 1

    def success_rate(self, backend: str) -> float:
        q = self._outcomes.get(backend)
        if not q:
            return 1.0
        return self._ok[backend] / len(q)


@dataclass(frozen=True, slots=True)
class BackendScore:
    backend: str
    score: float  # composite; 0.0 below min_overlap_threshold
    tier: Tier
    token_count: int
    raw_overlap: float
    tiered_overlap: float
    load_ratio: float
    health: float


@dataclass(frozen=True, slots=True)
class Selection:
    """The scorer's answer for one request: `backend` is None when the decision is fallback."""

    backend: str | None
    decision: Decision
    tier: Tier | None
    score: float  # best composite among the candidates (0.0 when none holds the prefix)

    @property
    def tier_label(self) -> TierLabel:
        return TierLabel.NONE if self.tier is None else TierLabel(self.tier.value)


@dataclass(slots=True)
class ScorerStats:
    kv_aware: int = 0
    fallback: int = 0
    index_queries: int = 0  # prepare() cache misses (the seed's query_latency_count)
    index_query_seconds: float = 0.0
    overlap_scores: int = 0  # kv_aware scores observed (the seed's overlap_score_count)

    def to_json(self) -> dict[str, int]:
        return {"kv_aware": self.kv_aware, "fallback": self.fallback,
                "total": self.kv_aware + self.fallback}


class PreparedPrefix:
    """The index's holders of one prefix and the in-flight snapshot, captured together."""

    __slots__ = ("at", "holders", "in_flight", "max_in_flight", "max_tokens", "prefix_hash")

    def __init__(self, prefix_hash: str, holders: list[Holder], in_flight: Mapping[str, int],
                 at: float) -> None:
        self.prefix_hash = prefix_hash
        self.holders = {h.backend: h for h in holders}  # index order kept
        self.max_tokens = max((h.token_count for h in holders), default=0)
        self.in_flight = in_flight
        self.max_in_flight = max(in_flight.values(), default=0)
        self.at = at


class KvOverlapScorer:
    def __init__(
        self,
        index: KvIndex,
        scoring: ScoringConfig | None = None,
        *,
        in_flight: InFlightTracker | None = None,
        health: HealthTracker | None = None,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        cache_ttl_s: float = PREPARE_TTL_S,
        pool_threshold: float = POOL_THRESHOLD,
    ) -> None:
        scoring = scoring or ScoringConfig()
        for name in ScoringConfig.__dataclass_fields__:
            value = getattr(scoring, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"scoring.{name} must be between 0 and 1, got {value!r}")
        if (reason := scoring.weight_sum_error()) is not None:
            raise ValueError(f"scoring: {reason}")
        self.index = index
        self.scoring = scoring
        self.in_flight = in_flight or InFlightTracker()
        self.health = health or HealthTracker()
        self.metrics = metrics
        self.cache_ttl_s = cache_ttl_s
        self.pool_threshold = pool_threshold
        self.stats = ScorerStats()
        self._clock = clock
        self._cache: dict[str, PreparedPrefix] = {}
        self._pending: dict[str, asyncio.Future[PreparedPrefix]] = {}
        s = scoring
        log.info("kv_scorer_configured", overlap_weight=s.overlap_weight,
                 load_weight=s.load_weight, health_weight=s.health_weight,
                 min_overlap_threshold=s.min_overlap_threshold,
                 gpu_tier_weight=s.gpu_tier_weight, storage_tier_weight=s.storage_tier_weight)

    # --- prepare: the async half --------------------------------------------------------------

    def _cached(self, prefix_hash: str) -> PreparedPrefix | None:
        p = self._cache.get(prefix_hash)
        if p is not None and self._clock() - p.at < self.cache_ttl_s:
            return p
        return None

    async def prepare(self, prefix_hash: str) -> PreparedPrefix:
        """Index holders + in-flight snapshot of `prefix_hash`, at most one index query per prefix
        per `cache_ttl_s` (100 ms)."""
        p = self._cached(prefix_hash)
        if p is not None:
            return p
        pending = self._pending.get(prefix_hash)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[PreparedPrefix] = asyncio.get_running_loop().create_future()
        self._pending[prefix_hash] = fut
        try:
            t0 = time.perf_counter()
            holders = await self.index.query(prefix_hash)
            self.stats.index_queries += 1
            self.stats.index_query_seconds += time.perf_counter() - t0
            p = PreparedPrefix(prefix_hash, holders, self.in_flight.snapshot(), self._clock())
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, nobody else must log it
            raise
        finally:
            del self._pending[prefix_hash]
        if len(self._cache) >= _SWEEP_AT:
            now = self._clock()
            self._cache = {k: v for k, v in self._cache.items() if now - v.at < self.cache_ttl_s}
        self._cache[prefix_hash] = p
        fut.set_result(p)
        return p

    def invalidate(self, prefix_hash: str | None = None) -> None:
        """Forget prepared results (all, or one prefix): after an admin clear, for instance."""
        if prefix_hash is None:
            self._cache.clear()
        else:
            self._cache.pop(prefix_hash, None)

    # --- score: the sync half -----------------------------------------------------------------

    def score_prepared(self, prepared: PreparedPrefix, backend: str) -> BackendScore | None:
        """The full breakdown of one backend's score; None when it does not hold the prefix."""
        h = prepared.holders.get(backend)
        if h is None:
            return None
        s = self.scoring
        raw = h.token_count / prepared.max_tokens if prepared.max_tokens > 0 else 1.0
        tiered = raw * (s.gpu_tier_weight if h.tier is Tier.GPU_HOT else s.storage_tier_weight)
        load = (prepared.in_flight.get(backend, 0) / prepared.max_in_flight
                if prepared.max_in_flight > 0 else 0.0)
        health = self.health.success_rate(backend)
        if tiered + _EPS < s.min_overlap_threshold:
            score = 0.0
        else:
            # fsum: 0.6 + 0.3 + 0.1 is 1.0 here, not 0.9999999999999999.
            score = math.fsum((s.overlap_weight * tiered, s.load_weight * (1.0 - load),
                               s.health_weight * health))
        return BackendScore(backend=backend, score=score, tier=h.tier, token_count=h.token_count,
                            raw_overlap=raw, tiered_overlap=tiered, load_ratio=load, health=health)

    def score_with_tier(self, prefix_hash: str, backend: str) -> tuple[float, Tier | None]:
        """Score and holding tier in one read of the prepared cache; (0.0, None) for a backend
        without the prefix or a prefix not prepared in the last 100 ms."""
        p = self._cached(prefix_hash)
        b = self.score_prepared(p, backend) if p is not None else None
        return (0.0, None) if b is None else (b.score, b.tier)

    def score(self, prefix_hash: str, backend: str) -> float:
        return self.score_with_tier(prefix_hash, backend)[0]

    def breakdown(self, prepared: PreparedPrefix) -> list[BackendScore]:
        """Every holder's score, best first (ties: the index's order)."""
        scores = [b for name in prepared.holders
                  if (b := self.score_prepared(prepared, name)) is not None]
        scores.sort(key=lambda b: -b.score)  # stable
        return scores

    # --- selection ----------------------------------------------------------------------------

    async def select(self, prefix_hash: str, candidates: Sequence[str] | None = None) -> Selection:
        """Run the scorer for a request with a prefix key: prepare, score every candidate (None:
        every holder), pick the best when above the pool threshold; records the decision metric
        (and the overlap histogram for kv_aware)."""
        prepared = await self.prepare(prefix_hash)
        names = list(prepared.holders) if candidates is None else candidates
        best: BackendScore | None = None
        for name in names:
            b = self.score_prepared(prepared, name)
            if b is not None and (best is None or b.score > best.score):
                best = b  # strictly greater: the first of equal scores stays
        if best is not None and best.score > self.pool_threshold + _EPS:
            sel = Selection(best.backend, Decision.KV_AWARE, best.tier, best.score)
            self.stats.kv_aware += 1
            self.stats.overlap_scores += 1
        else:
            sel = Selection(None, Decision.FALLBACK, None, best.score if best else 0.0)
            self.stats.fallback += 1
        if self.metrics is not None:
            self.metrics.record_decision(sel.decision, sel.tier_label, sel.score)
        return sel
