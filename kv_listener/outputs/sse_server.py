"""The listener's HTTP face (SPEC §6): `GET /events/{backend}`, `/healthz`, `/readyz`, `/metrics`,
`/stats`, as a Starlette app, and `serve()`, which runs it under uvicorn in the caller's loop.

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
import contextlib
import math
import socket
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Protocol

import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kv_listener.outputs.streams import (
    EventStream,
    HubDraining,
    StreamHub,
    TooManyClients,
    UnknownBackend,
)
from kv_listener.stats import SourceStats

log = structlog.get_logger(__name__)


class ListenerStatus(Protocol):
    """What the daemon tells the HTTP app about its sources."""

    def not_ready(self) -> Sequence[str]:
        """Backend names of the sources that are not ready (SPEC §6 `/readyz`); empty: ready."""
        ...

    def source_stats(self) -> Mapping[str, Mapping[str, Any]]:
        """backend -> its `/stats` entry (see `source_stats_entry`)."""
        ...

    def metrics_registry(self) -> CollectorRegistry:
        """The registry `/metrics` renders."""
        ...


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
        "detokenize_calls": stats.detokenize_calls,
        "detokenize_errors": stats.detokenize_errors.total(),
        "detokenize_errors_by_reason": dict(stats.detokenize_errors),
        "salt_rejected": stats.salt_rejected,
        "refused_publishers": stats.refused_publishers,
        "last_event_at": stats.last_event_at,
        "ready": stats.ready,
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
        return JSONResponse({
            "sources": sources,
            "streams": {"clients": hub.clients, "max_sse_clients": hub.max_sse_clients,
                        "draining": hub.draining},
        })

    return Starlette(routes=[
        Route("/events/{backend}", events, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ])


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (the daemon owns SIGTERM/SIGINT/SIGHUP) and with an
    event set once it accepts connections."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.accepting = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.accepting.set()


class RunningServer:
    """A started server. `port` is the bound port (useful with port 0)."""

    def __init__(self, server: _Server, task: asyncio.Task[None], host: str, port: int) -> None:
        self._server = server
        self._task = task
        self.host = host
        self.port = port

    async def stop(self) -> None:
        """Graceful stop: no new connections, open responses get the graceful timeout, then
        are cancelled. Drain the hub first so that streams end with `draining`."""
        self._server.should_exit = True
        await asyncio.shield(self._task)

    async def wait(self) -> None:
        """Return when the server stops (after `stop()`, or when it fails)."""
        await asyncio.shield(self._task)


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def serve(
    app: Any, host: str, port: int, *, graceful_timeout_s: float = 5.0, backlog: int = 2048,
) -> RunningServer:
    """Run `app` under uvicorn in the running loop; returns once it accepts connections.

    The socket is bound here, so a bind error is a plain `OSError` for the caller (uvicorn would
    `sys.exit`). Port 0 picks a free port: read it from `RunningServer.port`.
    """
    sock = _bind(host, port, backlog)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, http="h11", ws="none", lifespan="off", log_config=None, access_log=False,
        server_header=False, timeout_graceful_shutdown=math.ceil(graceful_timeout_s),
        backlog=backlog,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn-{host}:{bound_port}")
    accepting = asyncio.create_task(server.accepting.wait())
    try:
        await asyncio.wait({task, accepting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        accepting.cancel()
    if task.done():
        sock.close()
        task.result()  # raises what made it stop
        raise RuntimeError("uvicorn stopped during startup")
    log.info("http_listening", host=host, port=bound_port)
    return RunningServer(server, task, host, bound_port)
