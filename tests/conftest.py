"""Shared test fixtures. Component-specific fixtures live in their own modules (tests/support/)."""

from __future__ import annotations

import gc
import os
import sys
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

# Bytecode caches on, whatever the environment says. This machine (and CI on it) sets
# PYTHONDONTWRITEBYTECODE=1: then every Python process of the suite compiled the project's
# modules from source again, the four workers and each daemon, router, simulator and bench run
# a test starts (61 tests that start such processes, run alone: 45.5 -> 39.0 CPU s). The caches
# go where Python puts them by default (`__pycache__/`, ignored by git); the workers and the
# tests' subprocesses inherit this environment.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    """No cyclic garbage collection while the tests are collected; what collection built is
    frozen after it. Collecting imports every test module (re-writing its asserts) and makes
    ~1,700 items that live to the end: CPython's collector, run every 700 allocations, walked
    that growing heap again and again (a cold collection 6.5 -> 4.2-4.8 CPU s per worker, four
    workers; later full collections skip the frozen part). Not in xdist's controller: it
    collects nothing."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.enable()
    gc.freeze()


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
