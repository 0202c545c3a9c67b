"""One deadline on the running loop that can be armed again and cancelled (the HTTP server's
header read timeout, the event bus's attach timeout). Asyncio only: no I/O of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Deadline:
    """Calls `on_expiry` once the armed time has passed, unless cancelled first; arming again
    replaces the pending deadline. `pending` while armed and not yet expired."""

    def __init__(self, on_expiry: Callable[[], None]) -> None:
        self._on_expiry = on_expiry
        self._handle: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> bool:
        return self._handle is not None

    def arm(self, delay_s: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.cancel()
        self._handle = (loop or asyncio.get_running_loop()).call_later(delay_s, self._expired)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expired(self) -> None:
        self._handle = None
        self._on_expiry()
