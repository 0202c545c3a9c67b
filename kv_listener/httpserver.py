"""Run an ASGI app under uvicorn inside our own asyncio loop (shared by the listener's SSE app and
the router's admin app).

uvicorn's own signal handlers are disabled: the daemon owns SIGTERM/SIGINT/SIGHUP. The socket is
bound here so a bind failure is a plain `OSError` for the caller (uvicorn would `sys.exit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import Generator
from typing import Any

import structlog
import uvicorn

log = structlog.get_logger(__name__)


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
