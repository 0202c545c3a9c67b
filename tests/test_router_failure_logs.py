"""The router's failure logs as an operator reads them (issue 14, finding 9), from the real
rendered JSON output at `log.level: info`: a real consumer pointed at a closed port, at a server
that resets connections and then answers 503; a real Redis index pointed at a closed port (with
and without its in-memory fallback) and at a real redis-server that comes back. The lines carry
the URL or address (credentials stripped), the error class and errno/strerror or HTTP status;
an unchanged failure repeats at most once per interval, counted over a bounded number of attempts
(the consumer's sleep and clock are injected: the backoff is simulated, not waited for)."""

from __future__ import annotations

import asyncio
import errno
import io
import itertools
import json
import logging
import os
import socket
import struct
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import structlog

from kv_listener.core.records import Record
from kv_listener.logging import configure_logging
from kv_listener.outputs.sse_server import NoSources, create_app, serve
from kv_listener.outputs.streams import StreamHub
from kv_listener.router.config import EventSourceConfig, KvCacheIndexConfig
from kv_listener.router.config_redis import RedisConfig
from kv_listener.router.consumer import KvEventConsumerManager
from kv_listener.router.index import IndexEvent, PrefixEventType
from kv_listener.router.oplog import LOG_REPEAT_INTERVAL_S
from kv_listener.router.redis_index import IndexUnavailableError, RedisKvIndex
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer

B = "vllm-1"
SECRET = "pw-do-not-log-7c1e"
TIMEOUT_S = 10.0
EVENT = IndexEvent(PrefixEventType.CACHE_CREATED, B, "ab" * 32, 128)


class JsonLog:
    """What the process writes with `log: {level: info, format: json}`."""

    def __init__(self) -> None:
        self.buf = io.StringIO()

    @property
    def text(self) -> str:
        return self.buf.getvalue()

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        out = [json.loads(line) for line in self.text.splitlines() if line.strip()]
        return [r for r in out if event is None or r.get("event") == event]


@pytest.fixture
def json_log() -> Iterator[JsonLog]:
    log = JsonLog()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, sys.excepthook, threading.excepthook,
             sys.unraisablehook)
    configure_logging("info", "json", stream=log.buf)
    try:
        yield log
    finally:
        structlog.reset_defaults()
        logging.captureWarnings(False)
        for h in list(root.handlers):
            root.removeHandler(h)
        handlers, level, sys.excepthook, threading.excepthook, sys.unraisablehook = saved
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


class SimulatedTime:
    """The consumer's injected `sleep` and `monotonic`: a sleep advances the clock by its delay
    at once. From the `park_at`-th sleep on, sleeping waits for `resume` (set by the test)."""

    def __init__(self, park_at: int) -> None:
        self.now = 0.0
        self.delays: list[float] = []
        self.park_at = park_at
        self.resume = asyncio.Event()
        self._slept = asyncio.Condition()
        self.hooks: dict[int, Any] = {}  # sleep number -> async callable, run before returning

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        self.now += delay
        hook = self.hooks.get(len(self.delays))
        if hook is not None:
            await hook()
        async with self._slept:
            self._slept.notify_all()
        if len(self.delays) >= self.park_at:
            await self.resume.wait()
        await asyncio.sleep(0)

    async def wait_sleeps(self, n: int) -> None:
        async with asyncio.timeout(TIMEOUT_S), self._slept:
            await self._slept.wait_for(lambda: len(self.delays) >= n)


class Connected:
    """The part of the router metrics the consumer feeds, as an awaitable queue."""

    def __init__(self) -> None:
        self.changes: asyncio.Queue[bool] = asyncio.Queue()

    def event_dropped_inc(self, backend: str, reason: Any, n: int = 1) -> None:
        pass

    def set_connected(self, backend: str, connected: bool) -> None:
        self.changes.put_nowait(connected)

    async def wait(self, state: bool) -> None:
        async with asyncio.timeout(TIMEOUT_S):
            while await self.changes.get() is not state:
                pass


async def ignore(_: Record) -> None:
    pass


def consumer(url: str, time: SimulatedTime, metrics: Connected) -> KvEventConsumerManager:
    src = EventSourceConfig(backend_name=B, endpoint=url, reconnect_interval_ms=50)
    return KvEventConsumerManager([src], ignore, metrics=metrics, sleep=time.sleep,
                                  monotonic=time.monotonic, connect_timeout_s=5.0)


# --- consumer ---------------------------------------------------------------------------------

async def test_consumer_at_a_closed_port_logs_bounded_lines_then_its_recovery(
        json_log: JsonLog) -> None:
    port = free_port()  # nothing listens there (yet)
    plain_url = f"http://127.0.0.1:{port}/events/{B}"
    attempts = 40
    time, metrics = SimulatedTime(park_at=attempts), Connected()
    hub = StreamHub(history_size=100, max_lag=100, update_interval_s=0.0, max_sse_clients=4,
                    ping_interval_s=None)
    hub.add_backend(B)
    server = None
    try:
        async with consumer(f"http://ops:{SECRET}@127.0.0.1:{port}/events/{B}", time, metrics):
            await time.wait_sleeps(attempts)
            lines = json_log.records("kv_consumer_connect_failed")
            # Then the listener comes up on that port: the next attempt connects.
            server = await serve(create_app(hub, NoSources()), "127.0.0.1", port)
            time.resume.set()
            await metrics.wait(True)
    finally:
        if server is not None:
            await server.stop()

    first = lines[0]
    assert first["level"] == "warning"
    assert (first["reason"], first["error"], first["errno"], first["strerror"]) == (
        "connect_error", "ClientConnectorError", errno.ECONNREFUSED,
        os.strerror(errno.ECONNREFUSED))
    assert (first["url"], first["backend"], first["transport"]) == (plain_url, B, "sse")
    assert (first["attempt"], first["outage_s"], first["retry_in_s"]) == (1, 0.0, 0.05)
    assert "suppressed" not in first
    # Bounded: after the first, the unchanged failure is logged at most once per interval of the
    # (simulated) outage, and each line says how many attempts it stands for.
    elapsed = sum(time.delays[:attempts - 1])
    assert len(lines) <= 2 + elapsed / LOG_REPEAT_INTERVAL_S
    assert len(lines) < attempts / 2
    for before, after in itertools.pairwise(lines):
        assert after["outage_s"] - before["outage_s"] >= LOG_REPEAT_INTERVAL_S
        assert after["attempt"] == before["attempt"] + after["suppressed"] + 1
        assert after["level"] == "warning" and after["errno"] == errno.ECONNREFUSED
    assert lines[1]["suppressed"] >= 10  # the fast early retries of the first minute
    assert lines[-1]["retry_in_s"] == 60.0
    # The recovery closes the outage it reported.
    (up,) = json_log.records("kv_consumer_connected")
    assert up["level"] == "info"
    assert (up["failed_attempts"], up["outage_s"]) == (attempts, round(sum(time.delays), 3))
    assert up["url"] == plain_url
    assert SECRET not in json_log.text


async def _reset_or_503(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        mode: list[str]) -> None:
    await reader.readuntil(b"\r\n\r\n")
    if mode[0] == "503":
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                     b"content-length: 2\r\nconnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()
        return
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # an RST: "connection reset by peer"


async def test_consumer_logs_a_changed_failure_at_once(json_log: JsonLog) -> None:
    mode = ["reset"]
    srv = await asyncio.start_server(lambda r, w: _reset_or_503(r, w, mode), "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    time, metrics = SimulatedTime(park_at=8), Connected()

    async def to_503() -> None:
        mode[0] = "503"

    async def close() -> None:
        srv.close()
        await srv.wait_closed()

    time.hooks = {3: to_503, 5: close}
    async with consumer(f"http://127.0.0.1:{port}/events/{B}", time, metrics):
        await time.wait_sleeps(8)
    # Attempts 1-3 reset, 4-5 answer 503, 6-8 find the port closed: all within a few seconds,
    # so only the first of each kind is logged.
    lines = json_log.records("kv_consumer_connect_failed")
    assert [(r["attempt"], r["reason"], r.get("errno"), r.get("http_status")) for r in lines] == [
        (1, "connect_error", errno.ECONNRESET, None),
        (4, "http_status", None, 503),
        (6, "connect_error", errno.ECONNREFUSED, None),
    ]
    assert lines[0]["error"] == "ClientOSError"
    assert lines[0]["strerror"] == os.strerror(errno.ECONNRESET)
    assert lines[1]["detail"] == "HTTP 503"
    assert all(r["level"] == "warning" and "suppressed" not in r for r in lines)


# --- Redis index --------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


async def until(check: Any) -> None:
    """A condition of the index's background probe, which has nothing to await: poll, bounded."""
    async with asyncio.timeout(TIMEOUT_S):
        while not check():
            await asyncio.sleep(0.005)


@pytest.fixture
async def closed_redis() -> AsyncIterator[tuple[str, int]]:
    port = free_port()
    yield f"redis://:{SECRET}@127.0.0.1:{port}/0", port


async def test_redis_at_a_closed_port_names_its_address_and_errno(
        json_log: JsonLog, closed_redis: tuple[str, int]) -> None:
    url, port = closed_redis
    clock = Clock()
    index = RedisKvIndex.from_config(RedisConfig(url=url, connect_timeout_ms=1000),
                                     KvCacheIndexConfig(), probe_interval_s=0.01, clock=clock)
    try:
        await index.apply(EVENT)  # fails over to the in-memory fallback
        assert index.fallback_active
        await until(lambda: index.probes_failed >= 5)
        clock.now += LOG_REPEAT_INTERVAL_S + 1
        seen = index.probes_failed
        await until(lambda: index.probes_failed > seen + 1)
    finally:
        await index.close()
    (down,) = json_log.records("kv_index_redis_unavailable")
    assert down["level"] == "warning"
    assert (down["address"], down["error"], down["errno"], down["strerror"]) == (
        f"127.0.0.1:{port}", "ConnectionError", errno.ECONNREFUSED,
        os.strerror(errno.ECONNREFUSED))
    assert (down["op"], down["fallback"]) == ("apply", "memory")
    probes = json_log.records("kv_index_redis_still_unavailable")
    # Dozens of failed probes, two lines: the first, and one a (simulated) minute later.
    assert len(probes) == 2, probes
    assert (probes[0]["probes_failed"], probes[0]["suppressed"], probes[0]["outage_s"]) == (1, 0, 0.0)
    assert probes[1]["suppressed"] >= 4
    assert probes[1]["probes_failed"] == 1 + probes[1]["suppressed"] + 1
    assert probes[1]["outage_s"] == LOG_REPEAT_INTERVAL_S + 1
    assert all(p["address"] == f"127.0.0.1:{port}" and p["errno"] == errno.ECONNREFUSED
               for p in probes)
    assert SECRET not in json_log.text


async def test_redis_without_fallback_logs_its_errors_bounded(
        json_log: JsonLog, closed_redis: tuple[str, int]) -> None:
    url, port = closed_redis
    clock = Clock()
    index = RedisKvIndex.from_config(RedisConfig(url=url, fallback_to_memory=False),
                                     KvCacheIndexConfig(), clock=clock)
    try:
        for _ in range(10):
            with pytest.raises(IndexUnavailableError):
                await index.apply(EVENT)
        clock.now += LOG_REPEAT_INTERVAL_S
        with pytest.raises(IndexUnavailableError):
            await index.apply(EVENT)
    finally:
        await index.close()
    lines = json_log.records("kv_index_redis_error")
    assert [(r["suppressed"], r["redis_errors"]) for r in lines] == [(0, 1), (9, 11)]
    assert all((r["address"], r["errno"], r["op"], r["level"])
               == (f"127.0.0.1:{port}", errno.ECONNREFUSED, "apply", "warning") for r in lines)
    assert SECRET not in json_log.text


async def test_redis_recovery_reports_the_outage(json_log: JsonLog,
                                                 redis_server: RedisServer) -> None:
    redis_server.stop()
    clock = Clock()
    index = RedisKvIndex.from_config(RedisConfig(url=redis_server.url), KvCacheIndexConfig(),
                                     probe_interval_s=0.01, clock=clock)
    try:
        await index.apply(EVENT)
        await until(lambda: index.probes_failed >= 1)
        clock.now += 42.0
        await asyncio.to_thread(redis_server.start)
        async with asyncio.timeout(TIMEOUT_S):
            await index.wait_recovered()
    finally:
        await index.close()
    (up,) = json_log.records("kv_index_redis_recovered")
    assert up["level"] == "info"
    assert (up["address"], up["outage_s"], up["copied_entries"]) == (
        f"127.0.0.1:{redis_server.port}", 42.0, 1)
    assert up["probes_failed"] >= 1
