"""The listener daemon: only wiring. Config -> sources -> tracker -> event log -> outputs.

Owns the process lifecycle: an asyncio TaskGroup, the signals (SIGTERM/SIGINT: drain and exit 0;
SIGHUP: reload the config, an invalid file keeps the old one), and the shutdown order.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from kv_listener.config import ConfigError, ListenerConfig, load_config
from kv_listener.logging import configure_logging, get_logger

log = get_logger("kv_listener.app")


class Listener:
    def __init__(self, config: ListenerConfig, config_path: str | Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    def reload(self) -> bool:
        """Re-read the config file; on error log it and keep the running config."""
        if self.config_path is None:
            return False
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("config_reload_failed", path=str(self.config_path), errors=exc.errors)
            return False
        configure_logging(new.log.level, new.log.format)
        for w in new.warnings:
            log.warning("config_warning", detail=w)
        self.config = new
        log.info("config_reloaded", path=str(self.config_path), sources=len(new.sources))
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            log.info(
                "listener_started",
                sources=len(self.config.sources),
                listen=f"{self.config.listen_host}:{self.config.listen_port}",
            )
            await self._stop.wait()
            log.info("listener_stopping")
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        log.info("listener_stopped")


def run_listener(config_path: str | Path) -> int:
    config = load_config(config_path)
    configure_logging(config.log.level, config.log.format)
    for w in config.warnings:
        log.warning("config_warning", detail=w)
    asyncio.run(Listener(config, config_path).run())
    return 0
