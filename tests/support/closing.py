"""`async with closed_after(thing) as thing:`: for the objects with an async `close()` (an index,
a client) that `contextlib.aclosing` does not take (it calls `aclose()`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol, TypeVar


class _Closable(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


@contextlib.asynccontextmanager
async def closed_after(thing: C) -> AsyncIterator[C]:
    """`thing` for the block, closed when it ends (also on a failed assertion)."""
    try:
        yield thing
    finally:
        await thing.close()
