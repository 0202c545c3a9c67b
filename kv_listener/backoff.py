"""One retry delay policy for every loop that retries: sources, `/detokenize`, push, consumers.

Pure: no clock, no sleep, no I/O; the caller sleeps (or awaits) what `next_delay()` returns. The
delay starts at `initial_s`, doubles after each failure up to `max_s`, and `reset()` after a
success starts over. With `jitter` > 0 each delay is shortened by a random fraction up to
`jitter` (so a fleet that lost the same peer does not retry in lockstep, and `max_s` is never
exceeded); the random source is injected so that tests get exact delays.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Exponential delays: `initial_s`, doubling to `max_s`, optionally jittered downwards."""

    __slots__ = ("_next", "_rng", "failures", "initial_s", "jitter", "max_s")

    def __init__(self, initial_s: float, max_s: float, *, jitter: float = 0.0,
                 rng: Callable[[], float] = random.random) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {initial_s}, {max_s}")
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"backoff jitter must be in [0, 1), got {jitter}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self.failures = 0  # delays handed out since the last reset
        self._next = initial_s
        self._rng = rng

    @property
    def peek_s(self) -> float:
        """The base (unjittered) delay the next `next_delay()` starts from."""
        return self._next

    def next_delay(self) -> float:
        """The delay before the next attempt (one more failure counted)."""
        base = self._next
        self._next = min(base * 2, self.max_s)
        self.failures += 1
        if self.jitter:
            return base * (1.0 - self.jitter * self._rng())
        return base

    def reset(self) -> None:
        """After a success: the next failure waits `initial_s` again."""
        self._next = self.initial_s
        self.failures = 0
