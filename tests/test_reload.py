"""SIGHUP reload validates exactly as `config validate` does (issue #11, finding 2): a file that
command rejects (empty, a router file, errors) keeps the running configuration and its state;
a storm of SIGHUPs over valid and invalid files ends on the file as it is last written, and an
unchanged source keeps every record of its state. The real daemon process."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kv_listener.core.model import BlockStored
from kv_listener.core.salt import issue_cache_salt
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.support.daemon import Daemon, sse
from tests.support.ports import free_port
from tests.test_daemon_e2e import BLOCK, MODEL, block_hashes, source, stored

pytestmark = pytest.mark.timeout(60)


def salted(i: int) -> BlockStored:
    tokens = list(range(7 + i, 7 + i + BLOCK))
    key = hashlib.sha256(MODEL.encode() + b"\x00S" + f"system {i}".encode()).digest()
    salt = issue_cache_salt(b"s3cret", "vllm-1", key)
    return stored(tokens, block_hashes(tokens, f"chain-{i}"), extra_keys=((salt,), None))


def validate(path: Path) -> int:
    return subprocess.run([sys.executable, "-m", "kv_listener", "config", "validate", str(path)],
                          capture_output=True, check=False).returncode


async def live(session: aiohttp.ClientSession, base: str) -> int:
    async with session.get(f"{base}/stats") as resp:
        return int((await resp.json())["sources"]["vllm-1"]["prefixes_live"])


@pytest.mark.parametrize("text", ["", "# only a comment\n", "kv_cache_index:\n  backend: memory\n",
                                  "sources: []\nlisten: 'nope'\n"],
                         ids=["empty", "comment-only", "router-file", "invalid"])
async def test_a_file_that_config_validate_rejects_keeps_the_running_config(
        tmp_path: Path, session: aiohttp.ClientSession, text: str) -> None:
    secret = tmp_path / "salt.secret"
    secret.write_text("s3cret")
    port = free_port()
    cfg = {"listen": f"127.0.0.1:{free_port()}", "cache_salt": {"secret_file": str(secret)},
           "sources": [source("vllm-1", "vllm", port)]}
    async with Daemon(cfg, tmp_path) as daemon, \
            SimPublisher(f"tcp://127.0.0.1:{port}", mode="connect") as pub, \
            sse(session, f"{daemon.base}/events/vllm-1") as client:
        await client.next()
        await pub.wait_for_subscriber()
        pub.publish(encode_vllm_batch([salted(0)], ts=1.0))
        await client.until(lambda e: e.event == "cache_created")
        daemon.rewrite(text)
        # `config validate` refuses it (a router file it accepts as such: not a listener's)
        assert validate(daemon.path) == (0 if "kv_cache_index" in text else 2)
        daemon.signal(signal.SIGHUP)
        failed = await daemon.wait_log("config_reload_failed")
        assert failed["errors"]
        assert await live(session, daemon.base) == 1
        # the stream goes on: the next record is the next live one, not a clear or a drain
        pub.publish(encode_vllm_batch([salted(1)], ts=2.0))
        nxt = await client.next()
        assert nxt.event == "cache_created"


async def test_a_sighup_storm_ends_on_the_last_file_and_keeps_an_unchanged_source(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    secret = tmp_path / "salt.secret"
    secret.write_text("s3cret")
    p1, p2 = free_port(), free_port()
    base: dict[str, Any] = {"listen": f"127.0.0.1:{free_port()}",
                            "cache_salt": {"secret_file": str(secret)}}
    one = dict(base, sources=[source("vllm-1", "vllm", p1)])
    two = dict(base, sources=[source("vllm-1", "vllm", p1), source("vllm-2", "vllm", p2)])
    async with Daemon(one, tmp_path) as daemon, \
            SimPublisher(f"tcp://127.0.0.1:{p1}", mode="connect") as pub:
        async with sse(session, f"{daemon.base}/events/vllm-1") as client:
            await client.next()
            await pub.wait_for_subscriber()
            for i in range(40):
                pub.publish(encode_vllm_batch([salted(i)], ts=1.0))
            for _ in range(40):
                await client.until(lambda e: e.event == "cache_created")
        for i in range(30):
            daemon.rewrite(yaml.safe_dump(two) if i % 3 == 0 else "" if i % 3 == 1 else
                           "sources: [{backend_name: 'bad name'}]\n")
            daemon.signal(signal.SIGHUP)
        # the last file differs from every earlier one: the last SIGHUP must win
        p3 = free_port()
        daemon.rewrite(dict(base, sources=[source("vllm-1", "vllm", p1), source("vllm-3", "vllm", p3)]))
        daemon.signal(signal.SIGHUP)
        async with asyncio.timeout(30):
            while True:
                done = await daemon.wait_log("config_reloaded")
                if sorted(done["added"]) == ["vllm-3"]:
                    break
        async with session.get(f"{daemon.base}/stats") as resp:
            assert sorted((await resp.json())["sources"]) == ["vllm-1", "vllm-3"]
        assert await live(session, daemon.base) == 40
