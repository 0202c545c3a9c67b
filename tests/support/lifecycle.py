"""`with thing:` for the test servers that have `start()` and `stop()` (redis-server, a cluster)."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class StartStop:
    """Starts on entering the block, stops on leaving it (also on an error)."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
