"""A stand-in for `trtllm-serve`'s `POST /kv_cache_events` (tests, benchmark, demo).

Mirrors `tensorrt_llm/serve/openai_server.py` (wire-formats §4.1): the route takes no body and
answers a JSON list of every event queued since the last call (drain-on-read: two pollers would
each see part of the stream). Events are written by `sim.encode.encode_trtllm_events`
(KVCacheEventSerializer's shape, §4.2); `event_id` grows by one per event and per attention-DP
rank, as each rank's `KVCacheEventManager` counts on its own. Older releases wait up to 2 s for a
first event when the queue is empty (`get_kv_cache_events_async(2)`), newer ones return at once:
`wait_s` picks the behaviour.

Faults for tests: `fail_next` (any status/body/headers, e.g. 500, a 307 redirect, garbage JSON),
`stall_next` (answer late, to trigger client timeouts), `lose` (event ids skipped: events lost
inside the engine), `restart` (ids back to 0, queue lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kv_listener.core.decode import TrtllmRecord
from kv_listener.core.model import BlockRemoved, BlockStored, KvEvent
from kv_listener.sim.encode import encode_trtllm_events
from kv_listener.sim.lifecycle import AsyncLifecycle, start_site

PATH = "/kv_cache_events"


@dataclass(slots=True)
class _Fault:
    status: int = 500
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # answer after this long (a stall)
    drain: bool = False  # whether the queued events are consumed by this answer


class SimTrtllmServer:
    """The event queue and the handler. `app()` builds the aiohttp application; `serve()` runs
    it on 127.0.0.1 and returns a handle with `url` and `close()`."""

    def __init__(self, *, wait_s: float = 0.0, block_extras: bool = True) -> None:
        self._queue: list[dict[str, Any]] = []
        self._next_id: dict[int | None, int] = {}
        self._faults: deque[_Fault] = deque()
        self._wait_s = wait_s
        self._block_extras = block_extras
        self._emitted = asyncio.Event()
        self._closing = asyncio.Event()  # releases stalled answers at shutdown
        self._polled = asyncio.Condition()
        self.polls = 0  # requests answered (events or faults)
        self.poll_times: list[float] = []  # loop time of each request's arrival
        self.peers: list[str] = []

    # --- the engine side ----------------------------------------------------------------

    def emit(
        self, *events: KvEvent, window_size: int | None = None, dp_rank: int | None = None
    ) -> int:
        """Queue one TRT-LLM event (one created/removed/updated, or a chain of single-block
        BlockStored = one `stored` event); returns its event_id."""
        event_id = self._next_id.get(dp_rank, 0)
        self._next_id[dp_rank] = event_id + 1
        record = TrtllmRecord(event_id, window_size, dp_rank, tuple(events))
        body = encode_trtllm_events([record], block_extras=self._block_extras)
        self._queue.extend(json.loads(body))
        self._emitted.set()
        return event_id

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Queue one step of a simulated block pool (`sim.engine`: multi-block `BlockStored`,
        `BlockRemoved` with medium GPU) as TRT-LLM reports it: one `stored` record per chain
        run, each block its own single-hash entry (the salt on the root block only), and one
        `removed` record per eviction, without a medium (cache level 0 is implied)."""
        for ev in events:
            if isinstance(ev, BlockStored):
                bs = ev.block_size
                chain: list[KvEvent] = []
                parent = ev.parent_hash
                for i, h in enumerate(ev.block_hashes):
                    chain.append(BlockStored(
                        (h,), parent, ev.token_ids[i * bs:(i + 1) * bs], bs,
                        cache_salt=ev.cache_salt if i == 0 and parent is None else None))
                    parent = h
                self.emit(*chain)
            elif isinstance(ev, BlockRemoved):
                self.emit(BlockRemoved(ev.block_hashes))
            else:
                self.emit(ev)

    def emit_raw(self, record: Any) -> None:
        """Queue any JSON value as one element of the next answer (malformed records)."""
        self._queue.append(record)
        self._emitted.set()

    def lose(self, n: int = 1, dp_rank: int | None = None) -> None:
        """The next `n` event ids of `dp_rank` are never delivered."""
        self._next_id[dp_rank] = self._next_id.get(dp_rank, 0) + n

    def restart(self) -> None:
        """Server restart: queued events are lost and ids start at 0 again."""
        self._queue.clear()
        self._next_id.clear()

    @property
    def queued(self) -> int:
        return len(self._queue)

    # --- faults -------------------------------------------------------------------------

    def fail_next(
        self, status: int = 500, body: bytes = b"", headers: Mapping[str, str] | None = None,
        *, times: int = 1, drain: bool = False,
    ) -> None:
        for _ in range(times):
            self._faults.append(_Fault(status, body, dict(headers or {}), drain=drain))

    def stall_next(self, delay_s: float) -> None:
        """The next request is answered normally, but only after `delay_s`."""
        self._faults.append(_Fault(200, b"", {}, delay_s=delay_s, drain=True))

    async def wait_polls(self, n: int, timeout_s: float = 5.0) -> None:
        """Wait until `n` requests in total have been answered."""
        async with asyncio.timeout(timeout_s), self._polled:
            await self._polled.wait_for(lambda: self.polls >= n)

    # --- HTTP ---------------------------------------------------------------------------

    def _drain(self) -> bytes:
        events, self._queue = self._queue, []
        self._emitted.clear()
        return json.dumps(events, separators=(",", ":")).encode()

    async def _handle(self, request: web.Request) -> web.Response:
        self.poll_times.append(asyncio.get_running_loop().time())
        self.peers.append(request.remote or "")
        try:
            if self._faults:
                fault = self._faults.popleft()
                if fault.delay_s:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(fault.delay_s):
                            await self._closing.wait()
                if fault.drain:
                    return web.Response(body=self._drain(), content_type="application/json")
                return web.Response(status=fault.status, body=fault.body, headers=fault.headers)
            if not self._queue and self._wait_s > 0:
                try:
                    async with asyncio.timeout(self._wait_s):
                        await self._emitted.wait()
                except TimeoutError:
                    pass
            return web.Response(body=self._drain(), content_type="application/json")
        finally:
            async with self._polled:
                self.polls += 1
                self._polled.notify_all()

    def app(self, path: str = PATH) -> web.Application:
        app = web.Application()
        app.router.add_post(path, self._handle)
        return app

    async def serve(self, host: str = "127.0.0.1", port: int = 0,
                    path: str = PATH) -> ServedTrtllm:
        runner = await start_site(self.app(path), host, port, handle_signals=False)
        bound = runner.addresses[0][1]
        self._closing.clear()
        return ServedTrtllm(runner, f"http://{host}:{bound}{path}", self._closing)


class ServedTrtllm(AsyncLifecycle):
    """A served `SimTrtllmServer`; `async with` or `await close()`. (Not named `RunningServer`:
    that is `kv_listener.httpserver`'s uvicorn handle, which this aiohttp one is not.)"""

    def __init__(self, runner: web.AppRunner, url: str, closing: asyncio.Event) -> None:
        self._runner = runner
        self._closing = closing
        self.url = url

    async def close(self) -> None:
        self._closing.set()
        await self._runner.cleanup()

