"""What the router's failure logs share (issue 14, finding 9): an error described so an operator
can act on it, and a throttle that keeps a failure repeating for hours to a bounded number of
lines.

Owns no logger (the callers log, with these fields):
- `error_fields(exc)`: the exception's class plus the `errno` and `strerror` of the operating
  system error under it (aiohttp's `ClientConnectorError` is one itself; redis-py wraps the
  socket's error in its own `ConnectionError`). Never the exception's message: a library may put
  a URL with its credentials there.
- `LogThrottle`: a repeating condition is logged the first time, when it changes (another key),
  and then at most once per `interval_s`; the held-back occurrences are counted, so the next
  line can say how many there were.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from typing import Any

#: The least time between two log lines of one unchanged repeating failure. Above the consumer's
#: 60 s backoff cap, so a listener down for hours costs one line per 5 attempts, not one each
#: (the outage itself is `continuum_kv_consumer_connected == 0`'s to alert on).
LOG_REPEAT_INTERVAL_S = 300.0


def os_error_of(exc: BaseException) -> OSError | None:
    """The first `OSError` with an errno on the exception's cause/context chain (itself first)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and isinstance(cur.errno, int):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def error_fields(exc: BaseException) -> dict[str, Any]:
    """`{"error": <class>, "errno": <int>, "strerror": <text>}`; errno and strerror only when an
    operating system error is under `exc`. strerror is the C library's text for the errno
    (asyncio's own is "Connect call failed (...)", which says less)."""
    fields: dict[str, Any] = {"error": type(exc).__name__}
    os_err = os_error_of(exc)
    if os_err is not None and os_err.errno is not None:
        fields["errno"] = os_err.errno
        fields["strerror"] = os.strerror(os_err.errno)
    return fields


class LogThrottle:
    """Decides whether one occurrence of a repeating condition is logged now.

    `check(key)` returns None to hold the occurrence back (same key as the previous occurrence,
    less than `interval_s` after the last logged one), else the number of occurrences of this
    key held back since its last logged line (0 for a new or changed key: what was held back
    then was another condition). `clock` is monotonic seconds (tests inject one).
    """

    def __init__(self, interval_s: float = LOG_REPEAT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._key: Hashable | None = None
        self._logged_at: float | None = None
        self._held = 0

    def check(self, key: Hashable) -> int | None:
        now = self._clock()
        changed = self._logged_at is None or key != self._key
        self._key = key
        if not changed and self._logged_at is not None and now - self._logged_at < self.interval_s:
            self._held += 1
            return None
        held = 0 if changed else self._held
        self._held = 0
        self._logged_at = now
        return held

    def reset(self) -> None:
        """Forget the condition: its next occurrence is logged."""
        self._key = None
        self._logged_at = None
        self._held = 0
