"""The listener daemon: only wiring. Config -> sources -> tracker -> event log -> outputs.

Owns the process lifecycle: an asyncio TaskGroup, the signals (SIGTERM/SIGINT: every stream gets
`draining`, sources close, exit 0 within a bounded time; SIGHUP: reload the config, where added
sources start, removed ones stop and their streams end, changed ones restart with a clear,
unchanged ones keep their state and history, and an invalid file keeps the old config), and the
shutdown order: streams drain -> push client drains -> HTTP server stops -> sources stop.

Per source there is one `SourceRuntime`: the source task (ZMQ SUB or TRT-LLM poller) fills a
bounded queue; a pump task applies the queue to the pure `Tracker` and publishes the prefix
transitions to the `StreamHub`; the `ChainResolver` answers the tracker's detokenize requests off
the ingestion path. All of these run on one event loop, so the tracker needs no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kv_listener.config import ConfigError, ListenerConfig, SourceConfig, load_config, read_secret
from kv_listener.core.liveness import LivenessChange
from kv_listener.core.model import (
    ClearReason,
    Engine,
    EventBatch,
    PrefixTransition,
    ResolveOutcome,
    SourceCleared,
    SourceItem,
    TransitionKind,
)
from kv_listener.core.salt import SaltVerifier
from kv_listener.core.slicing import pieces
from kv_listener.core.tracker import Tracker, TrackerNotice
from kv_listener.errors import StartError, bind_error
from kv_listener.logging import apply_config_logging, get_logger
from kv_listener.metrics import BusView, ListenerCollector, SourceView, new_registry
from kv_listener.outputs.bus_client import BusClient
from kv_listener.outputs.sse_server import RunningServer, create_app, serve, source_stats_entry
from kv_listener.outputs.streams import StreamHub
from kv_listener.reloading import SerialReloader
from kv_listener.resolver.detokenize import sibling_url
from kv_listener.resolver.resolver import ChainResolver
from kv_listener.sources.common import batch_tokens
from kv_listener.sources.liveness import EngineWatch
from kv_listener.sources.trtllm import TrtllmSource
from kv_listener.sources.zmq import ZmqSource
from kv_listener.stats import SourceStats

log = get_logger("kv_listener.app")

#: Batches a source may queue ahead of the tracker before it drops and clears (never blocks).
SOURCE_QUEUE_SIZE = 10000
#: Queued engine batches applied before their transitions are published together.
PUMP_BATCHES_PER_PUBLISH = 64
#: ... or for at most this long, before the pump yields to the loop.
PUMP_SLICE_S = 0.005
#: How often chains whose detokenize failed are asked again.
RETRY_FAILED_S = 5.0
#: How long start-up waits for a ZMQ source's first bind/connect attempt before going on.
ATTACH_WAIT_S = 10.0
#: How long a stopping daemon waits for streams to take their `draining` record.
DRAIN_DEADLINE_S = 5.0
#: Backoff of a crashed source task: doubles from the first value up to the second.
RESTART_BACKOFF_S = (0.5, 30.0)
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
        self.log = get_logger("kv_listener.source", backend=cfg.backend_name,
                              engine=cfg.engine.value)
        self._salt_secret = salt_secret
        self.resolver: ChainResolver | None = None
        self.tracker = self._new_tracker(can_detokenize=False)
        self.source: ZmqSource | TrtllmSource | None = None
        self.watch = self._new_watch()
        self.engine_down = False
        self._tasks: list[asyncio.Task[None]] = []

    def _new_watch(self) -> EngineWatch | None:
        """The engine liveness watch (SPEC §5), or None (`engine_down_after: null`, or a vLLM /
        SGLang source with neither `health_endpoint` nor `detokenize_endpoint`)."""
        cfg = self.cfg
        if cfg.engine_down_after_s is None:
            self.stats.engine_state = "off"
            return None
        url = cfg.health_endpoint
        if url is None and cfg.engine is not Engine.TRTLLM:
            if cfg.detokenize_endpoint is None:
                self.stats.engine_state = "off"
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
        self._tasks = [
            asyncio.create_task(self._run_source(), name=f"source:{self.cfg.backend_name}"),
            asyncio.create_task(self._pump(), name=f"pump:{self.cfg.backend_name}"),
        ]
        if self.watch is not None:
            self._tasks.append(asyncio.create_task(self.watch.run(),
                                                   name=f"liveness:{self.cfg.backend_name}"))
        if self.resolver is not None:
            self._tasks.append(asyncio.create_task(self._retry_failed(),
                                                   name=f"retry:{self.cfg.backend_name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.resolver is not None:
            await self.resolver.close()

    def _make_source(self) -> ZmqSource | TrtllmSource:
        if self.cfg.engine is Engine.TRTLLM:
            return TrtllmSource(self.cfg, self.queue, self.stats)
        return ZmqSource(self.cfg, self.queue, self.stats)

    async def _run_source(self) -> None:
        """Run the source; a crash is logged, counted and restarted with backoff, and the
        tracker is cleared first because events may have been lost meanwhile."""
        delay = RESTART_BACKOFF_S[0]
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
                self.stats.ready = False
                self.stats.source_restarts += 1
                self.log.error("source_crashed", error=type(exc).__name__, detail=str(exc),
                               restart_in_s=round(delay, 2))
            if time.monotonic() - started > 60:
                delay = RESTART_BACKOFF_S[0]
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))  # noqa: S311 (jitter)
            delay = min(delay * 2, RESTART_BACKOFF_S[1])
            self._put_clear(ClearReason.SOURCE_RESTART)

    def _put_clear(self, reason: ClearReason) -> None:
        self.stats.clears[reason.value] += 1
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(SourceCleared(reason))

    async def _pump(self) -> None:
        while True:
            item = await self.queue.get()
            started = time.perf_counter()
            transitions: list[PrefixTransition] = []
            n = 0
            while True:
                self.stats.queued_tokens -= batch_tokens(item)
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
            self.stats.queue_depth = self.queue.qsize()
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
                    self.stats.clears[ClearReason.ENGINE_CLEARED.value] += cleared
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

    def tracker_gauges(self) -> dict[str, int]:
        st = self.tracker.stats()
        self.stats.salt_rejected = st["salt_rejected"]  # counted by the tracker, shown per source
        st["chains_pending"] = st["pending"]
        st["blocks_pruned"] = st["pruned"]
        return st


class Listener:
    def __init__(self, config: ListenerConfig, config_path: str | Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.hub = StreamHub.from_config(config)
        self.runtimes: dict[str, SourceRuntime] = {}
        self.bus: BusClient | None = None
        self._bus_task: asyncio.Task[None] | None = None
        # registering collects once at once: everything the collector reads must exist by now
        self.registry: CollectorRegistry = new_registry(
            ListenerCollector(self._source_views, self.hub.stream_views, self._bus_view))
        self.server: RunningServer | None = None
        self._stop = asyncio.Event()
        self._reloader = SerialReloader(self.reload, self._stop.is_set, log)
        self._salt_secret: bytes | None = None

    # --- ListenerStatus for the HTTP app ------------------------------------------------------

    def not_ready(self) -> Sequence[str]:
        return [name for name, rt in self.runtimes.items() if not rt.ready()]

    def source_readiness(self, backend: str) -> Mapping[str, Any] | None:
        rt = self.runtimes.get(backend)
        if rt is None:
            return None
        reason = rt.readiness()
        return {"backend": backend, "ready": reason is None, "reason": reason,
                "engine": rt.cfg.engine.value, "engine_state": rt.stats.engine_state,
                "publishers_connected": rt.stats.publishers_connected}

    def source_stats(self) -> Mapping[str, Mapping[str, Any]]:
        out: dict[str, Mapping[str, Any]] = {}
        for name, rt in self.runtimes.items():
            gauges = rt.tracker_gauges()
            entry = source_stats_entry(rt.stats, blocks_tracked=gauges["blocks_tracked"],
                                       tokens_retained=gauges["tokens_retained"],
                                       prefixes_live=gauges["prefixes_live"])
            entry["tracker"] = gauges
            entry.update(source_restarts=rt.stats.source_restarts, queue_depth=rt.queue.qsize())
            out[name] = entry
        return out

    def metrics_registry(self) -> CollectorRegistry:
        return self.registry

    def extra_stats(self) -> dict[str, Any]:
        """`/stats` beyond sources and streams: the push-mode client, when configured."""
        if self.bus is None:
            return {}
        st = self.bus.stats
        return {"event_bus": {
            "connected": st.connected, "session_id": st.session_id, "connects": st.connects,
            "sessions": st.sessions, "failures": dict(st.failures),
            "streams_opened": st.streams_opened, "streams_ended": dict(st.streams_ended),
            "bytes_pushed": st.bytes_pushed, "next_retry_in_s": st.next_retry_in_s,
        }}

    def _bus_view(self) -> BusView | None:
        if self.bus is None:
            return None
        st = self.bus.stats
        return BusView(connected=st.connected, connects=st.connects, sessions=st.sessions,
                       failures=dict(st.failures), streams_opened=st.streams_opened,
                       streams_ended=dict(st.streams_ended), bytes_pushed=st.bytes_pushed)

    def _source_views(self) -> list[SourceView]:
        views = []
        for name, rt in self.runtimes.items():
            rt.stats.queue_depth = rt.queue.qsize()
            views.append(SourceView(name, rt.stats, rt.tracker_gauges()))
        return views

    # --- lifecycle -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def _start_source(self, cfg: SourceConfig) -> None:
        self.hub.add_backend(cfg.backend_name)
        rt = SourceRuntime(cfg, self.config, self.hub, self._salt_secret)
        self.runtimes[cfg.backend_name] = rt
        await rt.start()
        log.info("source_started", backend=cfg.backend_name, engine=cfg.engine.value)

    async def _stop_source(self, name: str) -> None:
        rt = self.runtimes.pop(name)
        await rt.stop()
        log.info("source_stopped", backend=name)

    def _start_bus(self) -> None:
        """Push mode: dial out to the router's event bus (when configured) with the same byte
        streams the SSE endpoint serves. The local SSE server keeps working alongside."""
        if self.config.event_bus is None:
            return
        self.bus = BusClient(self.config.event_bus,
                             lambda: [s.backend_name for s in self.config.sources], self.hub.open)
        self._bus_task = asyncio.create_task(self.bus.run(), name="bus-client")
        log.info("bus_client_started", url=self.config.event_bus.url,
                 client_id=self.config.event_bus.client_id)

    async def _stop_bus(self) -> None:
        if self._bus_task is not None:
            self._bus_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._bus_task
        self.bus, self._bus_task = None, None

    async def reload(self) -> bool:
        """Re-read the config file; apply the differences; on error keep the running config."""
        if self.config_path is None:
            return False
        try:
            new = load_config(self.config_path)
            secret = read_secret(new.cache_salt.secret_file, new.cache_salt.secret_env)
        except ConfigError as exc:
            log.error("config_reload_failed", path=str(self.config_path), errors=exc.errors)
            return False
        old = self.config
        apply_config_logging(new.log.level, new.log.format, new.warnings)
        for key in ("listen_host", "listen_port", "history_size", "max_lag",
                    "update_interval_s", "max_sse_clients"):
            if getattr(old, key) != getattr(new, key):
                log.warning("config_change_needs_restart", key=key)
        # A change of the salt secret or of max_prefix_length changes every source's keys.
        global_change = secret != self._salt_secret or old.max_prefix_length != new.max_prefix_length
        self._salt_secret = secret
        self.config = new
        old_sources = {s.backend_name: s for s in old.sources}
        new_sources = {s.backend_name: s for s in new.sources}
        removed = [n for n in old_sources if n not in new_sources]
        added = [n for n in new_sources if n not in old_sources]
        changed = [n for n in new_sources if n in old_sources
                   and (global_change or new_sources[n] != old_sources[n])]
        for name in removed:
            await self._stop_source(name)
            self.hub.remove_backend(name)
        for name in changed:
            # Same backend, new source: consumers keep their stream and see the state restart
            # from scratch (cache_cleared), rather than a vanished backend.
            await self._stop_source(name)
            self.hub.publish(name, [PrefixTransition(kind=TransitionKind.CLEARED)])
            await self._start_source(new_sources[name])
        for name in added:
            await self._start_source(new_sources[name])
        if old.event_bus != new.event_bus:
            await self._stop_bus()
            self._start_bus()
        elif self.bus is not None and (added or removed):
            self.bus.sources_changed()
        log.info("config_reloaded", path=str(self.config_path), sources=len(new.sources),
                 added=added, removed=removed, restarted=changed)
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._salt_secret = read_secret(self.config.cache_salt.secret_file,
                                        self.config.cache_salt.secret_env)
        # Installed for the whole run, shutdown included: a second SIGTERM/Ctrl-C while draining
        # must not kill the process half-way (it only re-requests the stop already under way).
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._reloader.request)
        try:
            await self._serve_until_stopped()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        log.info("listener_stopped")

    async def _serve_until_stopped(self) -> None:
        app = create_app(self.hub, self)
        try:
            # Room for every SSE client plus scrapes and probes; beyond it a connection is closed.
            self.server = await serve(app, self.config.listen_host, self.config.listen_port,
                                      max_connections=self.config.max_sse_clients + 128)
        except OSError as exc:
            raise bind_error(f"listen: cannot bind {self.config.listen_host}:"
                             f"{self.config.listen_port}: {exc.strerror or exc}", exc) from None
        try:
            for cfg in self.config.sources:
                await self._start_source(cfg)
            # A port held by another process is a start-up failure (exit 1, the supervisor
            # tries again), not something to wait for silently while claiming to run.
            failures = []
            for i, cfg in enumerate(self.config.sources):
                error = await self.runtimes[cfg.backend_name].attach_error(ATTACH_WAIT_S)
                if error is not None:
                    failures.append(f"sources[{i}].zmq_endpoint: {error}")
            if failures:
                raise StartError(failures)
            self._start_bus()
            # What start-up built (modules, tokenizers, templates: most of the heap) lives as
            # long as the process: out of the cyclic collector's way, so a full collection
            # walks the sources' state only and pauses the loop that much less.
            gc.collect()
            gc.freeze()
            log.info("listener_started", sources=len(self.config.sources),
                     listen=f"{self.config.listen_host}:{self.server.port}")
            await self._stop.wait()
            log.info("listener_stopping")
            # Every stream (SSE and pushed) gets `draining`; the push client waits for the router
            # to take the whole bodies. Both at once: the client's drain waits for the hub's.
            deadline = DRAIN_DEADLINE_S
            if self.config.event_bus is not None:
                deadline = max(deadline, self.config.event_bus.drain_deadline_s)
            results = await asyncio.gather(
                self.hub.drain(deadline),
                self.bus.drain() if self.bus is not None else asyncio.sleep(0))
            if results[0] is False:
                log.warning("drain_deadline_passed")
        finally:
            await self._reloader.cancel()
            await self._stop_bus()
            await self.server.stop()
            for name in list(self.runtimes):
                await self._stop_source(name)
            self.hub.close()


def run_listener(config_path: str | Path) -> int:
    config = load_config(config_path)
    apply_config_logging(config.log.level, config.log.format, config.warnings)
    asyncio.run(Listener(config, config_path).run())
    return 0
