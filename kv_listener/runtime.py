"""One configured source's pipeline, started and stopped as a unit: `SourceRuntime`.

The source task (ZMQ SUB or TRT-LLM poller) fills a bounded queue; a pump task applies the queue
to the pure `Tracker` and publishes the prefix transitions to the `StreamHub`; the `ChainResolver`
answers the tracker's detokenize requests off the ingestion path; the `EngineWatch` declares the
engine down after a silence. All of these run on one event loop, so the tracker needs no lock.

Owns all of that source's counting: it creates the source's `SourceStats` and hands it to the
parts that see the facts (each counter changes in one `SourceStats` method, see
`kv_listener.stats`); it counts what only it sees (a crashed source task and its restart, the
clears it queues itself, the engine's own clears, the tokens the pump takes off the queue); and
it turns the counters into what `/stats`, `/readyz/{backend}` and `/metrics` show
(`stats_entry`, `readiness_entry`, `view`), with the queue depth and the tracker's gauges read at
that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from kv_listener.backoff import Backoff
from kv_listener.config import ListenerConfig, SourceConfig
from kv_listener.core.liveness import LivenessChange
from kv_listener.core.model import (
    ClearReason,
    Engine,
    EventBatch,
    PrefixTransition,
    ResolveOutcome,
    SourceCleared,
    SourceItem,
)
from kv_listener.core.salt import SaltVerifier
from kv_listener.core.slicing import pieces
from kv_listener.core.tracker import Tracker, TrackerNotice
from kv_listener.logging import get_logger
from kv_listener.metrics import SourceView
from kv_listener.outputs.sse_server import source_stats_entry
from kv_listener.outputs.streams import StreamHub
from kv_listener.resolver.detokenize import sibling_url
from kv_listener.resolver.resolver import ChainResolver
from kv_listener.sources.common import QueueFeeder
from kv_listener.sources.liveness import EngineWatch
from kv_listener.sources.trtllm import TrtllmSource
from kv_listener.sources.zmq import ZmqSource
from kv_listener.stats import SourceStats

#: Batches a source may queue ahead of the tracker before it drops and clears (never blocks).
SOURCE_QUEUE_SIZE = 10000
#: Queued engine batches applied before their transitions are published together.
PUMP_BATCHES_PER_PUBLISH = 64
#: ... or for at most this long, before the pump yields to the loop.
PUMP_SLICE_S = 0.005
#: How often chains whose detokenize failed are asked again.
RETRY_FAILED_S = 5.0
#: Backoff of a crashed source task: doubles from the first value up to the second.
RESTART_BACKOFF_S = (0.5, 30.0)
#: A source task that ran this long before it crashed starts its backoff over.
RESTART_BACKOFF_RESET_S = 60.0
_NOTICES = {
    TrackerNotice.TOKEN_COUNT_MISMATCH: "an event's token count does not fit its block size; "
    "its descendants stay unattributed",
    TrackerNotice.GROUP_SKIPPED: "events of a second KV-cache group (hybrid model) are skipped; "
    "only one group is tracked",
    TrackerNotice.SALT_REJECTED: "a cache salt failed verification (wrong secret or another "
    "backend's salt); its chain is discarded",
}


class SourceRuntime:
    """Everything that belongs to one configured source, started and stopped as a unit."""

    def __init__(self, cfg: SourceConfig, listener: ListenerConfig, hub: StreamHub,
                 salt_secret: bytes | None) -> None:
        self.cfg = cfg
        self.hub = hub
        self.max_prefix_length = listener.max_prefix_length
        self.stats = SourceStats(engine=cfg.engine.value)
        self.queue: asyncio.Queue[SourceItem] = asyncio.Queue(SOURCE_QUEUE_SIZE)
        # the one way onto the queue, for every source this runtime makes and its own clears
        self.feeder = QueueFeeder(self.queue, self.stats, cfg.backend_name)
        self.log = get_logger("kv_listener.source", backend=cfg.backend_name,
                              engine=cfg.engine.value)
        self._salt_secret = salt_secret
        self.resolver: ChainResolver | None = None
        self.tracker = self._new_tracker(can_detokenize=False)
        self.source: ZmqSource | TrtllmSource | None = None
        self.watch = self._new_watch()
        if self.watch is None:
            self.stats.engine_is("off")
        self.engine_down = False
        self._tasks: list[asyncio.Task[None]] = []

    def _new_watch(self) -> EngineWatch | None:
        """The engine liveness watch (SPEC §5), or None (`engine_down_after: null`, or a vLLM /
        SGLang source with neither `health_endpoint` nor `detokenize_endpoint`)."""
        cfg = self.cfg
        if cfg.engine_down_after_s is None:
            return None
        url = cfg.health_endpoint
        if url is None and cfg.engine is not Engine.TRTLLM:
            if cfg.detokenize_endpoint is None:
                return None
            url = sibling_url(cfg.detokenize_endpoint, "health")
        return EngineWatch(backend=cfg.backend_name, url=url, interval_s=cfg.health_interval_s,
                           down_after_s=cfg.engine_down_after_s, stats=self.stats,
                           on_change=self._on_liveness)

    def _on_liveness(self, change: LivenessChange, _now: float) -> None:
        if change is LivenessChange.WENT_DOWN:
            # Whatever the engine cached is gone with it (or unreachable): the router must not
            # send requests there for a cache hit. Rebuilt from what it publishes when it is back.
            self.engine_down = True
            self._put_clear(ClearReason.ENGINE_DOWN)
            if isinstance(self.source, ZmqSource):
                self.source.expect_new_stream()
        else:
            self.engine_down = False

    def _new_tracker(self, *, can_detokenize: bool) -> Tracker:
        verifier = None
        if self._salt_secret is not None:
            verifier = SaltVerifier(self._salt_secret, self.cfg.backend_name)
        return Tracker(engine=self.cfg.engine, model=self.cfg.model, limits=self.cfg.limits,
                       salt_verifier=verifier, can_detokenize=can_detokenize)

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the resolver (may load a tokenizer / learn a template) and start the tasks."""
        if self.cfg.detokenize_endpoint is not None or self.cfg.tokenizer is not None:
            try:
                self.resolver = await ChainResolver.for_source(
                    self.cfg, on_outcome=self._on_outcome,
                    max_prefix_length=self.max_prefix_length, stats=self.stats)
            except (ValueError, OSError) as exc:
                self.log.error("resolver_unavailable", error=type(exc).__name__, detail=str(exc))
        self.tracker = self._new_tracker(can_detokenize=self.resolver is not None)
        self.source = self._make_source()
        name = self.cfg.backend_name
        self._tasks = [asyncio.create_task(self._run_source(), name=f"source:{name}"),
                       asyncio.create_task(self._pump(), name=f"pump:{name}")]
        if self.watch is not None:
            self._tasks.append(asyncio.create_task(self.watch.run(), name=f"liveness:{name}"))
        if self.resolver is not None:
            self._tasks.append(asyncio.create_task(self._retry_failed(), name=f"retry:{name}"))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        # Awaited so that every task's `finally` (sockets, sessions) has run when this returns;
        # a cancellation is the expected end (a BaseException), anything else is raised here.
        errors = [r for r in await asyncio.gather(*tasks, return_exceptions=True)
                  if isinstance(r, Exception)]
        if errors:
            raise errors[0]
        if self.resolver is not None:
            await self.resolver.close()

    def _make_source(self) -> ZmqSource | TrtllmSource:
        if self.cfg.engine is Engine.TRTLLM:
            return TrtllmSource(self.cfg, self.queue, self.stats, feeder=self.feeder)
        return ZmqSource(self.cfg, self.queue, self.stats, feeder=self.feeder)

    async def _run_source(self) -> None:
        """Run the source; a crash is logged, counted and restarted with backoff, and the
        tracker is cleared first because events may have been lost meanwhile."""
        backoff = Backoff(*RESTART_BACKOFF_S)
        source = self.source
        while True:
            started = time.monotonic()
            try:
                self.source = source if source is not None else self._make_source()
                source = None
                await self.source.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats.restarted()
                self.log.error("source_crashed", error=type(exc).__name__, detail=str(exc),
                               restart_in_s=round(backoff.peek_s, 2))
            if time.monotonic() - started > RESTART_BACKOFF_RESET_S:
                backoff.reset()
            # +-20 % around the delay (Backoff's own jitter only shortens it).
            await asyncio.sleep(backoff.next_delay() * random.uniform(0.8, 1.2))  # noqa: S311
            self._put_clear(ClearReason.SOURCE_RESTART)

    def _put_clear(self, reason: ClearReason) -> None:
        # Counted now; a full queue takes it as soon as the pump has made room.
        self.feeder.put_clear(reason)

    # --- the pump: queue -> tracker -> hub -----------------------------------------------------

    async def _pump(self) -> None:
        while True:
            item = await self.queue.get()
            self.feeder.flush()  # there is room now: a clear owed goes in, behind what is queued
            started = time.perf_counter()
            transitions: list[PrefixTransition] = []
            n = 0
            while True:
                self.feeder.taken(item)
                if isinstance(item, EventBatch):
                    # A large batch in pieces: what the pieces so far gave is published and the
                    # loop runs between them, so one source holds the others a few ms at most.
                    for piece in pieces(item):
                        if time.perf_counter() - started >= PUMP_SLICE_S:
                            self._publish(transitions)
                            transitions = []
                            await asyncio.sleep(0)
                            started = time.perf_counter()
                        transitions.extend(self._apply(piece))
                else:
                    transitions.extend(self._apply(item))
                n += 1
                # Drain what is already queued, one publish per wake-up rather than per batch,
                # in bounded steps so one publish stays small next to consumers' max_lag.
                if self.queue.empty() or n >= PUMP_BATCHES_PER_PUBLISH or \
                        time.perf_counter() - started >= PUMP_SLICE_S:
                    break
                item = self.queue.get_nowait()
            self._publish(transitions)
            await asyncio.sleep(0)  # let the streams write and the source receive in between

    def _apply(self, item: SourceItem) -> list[PrefixTransition]:
        try:
            before = self.tracker.clears
            out = self.tracker.apply(item)
            # An engine's own AllBlocksCleared (vLLM reset_prefix_cache, ...) is only seen here;
            # TRT-LLM's `created` is counted by its source, which queues the clear itself.
            if isinstance(item, EventBatch) and self.cfg.engine is not Engine.TRTLLM:
                cleared = self.tracker.clears - before
                if cleared:
                    self.stats.cleared(ClearReason.ENGINE_CLEARED.value, cleared)
            return out
        except Exception as exc:  # a tracker bug must not stop ingestion: clear and go on
            self.log.error("tracker_error", error=type(exc).__name__, detail=str(exc))
            return self.tracker.apply(SourceCleared(ClearReason.SOURCE_RESTART))

    async def _retry_failed(self) -> None:
        """Chains whose detokenize failed (endpoint down, circuit open, backlog full) are asked
        again every `RETRY_FAILED_S`, so they resolve once the endpoint is back even if their
        engine stores nothing more; the resolver's breaker bounds the rate of real calls."""
        while True:
            await asyncio.sleep(RETRY_FAILED_S)  # a designed period: nothing to await instead
            if self.tracker.retry_failed():
                self._publish([])

    def _on_outcome(self, outcome: ResolveOutcome) -> None:
        try:
            transitions = self.tracker.on_resolved(outcome)
        except Exception as exc:
            self.log.error("tracker_error", error=type(exc).__name__, detail=str(exc))
            return
        self._publish(transitions)

    def _publish(self, transitions: list[PrefixTransition]) -> None:
        if transitions:
            self.hub.publish(self.cfg.backend_name, transitions)
        if self.resolver is not None:
            for req in self.tracker.take_resolve_requests():
                self.resolver.submit(req)
        for notice in self.tracker.take_notices():  # each condition once per tracker lifetime
            self.log.warning("tracker_notice", notice=notice.value, detail=_NOTICES[notice])

    # --- readiness -----------------------------------------------------------------------------

    async def attach_error(self, timeout_s: float) -> str | None:
        """Why the ZMQ socket could not be bound or connected at its first attempt (None: it
        was, or this is a TRT-LLM source, or the attempt takes longer than `timeout_s`, for
        instance resolving `allowed_publishers` host names)."""
        if not isinstance(self.source, ZmqSource):
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.source.first_attach.wait(), timeout_s)
        return self.source.attach_error

    def readiness(self) -> str | None:
        """Why this source is not ready, or None: `engine_down` (declared down by the liveness
        watch), `polls_failing` (TRT-LLM: no successful poll within three intervals),
        `not_attached` (the ZMQ socket is not bound or connected), `no_publisher` (bound or
        connected, but no engine has completed a ZMQ handshake with it)."""
        if self.engine_down:
            return "engine_down"
        if isinstance(self.source, TrtllmSource):
            return None if self.source.is_ready() else "polls_failing"
        if not self.stats.ready:
            return "not_attached"
        if self.stats.publishers_connected == 0:
            return "no_publisher"
        return None

    def ready(self) -> bool:
        """Ready in the sense of `/readyz` (SPEC §6): the socket is bound or connected, the
        polls succeed, the engine is not down. `/readyz/{backend}` also asks for a publisher."""
        return self.readiness() in (None, "no_publisher")

    # --- what /readyz/{backend}, /stats and /metrics show ------------------------------------

    def readiness_entry(self) -> dict[str, Any]:
        """`/readyz/{backend}`."""
        reason = self.readiness()
        return {"backend": self.cfg.backend_name, "ready": reason is None, "reason": reason,
                "engine": self.cfg.engine.value, "engine_state": self.stats.engine_state,
                "publishers_connected": self.stats.publishers_connected}

    def tracker_gauges(self) -> dict[str, int]:
        """The tracker's counters as this moment's gauges (and its salt rejections, shown as a
        counter of the source)."""
        st = self.tracker.stats()
        self.stats.salt_rejections(st["salt_rejected"])
        st["chains_pending"] = st["pending"]
        st["blocks_pruned"] = st["pruned"]
        return st

    def stats_entry(self) -> dict[str, Any]:
        """This source's `/stats` entry."""
        gauges = self.tracker_gauges()
        entry = source_stats_entry(self.stats, blocks_tracked=gauges["blocks_tracked"],
                                   tokens_retained=gauges["tokens_retained"],
                                   prefixes_live=gauges["prefixes_live"])
        entry["tracker"] = gauges
        entry.update(source_restarts=self.stats.source_restarts, queue_depth=self.queue.qsize())
        return entry

    def view(self) -> SourceView:
        """What `/metrics` shows of this source."""
        gauges = self.tracker_gauges()
        return SourceView(self.cfg.backend_name, self.stats, gauges, self.queue.qsize())
