"""The listener against vLLM's real replay buffer, served by vLLM's own `ZmqEventPublisher` (no
engine: the class a vLLM engine publishes with, run from .venv-engines), full or nearly: a
listener started late rebuilds all of it (SPEC §5), and a gap of 3,000 batches of 2,048 tokens
(more than the 16 MiB one request may hold) is filled from it.

vLLM 0.32's replay ROUTER sends its whole buffer in one loop and drops what the queue toward the
listener's DEALER cannot take (its high-water mark of 1,000 messages and ours), end marker
included. Before 2026-12-06 a late listener applied 2,000-4,677 of 10,000 batches of 2,048
tokens and reported `exact`: the answer went on the source's queue like live batches and
overflowed it (20 M token IDs against 4 Mi), and the overflow clear wiped the rebuild; holes and
lost end markers ended the replay. Now the answer waits for room and a hole or a stall ends a
request, the next asking from where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import free_port
from tests.engines.conftest import require_engines_venv
from tests.engines.paths import ENGINES_PYTHON
from tests.engines.tap import ZmqTap
from tests.support.daemon import Daemon

PUBLISHER = Path(__file__).resolve().parent / "vllm_replay_publisher.py"


class Publisher:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self) -> list[bytes]:
        assert self.proc.stdout is not None
        return (await asyncio.wait_for(self.proc.stdout.readline(), timeout=120)).split()

    async def publish(self, n: int, tokens: int) -> int:
        """Publish `n` batches; the number of batches the replay buffer then holds."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n} {tokens}\n".encode())
        await self.proc.stdin.drain()
        word, buffered = await self.line()
        assert word == b"published"
        return int(buffered)


@contextlib.asynccontextmanager
async def vllm_publisher(pub_endpoint: str, replay_endpoint: str) -> AsyncIterator[Publisher]:
    require_engines_venv()
    proc = await asyncio.create_subprocess_exec(
        str(ENGINES_PYTHON), str(PUBLISHER), pub_endpoint, replay_endpoint,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    pub = Publisher(proc)
    try:
        assert await pub.line() == [b"ready"]
        yield pub
    finally:
        proc.kill()
        await proc.wait()


def listener_config(zmq_endpoint: str, zmq_mode: str, replay_endpoint: str, max_tokens: int,
                    ) -> dict[str, Any]:
    return {"listen": f"127.0.0.1:{free_port()}",
            # every block retained: the checks below are that every batch was applied
            "limits": {"max_retained_tokens": max_tokens},
            "sources": [{"backend_name": "vllm-1", "engine": "vllm", "model": "m",
                         "zmq_endpoint": zmq_endpoint, "zmq_mode": zmq_mode,
                         "zmq_topic": "kv-events", "replay_endpoint": replay_endpoint,
                         "detokenize_endpoint": f"http://127.0.0.1:{free_port()}/detokenize"}]}


async def stats_when(daemon: Daemon, session: aiohttp.ClientSession,
                     done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """/stats of the source once `done` holds for it (bounded)."""
    async with asyncio.timeout(40):
        while True:
            async with session.get(f"{daemon.base}/stats") as resp:
                st: dict[str, Any] = (await resp.json())["sources"]["vllm-1"]
            if done(st):
                return st
            await asyncio.sleep(0.1)  # /stats is polled: nothing to await


async def settled(daemon: Daemon, session: aiohttp.ClientSession, blocks: int) -> dict[str, Any]:
    """/stats of the source once its queue is empty and it tracks `blocks` blocks."""
    return await stats_when(daemon, session,
                            lambda st: st["queue_depth"] == 0 and st["blocks_tracked"] >= blocks)


async def test_a_listener_started_late_rebuilds_all_of_a_full_replay_buffer(tmp_path: Path) -> None:
    batches, tokens = 10_000, 2_048
    replay = f"tcp://127.0.0.1:{free_port()}"
    async with vllm_publisher(f"tcp://127.0.0.1:{free_port()}", replay) as pub:
        assert await pub.publish(batches, tokens) == batches  # nobody listens: buffer only
        cfg = listener_config(f"tcp://127.0.0.1:{free_port()}", "bind", replay,
                              2 * batches * tokens)
        async with Daemon(cfg, tmp_path) as daemon, aiohttp.ClientSession() as session:
            rec = await daemon.wait_log("zmq_startup_replay", timeout_s=60, backend="vllm-1")
            assert (rec["status"], rec["batches"], rec["last_seq"]) == (
                "exact", batches, batches - 1), rec
            st = await settled(daemon, session, batches)
    assert st["events_dropped"] == {} and st["clears_by_reason"] == {}, st
    assert st["blocks_tracked"] == batches


async def test_a_gap_of_3000_batches_is_filled_from_the_replay_buffer(tmp_path: Path) -> None:
    lost, tokens = 3_000, 2_048
    replay, listen = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    tap = ZmqTap(f"tcp://127.0.0.1:{free_port()}")
    try:
        async with vllm_publisher(tap.endpoint, replay) as pub:
            cfg = listener_config(listen, "bind", replay, 4 * (lost + 2) * tokens)
            async with Daemon(cfg, tmp_path) as daemon, aiohttp.ClientSession() as session:
                await daemon.wait_log("zmq_startup_replay", timeout_s=30, backend="vllm-1")
                tap.forward_to(listen)
                assert await asyncio.to_thread(tap.wait_subscriptions, 1, 15.0)
                await pub.publish(1, tokens)
                assert await asyncio.to_thread(tap.wait_count, 1, 15.0)
                await settled(daemon, session, 1)
                tap.drop_next(lost)  # seqs 1..3000 never reach the listener; 3001 shows the gap
                await pub.publish(lost + 1, tokens)
                st = await stats_when(daemon, session,
                                      lambda st: st["replays"] + st["replay_failures"] >= 1)
                assert (st["replays"], st["replay_failures"], st["clears_by_reason"]) == (1, 0, {})
                st = await settled(daemon, session, lost + 2)
        tap.check()
    finally:
        tap.close()
    assert st["events_dropped"] == {} and st["clears_by_reason"] == {}, st
    assert (st["gaps"], st["blocks_tracked"]) == (1, lost + 2)
