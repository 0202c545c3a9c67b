"""The standalone companion router (`continuum-kv-listener router --config ROUTER.yaml`): wiring only.

Owns the router process's lifecycle, built from the router modules (SPEC §8 "Standalone run"):
the KV index `kv_cache_index.backend` asks for (memory, or Redis with its in-memory fallback),
the overlap scorer, one consumer per `kv_cache_index.event_sources[]` entry, the event-bus server
when `dynamo.event_bus.enabled` (its announced streams feed the `transport: event_bus` sources),
the admin JSON and `/metrics` on `admin.listen`, and a periodic index cleanup. With
`kv_cache_index.writer_lease.enabled` (Redis index only) the consumers take turns through a
lease in that Redis (`router.lease`): several routers share one index and exactly one of them
consumes and writes each backend's stream; while the index is in its in-memory fallback every
router consumes every source (a standby's fallback would otherwise stay empty), and on recovery
the lease rule returns before the recovery resync.

Signals, as the listener's: SIGTERM/SIGINT stop cleanly and the process exits 0 (consumers stop,
so nothing writes the index any more; event-bus sessions end; the HTTP servers stop; the index
closes). SIGHUP reloads the file: event sources are reconciled (added ones start, removed ones
stop, changed ones restart and resume from their last event ID), the event bus's credentials are
replaced (a session that lost its right to a backend gets `forbidden`), the admin API's bearer
tokens (`admin.auth`) are replaced, and the log level and format change. Everything else (the
index backend and its sizing, scoring, the bus address and certificates, Redis,
`admin.listen`) needs a restart, as the seed says of `kv_cache_index`: the reload logs
`config_change_needs_restart` for it and keeps the running value. An invalid file is
logged as `config_reload_failed` and the running configuration stays.

`Router` is also usable in-process (the demo embeds one): `await start()`, use `index`, `scorer`,
`consumers`, then `await stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import ssl
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kv_listener.errors import ConfigError, bind_error
from kv_listener.httpserver import RunningServer, serve
from kv_listener.logging import apply_config_logging, get_logger
from kv_listener.metrics import add_process_collectors
from kv_listener.reloading import SerialReloader
from kv_listener.router.admin import create_admin_app
from kv_listener.router.bus_server import EventBusServer
from kv_listener.router.config import RouterConfig, load_router_config
from kv_listener.router.consumer import KvEventConsumerManager, index_applier
from kv_listener.router.index import KvIndex, run_cleanup
from kv_listener.router.lease import WriterLease
from kv_listener.router.metrics import RouterMetrics
from kv_listener.router.redis_index import RedisKvIndex, build_index
from kv_listener.router.scorer import KvOverlapScorer

log = get_logger("kv_listener.router.app")

#: Bounds of the periodic index cleanup interval (a tenth of the entry TTL in between).
CLEANUP_INTERVAL_BOUNDS_S = (1.0, 60.0)

# (section, attribute, YAML path) of settings a reload cannot change in a running router.
_RESTART_ONLY = (
    ("kv_cache_index", "enabled", "kv_cache_index.enabled"),
    ("kv_cache_index", "backend", "kv_cache_index.backend"),
    ("kv_cache_index", "key_prefix", "kv_cache_index.key_prefix"),
    ("kv_cache_index", "max_entries", "kv_cache_index.max_entries"),
    ("kv_cache_index", "entry_ttl_seconds", "kv_cache_index.entry_ttl_seconds"),
    ("kv_cache_index", "scoring", "kv_cache_index.scoring"),
    ("kv_cache_index", "storage_offloading", "kv_cache_index.storage_offloading"),
    ("event_bus", "enabled", "dynamo.event_bus.enabled"),
    ("event_bus", "listen_host", "dynamo.event_bus.listen"),
    ("event_bus", "listen_port", "dynamo.event_bus.listen"),
    ("event_bus", "tls", "dynamo.event_bus.tls"),
    ("redis", None, "response_cache.redis"),
    ("admin", "listen_host", "admin.listen"),
    ("admin", "listen_port", "admin.listen"),
)


def cleanup_interval_s(entry_ttl_seconds: float) -> float:
    lo, hi = CLEANUP_INTERVAL_BOUNDS_S
    return min(hi, max(lo, entry_ttl_seconds / 10))


class _SwappableApp:
    """The admin server's ASGI app: delegates to the current admin app, so a reload can show
    the new configuration without restarting the server."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


class Router:
    """The companion router: index, scorer, consumers, event bus, admin server."""

    def __init__(self, config: RouterConfig, config_path: str | Path | None = None, *,
                 registry: CollectorRegistry | None = None, index: KvIndex | None = None) -> None:
        """`index`: an index the embedding application owns (default: the one the config asks
        for, built and closed by the router)."""
        self.config = config
        self.config_path = config_path
        # An embedder's registry is left as it is (the global one has process metrics already).
        self.registry = (registry if registry is not None
                         else add_process_collectors(CollectorRegistry()))
        self.metrics = RouterMetrics(self.registry, self._backend_names(config))
        self.index: KvIndex | None = index
        self._owns_index = index is None
        self.scorer: KvOverlapScorer | None = None
        self.consumers: KvEventConsumerManager | None = None
        self.bus: EventBusServer | None = None
        self.admin_server: RunningServer | None = None
        self._admin_app: _SwappableApp | None = None
        self._cleanup: asyncio.Task[None] | None = None
        self._resync: asyncio.Task[None] | None = None
        self.lease: WriterLease | None = None
        self._index_closed = False
        self._stop = asyncio.Event()
        self._reloader = SerialReloader(self.reload, self._stop.is_set, log)

    @staticmethod
    def _backend_names(config: RouterConfig) -> list[str]:
        return [s.backend_name for s in config.kv_cache_index.event_sources]

    @property
    def admin_port(self) -> int:
        if self.admin_server is None:
            raise RuntimeError("the router is not started")
        return self.admin_server.port

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Build and start everything. Raises StartError when an address is busy or not (yet)
        on this host, ConfigError when it can never be bound or a certificate cannot be loaded
        (one message per problem, with its YAML path); whatever was started by then is stopped
        again."""
        cfg = self.config
        kv = cfg.kv_cache_index
        try:
            if self.index is None:
                self.index = build_index(cfg, metrics=self.metrics)
            self.scorer = KvOverlapScorer(self.index, kv.scoring, metrics=self.metrics)
            open_stream = None
            if cfg.event_bus.enabled:
                self.bus = EventBusServer.from_config(cfg.event_bus)
                try:
                    await self.bus.start()
                except (OSError, ssl.SSLError, ValueError) as exc:
                    self.bus = None
                    message = (f"dynamo.event_bus: cannot start the event bus on "
                               f"{cfg.event_bus.listen_host}:{cfg.event_bus.listen_port}: "
                               f"{_reason(exc)}")
                    raise bind_error(message, exc) from None
                open_stream = self.bus.open_announced_stream
            if kv.writer_lease.enabled and isinstance(self.index, RedisKvIndex):
                # The index's own client: the same Redis (or cluster), TLS and credentials.
                self.lease = WriterLease.from_config(self.index.redis.client, kv.key_prefix,
                                                     kv.writer_lease)
            self.consumers = KvEventConsumerManager(
                kv.event_sources, index_applier(self.index), open_announced_stream=open_stream,
                metrics=self.metrics, lease=self.lease, announcer=self.bus)
            self._admin_app = _SwappableApp(self._new_admin_app())
            try:
                self.admin_server = await serve(self._admin_app, cfg.admin.listen_host,
                                                cfg.admin.listen_port)
            except OSError as exc:
                raise bind_error(f"admin.listen: cannot bind {cfg.admin.listen_host}:"
                                 f"{cfg.admin.listen_port}: {_reason(exc)}", exc) from None
            if kv.enabled:
                self.consumers.start()
            if isinstance(self.index, RedisKvIndex):
                self.index.add_state_listener(self._index_state_changed)
            self._cleanup = asyncio.create_task(
                run_cleanup(self.index, cleanup_interval_s(kv.entry_ttl_seconds)),
                name="kv-index-cleanup")
        except BaseException:
            await self.stop()
            raise
        log.info("router_started", admin=f"{cfg.admin.listen_host}:{self.admin_server.port}",
                 index=kv.backend.value, event_sources=len(kv.event_sources),
                 consumers_enabled=kv.enabled,
                 event_bus=self.bus.port if self.bus is not None else None,
                 writer_lease=self.lease.holder_id if self.lease is not None else None)

    def _index_state_changed(self, fallback_active: bool) -> None:
        """Redis is back: what it holds may not be what the streams said meanwhile (restarted
        empty, or removals the fallback could not carry over), so every stream resyncs. With
        the writer lease, the fallback also makes every source run here (`consume_all`), and
        the recovery first stops those this router does not hold."""
        if self.consumers is None or (fallback_active and self.lease is None):
            return
        if self._resync is not None and not self._resync.done():
            self._resync.cancel()
        self._resync = asyncio.get_running_loop().create_task(
            self._index_changed(self.consumers, fallback_active), name="kv-consumers-resync")

    @staticmethod
    async def _index_changed(consumers: KvEventConsumerManager, fallback_active: bool) -> None:
        await consumers.consume_all(fallback_active)
        if not fallback_active:
            await consumers.resync_all("index_recovered")

    def _new_admin_app(self) -> Any:
        assert self.index is not None and self.scorer is not None and self.consumers is not None
        return create_admin_app(self.config, self.index, self.scorer,
                                source_status=self.consumers.source_statuses,
                                registry=self.registry, metrics=self.metrics)

    async def stop(self) -> None:
        """Stop in order: consumers (nothing writes the index any more), event-bus sessions,
        the admin server, the cleanup task, the index. Safe to call twice."""
        if self._resync is not None:
            self._resync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resync
            self._resync = None
        if self.consumers is not None:
            await self.consumers.stop()
        if self.bus is not None:
            await self.bus.close()
            self.bus = None
        if self.admin_server is not None:
            await self.admin_server.stop()
            self.admin_server = None
        if self._cleanup is not None:
            self._cleanup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cleanup
            self._cleanup = None
        if self.index is not None and self._owns_index and not self._index_closed:
            self._index_closed = True
            await self.index.close()

    def request_stop(self) -> None:
        self._stop.set()

    # --- reload --------------------------------------------------------------------------------

    async def reload(self) -> bool:
        """Re-read the config file and apply what a running router can change (see the module
        docstring). False, with the old configuration kept, when the file is invalid."""
        if self.config_path is None:
            return False
        try:
            new = load_router_config(self.config_path)
        except ConfigError as exc:
            log.error("config_reload_failed", path=str(self.config_path), errors=exc.errors)
            return False
        old = self.config
        apply_config_logging(new.log.level, new.log.format, new.warnings)
        for section, attr, path in _RESTART_ONLY:
            before, after = getattr(old, section), getattr(new, section)
            if attr is not None:
                before, after = getattr(before, attr), getattr(after, attr)
            if before != after:
                log.warning("config_change_needs_restart", key=path)
        # The running configuration: the old one with what this reload applies replaced.
        running = dataclasses.replace(
            old,
            kv_cache_index=dataclasses.replace(old.kv_cache_index,
                                               event_sources=new.kv_cache_index.event_sources),
            event_bus=dataclasses.replace(old.event_bus, brokers=new.event_bus.brokers),
            # Admin tokens rotate without a restart, as the bus's credentials do.
            admin=dataclasses.replace(old.admin, auth=new.admin.auth),
            log=new.log, warnings=new.warnings,
        )
        self.config = running
        names = self._backend_names(running)
        result = None
        if self.consumers is not None:
            # Removed sources report "disconnected" while they stop, added ones while they
            # start: both must find their series, then only the new set stays.
            self.metrics.set_backends(set(names) | self.metrics.backends)
            result = await self.consumers.reload(running.kv_cache_index.event_sources)
        self.metrics.set_backends(names)
        if self.bus is not None:
            self.bus.update_brokers(running.event_bus.brokers)
        if self._admin_app is not None:
            self._admin_app.app = self._new_admin_app()
        log.info("config_reloaded", path=str(self.config_path), event_sources=len(names),
                 added=list(result.added) if result else [],
                 removed=list(result.removed) if result else [],
                 restarted=list(result.restarted) if result else [])
        return True

    # --- the process ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT (SIGHUP reloads), stop."""
        loop = asyncio.get_running_loop()
        await self.start()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._reloader.request)
        try:
            await self._stop.wait()
            log.info("router_stopping")
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            await self._reloader.cancel()
            await self.stop()
        log.info("router_stopped")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def run_router(config_path: str | Path) -> int:
    """`continuum-kv-listener router --config PATH`. Raises ConfigError (the CLI prints each
    error on its own line and exits 2) or StartError (exit 1); returns 0 after a clean stop."""
    config = load_router_config(config_path)
    apply_config_logging(config.log.level, config.log.format, config.warnings)
    asyncio.run(Router(config, config_path).run())
    return 0
