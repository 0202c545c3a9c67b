"""SIGHUP handling shared by the listener and the router: one reload at a time, and a SIGHUP
that arrives while one runs is not lost. The file may have changed after the running reload
read it, so exactly one more reload follows it (however many signals came meanwhile): the last
SIGHUP wins. Nothing is reloaded once the process is stopping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog


class SerialReloader:
    """`request()` from the SIGHUP handler; `cancel()` on the way out. `reload` returns whether
    the new file was applied; `stopping` says the process is shutting down."""

    def __init__(self, reload: Callable[[], Awaitable[bool]], stopping: Callable[[], bool],
                 log: structlog.typing.FilteringBoundLogger) -> None:
        self._reload = reload
        self._stopping = stopping
        self._log = log
        self._task: asyncio.Task[bool] | None = None
        self._again = False

    def request(self) -> None:
        if self._stopping():
            self._log.info("config_reload_ignored", reason="stopping")
            return
        if self._task is not None and not self._task.done():
            self._again = True
            self._log.info("config_reload_queued")
            return
        self._task = asyncio.create_task(self._until_settled(), name="config-reload")

    async def _until_settled(self) -> bool:
        while True:
            self._again = False
            ok = await self._reload()
            if not self._again or self._stopping():
                return ok

    async def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
