"""A source task that crashes is logged, counted, restarted with backoff and cleared first
(events may have been lost while it was down); the daemon keeps running."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from kv_listener import runtime as runtime_module
from kv_listener.config import parse_config
from kv_listener.core.model import ClearReason
from kv_listener.outputs.streams import StreamHub
from kv_listener.runtime import SourceRuntime
from kv_listener.sources.zmq import ZmqSource
from tests.support.ports import free_port


class Crashing:
    """Stands in for a source whose run() hits an unexpected exception (a library bug)."""

    async def run(self) -> None:
        raise RuntimeError("boom")


async def test_crashed_source_restarts_with_backoff_and_a_clear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_module, "RESTART_BACKOFF_S", (0.01, 0.04))
    cfg = parse_config({"sources": [{"backend_name": "vllm-1", "engine": "vllm", "model": "m",
                                     "zmq_endpoint": f"tcp://127.0.0.1:{free_port()}"}]})
    hub = StreamHub.from_config(cfg)
    rt = SourceRuntime(cfg.sources[0], cfg, hub, None)
    real_make = rt._make_source
    crashes = [Crashing(), Crashing()]  # two crashes, then the real ZMQ source
    monkeypatch.setattr(rt, "_make_source", lambda: crashes.pop() if crashes else real_make())
    with capture_logs() as logs:
        await rt.start()
        try:
            async with asyncio.timeout(5):
                while not isinstance(rt.source, ZmqSource):
                    await asyncio.sleep(0)  # yield until the restart loop made the real one
                await rt.source.ready.wait()
                while hub.backend("vllm-1").log.records_written().get("cache_cleared", 0) < 2:
                    await asyncio.sleep(0)  # the pump publishes the queued clears
        finally:
            await rt.stop()
            hub.close()
    assert rt.stats.source_restarts == 2
    assert rt.stats.clears[ClearReason.SOURCE_RESTART.value] == 2
    crashed = [e for e in logs if e["event"] == "source_crashed"]
    assert [(e["error"], e["log_level"]) for e in crashed] == [("RuntimeError", "error")] * 2
    assert crashed[1]["restart_in_s"] > crashed[0]["restart_in_s"] * 1.2  # backoff grows
