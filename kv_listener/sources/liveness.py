"""Engine liveness watch of one source (SPEC §5): the async shell around `core.liveness`.

Signs of life, checked every `health_interval`:

- vLLM / SGLang: a `2xx` answer of the engine's `GET /health` (vLLM answers 200 while its engine
  core runs and 503 once it died; SGLang likewise), or any batch received on the ZMQ socket since
  the last check. Connection errors, timeouts and 5xx are no sign. Another status (404, 401, a
  redirect) means something answers on that port but not a health route: it counts as alive, so a
  mistyped `health_endpoint` never clears a working engine, and is logged once.
- TRT-LLM: a successful poll since the last check (the poller's `stats.last_ok_at`).

Silent for `engine_down_after`: `on_change(WENT_DOWN)` (the runtime clears the source with
`engine_down` and reports it not ready); the next sign of life: `on_change(CAME_BACK)`.
`stats.engine_state` shows the state (`unknown`, `up`, `down`). Logs carry the endpoint's scheme,
host and port only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import structlog

from kv_listener.core.liveness import EngineState, Liveness, LivenessChange
from kv_listener.resolver.detokenize import endpoint_label
from kv_listener.stats import SourceStats

log = structlog.get_logger(__name__)

#: A health answer slower than this is no answer (bounded by half of `engine_down_after` too, so
#: at least two probes fit in the silence that declares an engine down).
MAX_PROBE_TIMEOUT_S = 5.0

ChangeCallback = Callable[[LivenessChange, float], None]


class EngineWatch:
    """Watches one engine until cancelled. `url` is the health URL (None: no probe, only the
    signs the source itself records: batches, successful polls)."""

    def __init__(self, *, backend: str, url: str | None, interval_s: float, down_after_s: float,
                 stats: SourceStats, on_change: ChangeCallback,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = min(MAX_PROBE_TIMEOUT_S, max(interval_s, down_after_s / 2))
        self.stats = stats
        self.liveness = Liveness(down_after_s, clock())
        self._on_change = on_change
        self._clock = clock
        self._log = log.bind(backend=backend)
        self._label = endpoint_label(url) if url is not None else None
        self._odd_status_logged = False
        self.probes = 0
        self.probe_failures = 0

    async def run(self) -> None:
        self.stats.engine_is(self.liveness.state.value)
        batches = self.stats.batches_received
        polled = self.stats.last_ok_at
        session = aiohttp.ClientSession() if self.url is not None else None
        try:
            while True:
                answered = await self._probe(session) if session is not None else False
                now = self._clock()
                sign = answered or self.stats.batches_received != batches or (
                    self.stats.last_ok_at is not None and self.stats.last_ok_at != polled)
                batches, polled = self.stats.batches_received, self.stats.last_ok_at
                change = self.liveness.alive(now) if sign else self.liveness.check(now)
                self.stats.engine_is(self.liveness.state.value,
                                     went_down=change is LivenessChange.WENT_DOWN)
                if change is not None:
                    self._report(change, now)
                # A designed period between checks: there is nothing to await instead.
                await asyncio.sleep(self.interval_s)
        finally:
            if session is not None:
                await session.close()

    def _report(self, change: LivenessChange, now: float) -> None:
        if change is LivenessChange.WENT_DOWN:
            self._log.warning("engine_down", endpoint=self._label,
                              silent_for_s=round(self.liveness.silent_for(now), 1),
                              down_after_s=self.liveness.down_after_s)
        else:
            self._log.info("engine_up", endpoint=self._label,
                           first=change is LivenessChange.FIRST_UP)
        self._on_change(change, now)

    async def _probe(self, session: aiohttp.ClientSession) -> bool:
        assert self.url is not None
        self.probes += 1
        try:
            async with session.get(self.url, allow_redirects=False,
                                   timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.probe_failures += 1
            if self.liveness.state is EngineState.UP:
                self._log.debug("engine_health_failed", endpoint=self._label,
                                error=type(exc).__name__)
            return False
        if 200 <= status < 300:
            return True
        if status >= 500:
            self.probe_failures += 1
            return False
        if not self._odd_status_logged:
            self._odd_status_logged = True
            self._log.warning("engine_health_unexpected_status", endpoint=self._label,
                              status=status, effect="counted as alive: check health_endpoint")
        return True
