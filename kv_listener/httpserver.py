"""Run an ASGI app under uvicorn inside our own asyncio loop (shared by the listener's SSE app and
the router's admin app).

uvicorn's own signal handlers are disabled: the daemon owns SIGTERM/SIGINT/SIGHUP. The socket is
bound here so a bind failure is a plain `OSError` for the caller (uvicorn would `sys.exit`).

Slow and hostile clients (issue #11): uvicorn 0.30-0.54 has no header read timeout (a client that
drips its request line and headers one byte at a time holds a connection for ever; its keep-alive
timer is cancelled by the first byte) and no hard connection cap (`limit_concurrency` answers 503
only once a request is complete). `_GuardedH11Protocol` adds both: a request's headers must be
complete within `header_timeout_s` of the connection, or of the previous response's end, else the
connection is closed; beyond `max_connections` open connections a new one is closed at once.
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
from uvicorn.protocols.http.h11_impl import H11Protocol

from kv_listener.timer import Deadline

log = structlog.get_logger(__name__)

#: Time a client has to send a whole request line and headers.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Open connections at most, whatever they do (SSE streams, scrapes, half-sent requests).
DEFAULT_MAX_CONNECTIONS = 1024


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header read timeout and a hard connection cap (see the
    module docstring). Configured through class attributes set by `serve()`."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    max_connections = DEFAULT_MAX_CONNECTIONS
    refused = 0  # connections closed at once (over the cap)
    timed_out = 0  # connections closed because their headers did not arrive in time

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline = Deadline(self._header_timed_out)
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            type(self).refused += 1
            transport.abort()
            return
        self._header_deadline.arm(self.header_timeout_s, self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_deadline.cancel()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers are complete
            self._header_deadline.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is not None \
                and self.cycle.response_complete:
            # the next request on this connection gets the same time
            self._header_deadline.arm(self.header_timeout_s, self.loop)

    def _header_timed_out(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            type(self).timed_out += 1
            self.transport.close()


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
        #: The connection protocol class (its `refused` and `timed_out` counters).
        self.protocol: type[_GuardedH11Protocol] = _GuardedH11Protocol

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
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> RunningServer:
    """Run `app` under uvicorn in the running loop; returns once it accepts connections.

    The socket is bound here, so a bind error is a plain `OSError` for the caller (uvicorn would
    `sys.exit`). Port 0 picks a free port: read it from `RunningServer.port`.
    """
    sock = _bind(host, port, backlog)
    bound_port = sock.getsockname()[1]
    # One protocol class per server: the limits are its class attributes.
    protocol = type("GuardedH11Protocol", (_GuardedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "max_connections": max_connections,
        "refused": 0, "timed_out": 0})
    config = uvicorn.Config(
        app, http=protocol, ws="none", lifespan="off", log_config=None, access_log=False,
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
    log.info("http_listening", host=host, port=bound_port, header_timeout_s=header_timeout_s,
             max_connections=max_connections)
    running = RunningServer(server, task, host, bound_port)
    running.protocol = protocol
    return running
