"""A coroutine run as a task for the length of an `async with` block, then cancelled and awaited:
the push client's `run()`, a slow reader or a drip of bytes in the fault tests. An exception the
task raised (other than its cancellation) surfaces at the end of the block."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


@contextlib.asynccontextmanager
async def running_task(coro: Coroutine[Any, Any, T]) -> AsyncIterator[asyncio.Task[T]]:
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
