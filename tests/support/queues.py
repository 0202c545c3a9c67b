"""Awaiting what a source puts on its queue, with a bound (never a sleep)."""

from __future__ import annotations

import asyncio

from kv_listener.core.model import EventBatch, SourceItem

TIMEOUT_S = 5.0


async def get(queue: asyncio.Queue[SourceItem]) -> SourceItem:
    async with asyncio.timeout(TIMEOUT_S):
        return await queue.get()


async def get_batch(queue: asyncio.Queue[SourceItem]) -> EventBatch:
    item = await get(queue)
    assert isinstance(item, EventBatch), item
    return item
