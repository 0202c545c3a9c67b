"""kv_listener.timer.Deadline on a real event loop."""

from __future__ import annotations

import asyncio

from kv_listener.timer import Deadline


async def test_expires_once_after_its_delay() -> None:
    fired = asyncio.Event()
    calls: list[float] = []
    loop = asyncio.get_running_loop()

    def expired() -> None:
        calls.append(loop.time())
        fired.set()

    d = Deadline(expired)
    assert not d.pending
    start = loop.time()
    d.arm(0.05)
    assert d.pending
    async with asyncio.timeout(5):
        await fired.wait()
    assert len(calls) == 1 and calls[0] - start >= 0.05
    assert not d.pending


async def test_cancel_and_rearm_replace_the_pending_deadline() -> None:
    fired: list[str] = []
    later = asyncio.Event()
    d = Deadline(lambda: fired.append("d"))
    d.arm(0.01)
    d.cancel()
    assert not d.pending
    d.cancel()  # idempotent
    d.arm(0.01)
    d.arm(0.2)  # replaces the first: nothing at 0.01
    asyncio.get_running_loop().call_later(0.1, later.set)
    async with asyncio.timeout(5):
        await later.wait()
    assert fired == [] and d.pending
    d.cancel()
