"""Test helpers shared by several test modules: real servers started per test, a manual clock."""

from __future__ import annotations


class ManualClock:
    """A monotonic clock the test moves by hand (TTL and cache windows without sleeping)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
