"""A listener started next to a running vLLM rebuilds from vLLM's real replay buffer, all of it
(SPEC §5): 10,000 batches of 2,048 tokens, served by vLLM's own `ZmqEventPublisher` (no engine:
the class the engine publishes with, from .venv-engines) to the real daemon.

Before 2026-12-06 this lost most of the buffer while reporting `exact`: the answer went on the
source's queue like live batches, overflowed it (10,000 batches hold 20 M token IDs, the queue
4 Mi), and the overflow clear wiped what had been applied; and vLLM's ROUTER, which sends its
whole buffer in one loop and drops what the queue toward the DEALER cannot take, left holes and
lost end markers that ended the replay. Measured then: 2,000-4,677 of 10,000 batches.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.conftest import free_port
from tests.engines.conftest import require_engines_venv
from tests.engines.paths import ENGINES_PYTHON
from tests.support.daemon import Daemon

PUBLISHER = Path(__file__).resolve().parent / "vllm_replay_publisher.py"
BATCHES = 10_000
TOKENS = 2_048


async def test_a_listener_started_late_rebuilds_all_of_a_full_replay_buffer(tmp_path: Path) -> None:
    require_engines_venv()
    pub_port, replay_port = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        str(ENGINES_PYTHON), str(PUBLISHER), str(pub_port), str(replay_port), str(BATCHES),
        str(TOKENS), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=120)
        assert line.split() == [b"ready", str(BATCHES).encode()], line
        cfg = {"listen": f"127.0.0.1:{free_port()}",
               # every block retained: the check below is that every batch was applied
               "limits": {"max_retained_tokens": 2 * BATCHES * TOKENS},
               "sources": [{"backend_name": "vllm-1", "engine": "vllm", "model": "m",
                            "zmq_endpoint": f"tcp://127.0.0.1:{pub_port}", "zmq_mode": "connect",
                            "zmq_topic": "kv-events",
                            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                            "detokenize_endpoint": f"http://127.0.0.1:{free_port()}/detokenize"}]}
        async with Daemon(cfg, tmp_path) as daemon, aiohttp.ClientSession() as session:
            replay = await daemon.wait_log("zmq_startup_replay", timeout_s=60, backend="vllm-1")
            assert (replay["status"], replay["batches"], replay["last_seq"]) == (
                "exact", BATCHES, BATCHES - 1), replay
            async with asyncio.timeout(60):
                while True:  # the pump applies what the replay queued
                    async with session.get(f"{daemon.base}/stats") as resp:
                        st = (await resp.json())["sources"]["vllm-1"]
                    if st["queue_depth"] == 0 and st["blocks_tracked"] >= BATCHES:
                        break
                    await asyncio.sleep(0.1)  # /stats is polled: nothing to await
    finally:
        proc.kill()
        await proc.wait()
    assert st["events_dropped"] == {} and st["clears_by_reason"] == {}, st
    assert st["blocks_tracked"] == BATCHES
