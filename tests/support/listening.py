"""Shortcuts for the tests that run the listener daemon against a simulated engine: a salted
config's base, and the daemon with one engine publishing and one client of a backend's stream."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from kv_listener.sim.publisher import SimPublisher
from tests.support.daemon import Daemon, SseClient, sse
from tests.support.ports import free_port


def salted_base(tmp_path: Path, secret: str = "s3cret") -> dict[str, Any]:
    """A free `listen` address and `cache_salt` reading `secret` from a file in `tmp_path`."""
    path = tmp_path / "salt.secret"
    path.write_text(secret)
    return {"listen": f"127.0.0.1:{free_port()}", "cache_salt": {"secret_file": str(path)}}


class Listening(NamedTuple):
    daemon: Daemon
    pub: SimPublisher
    client: SseClient


@contextlib.asynccontextmanager
async def listening(config: dict[str, Any], tmp_path: Path, session: aiohttp.ClientSession,
                    zmq_port: int, backend: str) -> AsyncIterator[Listening]:
    """The daemon on `config`, an engine publishing to `zmq_port` (the daemon has subscribed)
    and a client of `backend`'s stream that has read its first event (the resync)."""
    async with Daemon(config, tmp_path) as daemon, \
            SimPublisher(f"tcp://127.0.0.1:{zmq_port}", mode="connect") as pub, \
            sse(session, f"{daemon.base}/events/{backend}") as client:
        await client.next()
        await pub.wait_for_subscriber()
        yield Listening(daemon, pub, client)
