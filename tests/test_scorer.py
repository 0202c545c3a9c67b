"""KvOverlapScorer: every rule of the seed's formula, thresholds, tiers, ties, the 100 ms prepare
cache (injected clock), the load and health inputs, and the decision metrics. The index under
the scorer is a real InMemoryKvIndex (and a real Redis one for shared concurrent prepares)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kv_listener.core.model import Tier
from kv_listener.router.config import (
    KvCacheIndexConfig,
    RedisConfig,
    ScoringConfig,
    StorageOffloadingConfig,
)
from kv_listener.router.index import IndexEvent, InMemoryKvIndex, PrefixEventType
from kv_listener.router.metrics import Decision, RouterMetrics
from kv_listener.router.redis_index import RedisKvIndex
from kv_listener.router.scorer import (
    HealthTracker,
    InFlightTracker,
    KvOverlapScorer,
    Selection,
)
from tests.support import ManualClock
from tests.support.redis_server import RedisServer

P = "ab" * 32
Q = "cd" * 32
WARM = StorageOffloadingConfig(enabled=True)


class Rig:
    """A real in-memory index, trackers and a scorer on a manual clock."""

    def __init__(self, scoring: ScoringConfig | None = None) -> None:
        self.clock = ManualClock()
        self.index = InMemoryKvIndex(offloading=WARM, clock=self.clock)
        self.in_flight = InFlightTracker()
        self.health = HealthTracker(window=10)
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry, ["a", "b", "c"])
        self.scorer = KvOverlapScorer(self.index, scoring, in_flight=self.in_flight,
                                      health=self.health, metrics=self.metrics, clock=self.clock)

    def gpu(self, backend: str, tokens: int, prefix: str = P) -> None:
        self.index.apply_now(IndexEvent(PrefixEventType.CACHE_CREATED, backend, prefix, tokens))

    def warm(self, backend: str, tokens: int, prefix: str = P) -> None:
        self.index.apply_now(IndexEvent(PrefixEventType.CACHE_OFFLOADED, backend, prefix, tokens))

    async def scores(self, prefix: str = P) -> dict[str, float]:
        prepared = await self.scorer.prepare(prefix)
        return {b.backend: b.score for b in self.scorer.breakdown(prepared)}

    def decisions(self, decision: str, tier: str) -> float:
        v = self.registry.get_sample_value("continuum_kv_index_routing_decisions_total",
                                           {"decision": decision, "tier": tier})
        return v or 0.0


@pytest.fixture
def rig() -> Rig:
    return Rig()


async def test_no_traffic_best_gpu_holder_scores_exactly_one(rig: Rig) -> None:
    rig.gpu("a", 2048)
    sel = await rig.scorer.select(P)
    assert sel == Selection("a", Decision.KV_AWARE, Tier.GPU_HOT, 1.0)
    assert rig.scorer.score(P, "a") == 1.0
    assert rig.scorer.score_with_tier(P, "a") == (1.0, Tier.GPU_HOT)


async def test_raw_overlap_is_normalized_to_the_best_holder(rig: Rig) -> None:
    rig.gpu("a", 2000)
    rig.gpu("b", 1000)  # raw 0.5 -> 0.6*0.5 + 0.3 + 0.1
    rig.gpu("c", 500)  # raw 0.25 -> below min_overlap_threshold 0.3 -> 0.0
    assert await rig.scores() == pytest.approx({"a": 1.0, "b": 0.7, "c": 0.0})
    prepared = await rig.scorer.prepare(P)
    b = rig.scorer.score_prepared(prepared, "b")
    assert b is not None
    assert (b.raw_overlap, b.tiered_overlap, b.load_ratio, b.health) == (0.5, 0.5, 0.0, 1.0)


async def test_threshold_applies_to_tiered_score_and_equal_passes(rig: Rig) -> None:
    rig.gpu("a", 1000)
    rig.gpu("b", 300)  # tiered exactly 0.3: passes (the seed's >=)
    rig.gpu("c", 299)  # just below: 0.0
    assert await rig.scores() == pytest.approx({"a": 1.0, "b": 0.6 * 0.3 + 0.4, "c": 0.0})


async def test_storage_warm_gets_the_storage_multiplier(rig: Rig) -> None:
    rig.gpu("a", 1000)
    rig.warm("b", 1000)  # raw 1.0 * 0.6
    assert await rig.scores() == pytest.approx({"a": 1.0, "b": 0.6 * 0.6 + 0.4})
    assert rig.scorer.score_with_tier(P, "b") == (pytest.approx(0.76), Tier.STORAGE_WARM)


async def test_warm_only_holder_excluded_when_storage_weight_below_threshold() -> None:
    rig = Rig(ScoringConfig(storage_tier_weight=0.2))
    rig.warm("a", 1000)
    assert await rig.scores() == {"a": 0.0}
    sel = await rig.scorer.select(P)
    assert (sel.backend, sel.decision) == (None, Decision.FALLBACK)


async def test_warm_holder_selected_with_storage_tier_label(rig: Rig) -> None:
    rig.warm("a", 1000)
    sel = await rig.scorer.select(P)
    assert sel == Selection("a", Decision.KV_AWARE, Tier.STORAGE_WARM, pytest.approx(0.76))
    assert rig.decisions("kv_aware", "storage_warm") == 1


async def test_gpu_tier_weight_below_threshold_never_routes() -> None:
    rig = Rig(ScoringConfig(gpu_tier_weight=0.25))
    rig.gpu("a", 1000)
    assert (await rig.scorer.select(P)).decision is Decision.FALLBACK


async def test_only_holders_are_scored(rig: Rig) -> None:
    rig.gpu("a", 1000)
    rig.in_flight.start("a")  # a is the busiest backend
    # "idle" has no cache: load + health alone would be 0.4 > 0.3, but it is not a holder.
    assert rig.scorer.score(P, "idle") == 0.0
    sel = await rig.scorer.select(P, ["idle", "a"])
    assert sel.backend == "a"
    assert sel.score == pytest.approx(0.6 + 0.0 + 0.1)
    assert rig.scorer.score_with_tier(P, "idle") == (0.0, None)
    sel = await rig.scorer.select(P, ["idle"])
    assert sel == Selection(None, Decision.FALLBACK, None, 0.0)
    assert await rig.scorer.select(Q) == Selection(None, Decision.FALLBACK, None, 0.0)


async def test_pool_threshold_is_strictly_greater_than_point_three() -> None:
    # score = 0.5 * tiered (load term 0: the holder is the busiest backend; no health weight)
    rig = Rig(ScoringConfig(overlap_weight=0.5, load_weight=0.5, health_weight=0.0,
                            storage_tier_weight=0.6))
    rig.warm("a", 100)
    rig.in_flight.start("a")
    sel = await rig.scorer.select(P)
    assert sel.score == pytest.approx(0.3)
    assert sel.decision is Decision.FALLBACK  # 0.3 is not > 0.3

    rig2 = Rig(ScoringConfig(overlap_weight=0.5, load_weight=0.5, health_weight=0.0,
                             storage_tier_weight=0.62))
    rig2.warm("a", 100)
    rig2.in_flight.start("a")
    sel = await rig2.scorer.select(P)
    assert (sel.backend, sel.decision, sel.score) == ("a", Decision.KV_AWARE, pytest.approx(0.31))


async def test_load_ratio_against_the_busiest_backend(rig: Rig) -> None:
    rig.gpu("a", 1000)
    rig.gpu("b", 1000)
    for _ in range(3):
        rig.in_flight.start("a")
    rig.in_flight.start("b")
    rig.in_flight.start("c")  # not a holder, still part of the snapshot
    scores = await rig.scores()
    assert scores == pytest.approx({"a": 0.6 + 0.0 + 0.1, "b": 0.6 + 0.3 * (1 - 1 / 3) + 0.1})
    assert (await rig.scorer.select(P)).backend == "b"


async def test_load_ratio_zero_when_nothing_in_flight(rig: Rig) -> None:
    rig.gpu("a", 1000)
    with rig.in_flight.track("a"):
        assert rig.in_flight.in_flight("a") == 1
    assert rig.in_flight.snapshot() == {}
    rig.in_flight.finish("a")  # unmatched: stays at 0
    assert rig.in_flight.in_flight("a") == 0
    assert await rig.scores() == {"a": 1.0}


async def test_health_is_the_recent_success_rate(rig: Rig) -> None:
    assert rig.health.success_rate("a") == 1.0  # no data
    rig.gpu("a", 1000)
    rig.gpu("b", 1000)
    for ok in (True, False, False, True):
        rig.health.record("a", ok)
    assert rig.health.success_rate("a") == 0.5
    assert await rig.scores() == pytest.approx({"b": 1.0, "a": 0.6 + 0.3 + 0.1 * 0.5})
    assert (await rig.scorer.select(P, ["a", "b"])).backend == "b"
    for _ in range(10):  # the window (10) forgets the failures
        rig.health.record("a", True)
    assert rig.health.success_rate("a") == 1.0
    with pytest.raises(ValueError):
        HealthTracker(window=0)


async def test_ties_go_to_the_first_candidate(rig: Rig) -> None:
    rig.gpu("b", 1000)
    rig.gpu("a", 1000)
    assert (await rig.scorer.select(P, ["b", "a"])).backend == "b"
    assert (await rig.scorer.select(P, ["a", "b"])).backend == "a"
    assert (await rig.scorer.select(P)).backend == "a"  # index order: then by name


async def test_holders_with_unknown_token_counts_are_equal(rig: Rig) -> None:
    rig.gpu("a", 0)
    rig.gpu("b", 0)
    assert await rig.scores() == {"a": 1.0, "b": 1.0}


@pytest.mark.parametrize(
    ("weights", "ok"),
    [((0.6, 0.3, 0.1), True), ((0.5, 0.3, 0.1), False), ((0.6, 0.3, 0.1000005), True),
     ((0.6, 0.3, 0.10001), False), ((1.0, 0.0, 0.0), True)],
)
def test_weights_must_sum_to_one(weights: tuple[float, float, float], ok: bool) -> None:
    cfg = ScoringConfig(overlap_weight=weights[0], load_weight=weights[1], health_weight=weights[2])
    idx = InMemoryKvIndex()
    if ok:
        KvOverlapScorer(idx, cfg)
    else:
        with pytest.raises(ValueError, match=r"sum to 1\.0"):
            KvOverlapScorer(idx, cfg)


def test_weights_out_of_range_refused() -> None:
    with pytest.raises(ValueError, match="gpu_tier_weight"):
        KvOverlapScorer(InMemoryKvIndex(), ScoringConfig(gpu_tier_weight=1.5))


async def test_prepare_caches_index_and_load_for_100ms(rig: Rig) -> None:
    rig.gpu("a", 1000)
    await rig.scorer.prepare(P)
    assert rig.scorer.stats.index_queries == 1
    # Within the window: neither the index nor the in-flight snapshot is read again.
    rig.gpu("b", 4000)
    rig.in_flight.start("a")
    rig.clock.advance(0.099)
    await rig.scorer.prepare(P)
    assert rig.scorer.stats.index_queries == 1
    assert rig.scorer.score(P, "a") == 1.0
    assert rig.scorer.score(P, "b") == 0.0
    # Health is read at score time, not cached.
    rig.health.record("a", False)
    assert rig.scorer.score(P, "a") == pytest.approx(0.9)
    # score() reads only the cache: past the window it has nothing.
    rig.clock.advance(0.001)
    assert rig.scorer.score_with_tier(P, "a") == (0.0, None)
    await rig.scorer.prepare(P)
    assert rig.scorer.stats.index_queries == 2
    assert (await rig.index.stats()).queries == 2
    assert rig.scorer.score(P, "b") == pytest.approx(1.0)  # idle, best holder now
    assert rig.scorer.score(P, "a") == 0.0  # 1000/4000 = 0.25, below 0.3 now
    rig.scorer.invalidate()
    assert rig.scorer.score(P, "b") == 0.0


async def test_decisions_and_overlap_histogram_are_recorded(rig: Rig) -> None:
    rig.gpu("a", 1000)
    await rig.scorer.select(P)
    await rig.scorer.select(P)
    await rig.scorer.select(Q)
    assert rig.decisions("kv_aware", "gpu_hot") == 2
    assert rig.decisions("fallback", "none") == 1
    assert rig.registry.get_sample_value("continuum_kv_index_overlap_score_count") == 2
    assert rig.registry.get_sample_value("continuum_kv_index_overlap_score_sum") == 2.0
    assert rig.scorer.stats.to_json() == {"kv_aware": 2, "fallback": 1, "total": 3}
    assert rig.scorer.stats.overlap_scores == 2


async def test_concurrent_prepares_share_one_index_query(redis_server: RedisServer) -> None:
    idx = RedisKvIndex.from_config(RedisConfig(url=redis_server.url), KvCacheIndexConfig())
    try:
        await idx.apply(IndexEvent(PrefixEventType.CACHE_CREATED, "a", P, 10))
        scorer = KvOverlapScorer(idx)
        results = await asyncio.gather(*(scorer.prepare(P) for _ in range(5)))
        assert scorer.stats.index_queries == 1
        assert (await idx.stats()).queries == 1
        assert all(r is results[0] for r in results)
        assert list(results[0].holders) == ["a"]
    finally:
        await idx.close()
