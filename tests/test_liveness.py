"""Engine liveness (issue #10, bug 3; SPEC §5): a killed engine sends nothing on ZMQ, so without
a check its prefixes stay live forever. The real daemon watches the engine's `GET /health` beside
`/detokenize`; an engine silent for `engine_down_after` gets `cache_cleared` (`engine_down`) and
its source is not ready until it is back; an idle engine that answers is never cleared.

The engine here is the package's engine stand-in: a ZMQ publisher and an aiohttp server with
`/detokenize`, `/tokenize` and `/health` backed by a real tokenizer, stopped and started again on
the same ports, as a killed and restarted engine is (the real vLLM version of this runs in
tests/engines/)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kv_listener.core.liveness import EngineState, Liveness, LivenessChange
from kv_listener.core.model import BlockStored
from kv_listener.core.salt import issue_cache_salt
from kv_listener.resolver.template import load_tokenizer
from kv_listener.sim.detokenize_server import DetokenizeServer
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from kv_listener.sim.trtllm_server import SimTrtllmServer
from tests.conftest import FIXTURES
from tests.support.daemon import Daemon, sse
from tests.support.detokenize_server import DetokenizeServer as ScriptedServer
from tests.support.listening import listening
from tests.support.ports import free_port
from tests.test_daemon_e2e import MODEL, SYSTEM, USER, block_hashes, chat_tokens, spec_hash, stored

pytestmark = pytest.mark.timeout(60)

TOK = load_tokenizer(FIXTURES / "tokenizers" / "chatml")
SECRET = "liveness-secret"


def config(zport: int, http_port: int, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    secret = tmp_path / "salt.secret"
    secret.write_text(SECRET)
    return {"listen": f"127.0.0.1:{free_port()}", "update_interval": "50ms",
            "cache_salt": {"secret_file": str(secret)},
            "sources": [{"backend_name": "vllm-1", "engine": "vllm", "model": MODEL,
                         "zmq_endpoint": f"tcp://127.0.0.1:{zport}",
                         "detokenize_endpoint": f"http://127.0.0.1:{http_port}/detokenize",
                         "health_interval": "100ms", "engine_down_after": "1s", **extra}]}


def salted_chain(system: str) -> BlockStored:
    tokens = chat_tokens(system, USER)
    key = bytes.fromhex(spec_hash(MODEL, system=system))
    salt = issue_cache_salt(SECRET.encode(), "vllm-1", key)
    return stored(tokens, block_hashes(tokens, salt), extra_keys=((salt,),))


async def readyz(session: aiohttp.ClientSession, base: str) -> tuple[int, Any]:
    async with session.get(f"{base}/readyz") as resp:
        return resp.status, await resp.json()


async def stats(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(f"{base}/stats") as resp:
        body: dict[str, Any] = await resp.json()
        return dict(body["sources"]["vllm-1"])


async def test_a_killed_engine_is_cleared_and_not_ready_until_it_returns(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    zport, hport = free_port(), free_port()
    engine = await DetokenizeServer(TOK, port=hport).start()
    pub = await SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect").start()
    try:
        async with Daemon(config(zport, hport, tmp_path), tmp_path) as daemon, \
                sse(session, f"{daemon.base}/events/vllm-1") as client:
            assert (await client.next()).event == "cache_cleared"  # resync of an empty log
            await pub.wait_for_subscriber()
            pub.publish(encode_vllm_batch([salted_chain(SYSTEM)], ts=1.0, version="0.33"))
            created = await client.until(lambda e: e.event == "cache_created")
            assert json.loads(created.data)["prefix_hash"] == spec_hash(MODEL, system=SYSTEM)
            await daemon.wait_log("engine_up", backend="vllm-1")
            assert (await readyz(session, daemon.base))[0] == 200

            # The engine dies: its HTTP server and its publisher go, nothing more is sent.
            await engine.close()
            await pub.close()
            cleared = await client.next(timeout_s=10)
            assert (cleared.event, json.loads(cleared.data)["event"]) == \
                ("cache_cleared", "cache_cleared")
            down = await daemon.wait_log("engine_down", backend="vllm-1")
            assert down["silent_for_s"] >= 1.0
            assert await readyz(session, daemon.base) == (503, ["vllm-1"])
            st = await stats(session, daemon.base)
            assert st["engine_state"] == "down" and st["engine_downs"] == 1
            assert st["clears_by_reason"].get("engine_down") == 1
            assert st["prefixes_live"] == 0

            # It comes back on the same ports, as a restarted engine: a new publisher at seq 0.
            engine = await DetokenizeServer(TOK, port=hport).start()
            pub = await SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect").start()
            await daemon.wait_log("engine_up", backend="vllm-1")
            await pub.wait_for_subscriber()
            other = SYSTEM + " Be brief."
            pub.publish(encode_vllm_batch([salted_chain(other)], ts=2.0, version="0.33"))
            created = await client.until(lambda e: e.event == "cache_created")
            assert json.loads(created.data)["prefix_hash"] == spec_hash(MODEL, system=other)
            assert (await readyz(session, daemon.base))[0] == 200
            st = await stats(session, daemon.base)
            assert (st["engine_state"], st["prefixes_live"]) == ("up", 1)
            async with session.get(f"{daemon.base}/metrics") as resp:
                assert 'continuum_kv_listener_engine_up{backend="vllm-1"} 1.0' in await resp.text()
    finally:
        await pub.close()
        await engine.close()


async def test_an_idle_engine_that_answers_is_never_cleared(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    zport, hport = free_port(), free_port()
    async with DetokenizeServer(TOK, port=hport) as engine, \
            SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub, \
            Daemon(config(zport, hport, tmp_path), tmp_path) as daemon, \
            sse(session, f"{daemon.base}/events/vllm-1") as client:
        await client.next()
        await pub.wait_for_subscriber()
        pub.publish(encode_vllm_batch([salted_chain(SYSTEM)], ts=1.0, version="0.33"))
        await client.until(lambda e: e.event == "cache_created")
        # Idle for three times engine_down_after: health checks keep answering, no batch comes.
        async with asyncio.timeout(20):
            for _ in range(30):  # 30 x 100 ms
                engine.health_checked.clear()
                await engine.health_checked.wait()
        st = await stats(session, daemon.base)
        assert (st["engine_state"], st["engine_downs"], st["prefixes_live"]) == ("up", 0, 1)
        assert "engine_down" not in st["clears_by_reason"]
        assert (await readyz(session, daemon.base))[0] == 200


async def test_an_engine_that_never_came_up_is_not_ready(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    # Sidecar first: the engine is still loading its model (nothing listens on its port yet).
    zport, hport = free_port(), free_port()
    async with Daemon(config(zport, hport, tmp_path), tmp_path) as daemon:
        down = await daemon.wait_log("engine_down", backend="vllm-1")
        assert down["endpoint"] == f"http://127.0.0.1:{hport}"
        assert await readyz(session, daemon.base) == (503, ["vllm-1"])
        async with DetokenizeServer(TOK, port=hport):
            await daemon.wait_log("engine_up", backend="vllm-1")
            assert (await readyz(session, daemon.base))[0] == 200


# --- the pure state (core.liveness) -------------------------------------------------------------


def test_liveness_declares_down_once_after_the_silence_and_comes_back() -> None:
    lv = Liveness(10.0, now=100.0)
    assert lv.state is EngineState.UNKNOWN
    assert lv.check(109.9) is None  # silent since the start, not long enough
    assert lv.alive(105.0) is LivenessChange.FIRST_UP
    assert lv.check(114.9) is None and lv.state is EngineState.UP
    assert lv.alive(104.0) is None  # a late probe answer does not move the last sign back
    assert lv.check(115.0) is LivenessChange.WENT_DOWN
    assert lv.check(200.0) is None and lv.downs == 1  # declared once
    assert lv.state is EngineState.DOWN
    assert lv.alive(201.0) is LivenessChange.CAME_BACK
    assert lv.check(210.9) is None and lv.state is EngineState.UP


def test_an_engine_never_seen_is_down_after_the_silence_from_the_start() -> None:
    lv = Liveness(2.0, now=0.0)
    assert lv.check(2.0) is LivenessChange.WENT_DOWN
    with pytest.raises(ValueError, match="down_after_s"):
        Liveness(0.0, now=0.0)


async def test_a_trtllm_engine_whose_polls_fail_is_declared_down(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    port = free_port()
    sim = SimTrtllmServer()
    cfg = {"listen": f"127.0.0.1:{free_port()}",
           "sources": [{"backend_name": "vllm-1", "engine": "trtllm", "model": MODEL,
                        "trtllm_endpoint": f"http://127.0.0.1:{port}/kv_cache_events",
                        "poll_interval": "50ms", "engine_down_after": "1s"}]}
    running = await sim.serve(port=port)
    try:
        async with Daemon(cfg, tmp_path) as daemon:
            await daemon.wait_log("engine_up", backend="vllm-1")
            await running.close()
            down = await daemon.wait_log("engine_down", backend="vllm-1")
            assert down["endpoint"] is None  # the poll itself is the check
            assert await readyz(session, daemon.base) == (503, ["vllm-1"])
            assert (await stats(session, daemon.base))["clears_by_reason"]["engine_down"] == 1
            running = await sim.serve(port=port)
            await daemon.wait_log("engine_up", backend="vllm-1")
    finally:
        await running.close()


async def test_a_chain_whose_detokenize_failed_resolves_once_the_endpoint_is_back(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    # issue #11, finding 1: pending chains resolve once /detokenize returns, even when the
    # engine stores nothing more (the daemon asks failed chains again every few seconds).
    zport = free_port()
    server = await ScriptedServer(TOK).start()
    server.script = [500, 500, 500]  # the first call and its two retries fail
    cfg = {"listen": f"127.0.0.1:{free_port()}", "update_interval": "50ms",
           "sources": [{"backend_name": "vllm-1", "engine": "vllm", "model": MODEL,
                        "zmq_endpoint": f"tcp://127.0.0.1:{zport}",
                        "detokenize_endpoint": server.url}]}
    try:
        async with listening(cfg, tmp_path, session, zport, "vllm-1") as (daemon, pub, client):
            tokens = chat_tokens(SYSTEM, USER)
            pub.publish(encode_vllm_batch([stored(tokens, block_hashes(tokens))], ts=1.0))
            await daemon.wait_log("detokenize_failed", backend="vllm-1")
            created = await client.until(lambda e: e.event == "cache_created", timeout_s=30)
            assert json.loads(created.data)["prefix_hash"] == spec_hash(MODEL, system=SYSTEM)
            assert len(server.requests) >= 4  # the failed call (3 attempts), then the retry
    finally:
        await server.close()
