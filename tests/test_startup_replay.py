"""A listener killed with SIGKILL and started again next to a running engine rebuilds the
engine's state from its replay buffer (issue #11, finding 6): exact when the buffer still starts
at seq 0, otherwise what it holds (said in the log and in /stats). The real daemon process and
the engine stand-in's publisher with vLLM's replay ROUTER."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kv_listener.core.model import BlockStored
from kv_listener.core.salt import issue_cache_salt
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.support.daemon import Daemon, sse
from tests.support.ports import free_port
from tests.test_daemon_e2e import BLOCK, MODEL, block_hashes, stored

pytestmark = pytest.mark.timeout(60)


def key_of(i: int) -> bytes:
    return hashlib.sha256(MODEL.encode() + b"\x00S" + f"system prompt {i}".encode()).digest()


def salted(i: int) -> BlockStored:
    tokens = list(range(11 + i, 11 + i + 2 * BLOCK))
    salt = issue_cache_salt(b"s3cret", "vllm-1", key_of(i))
    return stored(tokens, block_hashes(tokens, f"chain-{i}"), extra_keys=((salt,), None))


def config(tmp_path: Path, zport: int, rport: int) -> dict[str, Any]:
    secret = tmp_path / "salt.secret"
    secret.write_text("s3cret")
    return {"listen": f"127.0.0.1:{free_port()}", "cache_salt": {"secret_file": str(secret)},
            "sources": [{"backend_name": "vllm-1", "engine": "vllm", "model": MODEL,
                         "zmq_endpoint": f"tcp://127.0.0.1:{zport}",
                         "replay_endpoint": f"tcp://127.0.0.1:{rport}"}]}


async def snapshot(session: aiohttp.ClientSession, base: str, n: int) -> set[str]:
    """The prefixes of a new consumer's resync (n records expected after its cache_cleared)."""
    async with sse(session, f"{base}/events/vllm-1") as client:
        first = await client.next()
        assert first.event == "cache_cleared"
        return {json.loads((await client.next()).data)["prefix_hash"] for _ in range(n)}


async def stats(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(f"{base}/stats") as resp:
        return dict((await resp.json())["sources"]["vllm-1"])


@pytest.mark.parametrize(("buffer_steps", "status"), [(10_000, "exact"), (15, "partial")])
async def test_a_listener_restarted_after_sigkill_rebuilds_from_the_replay_buffer(
        tmp_path: Path, session: aiohttp.ClientSession, buffer_steps: int, status: str) -> None:
    zport, rport = free_port(), free_port()
    cfg = config(tmp_path, zport, rport)
    async with SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect",
                            replay_endpoint=f"tcp://127.0.0.1:{rport}",
                            buffer_steps=buffer_steps) as pub:
        first = Daemon(cfg, tmp_path)
        async with first:
            await pub.wait_for_subscriber()
            for i in range(22):
                pub.publish(encode_vllm_batch([salted(i)], ts=1.0))
            await first.wait_log("zmq_startup_replay")
            async with sse(session, f"{first.base}/events/vllm-1") as client:
                await client.until(lambda e: e.event == "cache_created" and
                                   json.loads(e.data)["prefix_hash"] == key_of(21).hex())
            first.signal(signal.SIGKILL)
            await first.wait_exit()
        # the engine goes on running, idle; a new listener starts beside it
        async with Daemon(cfg, tmp_path) as second:
            done = await second.wait_log("zmq_startup_replay")
            assert done["status"] == status
            held = 22 if status == "exact" else 15
            assert done["batches"] == held
            st = await stats(session, second.base)
            assert st["startup_replay"] == {"status": status, "batches": held,
                                            "from_seq": 22 - held}
            assert st["prefixes_live"] == held
            assert await snapshot(session, second.base, held) == \
                {key_of(i).hex() for i in range(22 - held, 22)}
            # live batches go on in order after the replayed ones
            await pub.wait_for_subscriber()
            pub.publish(encode_vllm_batch([salted(30)], ts=2.0))
            async with sse(session, f"{second.base}/events/vllm-1") as client:
                await client.until(lambda e: e.event == "cache_created" and
                                   json.loads(e.data)["prefix_hash"] == key_of(30).hex())
            assert (await stats(session, second.base))["clears_by_reason"] == {}
