"""Consumers and clients misbehaving against the listener while the engines go on, each ending
with the convergence check: 1,000 SSE reconnects (a consumer that resumes 1,000 times, some with
garbage Last-Event-IDs, must end with exactly the engine's state), slow-reading and never-reading
SSE clients, headers dripped one byte at a time (slowloris)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from kv_listener.core.sse import SseParser
from tests.reliability.harness import Stack
from tests.support.tasks import running_task

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]


class ResumingView:
    """A consumer that connects, reads what one chunk brings, and disconnects, resuming each time
    from the WHATWG last event ID (or, every `garbage_every` times, from a made-up one)."""

    def __init__(self, base: str, backend: str) -> None:
        self.url = f"{base}/events/{backend}"
        self.state: dict[str, tuple[int, str]] = {}
        self.last_event_id = ""
        self.connections = 0
        self.resyncs = 0

    def apply(self, event: str, data: dict[str, object]) -> None:
        if event == "cache_cleared":
            self.state.clear()
            self.resyncs += 1
        elif event in ("cache_created", "cache_offloaded"):
            self.state[str(data["prefix_hash"])] = (int(data["token_count"]),  # type: ignore[call-overload]
                                                    str(data["tier"]))
        elif event == "cache_evicted":
            self.state.pop(str(data["prefix_hash"]), None)

    async def once(self, http: aiohttp.ClientSession, last_event_id: str, read_s: float) -> None:
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        parser = SseParser(last_event_id=self.last_event_id)
        async with http.get(self.url, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=None)) as resp:
            assert resp.status == 200, resp.status
            self.connections += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(read_s):
                    while True:
                        chunk = await resp.content.readany()
                        if not chunk:
                            break
                        for ev in parser.feed(chunk):
                            self.apply(ev.event, json.loads(ev.data))
                            self.last_event_id = ev.last_event_id


async def test_a_thousand_reconnects_end_with_the_engine_state(stack: Stack) -> None:
    a = stack.engine("vllm-1")
    view = ResumingView(stack.base, "vllm-1")
    for i in range(1000):
        if i % 25 == 0:
            a.traffic(2, seed=50 + i)
        garbage = i % 97 == 13
        await view.once(stack.http, "nonsense-id-00-zz" if garbage else view.last_event_id,
                        0.005 if i < 999 else 1.0)
    await stack.converge()
    # one last resume after quiet, then its state is the engine's
    await view.once(stack.http, view.last_event_id, 1.0)
    truth = a.truth.expected()
    assert view.connections == 1001 and view.resyncs >= 10
    assert view.state == truth
    assert len(truth) >= 3


async def test_slow_and_never_reading_sse_clients(stack: Stack) -> None:
    host, port = stack.base.removeprefix("http://").rsplit(":", 1)
    request = (f"GET /events/vllm-1 HTTP/1.1\r\nHost: {host}\r\n"
               "Accept: text/event-stream\r\n\r\n").encode()
    stalled = []
    for _ in range(40):  # never read a byte
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        stalled.append((reader, writer))
    slow_reader, slow_writer = await asyncio.open_connection(host, int(port))
    slow_writer.write(request)

    async def read_slowly() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(400):
                if not await slow_reader.read(64):
                    return
                await asyncio.sleep(0.01)  # a deliberately slow consumer, not a wait

    try:
        async with running_task(read_slowly()):
            for e in stack.engines.values():
                e.traffic(60, systems=12, seed=60)
            await stack.converge()
            assert await stack.healthz() == 200
    finally:
        for _, w in [*stalled, (slow_reader, slow_writer)]:
            w.close()


async def test_slowloris_headers_do_not_hold_the_listener(stack: Stack) -> None:
    host, port = stack.base.removeprefix("http://").rsplit(":", 1)
    drips = []
    for _ in range(60):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /events/vllm-2 HTTP/1.1\r\nHo")
        drips.append(writer)

    async def drip() -> None:
        for i in range(30):
            for w in drips:
                with contextlib.suppress(ConnectionError):
                    w.write(b"st: x\r\nX-%d: y\r\n" % i)
            await asyncio.sleep(0.1)  # the attack's pace, not a wait

    try:
        async with running_task(drip()):
            for e in stack.engines.values():
                e.traffic(12, seed=70)
            await stack.converge()
            assert await stack.healthz() == 200
    finally:
        for w in drips:
            w.close()
