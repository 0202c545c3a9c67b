"""The simulated engine's HTTP server, run for real on 127.0.0.1 with its engine's real ZMQ sockets:
every route's shape, chat and both completion forms hitting the same cached blocks, streaming
(first chunk at prefill end, usage last), the sequence-slot limit by admission order, the KV
events on the PUB and the replay ROUTER decoded back to the pool's blocks, the running-only
KV usage, and bad input answered 400 / 404 without touching the engine.

A "frozen" timing (a decode step of 1000 s) holds a request right after its first token, so a
test observes a running request without racing it; closing its connection aborts it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kv_listener.core.decode import decode_zmq_payload
from kv_listener.core.model import BlockRemoved, BlockStored, Engine
from kv_listener.core.sequence import END_SEQ, parse_event_frames
from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer
from kv_listener.sim.detokenize_server import tokenizer_info
from kv_listener.sim.engine import SimEngine, render_chat
from kv_listener.sim.server import VLLM_VERSION, EngineServer
from kv_listener.sim.service import RequestRecord, ServiceTiming
from kv_listener.sim.workload import SYSTEM_PROMPTS, ChatWorkload

MODEL = "sim-test-model"
#: Real times a hundredth of the defaults: a request takes well under a millisecond.
FAST = ServiceTiming(time_scale=0.01)
#: After its first token a request waits 1000 s for the next one: it stays running until aborted.
FROZEN = ServiceTiming(decode_s_per_token=1000.0, time_scale=1.0)

_tok: list[Any] = []


def tokenizer() -> Any:
    if not _tok:
        _tok.append(load_tokenizer(DEMO_TOKENIZER_DIR))
    return _tok[0]


@contextlib.asynccontextmanager
async def serving(*, timing: ServiceTiming = FAST, num_blocks: int = 256,
                  max_num_seqs: int = 4) -> AsyncIterator[EngineServer]:
    engine = SimEngine("vllm-1", tokenizer(), num_blocks=num_blocks, max_num_seqs=max_num_seqs)
    async with EngineServer(engine, model=MODEL, timing=timing,
                            tokenizer_info=tokenizer_info(DEMO_TOKENIZER_DIR)) as server:
        yield server


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


def system_chat(i: int, user: str = "Hello there.") -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPTS[i].text},
            {"role": "user", "content": user}]


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


async def next_data(resp: aiohttp.ClientResponse) -> Any:
    """The next `data:` event of a server-sent-event stream (JSON, or the string "[DONE]")."""
    while True:
        line = await resp.content.readline()
        assert line, "the stream ended"
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            return "[DONE]" if data == b"[DONE]" else json.loads(data)
        assert line == b"\n", line


async def all_data(resp: aiohttp.ClientResponse) -> list[Any]:
    events = [await next_data(resp)]
    while events[-1] != "[DONE]":
        events.append(await next_data(resp))
    assert await resp.content.read() == b"\n"  # the blank line that ends the last event
    return events


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            assert series.endswith(f'{{engine="0",model_name="{MODEL}"}}')
            out[series.split("{")[0]] = float(value)
    return out


def blocks_for(tokens: int) -> int:
    return -(-tokens // 16)


# --- time model -------------------------------------------------------------------------------


def test_service_timing_scales_every_simulated_time_and_refuses_nonsense() -> None:
    t = ServiceTiming()
    assert t.prefill_s(1000) == pytest.approx((0.005 + 1000 * 0.00005) * 0.1)
    assert t.prefill_s(0) == pytest.approx(0.0005)  # a full cache hit still costs the step
    assert t.decode_step_s() == pytest.approx(0.001)
    assert ServiceTiming(time_scale=1.0).decode_step_s() == pytest.approx(0.010)
    for bad in ({"time_scale": -1.0}, {"prefill_s_per_token": math.nan}, {"min_tick_s": -0.1}):
        with pytest.raises(ValueError):
            ServiceTiming(**bad)


# --- shapes -------------------------------------------------------------------------------------


async def test_probe_and_tokenizer_routes_answer_in_the_peers_shapes(
        session: aiohttp.ClientSession) -> None:
    async with serving(num_blocks=100) as server:
        base = server.url
        async with session.get(base + "/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        models = await get_json(session, base + "/v1/models")
        assert models["object"] == "list"
        (card,) = models["data"]
        assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 1600
        assert await get_json(session, base + "/version") == {"version": VLLM_VERSION}
        for path in ("/v1/loads", "/loads"):
            assert await get_json(session, base + path) == {"dp_rank_count": 1, "loads": [{
                "dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0,
                "max_total_num_tokens": 1600, "token_usage": 0.0}]}
        assert await get_json(session, base + "/get_load") == {"load": 0}
        m = await metrics(session, base)
        assert {k: m[k] for k in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                                  "vllm:num_requests_waiting", "vllm:prefix_cache_queries_total",
                                  "vllm:prefix_cache_hits_total")} == dict.fromkeys(
            ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
             "vllm:num_requests_waiting", "vllm:prefix_cache_queries_total",
             "vllm:prefix_cache_hits_total"), 0.0)
        assert await get_json(session, base + "/tokenizer_info") == tokenizer_info(
            DEMO_TOKENIZER_DIR)
        # /tokenize and /detokenize as the listener's resolver and vLLM clients call them.
        status, tok = await post(session, base + "/tokenize",
                                 {"model": MODEL, "prompt": "<|im_start|>user\nhi"})
        assert status == 200
        assert tok == {"count": len(tok["tokens"]), "max_model_len": 1600,
                       "tokens": tokenizer().encode("<|im_start|>user\nhi"), "token_strs": None}
        messages = system_chat(0)
        status, chat_tok = await post(session, base + "/tokenize", {"messages": messages})
        assert status == 200 and chat_tok["tokens"] == list(render_chat(tokenizer(), messages))
        # vLLM >= 0.20's render route, which vllm-router asks every worker before it forwards
        for _ in range(2):  # the second answer comes from the memo: the same IDs
            status, rendered = await post(session, base + "/v1/chat/completions/render",
                                          chat_body(messages))
            assert status == 200 and rendered == {"token_ids": chat_tok["tokens"]}
        status, _ = await post(session, base + "/v1/chat/completions/render",
                               {"model": "other", "messages": messages})
        assert status == 404
        status, detok = await post(session, base + "/detokenize", {"tokens": tok["tokens"]})
        assert status == 200 and detok == {"prompt": "<|im_start|>user\nhi"}


async def test_chat_and_both_completion_forms_hit_the_same_cached_blocks(
        session: aiohttp.ClientSession) -> None:
    """The rendered chat text as a completion, and its token IDs, are the chat request's
    prompt: the second and third requests are served from the first one's blocks."""
    messages = ChatWorkload(seed=2).next().messages
    ids = list(render_chat(tokenizer(), messages))
    text = tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n = len(ids)
    hit = (n - 1) // 16 * 16  # whole blocks, the last prompt token always recomputed (vLLM)
    async with serving() as server:
        status, chat = await post(session, server.url + "/v1/chat/completions",
                                  chat_body(messages, max_tokens=5))
        assert status == 200
        assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
        assert chat["model"] == MODEL
        (choice,) = chat["choices"]
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] == "length"
        assert chat["usage"] == {"prompt_tokens": n, "completion_tokens": 5,
                                 "total_tokens": n + 5,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        for prompt in (text, ids, [ids]):
            status, comp = await post(session, server.url + "/v1/completions",
                                      {"model": MODEL, "prompt": prompt, "max_tokens": 3})
            assert status == 200
            assert comp["object"] == "text_completion" and comp["id"].startswith("cmpl-")
            assert isinstance(comp["choices"][0]["text"], str)
            assert comp["usage"]["prompt_tokens"] == n
            assert comp["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
        # The model may be left out, as vLLM allows.
        status, again = await post(session, server.url + "/v1/chat/completions",
                                   {"messages": messages, "max_tokens": 1})
        assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
        stats = server.stats
        assert (stats.requests, stats.prompt_tokens, stats.cached_tokens) == (5, 5 * n, 4 * hit)
        assert stats.completion_tokens == 5 + 3 * 3 + 1 and stats.aborted == stats.rejected == 0
        assert [r.kind for r in stats.records] == ["chat", "completion", "completion",
                                                   "completion", "chat"]
        assert all(r.ttft_s is not None and r.ttft_s > 0 for r in stats.records)
        m = await metrics(session, server.url)
        assert m["vllm:prefix_cache_queries_total"] == 5 * n
        assert m["vllm:prefix_cache_hits_total"] == 4 * hit
        assert m["vllm:kv_cache_usage_perc"] == 0.0  # idle: cached blocks are not usage


async def test_streaming_sends_the_first_token_then_decode_chunks_then_usage(
        session: aiohttp.ClientSession) -> None:
    # A 20 ms decode step against the 5 ms tick: several decode chunks.
    timing = ServiceTiming(decode_s_per_token=0.020, time_scale=1.0)
    messages = system_chat(1)
    n = len(render_chat(tokenizer(), messages))
    async with serving(timing=timing) as server:
        async with session.post(server.url + "/v1/chat/completions",
                                json=chat_body(messages, max_tokens=4, stream=True)) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            assert resp.headers["x-engine-name"] == "vllm-1"  # for a client behind a proxy
            events = await all_data(resp)
        role, *content, last, done = events
        rec = server.stats.records[0]
        assert last.pop("x_sim") == {"engine": "vllm-1", "ttft_s": rec.ttft_s}
        assert done == "[DONE]"
        ids = {e["id"] for e in events[:-1]}
        assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
        assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL
                   for e in events[:-1])
        assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]
        assert len(content) >= 2  # the first token alone, then decode chunks
        assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (
            len(content) - 1) + ["length"]
        assert all(isinstance(c["choices"][0]["delta"].get("content", ""), str) for c in content)
        assert "role" not in content[0]["choices"][0]["delta"]
        assert last["choices"] == []
        assert last["usage"] == {"prompt_tokens": n, "completion_tokens": 4, "total_tokens": n + 4,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        # Completions stream the same way, with `text` and no role chunk.
        async with session.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": list(render_chat(tokenizer(), messages)),
                "max_tokens": 3, "stream": True}) as resp:
            events = await all_data(resp)
        *content, last, done = events
        assert last["x_sim"]["engine"] == "vllm-1"
        assert all(c["object"] == "text_completion" and "text" in c["choices"][0]
                   for c in content)
        assert content[-1]["choices"][0]["finish_reason"] == "length"
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
        assert [r.stream for r in server.stats.records] == [True, True]


async def test_first_chunk_comes_at_prefill_end_and_kv_usage_counts_running_requests_only(
        session: aiohttp.ClientSession) -> None:
    messages = system_chat(2)
    n = len(render_chat(tokenizer(), messages))
    async with serving(timing=FROZEN, num_blocks=128) as server:
        pool = server.engine.core.pool
        resp = await session.post(server.url + "/v1/chat/completions",
                                  json=chat_body(messages, max_tokens=3, stream=True))
        try:
            role = await next_data(resp)
            first = await next_data(resp)
            assert role["choices"][0]["delta"]["role"] == "assistant"
            assert first["choices"][0]["finish_reason"] is None
            # The next token is 1000 s away: this chunk was sent when prefill ended.
            assert server.num_running == 1 and server.stats.records == []
            in_use = blocks_for(n + 1)  # the prompt and the first sampled token
            assert pool.stats().in_use == in_use
            m = await metrics(session, server.url)
            assert m["vllm:kv_cache_usage_perc"] == pytest.approx(in_use / 128)
            assert m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] == 0
            (load,) = (await get_json(session, server.url + "/v1/loads"))["loads"]
            assert load["num_running_reqs"] == 1
            assert load["token_usage"] == pytest.approx(in_use / 128)
            assert await get_json(session, server.url + "/get_load") == {"load": 1}
        finally:
            resp.close()  # the client leaves: the engine aborts the request (vLLM does)
        await server.wait_until(lambda: server.num_running == 0)
        await server.wait_until(lambda: len(server.stats.records) == 1)
        (rec,) = server.stats.records
        assert rec.finish_reason == "abort" and rec.completion_tokens == 1
        assert rec.ttft_s is not None and server.stats.aborted == 1 and server.stats.requests == 0
        # Its blocks stay cached, but no running request holds them: usage is back to 0.
        assert pool.stats().cached == n // 16 and pool.stats().in_use == 0
        m = await metrics(session, server.url)
        assert m["vllm:kv_cache_usage_perc"] == 0.0 and m["vllm:num_requests_running"] == 0


async def test_max_num_seqs_holds_later_requests_in_arrival_order(
        session: aiohttp.ClientSession) -> None:
    async with serving(timing=FROZEN, max_num_seqs=1) as server:
        a = await session.post(server.url + "/v1/chat/completions",
                               json=chat_body(system_chat(0), max_tokens=2, stream=True))
        try:
            await next_data(a)
            await next_data(a)  # A's first token: A holds the only sequence slot
            b = asyncio.create_task(post(session, server.url + "/v1/chat/completions",
                                         chat_body(system_chat(1), max_tokens=1)))
            await server.wait_until(lambda: server.num_waiting == 1)
            c = asyncio.create_task(post(session, server.url + "/v1/completions", {
                "model": MODEL, "prompt": SYSTEM_PROMPTS[2].text, "max_tokens": 1}))
            await server.wait_until(lambda: server.num_waiting == 2)
            # D queues behind them, and its client gives up while it waits.
            d = await session.post(server.url + "/v1/chat/completions",
                                   json=chat_body(system_chat(3), max_tokens=1, stream=True))
            await server.wait_until(lambda: server.num_waiting == 3)
            d.close()
            await server.wait_until(lambda: server.num_waiting == 2)
            m = await metrics(session, server.url)
            assert m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] == 2
            (load,) = (await get_json(session, server.url + "/v1/loads"))["loads"]
            assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 2)
            assert await get_json(session, server.url + "/get_load") == {"load": 3}
            assert not b.done() and not c.done()
        finally:
            a.close()
        (sb, body_b), (sc, body_c) = await b, await c
        assert sb == sc == 200
        assert body_b["usage"]["completion_tokens"] == body_c["usage"]["completion_tokens"] == 1
        by_kind: dict[tuple[str, bool], RequestRecord] = {
            (r.kind, r.stream): r for r in server.stats.records}
        ra, rb, rc = by_kind["chat", True], by_kind["chat", False], by_kind["completion", False]
        rd = server.stats.records[0]  # the first to end: it left the queue
        assert rd.finish_reason == "abort" and rd.admitted_at is None and rd.ttft_s is None
        assert ra.finish_reason == "abort" and rb.finish_reason == rc.finish_reason == "length"
        assert server.stats.aborted == 2 and server.stats.requests == 2
        # One at a time, first come first served: B only after A ended, C only after B.
        assert rb.admitted_at is not None and rc.admitted_at is not None
        assert ra.finished_at <= rb.admitted_at and rb.finished_at <= rc.admitted_at
        assert rb.arrived_at < ra.finished_at and rc.arrived_at < ra.finished_at


async def test_close_aborts_running_and_waiting_requests_and_frees_their_blocks(
        session: aiohttp.ClientSession) -> None:
    engine = SimEngine("vllm-1", tokenizer(), num_blocks=128, max_num_seqs=1)
    server = await EngineServer(engine, model=MODEL, timing=FROZEN).start()
    try:
        a = await session.post(server.url + "/v1/chat/completions",
                               json=chat_body(system_chat(0), max_tokens=2, stream=True))
        await next_data(a)
        b = asyncio.create_task(post(session, server.url + "/v1/chat/completions",
                                     chat_body(system_chat(1), max_tokens=1)))
        await server.wait_until(lambda: server.num_waiting == 1)
    finally:
        async with asyncio.timeout(5):
            await server.close()
    with pytest.raises(aiohttp.ClientError):
        await b
    a.close()
    assert [r.finish_reason for r in server.stats.records] == ["abort", "abort"]
    assert server.num_running == server.num_waiting == 0
    assert engine.core.pool.stats().in_use == 0


# --- KV events ----------------------------------------------------------------------------------


async def test_kv_events_on_the_engine_pub_and_its_replay_decode_to_the_pool_blocks(
        session: aiohttp.ClientSession) -> None:
    """Three long prompts through a 64-block pool: blocks are stored and evicted; the events
    seen on the PUB, applied in order, leave exactly the pool's cached hashes."""
    async with serving(num_blocks=64) as server:
        engine = server.engine
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        dealer = ctx.socket(zmq.DEALER)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(engine.endpoint)
            await engine.publisher.wait_for_subscriber()
            for i in range(3):
                status, _ = await post(session, server.url + "/v1/chat/completions",
                                       chat_body(system_chat(i), max_tokens=20))
                assert status == 200
            live = [await sub.recv_multipart() for _ in range(engine.batches)]
            assert engine.replay_endpoint is not None
            dealer.connect(engine.replay_endpoint)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = [await dealer.recv_multipart() for _ in range(engine.batches + 1)]
        finally:
            sub.close(linger=0)
            dealer.close(linger=0)
            ctx.term()
    cached: set[int] = set()
    announced: set[int] = set()
    removed = 0
    seqs = []
    for raw in live:
        _, seq, payload = parse_event_frames(raw)
        seqs.append(seq)
        decoded = decode_zmq_payload(Engine.VLLM, payload)
        assert not decoded.drops
        for ev in decoded.batch.events:
            if isinstance(ev, BlockStored):
                assert ev.parent_hash is None or ev.parent_hash in announced
                assert len(ev.token_ids) == 16 * len(ev.block_hashes)
                cached.update(ev.block_hashes)
                announced.update(ev.block_hashes)
            else:
                assert isinstance(ev, BlockRemoved)
                cached.difference_update(ev.block_hashes)
                removed += len(ev.block_hashes)
    assert seqs == list(range(len(live)))
    assert removed > 0 and cached == engine.core.pool.cached_hashes()
    # The replay ROUTER answers the same batches, then the end marker (vLLM >= 0.26 layout).
    assert [f[2:] for f in replayed[:-1]] == [[raw[1], raw[2]] for raw in live]
    assert replayed[-1] == [b"", b"", END_SEQ, b""]


# --- bad input --------------------------------------------------------------------------------


BAD_REQUESTS: list[tuple[str, Any, int]] = [
    ("/v1/chat/completions", b"not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", b"[" * 100_000, 400),  # nested past the recursion limit
    ("/v1/chat/completions", {"model": MODEL}, 400),  # no messages
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}, 400),
    ("/v1/chat/completions", chat_body(system_chat(0), max_tokens=-1), 400),
    ("/v1/chat/completions", chat_body(system_chat(0), max_tokens=0), 400),
    ("/v1/chat/completions", chat_body(system_chat(0), max_tokens="5"), 400),
    ("/v1/chat/completions", chat_body(system_chat(0), max_tokens=10_000), 400),  # > context
    ("/v1/chat/completions", chat_body(system_chat(0), stream="yes"), 400),
    ("/v1/chat/completions", chat_body(system_chat(0), n=2), 400),
    ("/v1/chat/completions", chat_body(system_chat(0), model="other-model"), 404),
    ("/v1/chat/completions", chat_body(system_chat(0), model=7), 400),
    ("/v1/completions", {"model": MODEL}, 400),  # no prompt
    ("/v1/completions", {"prompt": [1, 2, 100_000]}, 400),  # out of vocabulary
    ("/v1/completions", {"prompt": [-1]}, 400),
    ("/v1/completions", {"prompt": [1.5]}, 400),
    ("/v1/completions", {"prompt": [True]}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": 5}, 400),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400),  # batched
    ("/v1/completions", {"prompt": "x\udc00"}, 400),
    ("/v1/completions", {"prompt": "hi", "add_special_tokens": "no"}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "other-model"}, 404),
    ("/tokenize", {"prompt": 3}, 400),
    ("/tokenize", b"{", 400),
    ("/detokenize", {"tokens": [99_999]}, 400),
    ("/detokenize", {"tokens": "1 2"}, 400),
    ("/detokenize", {"tokens": [1], "model": "other-model"}, 404),
]


async def test_bad_input_is_refused_in_openai_shape_and_never_reaches_the_engine(
        session: aiohttp.ClientSession) -> None:
    async with serving() as server:
        for path, body, status in BAD_REQUESTS:
            kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with session.post(server.url + path, **kwargs) as resp:
                assert resp.status == status, (path, body)
                answer = await resp.json()
            assert set(answer) == {"error"}, answer
            err = answer["error"]
            assert err["code"] == status and err["param"] is None
            assert err["type"] == ("BadRequestError" if status == 400 else "NotFoundError")
            assert isinstance(err["message"], str) and err["message"]
        assert server.stats.rejected == len(BAD_REQUESTS)
        assert server.engine.core.requests == 0 and server.engine.batches == 0
        # Still serving.
        status, ok = await post(session, server.url + "/v1/completions",
                                {"prompt": "hello", "max_tokens": 2})
        assert status == 200 and ok["usage"]["completion_tokens"] == 2
