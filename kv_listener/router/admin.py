"""Admin HTTP API of the companion router (Starlette), JSON shaped like the seed's.

Owns: the routes and their JSON; serving the app (uvicorn on `admin.listen`) is the caller's job.

- `GET  /admin/kv-index/stats`     config, index counts, event sources, routing decisions.
- `GET  /admin/kv-index/backends`  per backend: connection, event counters, index entries.
- `POST /admin/kv-index/clear`     empties the index: `{"success", "entries_before_clear",
  "cleared_entries"}`. With the Redis index this deletes EVERY key under the configured key
  prefix (`kv_cache_index.key_prefix`, default `cr:kvidx:`), which all routers sharing that Redis
  use: they lose their index too. Every index refills from the event streams as events arrive.
- `GET  /admin/kv-index/prefix/{prefix_hash}` -> `{"prefix_hash", "holders": [{"backend",
  "token_count", "tier", "score"}]}`, best score first, `404` when no backend holds it.
- `GET  /metrics`                  the router's Prometheus registry, when one is given.

The endpoints have no authentication: `admin.listen` defaults to 127.0.0.1 and the config warns
when it is not a loopback address.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kv_listener.router.config import RouterConfig
from kv_listener.router.index import PREFIX_HASH_RE, BackendEntries, IndexStats, KvIndex
from kv_listener.router.redis_index import REDIS_ERRORS, IndexUnavailableError
from kv_listener.router.scorer import KvOverlapScorer, PreparedPrefix

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """What the consumer manager reports per event source (the seed's per-source stats)."""

    backend_name: str
    connected: bool = False
    events_received: int = 0
    events_dropped: int = 0
    index_created: int = 0  # cache_created applied
    index_evicted: int = 0  # cache_evicted applied
    reconnect_count: int = 0
    last_event_at: float | None = None  # wall clock (epoch seconds) of the last event


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unavailable(exc: BaseException) -> JSONResponse:
    log.warning("admin_index_unavailable", error=type(exc).__name__)
    return JSONResponse({"success": False, "error": "index unavailable (Redis unreachable)"},
                        status_code=503)


_INDEX_DOWN: tuple[type[Exception], ...] = (IndexUnavailableError, *REDIS_ERRORS)


def create_admin_app(
    config: RouterConfig,
    index: KvIndex,
    scorer: KvOverlapScorer,
    *,
    source_status: Callable[[], Iterable[SourceStatus]] = tuple,
    registry: CollectorRegistry | None = None,
) -> Starlette:
    kv = config.kv_cache_index

    def sources() -> list[SourceStatus]:
        return list(source_status())

    async def stats(_: Request) -> Response:
        try:
            s: IndexStats = await index.stats()
        except _INDEX_DOWN as exc:
            return _unavailable(exc)
        sc = kv.scoring
        body: dict[str, Any] = {
            "enabled": kv.enabled,
            "config": {
                "backend": kv.backend.value,
                "max_entries": kv.max_entries,
                "entry_ttl_seconds": kv.entry_ttl_seconds,
                "key_prefix": kv.key_prefix,
                "event_sources_count": len(kv.event_sources),
                "scoring": {
                    "overlap_weight": sc.overlap_weight, "load_weight": sc.load_weight,
                    "health_weight": sc.health_weight,
                    "min_overlap_threshold": sc.min_overlap_threshold,
                    "gpu_tier_weight": sc.gpu_tier_weight,
                    "storage_tier_weight": sc.storage_tier_weight,
                },
                "storage_offloading": {
                    "enabled": kv.storage_offloading.enabled,
                    "treat_eviction_as_offload": kv.storage_offloading.treat_eviction_as_offload,
                },
            },
            "index": s.to_json(),
            "event_sources": [
                {"backend_name": st.backend_name, "connected": st.connected,
                 "events_received": st.events_received, "events_dropped": st.events_dropped,
                 "last_event_at": _iso(st.last_event_at), "reconnect_count": st.reconnect_count}
                for st in sources()
            ],
            "routing_decisions": scorer.stats.to_json(),
            "process": {"asyncio_tasks": len(asyncio.all_tasks())},
            "query_latency_count": scorer.stats.index_queries,
            "overlap_score_count": scorer.stats.overlap_scores,
        }
        return JSONResponse(body)

    async def backends(_: Request) -> Response:
        try:
            s = await index.stats()
        except _INDEX_DOWN as exc:
            return _unavailable(exc)
        by_name = {st.backend_name: st for st in sources()}
        # Configured sources first (config order), then backends only the index knows (a shared
        # Redis index holds other routers' backends too).
        names = [src.backend_name for src in kv.event_sources]
        names += sorted(set(by_name) - set(names))
        names += sorted(set(s.per_backend) - set(names))
        out = []
        for name in names:
            st = by_name.get(name, SourceStatus(name))
            counts = s.per_backend.get(name, BackendEntries())
            out.append({
                "backend_name": name,
                "configured": kv.source(name) is not None,
                "connection": {"connected": st.connected, "reconnect_count": st.reconnect_count,
                               "last_event_at": _iso(st.last_event_at)},
                "events": {"received": st.events_received, "dropped": st.events_dropped,
                           "index_created": st.index_created, "index_evicted": st.index_evicted},
                "index": {"entries": counts.total, "gpu_hot": counts.gpu_hot,
                          "storage_warm": counts.storage_warm},
            })
        return JSONResponse({"enabled": kv.enabled, "backends": out})

    async def clear(_: Request) -> Response:
        try:
            result = await index.clear()
        except _INDEX_DOWN as exc:
            return _unavailable(exc)
        scorer.invalidate()  # no routing on what was just cleared
        log.info("admin_kv_index_cleared", entries_before_clear=result.entries_before_clear,
                 cleared_entries=result.cleared_entries)
        return JSONResponse({"success": True, "entries_before_clear": result.entries_before_clear,
                             "cleared_entries": result.cleared_entries})

    async def prefix(request: Request) -> Response:
        prefix_hash = request.path_params["prefix_hash"]
        if not PREFIX_HASH_RE.match(prefix_hash):
            return JSONResponse({"error": "unknown prefix_hash (expected 64 lowercase hex)"},
                                status_code=404)
        try:
            holders = await index.query(prefix_hash)
        except _INDEX_DOWN as exc:
            return _unavailable(exc)
        if not holders:
            return JSONResponse({"error": "unknown prefix_hash"}, status_code=404)
        # Scored like a request would be now (fresh index read, current load), without touching
        # the scorer's prepare cache or its decision counters.
        prepared = PreparedPrefix(prefix_hash, holders, scorer.in_flight.snapshot(), 0.0)
        return JSONResponse({
            "prefix_hash": prefix_hash,
            "holders": [{"backend": b.backend, "token_count": b.token_count,
                         "tier": b.tier.value, "score": round(b.score, 6)}
                        for b in scorer.breakdown(prepared)],
        })

    async def metrics(_: Request) -> Response:
        assert registry is not None
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/admin/kv-index/stats", stats, methods=["GET"]),
        Route("/admin/kv-index/backends", backends, methods=["GET"]),
        Route("/admin/kv-index/clear", clear, methods=["POST"]),
        Route("/admin/kv-index/prefix/{prefix_hash}", prefix, methods=["GET"]),
    ]
    if registry is not None:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    return Starlette(routes=routes)
