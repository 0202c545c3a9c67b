"""Engine liveness of one source (SPEC §5): is the engine behind a source still there?

ZMQ PUB/SUB carries no heartbeat: a killed engine simply sends nothing, exactly like an idle one,
and its prefixes would stay live on the stream forever. The edge therefore feeds this state with
*signs of life* (an answer of the engine's `GET /health`, a batch on its ZMQ socket, a successful
TRT-LLM poll) and asks it, now and then, whether the engine has been silent for too long.

Rules:

- An engine with no sign of life for `down_after_s` (counted from the last sign, or from the
  start) is DOWN: the edge clears the source (`engine_down`) and reports it not ready. It is
  declared down once; nothing more happens while it stays silent.
- The first sign of life after that brings it back UP (`CAME_BACK`): the edge rebuilds its state
  from what the engine sends (and its replay buffer, when it has one).
- An idle engine that answers its health check is alive: it is never cleared.

Pure: no I/O, no clock (monotonic seconds are passed in).
"""

from __future__ import annotations

import enum


class EngineState(enum.StrEnum):
    """Values are `/stats` and log labels."""

    UNKNOWN = "unknown"  # no sign of life since the start yet
    UP = "up"
    DOWN = "down"


class LivenessChange(enum.StrEnum):
    FIRST_UP = "first_up"  # the first sign of life since the start
    WENT_DOWN = "went_down"
    CAME_BACK = "came_back"


class Liveness:
    """The liveness state of one engine. `now` is monotonic seconds."""

    __slots__ = ("_last_sign", "down_after_s", "downs", "state")

    def __init__(self, down_after_s: float, now: float) -> None:
        if down_after_s <= 0:
            raise ValueError("down_after_s must be > 0")
        self.down_after_s = down_after_s
        self.state = EngineState.UNKNOWN
        self._last_sign = now
        self.downs = 0  # times declared down

    def silent_for(self, now: float) -> float:
        return max(0.0, now - self._last_sign)

    def alive(self, now: float) -> LivenessChange | None:
        """A sign of life. Returns FIRST_UP for the first one, CAME_BACK when the engine was
        down, else None."""
        self._last_sign = max(self._last_sign, now)
        was = self.state
        self.state = EngineState.UP
        if was is EngineState.DOWN:
            return LivenessChange.CAME_BACK
        return LivenessChange.FIRST_UP if was is EngineState.UNKNOWN else None

    def check(self, now: float) -> LivenessChange | None:
        """No sign of life at `now` (a failed probe, or just time passing). Returns WENT_DOWN
        when the silence has just reached `down_after_s`."""
        if self.state is EngineState.DOWN or now - self._last_sign < self.down_after_s:
            return None
        self.state = EngineState.DOWN
        self.downs += 1
        return LivenessChange.WENT_DOWN
