"""The reliability suite's shared pipeline (one per test module: started once, each test ends
converged, so the next one starts from a known state)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.engines.view import StreamView
from tests.reliability.harness import (
    BUS_TOKEN,
    RouterView,
    Stack,
    TrtllmTruthEngine,
    TruthEngine,
    bus_listener_block,
    bus_router_config,
    listener_config,
    router_config,
)
from tests.support.daemon import Daemon
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer
from tests.support.tls import TlsMaterial


async def start_stack(tmp: Path, cleanup: contextlib.AsyncExitStack,
                      extra_sources: Sequence[Mapping[str, Any]] = (),
                      bus: TlsMaterial | None = None, trtllm: bool = False) -> Stack:
    """Engines, Redis, the listener, a router on each index; with `bus`, the listener also
    pushes every backend to a third router's event bus (TLS HTTP/2, bearer token)."""
    engines: dict[str, Any] = {}
    for name in ("vllm-1", "vllm-2"):
        engine = TruthEngine(name)
        cleanup.push_async_callback(engine.close)
        engines[name] = await engine.start()
    if trtllm:
        trt = TrtllmTruthEngine("trtllm-1")
        cleanup.push_async_callback(trt.close)
        engines[trt.name] = await trt.start()
    redis = RedisServer(tmp)
    redis.start()
    cleanup.callback(redis.stop)
    listen = f"127.0.0.1:{free_port()}"
    top: dict[str, Any] = {}
    routers = []
    bus_port = None
    if bus is not None:
        bus_port, admin_port = free_port(), free_port()
        token = tmp / "bus-token"
        token.write_bytes(BUS_TOKEN + b"\n")
        top["event_bus"] = bus_listener_block(bus_port, bus.ca_file, token)
        d = Daemon(bus_router_config(list(engines), admin_port, bus_port, bus.server.cert,
                                     bus.server.key),
                   tmp, command=("router",), name="router-bus", started="router_started")
        cleanup.push_async_callback(d.stop)
        await d.start()
        routers.append(RouterView("bus", d, admin_port))
    listener = Daemon(listener_config(int(listen.rsplit(":")[1]), list(engines.values()),
                                      extra_sources, **top), tmp)
    cleanup.push_async_callback(listener.stop)
    await listener.start()
    http = await cleanup.enter_async_context(aiohttp.ClientSession())
    for rname, url in (("memory", None), ("redis", redis.url)):
        port = free_port()
        d = Daemon(router_config(listen, engines, port, url), tmp, command=("router",),
                   name=f"router-{rname}", started="router_started")
        cleanup.push_async_callback(d.stop)
        await d.start()
        routers.append(RouterView(rname, d, port))
    views = {n: StreamView(listener.base, n) for n in engines}
    for v in views.values():
        cleanup.push_async_callback(v.close)
        v.start(http)
    stack = Stack(tmp=tmp, http=http, engines=engines, listener=listener, views=views,
                  routers=routers, redis=redis, bus_port=bus_port)
    for engine in engines.values():
        if isinstance(engine, TruthEngine):
            await engine.publisher.wait_for_subscriber()
    return stack


@contextlib.asynccontextmanager
async def running_stack(tmp: Path, **kwargs: Any
                        ) -> AsyncIterator[tuple[Stack, contextlib.AsyncExitStack]]:
    """`start_stack` whose whole pipeline (the SSE views of the moment included) is stopped on
    exit; the caller may add to the exit stack and must converge once its setup is done."""
    async with contextlib.AsyncExitStack() as cleanup:
        st = await start_stack(tmp, cleanup, **kwargs)

        async def close_views() -> None:
            for v in st.views.values():  # restart_views may have replaced the first ones
                await v.close()

        cleanup.push_async_callback(close_views)
        yield st, cleanup


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with running_stack(tmp_path_factory.mktemp("reliability")) as (st, _):
        await st.converge()
        yield st
