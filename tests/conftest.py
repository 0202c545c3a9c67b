"""Shared test fixtures. Component-specific fixtures live in their own modules (tests/support/)."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

# Nothing may be downloaded at run time: make transformers / huggingface_hub fail fast instead.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers that cannot bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def unused_port() -> Iterator[int]:
    yield free_port()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client session for tests that talk to a real server."""
    async with aiohttp.ClientSession() as s:
        yield s
