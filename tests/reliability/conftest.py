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

from tests.conftest import free_port
from tests.engines.view import StreamView
from tests.reliability.harness import (
    RouterView,
    Stack,
    TruthEngine,
    listener_config,
    router_config,
)
from tests.support.daemon import Daemon
from tests.support.redis_server import RedisServer


async def start_stack(tmp: Path, cleanup: contextlib.AsyncExitStack,
                      extra_sources: Sequence[Mapping[str, Any]] = ()) -> Stack:
    engines = {}
    for name in ("vllm-1", "vllm-2"):
        engine = TruthEngine(name)
        cleanup.push_async_callback(engine.close)
        engines[name] = await engine.start()
    redis = RedisServer(tmp)
    redis.start()
    cleanup.callback(redis.stop)
    listen = f"127.0.0.1:{free_port()}"
    listener = Daemon(listener_config(int(listen.rsplit(":")[1]), list(engines.values()),
                                      extra_sources), tmp)
    cleanup.push_async_callback(listener.stop)
    await listener.start()
    http = await cleanup.enter_async_context(aiohttp.ClientSession())
    routers = []
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
                  routers=routers, redis=redis)
    for engine in engines.values():
        await engine.publisher.wait_for_subscriber()
    return stack


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    tmp = tmp_path_factory.mktemp("reliability")
    async with contextlib.AsyncExitStack() as cleanup:
        st = await start_stack(tmp, cleanup)
        await st.converge()
        try:
            yield st
        finally:
            for v in st.views.values():
                await v.close()
