"""How the engine stand-ins start and stop, written once for all of them.

Owns two things every stand-in repeated: `async with x:` as `await x.start()` ... `await
x.close()` (`AsyncLifecycle`), and an aiohttp application served on a host and port (port 0:
read the bound one from the runner) that leaves nothing behind when the bind fails
(`start_site`). Nothing here is engine-specific.
"""

from __future__ import annotations

from typing import Any, Self

from aiohttp import web


class AsyncLifecycle:
    """`async with x as started:` is `started = await x.start()`, then `await x.close()` on the
    way out, whatever happened inside. A class without a start step keeps the default one,
    which returns the object as it is."""

    async def start(self) -> Self:
        return self

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_site(app: web.Application, host: str, port: int,
                     **runner_options: Any) -> web.AppRunner:
    """Serve `app` on `host:port` (`runner_options` go to `web.AppRunner`); returns the set-up
    runner, whose `addresses[0][1]` is the bound port. A failed setup or bind cleans the runner
    up (nothing is left listening) and raises."""
    runner = web.AppRunner(app, **runner_options)
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
