"""Admin HTTP API of the companion router (Starlette), JSON shaped like the seed's.

Owns: the routes and their JSON; serving the app (uvicorn on `admin.listen`) is the caller's job.

- `GET  /admin/kv-index/stats`     config, index counts, event sources, routing decisions.
- `GET  /admin/kv-index/backends`  per backend: connection, event counters, index entries; with
  `kv_cache_index.writer_lease` enabled also `lease` (`writer` | `standby`: whether this router
  consumes the backend's stream and writes it) and `lease_holder` (the holder id last seen).
- `POST /admin/kv-index/clear`     empties the index: `{"success", "entries_before_clear",
  "cleared_entries"}`. With the Redis index this deletes EVERY key under the configured key
  prefix (`kv_cache_index.key_prefix`, default `cr:kvidx:`), which all routers sharing that Redis
  use: they lose their index too. Every index refills from the event streams as events arrive.
- `GET  /admin/kv-index/prefix/{prefix_hash}` -> `{"prefix_hash", "holders": [{"backend",
  "token_count", "tier", "score"}]}`, best score first; `400` when `prefix_hash` is not 64
  lowercase hex digits (SPEC §2's form, the one the index keys use), `404` when no backend
  holds a well-formed one.
- `GET  /metrics`                  the router's Prometheus registry, when one is given.
- `GET  /healthz`                  `{"status": "ok"}` while the process serves (liveness probe).

Authentication (`admin.auth`, optional; the seed: "all admin endpoints ... need authentication
depending on configuration"): without it nothing is checked (`admin.listen` defaults to
127.0.0.1 and the config warns when it is not a loopback address). With it, every request needs
`authorization: Bearer <token>` whose SHA-256 is one of `admin.auth.tokens[].token_hash`, except
`GET /healthz` (a kubelet's probe carries no credential) and `GET /metrics` unless
`admin.auth.protect_metrics` (Prometheus can send a bearer token, `authorization.credentials_file`
in its scrape config, but many scrape setups cannot; the metrics hold no prefix hash). Unknown
paths are refused like known ones, so a client without a token learns nothing about the routes.
A refusal is `401` with `www-authenticate: Bearer realm="continuum-kv-router"`, counted in
`continuum_kv_admin_auth_failures_total{reason}` and logged as `admin_auth_failed` (reason,
method, path, client address; never the header), at most once a minute per reason with the
count of the refusals held back meanwhile. Tokens are compared by their SHA-256 in constant time.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kv_listener.core.records import is_prefix_hash
from kv_listener.router.config import AdminAuthConfig, RouterConfig
from kv_listener.router.consumer_state import SourceStatus
from kv_listener.router.index import BackendEntries, IndexStats, KvIndex
from kv_listener.router.metrics import AuthFailure, RouterMetrics
from kv_listener.router.oplog import LogThrottle
from kv_listener.router.redis_store import REDIS_ERRORS, IndexUnavailableError
from kv_listener.router.scorer import KvOverlapScorer, PreparedPrefix

log = structlog.get_logger(__name__)

AUTH_REALM = "continuum-kv-router"
#: The least time between two `admin_auth_failed` lines of one reason (the counter counts all).
AUTH_LOG_INTERVAL_S = 60.0
#: The longest request path an `admin_auth_failed` line carries (a scanner's paths are junk).
_LOGGED_PATH_CHARS = 200
_AUTH_ERRORS = {
    AuthFailure.MISSING: "missing bearer token (authorization: Bearer <token>)",
    AuthFailure.MALFORMED: "malformed authorization header (expected: Bearer <token>)",
    AuthFailure.INVALID: "invalid bearer token",
}


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unavailable(exc: BaseException) -> JSONResponse:
    log.warning("admin_index_unavailable", error=type(exc).__name__)
    return JSONResponse({"success": False, "error": "index unavailable (Redis unreachable)"},
                        status_code=503)


_INDEX_DOWN: tuple[type[Exception], ...] = (IndexUnavailableError, *REDIS_ERRORS)


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | AuthFailure:
    """The token of the request's one `authorization: Bearer <token>` header (raw bytes, as
    hashed), or why there is none. The scheme is case-insensitive (RFC 9110 §11.1)."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if not values:
        return AuthFailure.MISSING
    if len(values) > 1:
        return AuthFailure.MALFORMED
    scheme, _, token = values[0].strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token or b" " in token or b"\t" in token:
        return AuthFailure.MALFORMED
    return token


class BearerAuth:
    """ASGI middleware in front of the admin routes: refuses (401) an http request without a
    valid bearer token unless `auth.exempt()` names its path (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, auth: AdminAuthConfig, metrics: RouterMetrics | None,
                 log_interval_s: float = AUTH_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.auth = auth
        self.metrics = metrics
        # One throttle per reason: a client alternating reasons must not defeat it.
        self._throttles = {r: LogThrottle(log_interval_s, clock) for r in AuthFailure}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.auth.exempt(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        failure = token if isinstance(token, AuthFailure) else None
        if failure is None and self.auth.match(token) is None:
            failure = AuthFailure.INVALID
        if failure is None:
            await self.app(scope, receive, send)
            return
        self._refused(scope, failure)
        challenge = f'Bearer realm="{AUTH_REALM}"'
        if failure is AuthFailure.INVALID:
            challenge += ', error="invalid_token"'  # RFC 6750 §3.1
        response = JSONResponse({"error": _AUTH_ERRORS[failure]}, status_code=401,
                                headers={"www-authenticate": challenge})
        await response(scope, receive, send)

    def _refused(self, scope: Scope, failure: AuthFailure) -> None:
        if self.metrics is not None:
            self.metrics.admin_auth_failed(failure)
        held = self._throttles[failure].check(failure)
        if held is None:
            return
        client = scope.get("client")
        log.warning("admin_auth_failed", reason=failure.value, method=scope.get("method"),
                    path=str(scope.get("path", ""))[:_LOGGED_PATH_CHARS],
                    client=client[0] if client else None, suppressed=held)


def create_admin_app(
    config: RouterConfig,
    index: KvIndex,
    scorer: KvOverlapScorer,
    *,
    source_status: Callable[[], Iterable[SourceStatus]] = tuple,
    registry: CollectorRegistry | None = None,
    metrics: RouterMetrics | None = None,
    auth_log_interval_s: float = AUTH_LOG_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    """The admin app for `config`. `metrics` counts refused requests when `admin.auth` is set;
    `auth_log_interval_s` and the monotonic `clock` bound its `admin_auth_failed` lines."""
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
            if kv.writer_lease.enabled:
                out[-1]["lease"] = st.lease
                out[-1]["lease_holder"] = st.lease_holder
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
        if not is_prefix_hash(prefix_hash):
            # Not a prefix hash at all (uppercase included: SPEC §2 keys are lowercase and the
            # index never holds another form), so no prefix could ever be found under it.
            return JSONResponse({"error": "malformed prefix_hash: expected 64 lowercase hex "
                                          "digits"}, status_code=400)
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

    async def prometheus(_: Request) -> Response:
        assert registry is not None
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    routes = [
        Route("/admin/kv-index/stats", stats, methods=["GET"]),
        Route("/admin/kv-index/backends", backends, methods=["GET"]),
        Route("/admin/kv-index/clear", clear, methods=["POST"]),
        Route("/admin/kv-index/prefix/{prefix_hash}", prefix, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    if registry is not None:
        routes.append(Route("/metrics", prometheus, methods=["GET"]))
    middleware = []
    if config.admin.auth is not None:
        middleware.append(Middleware(BearerAuth, auth=config.admin.auth, metrics=metrics,
                                     log_interval_s=auth_log_interval_s, clock=clock))
    return Starlette(routes=routes, middleware=middleware)
