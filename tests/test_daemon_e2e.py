"""The real daemon end to end: engine-like ZMQ publishers (vLLM map and array encodings, SGLang)
-> `python -m kv_listener --config FILE` -> SSE on a real socket. Prefix hashes are computed here
independently from the conversation (SPEC §2 formula with hashlib), not with the listener's code.
"""

from __future__ import annotations

import hashlib
import json
import signal
from array import array
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kv_listener.core.model import AllBlocksCleared, BlockRemoved, BlockStored
from kv_listener.core.salt import issue_cache_salt
from kv_listener.resolver.template import load_tokenizer
from kv_listener.sim.encode import encode_sglang_batch, encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.conftest import FIXTURES
from tests.support.daemon import Daemon, SseClient, sse
from tests.support.detokenize_server import DetokenizeServer
from tests.support.listening import listening, salted_base
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
MODEL = "tiny-chat"
SYSTEM = "You are a careful assistant for the fleet operators. Answer briefly."
USER = "Which backend holds the longest cached prefix for this conversation right now?"
TOK = load_tokenizer(FIXTURES / "tokenizers" / "chatml")


def spec_hash(model: str, *, system: str | None = None, first: str | None = None) -> str:
    """SPEC §2, written out independently of kv_listener.core.prefix."""
    if system:
        body = b"S" + system.encode()[:1024]
    else:
        assert first
        body = b"M" + first.encode()[:1024]
    return hashlib.sha256(model.encode() + b"\x00" + body).hexdigest()


def chat_tokens(system: str | None, user: str, *turns: str) -> list[int]:
    """The engine's prompt tokens; `turns` (assistant, user, ...) follow the first user message so
    that its end delimiter lands inside a full block."""
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": user}] + \
        [{"role": ("assistant", "user")[i % 2], "content": t} for i, t in enumerate(turns)]
    text = TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(TOK.encode(text, add_special_tokens=False))


def block_hashes(tokens: list[int], salt: str = "") -> list[int]:
    """A chained hash per full block (any deterministic u64 chain will do for the listener)."""
    out, parent = [], salt.encode()
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = hashlib.sha256(parent + array("I", tokens[i:i + BLOCK]).tobytes()).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def stored(tokens: list[int], hashes: list[int], *, extra_keys: Any = None,
           cache_salt: str | None = None, medium: str = "GPU") -> BlockStored:
    n = len(hashes) * BLOCK
    return BlockStored(block_hashes=tuple(hashes), parent_hash=None, token_ids=array("I", tokens[:n]),
                       block_size=BLOCK, medium=medium, extra_keys=extra_keys, cache_salt=cache_salt)


def source(name: str, engine: str, zmq_port: int, **extra: Any) -> dict[str, Any]:
    return {"backend_name": name, "engine": engine, "model": MODEL,
            "zmq_endpoint": f"tcp://127.0.0.1:{zmq_port}", **extra}


def data(ev: Any) -> dict[str, Any]:
    return dict(json.loads(ev.data))


async def test_vllm_map_unsalted_chain_through_detokenize(tmp_path: Path,
                                                          session: aiohttp.ClientSession) -> None:
    detok = await DetokenizeServer(TOK, engine="vllm").start()
    zport = free_port()
    cfg = {"listen": f"127.0.0.1:{free_port()}", "update_interval": "50ms",
           "sources": [source("vllm-1", "vllm", zport, detokenize_endpoint=detok.url)]}
    try:
        async with Daemon(cfg, tmp_path) as daemon, \
                SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub, \
                sse(session, f"{daemon.base}/events/vllm-1") as client:
            first = await client.next()
            assert first.event == "cache_cleared" and first.id is not None  # resync of an empty log
            await pub.wait_for_subscriber()
            tokens = chat_tokens(SYSTEM, USER)
            hashes = block_hashes(tokens)
            pub.publish(encode_vllm_batch([stored(tokens, hashes)], ts=1.0, version="0.33"))
            created = await client.until(lambda e: e.event == "cache_created")
            want = spec_hash(MODEL, system=SYSTEM)
            assert data(created) == {"event": "cache_created", "backend": "vllm-1",
                                     "prefix_hash": want, "token_count": len(hashes) * BLOCK,
                                     "tier": "gpu_hot", "ts": data(created)["ts"]}
            # offload to CPU (vLLM's tokenless placeholder), then the GPU copy goes
            placeholder = BlockStored(block_hashes=tuple(hashes), parent_hash=None,
                                      token_ids=array("I"), block_size=0, medium="CPU")
            pub.publish(encode_vllm_batch([placeholder], ts=2.0, version="0.33"))
            pub.publish(encode_vllm_batch([BlockRemoved(block_hashes=(h,), medium="GPU")
                                           for h in hashes], ts=3.0, version="0.33"))
            off = await client.until(lambda e: e.event == "cache_offloaded")
            assert (data(off)["prefix_hash"], data(off)["tier"]) == (want, "storage_warm")
            assert data(off)["token_count"] == len(hashes) * BLOCK
            pub.publish(encode_vllm_batch([BlockRemoved(block_hashes=tuple(hashes), medium="CPU")],
                                          ts=4.0, version="0.33"))
            gone = await client.until(lambda e: e.event == "cache_evicted")
            assert data(gone) == {"event": "cache_evicted", "backend": "vllm-1",
                                  "prefix_hash": want, "ts": data(gone)["ts"]}
            # a new chain, then the engine resets its prefix cache
            other = chat_tokens(None, USER + " And the second one?",
                                "The second one is vllm-2, it has held it since noon.", "Thanks!")
            pub.publish(encode_vllm_batch([stored(other, block_hashes(other))], ts=5.0))
            again = await client.until(lambda e: e.event == "cache_created")
            assert data(again)["prefix_hash"] == spec_hash(MODEL, first=USER + " And the second one?")
            pub.publish(encode_vllm_batch([AllBlocksCleared()], ts=6.0))
            cleared = await client.until(lambda e: e.event == "cache_cleared")
            assert "prefix_hash" not in data(cleared)
            assert len(detok.requests) >= 1
            async with session.get(f"{daemon.base}/stats") as resp:
                st = (await resp.json())["sources"]["vllm-1"]
            assert (st["clears"], st["clears_by_reason"]) == (1, {"engine_cleared": 1})
    finally:
        await detok.close()


async def test_salted_vllm_array_and_sglang_chains_need_no_detokenize(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    vport, sport = free_port(), free_port()
    cfg = dict(salted_base(tmp_path, "s3cret\n"),
               sources=[source("vllm-1", "vllm", vport), source("sglang-1", "sglang", sport)])
    key_v = hashlib.sha256(MODEL.encode() + b"\x00S" + b"system one").digest()
    key_s = hashlib.sha256(MODEL.encode() + b"\x00S" + b"system two").digest()
    salt_v = issue_cache_salt(b"s3cret", "vllm-1", key_v)
    forged = issue_cache_salt(b"s3cret", "vllm-2", key_v)  # another backend's salt
    salt_s = issue_cache_salt(b"s3cret", "sglang-1", key_s)
    tokens = list(range(100, 100 + 4 * BLOCK))  # no tokenizer needed: the salt decides
    async with Daemon(cfg, tmp_path) as daemon, \
            SimPublisher(f"tcp://127.0.0.1:{vport}", mode="connect") as vpub, \
            SimPublisher(f"tcp://127.0.0.1:{sport}", mode="connect") as spub, \
            sse(session, f"{daemon.base}/events/vllm-1") as vc, \
            sse(session, f"{daemon.base}/events/sglang-1") as sc:
        await vc.next()
        await sc.next()
        await vpub.wait_for_subscriber()
        await spub.wait_for_subscriber()
        hv = block_hashes(tokens, "v")
        bad = block_hashes(tokens, "forged")
        # vLLM <= 0.23 array form; the salt sits in the root block's extra_keys after a LoRA-less
        # entry list (one entry per hash); a forged salt's chain is discarded
        vpub.publish(encode_vllm_batch(
            [stored(tokens, bad, extra_keys=((forged,),) + (None,) * 3),
             stored(tokens, hv, extra_keys=((salt_v,),) + (None,) * 3)], ts=1.0, version="0.23"))
        hs = block_hashes(tokens, "s")
        spub.publish(encode_sglang_batch([stored(tokens, hs, cache_salt=salt_s)], ts=1.0,
                                         version="0.5.23"))
        v = await vc.until(lambda e: e.event == "cache_created")
        s = await sc.until(lambda e: e.event == "cache_created")
        assert (data(v)["prefix_hash"], data(v)["token_count"]) == (key_v.hex(), 4 * BLOCK)
        assert (data(s)["prefix_hash"], data(s)["token_count"]) == (key_s.hex(), 4 * BLOCK)
        async with session.get(f"{daemon.base}/stats") as resp:
            stats = await resp.json()
        assert stats["sources"]["vllm-1"]["salt_rejected"] == 1
        assert stats["sources"]["vllm-1"]["prefixes_live"] == 1
        assert stats["sources"]["sglang-1"]["engine"] == "sglang"
        assert stats["sources"]["vllm-1"]["detokenize_calls"] == 0


async def test_health_ready_metrics_and_404(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    zport = free_port()
    cfg = {"listen": f"127.0.0.1:{free_port()}", "sources": [source("vllm-1", "vllm", zport)]}
    async with Daemon(cfg, tmp_path) as daemon:
        async with session.get(f"{daemon.base}/healthz") as resp:
            assert resp.status == 200
        await daemon.wait_log("source_started", backend="vllm-1")
        async with session.get(f"{daemon.base}/events/nope") as resp:
            assert resp.status == 404
        async with session.get(f"{daemon.base}/metrics") as resp:
            text = await resp.text()
        assert 'continuum_kv_listener_events_received_total{backend="vllm-1"}' in text


async def test_sigterm_sends_draining_and_exits_0(tmp_path: Path,
                                                  session: aiohttp.ClientSession) -> None:
    zport = free_port()
    cfg = {"listen": f"127.0.0.1:{free_port()}", "sources": [source("vllm-1", "vllm", zport)]}
    async with Daemon(cfg, tmp_path) as daemon:
        client = await SseClient(session, f"{daemon.base}/events/vllm-1").connect()
        await client.next()
        daemon.signal(signal.SIGTERM)
        ev = await client.until(lambda e: e.event == "draining")
        assert ev.id is None
        assert data(ev) == {"event": "draining", "backend": "vllm-1"}
        client.close()
        assert await daemon.wait_exit() == 0


async def test_sighup_adds_and_removes_sources_keeping_the_others_history(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    p1, p2, p3 = free_port(), free_port(), free_port()
    base = salted_base(tmp_path)
    cfg = dict(base, sources=[source("vllm-1", "vllm", p1), source("vllm-2", "vllm", p2)])
    tokens = list(range(7, 7 + 2 * BLOCK))

    def salted(backend: str, system: str, tag: str) -> BlockStored:
        key = hashlib.sha256(MODEL.encode() + b"\x00S" + system.encode()).digest()
        salt = issue_cache_salt(b"s3cret", backend, key)
        return stored(tokens, block_hashes(tokens, tag), extra_keys=((salt,), None))

    async with Daemon(cfg, tmp_path) as daemon, \
            SimPublisher(f"tcp://127.0.0.1:{p1}", mode="connect") as pub1:
        async with sse(session, f"{daemon.base}/events/vllm-1") as c1:
            await c1.next()
            await pub1.wait_for_subscriber()
            pub1.publish(encode_vllm_batch([salted("vllm-1", "kept", "a")], ts=1.0))
            created = await c1.until(lambda e: e.event == "cache_created")
            kept_id = created.id
        async with sse(session, f"{daemon.base}/events/vllm-2") as c2:
            await c2.next()
            # drop vllm-2, add vllm-3; vllm-1 is unchanged and must keep its state and history
            daemon.rewrite(dict(base, sources=[source("vllm-1", "vllm", p1),
                                               source("vllm-3", "vllm", p3)]))
            daemon.signal(signal.SIGHUP)
            reloaded = await daemon.wait_log("config_reloaded")
            assert (reloaded["added"], reloaded["removed"], reloaded["restarted"]) == \
                (["vllm-3"], ["vllm-2"], [])
            ended = await c2.until(lambda e: e.event == "draining")  # its stream ends
            assert data(ended)["backend"] == "vllm-2"
        async with session.get(f"{daemon.base}/events/vllm-2") as resp:
            assert resp.status == 404
        # vllm-1 resumes from its old ID with no resync: same epoch, history kept
        async with sse(session, f"{daemon.base}/events/vllm-1", kept_id) as c1:
            pub1.publish(encode_vllm_batch([salted("vllm-1", "after reload", "b")], ts=2.0))
            nxt = await c1.next()
            assert nxt.event == "cache_created" and nxt.id is not None
            assert kept_id is not None
            assert nxt.id.split("-")[0] == kept_id.split("-")[0]
            assert int(nxt.id.split("-")[1]) == int(kept_id.split("-")[1]) + 1
        async with SimPublisher(f"tcp://127.0.0.1:{p3}", mode="connect") as pub3, \
                sse(session, f"{daemon.base}/events/vllm-3") as c3:
            await c3.next()
            await pub3.wait_for_subscriber()
            pub3.publish(encode_vllm_batch([salted("vllm-3", "new one", "c")], ts=3.0))
            new = await c3.until(lambda e: e.event == "cache_created")
            assert data(new)["backend"] == "vllm-3"
        # an invalid file is logged and the running config stays
        daemon.rewrite("sources: [{backend_name: 'bad name'}]\n")
        daemon.signal(signal.SIGHUP)
        failed = await daemon.wait_log("config_reload_failed")
        assert any("sources[0].backend_name" in e for e in failed["errors"])
        async with session.get(f"{daemon.base}/stats") as resp:
            assert sorted((await resp.json())["sources"]) == ["vllm-1", "vllm-3"]


async def test_changed_source_restarts_behind_a_cache_cleared(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    port = free_port()
    base = salted_base(tmp_path)
    tokens = list(range(3, 3 + BLOCK))
    key = hashlib.sha256(MODEL.encode() + b"\x00S" + b"sys").digest()
    salt = issue_cache_salt(b"s3cret", "vllm-1", key)
    cfg = dict(base, sources=[source("vllm-1", "vllm", port)])
    async with listening(cfg, tmp_path, session, port, "vllm-1") as (daemon, pub, client):
        pub.publish(encode_vllm_batch([stored(tokens, block_hashes(tokens), extra_keys=((salt,),))],
                                      ts=1.0))
        await client.until(lambda e: e.event == "cache_created")
        daemon.rewrite(dict(base, sources=[source("vllm-1", "vllm", port, zmq_topic="kv")]))
        daemon.signal(signal.SIGHUP)
        reloaded = await daemon.wait_log("config_reloaded")
        assert reloaded["restarted"] == ["vllm-1"]
        cleared = await client.until(lambda e: e.event == "cache_cleared")
        assert cleared.id is not None  # a live record on the same stream, not a resync
        async with session.get(f"{daemon.base}/stats") as resp:
            assert (await resp.json())["sources"]["vllm-1"]["prefixes_live"] == 0


async def test_a_second_sigterm_while_draining_still_exits_0(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    cfg = {"listen": f"127.0.0.1:{free_port()}", "sources": [source("vllm-1", "vllm", free_port())]}
    async with Daemon(cfg, tmp_path) as daemon:
        client = await SseClient(session, f"{daemon.base}/events/vllm-1").connect()
        await client.next()
        daemon.signal(signal.SIGTERM)
        await daemon.wait_log("listener_stopping")
        daemon.signal(signal.SIGTERM)  # impatient operator
        daemon.signal(signal.SIGINT)
        assert (await client.until(lambda e: e.event == "draining")).id is None
        client.close()
        assert await daemon.wait_exit() == 0


async def test_sglang_unsalted_chain_through_sglang_detokenize(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """SGLang's /detokenize answers {"text"} and drops special tokens unless asked not to: the
    listener must send skip_special_tokens=false, or the role markers vanish and nothing parses."""
    detok = await DetokenizeServer(TOK, engine="sglang").start()
    zport = free_port()
    cfg = {"listen": f"127.0.0.1:{free_port()}",
           "sources": [source("sglang-1", "sglang", zport, detokenize_endpoint=detok.url)]}
    try:
        async with listening(cfg, tmp_path, session, zport, "sglang-1") as (_, pub, client):
            tokens = chat_tokens(SYSTEM, USER)
            hashes = block_hashes(tokens)
            # SGLang 0.5.17 array form, one event per page run; len(tokens) == block_size * hashes
            pub.publish(encode_sglang_batch([stored(tokens, hashes)], ts=1.0, version="0.5.17"))
            created = await client.until(lambda e: e.event == "cache_created")
            assert data(created)["prefix_hash"] == spec_hash(MODEL, system=SYSTEM)
            assert data(created)["token_count"] == len(hashes) * BLOCK
            assert detok.requests and all(r.get("skip_special_tokens") is False
                                          for r in detok.requests)
    finally:
        await detok.close()
