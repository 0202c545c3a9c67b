"""Admin API under real uvicorn on 127.0.0.1 (port 0) with a real aiohttp client, over a real
in-memory index and, for clear/stats/503, a real Redis index on a real redis-server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from kv_listener.httpserver import serve
from kv_listener.router.admin import SourceStatus, create_admin_app
from kv_listener.router.config import (
    EventSourceConfig,
    IndexBackend,
    KvCacheIndexConfig,
    RedisConfig,
    RouterConfig,
    StorageOffloadingConfig,
)
from kv_listener.router.index import IndexEvent, InMemoryKvIndex, KvIndex, PrefixEventType
from kv_listener.router.metrics import RouterMetrics
from kv_listener.router.redis_index import RedisKvIndex
from kv_listener.router.scorer import KvOverlapScorer
from tests.support.redis_server import RedisServer

P = "5a" * 32
Q = "6b" * 32
CREATED = PrefixEventType.CACHE_CREATED
OFFLOADED = PrefixEventType.CACHE_OFFLOADED
TIMEOUT = aiohttp.ClientTimeout(total=10)

KV = KvCacheIndexConfig(
    storage_offloading=StorageOffloadingConfig(enabled=True),
    event_sources=(
        EventSourceConfig("vllm-1", endpoint="http://127.0.0.1:7817/events/vllm-1"),
        EventSourceConfig("vllm-2", endpoint="http://127.0.0.1:7817/events/vllm-2"),
    ),
)


@contextlib.asynccontextmanager
async def served(app: Starlette) -> AsyncIterator[str]:
    server = await serve(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.stop()


class Admin:
    def __init__(self, base: str, session: aiohttp.ClientSession, index: KvIndex,
                 scorer: KvOverlapScorer, registry: CollectorRegistry) -> None:
        self.base, self.session, self.index, self.scorer = base, session, index, scorer
        self.registry = registry

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.base + path) as resp:
            return resp.status, await resp.json()

    async def post(self, path: str) -> tuple[int, Any]:
        async with self.session.post(self.base + path) as resp:
            return resp.status, await resp.json()


STATUS = [
    SourceStatus("vllm-1", connected=True, events_received=8412, events_dropped=1,
                 index_created=7981, index_evicted=431, reconnect_count=2,
                 last_event_at=1773397457.5),
    SourceStatus("vllm-2"),
]


@contextlib.asynccontextmanager
async def admin_for(index: KvIndex, kv: KvCacheIndexConfig = KV) -> AsyncIterator[Admin]:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, [s.backend_name for s in kv.event_sources])
    scorer = KvOverlapScorer(index, kv.scoring, metrics=metrics)
    app = create_admin_app(RouterConfig(kv_cache_index=kv), index, scorer,
                           source_status=lambda: STATUS, registry=registry)
    async with served(app) as base, aiohttp.ClientSession(timeout=TIMEOUT) as session:
        yield Admin(base, session, index, scorer, registry)


@pytest.fixture
async def admin() -> AsyncIterator[Admin]:
    async with admin_for(InMemoryKvIndex(offloading=KV.storage_offloading)) as a:
        yield a


async def fill(index: KvIndex) -> None:
    await index.apply(IndexEvent(CREATED, "vllm-1", P, 2048))
    await index.apply(IndexEvent(OFFLOADED, "vllm-2", P, 2048))
    await index.apply(IndexEvent(CREATED, "vllm-2", Q, 100))
    await index.apply(IndexEvent(CREATED, "other-router-backend", Q, 50))


async def test_prefix_holders_sorted_by_score(admin: Admin) -> None:
    await fill(admin.index)
    status, body = await admin.get(f"/admin/kv-index/prefix/{P}")
    assert status == 200
    assert body == {"prefix_hash": P, "holders": [
        {"backend": "vllm-1", "token_count": 2048, "tier": "gpu_hot", "score": 1.0},
        {"backend": "vllm-2", "token_count": 2048, "tier": "storage_warm", "score": 0.76},
    ]}
    # Load moves the order: the GPU holder busy, the warm one idle.
    admin.scorer.in_flight.start("vllm-1")
    _, body = await admin.get(f"/admin/kv-index/prefix/{P}")
    assert [(h["backend"], h["score"]) for h in body["holders"]] == [("vllm-2", 0.76),
                                                                      ("vllm-1", 0.7)]
    # The admin view does not count as a routing decision.
    assert admin.scorer.stats.to_json()["total"] == 0


async def test_prefix_unknown_is_404_malformed_is_400(admin: Admin) -> None:
    await fill(admin.index)
    status, body = await admin.get(f"/admin/kv-index/prefix/{'00' * 32}")
    assert (status, body) == (404, {"error": "unknown prefix_hash"})
    # Not a prefix hash at all: the client's mistake, not an unknown prefix. Uppercase too:
    # SPEC §2's prefix_hash is lowercase hex, the form the index is keyed by (P is held).
    for bad in ("not-a-hash", P.upper(), P[:63], P + "0", "g" * 64, "%20" + P[3:]):
        status, body = await admin.get(f"/admin/kv-index/prefix/{bad}")
        assert status == 400, bad
        assert body == {"error": "malformed prefix_hash: expected 64 lowercase hex digits"}
    assert (await admin.get(f"/admin/kv-index/prefix/{P}"))[0] == 200


async def test_healthz(admin: Admin) -> None:
    assert await admin.get("/healthz") == (200, {"status": "ok"})


async def test_stats_shape(admin: Admin) -> None:
    await fill(admin.index)
    await admin.scorer.select(P)
    await admin.scorer.select("77" * 32)
    status, body = await admin.get("/admin/kv-index/stats")
    assert status == 200
    assert body["enabled"] is True
    assert body["config"]["backend"] == "memory"
    assert body["config"]["max_entries"] == 100000
    assert body["config"]["entry_ttl_seconds"] == 600
    assert body["config"]["event_sources_count"] == 2
    assert body["config"]["scoring"] == {
        "overlap_weight": 0.6, "load_weight": 0.3, "health_weight": 0.1,
        "min_overlap_threshold": 0.3, "gpu_tier_weight": 1.0, "storage_tier_weight": 0.6}
    idx = body["index"]
    assert (idx["prefix_count"], idx["entry_count"], idx["total_hits"]) == (2, 4, 1)
    assert idx["total_evictions"] == 0
    assert body["event_sources"][0] == {
        "backend_name": "vllm-1", "connected": True, "events_received": 8412,
        "events_dropped": 1, "last_event_at": "2026-03-13T10:24:17Z", "reconnect_count": 2}
    assert body["event_sources"][1]["last_event_at"] is None
    assert body["routing_decisions"] == {"kv_aware": 1, "fallback": 1, "total": 2}
    assert body["process"]["asyncio_tasks"] >= 1
    assert body["query_latency_count"] == 2
    assert body["overlap_score_count"] == 1


async def test_backends_shape(admin: Admin) -> None:
    await fill(admin.index)
    status, body = await admin.get("/admin/kv-index/backends")
    assert status == 200
    assert body["enabled"] is True
    names = [b["backend_name"] for b in body["backends"]]
    assert names == ["vllm-1", "vllm-2", "other-router-backend"]
    first = body["backends"][0]
    assert first == {
        "backend_name": "vllm-1", "configured": True,
        "connection": {"connected": True, "reconnect_count": 2,
                       "last_event_at": "2026-03-13T10:24:17Z"},
        "events": {"received": 8412, "dropped": 1, "index_created": 7981, "index_evicted": 431},
        "index": {"entries": 1, "gpu_hot": 1, "storage_warm": 0},
    }
    assert body["backends"][1]["index"] == {"entries": 2, "gpu_hot": 1, "storage_warm": 1}
    assert body["backends"][2]["configured"] is False
    assert body["backends"][2]["connection"]["connected"] is False


async def test_clear_reports_counts_and_forgets_prepared_scores(admin: Admin) -> None:
    await fill(admin.index)
    await admin.scorer.prepare(P)
    assert admin.scorer.score(P, "vllm-1") == 1.0
    status, body = await admin.post("/admin/kv-index/clear")
    assert (status, body) == (200, {"success": True, "entries_before_clear": 4,
                                    "cleared_entries": 4})
    assert admin.scorer.score(P, "vllm-1") == 0.0
    assert (await admin.get(f"/admin/kv-index/prefix/{P}"))[0] == 404
    assert (await admin.post("/admin/kv-index/clear"))[1]["entries_before_clear"] == 0
    async with admin.session.get(admin.base + "/admin/kv-index/clear") as resp:
        assert resp.status == 405


async def test_metrics_endpoint_serves_the_router_registry(admin: Admin) -> None:
    await fill(admin.index)
    await admin.scorer.select(P)
    async with admin.session.get(admin.base + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert 'continuum_kv_index_routing_decisions_total{decision="kv_aware",tier="gpu_hot"} 1.0' \
        in text
    assert 'continuum_kv_consumer_connected{backend="vllm-1"} 0.0' in text
    assert "continuum_cache_fallback_active 0.0" in text


async def test_redis_clear_and_stats(redis_server: RedisServer) -> None:
    kv = KvCacheIndexConfig(backend=IndexBackend.REDIS, storage_offloading=KV.storage_offloading,
                            event_sources=KV.event_sources)
    index = RedisKvIndex.from_config(RedisConfig(url=redis_server.url), kv)
    try:
        async with admin_for(index, kv) as admin:
            await fill(index)
            _, body = await admin.get("/admin/kv-index/stats")
            assert body["config"]["backend"] == "redis"
            assert (body["index"]["entry_count"], body["index"]["prefix_count"]) == (4, 2)
            assert body["index"]["fallback_active"] is False
            _, body = await admin.get(f"/admin/kv-index/prefix/{P}")
            assert [h["backend"] for h in body["holders"]] == ["vllm-1", "vllm-2"]
            status, body = await admin.post("/admin/kv-index/clear")
            assert (status, body["entries_before_clear"], body["cleared_entries"]) == (200, 4, 4)
            assert (await admin.get("/admin/kv-index/stats"))[1]["index"]["entry_count"] == 0
    finally:
        await index.close()


async def test_redis_down_without_fallback_is_503(redis_server: RedisServer) -> None:
    kv = KvCacheIndexConfig(backend=IndexBackend.REDIS)
    index = RedisKvIndex.from_config(RedisConfig(url=redis_server.url, fallback_to_memory=False),
                                     kv)
    try:
        async with admin_for(index, kv) as admin:
            redis_server.stop()
            for path in ("/admin/kv-index/stats", "/admin/kv-index/backends"):
                status, body = await admin.get(path)
                assert (status, body["success"]) == (503, False)
            assert (await admin.post("/admin/kv-index/clear"))[0] == 503
            # A query miss is a 404, as for any prefix nobody holds.
            assert (await admin.get(f"/admin/kv-index/prefix/{P}"))[0] == 404
    finally:
        await index.close()
