"""Waiting, bounded, for a condition nothing announces (a lease key, a keeper's state, a child
process's signal handler): polled every 10 ms, with the condition named in the failure."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path


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


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has installed a handler for `sig` (Linux: the `SigCgt` mask of
    /proc/<pid>/status). Before that, a signal sent to it takes the default action: SIGHUP ends
    it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise AssertionError(f"no SigCgt line in /proc/{pid}/status")
