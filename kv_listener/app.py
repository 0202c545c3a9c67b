"""The listener daemon: only wiring. Config -> sources -> tracker -> event log -> outputs.

Owns the process lifecycle: an asyncio TaskGroup, the signals (SIGTERM/SIGINT: every stream gets
`draining`, sources close, exit 0 within a bounded time; SIGHUP: reload the config, where added
sources start, removed ones stop and their streams end, changed ones restart with a clear,
unchanged ones keep their state and history, and an invalid file keeps the old config), and the
shutdown order: streams drain -> push client drains -> HTTP server stops -> sources stop.

Per source there is one `kv_listener.runtime.SourceRuntime` (source task, queue, pump, tracker,
resolver, liveness watch, and all of that source's counting); this module starts and stops them
and answers the HTTP app's questions (`ListenerStatus`) from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kv_listener.config import ConfigError, ListenerConfig, SourceConfig, load_config, read_secret
from kv_listener.core.model import PrefixTransition, TransitionKind
from kv_listener.errors import StartError, bind_error
from kv_listener.logging import apply_config_logging, get_logger
from kv_listener.metrics import BusView, ListenerCollector, SourceView, new_registry
from kv_listener.outputs.bus_client import BusClient
from kv_listener.outputs.sse_server import RunningServer, create_app, serve
from kv_listener.outputs.streams import StreamHub
from kv_listener.reloading import SerialReloader
from kv_listener.runtime import SourceRuntime

log = get_logger("kv_listener.app")

#: How long start-up waits for a ZMQ source's first bind/connect attempt before going on.
ATTACH_WAIT_S = 10.0
#: How long a stopping daemon waits for streams to take their `draining` record.
DRAIN_DEADLINE_S = 5.0


#: The cyclic collector's youngest-generation threshold once running (CPython's default: 700).
#: A busy source allocates container objects that die within one batch (event tuples, lists,
#: the loop's own); at 700 the collector runs every few batches and walks whatever of them is
#: still alive, about a tenth of the daemon's CPU on salted chains (bench/README.md). At 5,000
#: they are mostly gone by then: a collection walks the survivors (what the tracker keeps),
#: under 1 ms here. The garbage it lets wait is at most that many objects.
GC_YOUNG_THRESHOLD = 5000


#: glibc's `M_MMAP_THRESHOLD` (malloc.h) and the value it is pinned at: its default, 128 KiB.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 << 10


def pin_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its default instead of letting it rise. glibc raises it to
    the size of every mapped block that is freed (up to 32 MiB); from then on blocks below that
    size come from the heap, where a freed one is a hole that RSS keeps. The tracker's columns
    grow by copy (`core.blocks`), the larger ones first: after one growth its smaller columns
    came from the heap and every later growth left a hole, 116 B of RSS per block at a million
    blocks in 16-block chains against 89 B with the threshold pinned (bench/peers.py memory,
    2026-12-04). A pinned threshold costs a `mmap` per allocation of 128 KiB or more (a large
    frame). No library wraps `mallopt`, so ctypes calls it. False, and nothing changed, on a C
    library other than glibc."""
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False  # musl, macOS, ...: their own allocators
        return bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD),
                                 ctypes.c_int(MMAP_THRESHOLD_BYTES)))
    except (OSError, AttributeError):
        return False


def settle_heap() -> None:
    """Once start-up is done: what it built (modules, tokenizers, templates: most of the heap)
    lives as long as the process, so it goes out of the cyclic collector's way (a full collection
    walks the sources' state only and pauses the loop that much less), and the youngest
    generation is collected less often (`GC_YOUNG_THRESHOLD`)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


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
        self._mmap_pinned = False  # pin_mmap_threshold() took (glibc), set by run()
        self._reloader = SerialReloader(self.reload, self._stop.is_set, log)
        self._salt_secret: bytes | None = None

    # --- ListenerStatus for the HTTP app ------------------------------------------------------

    def not_ready(self) -> Sequence[str]:
        return [name for name, rt in self.runtimes.items() if not rt.ready()]

    def source_readiness(self, backend: str) -> Mapping[str, Any] | None:
        rt = self.runtimes.get(backend)
        return None if rt is None else rt.readiness_entry()

    def source_stats(self) -> Mapping[str, Mapping[str, Any]]:
        return {name: rt.stats_entry() for name, rt in self.runtimes.items()}

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
        return [rt.view() for rt in self.runtimes.values()]

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
        # before any source starts: their trackers' columns grow from here
        self._mmap_pinned = pin_mmap_threshold()
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
            settle_heap()
            log.info("listener_started", sources=len(self.config.sources),
                     listen=f"{self.config.listen_host}:{self.server.port}",
                     mmap_threshold_pinned=self._mmap_pinned)
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
