"""Waiting, bounded, for a condition nothing announces (a lease key, a keeper's state): polled
every 10 ms, with the condition named in the failure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(pred: Callable[[], bool], what: str, timeout_s: float = 10.0) -> float:
    """Return the seconds it took `pred()` to hold; AssertionError naming `what` after
    `timeout_s`."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            while not pred():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s} s: {what}") from None
    return time.monotonic() - start
