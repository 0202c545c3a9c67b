"""The listener's HTTP face (SPEC §6): `GET /events/{backend}`, `/healthz`, `/readyz` (and one
source's `/readyz/{backend}`), `/metrics`, `/stats`, as a Starlette app;
`kv_listener.httpserver.serve()` runs it under uvicorn in the caller's loop (re-exported here).

Owns: the HTTP mapping of the streams (`Last-Event-ID` header or `last_event_id` query parameter;
404 for an unknown backend, 503 above `max_sse_clients` or while draining), the JSON shape of
`/stats`, and the server lifecycle. The bytes of a stream come from `StreamHub.open()` unchanged
(the push mode sends the same iterator's bytes); what the daemon knows about its sources
(readiness, counters, the Prometheus registry) comes in through the `ListenerStatus` protocol.

Why not sse-starlette: it patches uvicorn's signal handler at import and polls a process-wide
shutdown flag, and we own the signals; our iterator already yields finished SSE bytes,
keep-alive comments included, so a plain streaming response is byte-exact.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kv_listener.httpserver import RunningServer, serve
from kv_listener.outputs.streams import (
    EventStream,
    HubDraining,
    StreamHub,
    TooManyClients,
    UnknownBackend,
)
from kv_listener.stats import SourceStats

__all__ = ["ListenerStatus", "NoSources", "RunningServer", "create_app", "serve", "source_stats_entry"]

log = structlog.get_logger(__name__)


class ListenerStatus(Protocol):
    """What the daemon tells the HTTP app about its sources."""

    def not_ready(self) -> Sequence[str]:
        """Backend names of the sources that are not ready (SPEC §6 `/readyz`); empty: ready."""
        ...

    def source_readiness(self, backend: str) -> Mapping[str, Any] | None:
        """`/readyz/{backend}`: {"backend", "ready", "reason", ...}; None for an unknown one."""
        ...

    def source_stats(self) -> Mapping[str, Mapping[str, Any]]:
        """backend -> its `/stats` entry (see `source_stats_entry`)."""
        ...

    def metrics_registry(self) -> CollectorRegistry:
        """The registry `/metrics` renders."""
        ...


class NoSources:
    """`ListenerStatus` of an app that serves a hub's streams with no sources behind it (tests,
    benches, a hub fed by something else): always ready, no source stats, an empty registry."""

    def __init__(self) -> None:
        self._registry = CollectorRegistry()

    def not_ready(self) -> Sequence[str]:
        return []

    def source_readiness(self, backend: str) -> Mapping[str, Any] | None:
        return None

    def source_stats(self) -> Mapping[str, Mapping[str, Any]]:
        return {}

    def metrics_registry(self) -> CollectorRegistry:
        return self._registry


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def source_stats_entry(
    stats: SourceStats, *, blocks_tracked: int, tokens_retained: int, prefixes_live: int,
) -> dict[str, Any]:
    """One source's `/stats` entry in the SPEC §6 shape (plus a few keys of ours)."""
    return {
        "engine": stats.engine,
        "events_received": stats.events_received,
        "events_decoded": stats.events_decoded,
        "events_dropped": dict(stats.events_dropped),
        "gaps": stats.gaps,
        "replays": stats.replays,
        "replay_failures": stats.replay_failures,
        "clears": stats.clears.total(),
        "clears_by_reason": dict(stats.clears),
        "blocks_tracked": blocks_tracked,
        "tokens_retained": tokens_retained,
        "prefixes_live": prefixes_live,
        "queued_tokens": stats.queued_tokens,
        "queued_hashes": stats.queued_hashes,
        "detokenize_calls": stats.detokenize_calls,
        "tokenize_calls": stats.tokenize_calls,
        "detokenize_errors": stats.detokenize_errors.total(),
        "detokenize_errors_by_reason": dict(stats.detokenize_errors),
        "salt_rejected": stats.salt_rejected,
        "refused_publishers": stats.refused_publishers,
        "zmq_disconnects": stats.zmq_disconnects,
        "publishers_connected": stats.publishers_connected,
        # ISO 8601 UTC like the router's admin JSON (the seed's format); the epoch float too
        "last_event_at": _iso(stats.last_event_at),
        "last_event_ts": stats.last_event_at,
        "ready": stats.ready,
        "startup_replay": None if stats.startup_replay is None else {
            "status": stats.startup_replay, "batches": stats.startup_replay_batches,
            "from_seq": stats.startup_replay_from_seq},
        "engine_state": stats.engine_state,
        "engine_downs": stats.engine_downs,
    }


# no-store: an SSE stream is never cacheable; X-Accel-Buffering: nginx must not hold records back.
_SSE_HEADERS = {"cache-control": "no-store", "x-accel-buffering": "no"}
_SSE_MEDIA_TYPE = "text/event-stream"


class _EventStreamResponse(StreamingResponse):
    """Streams an `EventStream` and closes it however the response ends (end of stream, client
    gone, cancellation), so the client slot is freed at once."""

    def __init__(self, stream: EventStream) -> None:
        super().__init__(stream, media_type=_SSE_MEDIA_TYPE, headers=_SSE_HEADERS)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.aclose()


def _unknown_backend(backend: str) -> Response:
    return JSONResponse({"error": "unknown backend", "backend": backend}, status_code=404)


def create_app(hub: StreamHub, status: ListenerStatus) -> Starlette:
    """The listener's Starlette app (no lifespan: the daemon starts and stops things itself)."""

    async def events(request: Request) -> Response:
        backend = request.path_params["backend"]
        # The header (sent by EventSource on reconnect) is newer than the URL it reconnects to.
        last_id = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        if request.method == "HEAD":
            # Starlette answers HEAD on GET routes; an endless body must not be started for it.
            if backend not in hub.backends:
                return _unknown_backend(backend)
            return Response(media_type=_SSE_MEDIA_TYPE, headers=_SSE_HEADERS)
        try:
            stream = hub.open(backend, last_id or None)
        except UnknownBackend:
            return _unknown_backend(backend)
        except TooManyClients:
            log.warning("sse_too_many_clients", backend=backend, limit=hub.max_sse_clients)
            return JSONResponse({"error": "too many streams", "limit": hub.max_sse_clients},
                                status_code=503, headers={"retry-after": "1"})
        except HubDraining:
            return JSONResponse({"error": "draining"}, status_code=503,
                                headers={"retry-after": "1"})
        return _EventStreamResponse(stream)

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> Response:
        not_ready = sorted(status.not_ready())
        return JSONResponse(not_ready, status_code=503 if not_ready else 200)

    async def readyz_source(request: Request) -> Response:
        # One source, stricter than /readyz: its engine must be connected too. For a probe or
        # an alert about one backend, where one dead source must not fail the others.
        backend = request.path_params["backend"]
        body = status.source_readiness(backend)
        if body is None:
            return _unknown_backend(backend)
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(status.metrics_registry()),
                        media_type=CONTENT_TYPE_LATEST)

    async def stats(_: Request) -> Response:
        sources: dict[str, dict[str, Any]] = {
            name: dict(entry) for name, entry in status.source_stats().items()
        }
        for name, stream_stats in hub.stats().items():
            entry = sources.setdefault(name, {})
            for key, value in stream_stats.items():
                entry.setdefault(key, value)
        body: dict[str, Any] = {
            "sources": sources,
            "streams": {"clients": hub.clients, "max_sse_clients": hub.max_sse_clients,
                        "draining": hub.draining},
            "process": {"asyncio_tasks": len(asyncio.all_tasks())},
        }
        extra = getattr(status, "extra_stats", None)  # optional: e.g. the push client's state
        if extra is not None:
            body.update(extra())
        return JSONResponse(body)

    return Starlette(routes=[
        Route("/events/{backend}", events, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/readyz/{backend}", readyz_source, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ])
