"""Shared test fixtures. Component-specific fixtures live in their own modules (tests/support/)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from tests.support.ports import free_port  # noqa: F401 (bench/ scripts import it from here)
from tests.support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

# Nothing may be downloaded at run time: make transformers / huggingface_hub fail fast instead.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `-n` and the default `--dist load`: the engine tests together on one worker, each
    module sharing one expensive module-scoped set-up whole on one, the rest test by test
    (tests/support/workers.py)."""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for on the command line: xdist's own
    from tests.support.workers import SuiteScheduling  # noqa: PLC0415 (xdist only when -n)

    return SuiteScheduling(config, log)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client session for tests that talk to a real server."""
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on 127.0.0.1 for the test (tests/support/redis_server.py)."""
    with RedisServer(tmp_path) as server:
        yield server


@pytest.fixture
async def lease_redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A client of that server with 0.5 s timeouts, as a router's writer lease uses one: a hung
    server (`CLIENT PAUSE`) shows as timeouts, not as a wait (tests of router/lease.py)."""
    client = Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=0.5,
                            socket_connect_timeout=0.5)
    yield client
    await client.aclose()


@pytest.fixture
async def raw_redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A plain client of that server, to look at the keys an index wrote."""
    client = Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()
