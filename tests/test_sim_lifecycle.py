"""The pieces the engine stand-ins share since the simulator's server was split (issue 15):
`sim.lifecycle` (`async with` as start/close, an aiohttp app served), `sim.service` (an engine's
requests without a socket), `sim.openai_wire` (the bodies, pure), and the route table of
`sim.server` (every route still answers, HEAD included where aiohttp's `add_get` gives it)."""

from __future__ import annotations

import socket
from typing import Any, Self

import aiohttp
import pytest
from aiohttp import web

from kv_listener.core.model import BlockStored, KvEvent
from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer
from kv_listener.sim.engine import SimEngine
from kv_listener.sim.lifecycle import AsyncLifecycle, start_site
from kv_listener.sim.openai_wire import (
    RequestError,
    choice,
    is_int,
    parse_prompt,
    parse_sampling,
    prom_label,
    sse_event,
)
from kv_listener.sim.server import EngineServer
from kv_listener.sim.service import DEMO_TIMING, EngineService, ServiceTiming
from kv_listener.sim.trtllm_server import ServedTrtllm, SimTrtllmServer

FAST = ServiceTiming(time_scale=0.01)
_tok: list[Any] = []


def tokenizer() -> Any:
    if not _tok:
        _tok.append(load_tokenizer(DEMO_TOKENIZER_DIR))
    return _tok[0]


# --- sim.lifecycle ----------------------------------------------------------------------------


class Recorder(AsyncLifecycle):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def start(self) -> Self:
        self.calls.append("start")
        return self

    async def close(self) -> None:
        self.calls.append("close")


class NoStart(AsyncLifecycle):
    closed = False

    async def close(self) -> None:
        self.closed = True


async def test_async_with_starts_and_closes_even_when_the_body_raises() -> None:
    rec = Recorder()
    with pytest.raises(ZeroDivisionError):
        async with rec as started:
            assert started is rec and rec.calls == ["start"]
            _ = 1 / 0
    assert rec.calls == ["start", "close"]


async def test_the_default_start_returns_the_object_itself() -> None:
    obj = NoStart()
    async with obj as started:
        assert started is obj and not obj.closed
    assert obj.closed


async def hello(_: web.Request) -> web.Response:
    return web.Response(text="hello")


def app() -> web.Application:
    application = web.Application()
    application.router.add_get("/", hello)
    return application


async def test_start_site_serves_on_the_port_it_bound() -> None:
    runner = await start_site(app(), "127.0.0.1", 0)
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/") as resp:
            assert resp.status == 200 and await resp.text() == "hello"
    finally:
        await runner.cleanup()


async def test_start_site_on_a_busy_port_raises_and_leaves_the_other_server_alone() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError):
            await start_site(app(), "127.0.0.1", port)
        busy.settimeout(0.5)
        client = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        client.close()  # the port is still the first socket's


# --- sim.service ------------------------------------------------------------------------------


async def test_engine_service_runs_a_chat_without_any_socket() -> None:
    events: list[KvEvent] = []
    engine = SimEngine("vllm-1", tokenizer(), num_blocks=64, sink=events.extend)
    messages = [{"role": "system", "content": "You answer briefly. " * 20},
                {"role": "user", "content": "Hi."}]
    async with EngineService(engine, timing=FAST) as service:
        assert not isinstance(service, EngineServer)
        first, _ = await service.chat(messages, max_tokens=3)
        second, text = await service.chat(messages, max_tokens=3)
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    assert second.completion_tokens == 3 and isinstance(text, str)
    assert service.stats.requests == 2 and service.num_running == 0
    assert any(isinstance(e, BlockStored) for e in events)


async def test_engine_service_refuses_what_does_not_fit_the_context() -> None:
    engine = SimEngine("vllm-1", tokenizer(), num_blocks=4, sink=lambda _: None)
    async with EngineService(engine, timing=FAST, max_model_len=32) as service:
        with pytest.raises(RequestError) as err:
            await service.chat([{"role": "user", "content": "word " * 40}], max_tokens=4)
    assert err.value.status == 400 and "maximum context length is 32" in err.value.message


def test_engine_service_checks_its_limits_at_construction() -> None:
    engine = SimEngine("vllm-1", tokenizer(), num_blocks=4, sink=lambda _: None)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineService(engine, max_model_len=4 * 16 + 1)
    with pytest.raises(ValueError, match="default_max_tokens"):
        EngineService(engine, default_max_tokens=0)


def test_the_demo_timing_is_the_pace_the_demo_had() -> None:
    # 5 ms per prefill step, 0.3 ms per uncached prompt token, 3 ms per output token, real time.
    assert DEMO_TIMING.prefill_s(100) == pytest.approx(0.035)
    assert DEMO_TIMING.decode_step_s() == pytest.approx(0.003)


# --- sim.server: the route table --------------------------------------------------------------

GETS = ["/health", "/v1/models", "/version", "/v1/loads", "/loads", "/get_load", "/metrics",
        "/tokenizer_info"]
POSTS = ["/v1/chat/completions", "/v1/chat/completions/render", "/v1/completions", "/tokenize",
         "/detokenize"]


async def test_every_route_answers_and_gets_answer_head_too() -> None:
    engine = SimEngine("vllm-1", tokenizer(), num_blocks=64)
    async with EngineServer(engine, timing=FAST, tokenizer_info={"chat_template": "x"},
                            health_path="/ping") as server, aiohttp.ClientSession() as http:
        for path in [*GETS, "/ping"]:
            async with http.get(server.url + path) as resp:
                assert resp.status == 200, path
            async with http.head(server.url + path) as resp:
                assert resp.status == 200, path
        for path in POSTS:  # an empty object: the route is there and refuses it in vLLM's shape
            async with http.post(server.url + path, json={}) as resp:
                assert resp.status == 400, path
                assert (await resp.json())["error"]["code"] == 400, path
            async with http.get(server.url + path) as resp:
                assert resp.status == 405, path


async def test_a_server_that_cannot_bind_closes_its_engine() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        engine = SimEngine("vllm-1", tokenizer(), num_blocks=64)
        server = EngineServer(engine, timing=FAST, port=busy.getsockname()[1])
        with pytest.raises(OSError):
            await server.start()
    assert engine.publisher._pub is None  # the engine's ZMQ sockets are closed again
    await server.close()  # and closing once more is harmless


async def test_the_trtllm_stand_in_is_served_under_its_own_name() -> None:
    async with await SimTrtllmServer().serve() as served:
        assert isinstance(served, ServedTrtllm)
        async with aiohttp.ClientSession() as http, http.post(served.url) as resp:
            assert resp.status == 200 and await resp.json() == []


# --- sim.openai_wire --------------------------------------------------------------------------


def test_wire_parsing_and_bodies() -> None:
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert parse_prompt({"prompt": ["one prompt"]}) == "one prompt"
    assert parse_prompt({"prompt": [1, 2, 3]}) == [1, 2, 3]
    with pytest.raises(RequestError, match="batched"):
        parse_prompt({"prompt": ["a", "b"]})
    assert parse_sampling({"max_completion_tokens": 7, "stream": True}, 16) == (7, True)
    for bad in ({"max_tokens": True}, {"n": 2}, {"stream": "yes"}):
        with pytest.raises(RequestError):
            parse_sampling(bad, 16)
    assert choice("chat", "", "length", delta=True)["delta"] == {}
    assert choice("chat", "hi", None, delta=True)["delta"] == {"content": "hi"}
    assert choice("completion", "hi", "length", delta=False)["text"] == "hi"
    assert choice("chat", "hi", "length", delta=False)["message"]["content"] == "hi"
    assert sse_event({"a": [1, 2]}) == b'data: {"a":[1,2]}\n\n'
    assert prom_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
