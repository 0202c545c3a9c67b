"""Detokenize clients against a real aiohttp `/detokenize` server on 127.0.0.1 (both engine
shapes), the local tokenizer path, timeouts, retries and the circuit breaker."""

from __future__ import annotations

import asyncio
import threading
from array import array
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kv_listener.core.model import Engine
from kv_listener.resolver import detokenize
from kv_listener.resolver.detokenize import (
    BreakerState,
    CircuitBreaker,
    DetokenizeError,
    HttpDetokenizer,
    LocalDetokenizer,
    TokenizerInfoAnswer,
    TokenizerInfoStatus,
    endpoint_label,
    fetch_tokenizer_info,
    parse_detokenize_response,
    probe_tokenizer_info,
    tokenizer_info_url,
)
from tests.support.detokenize_server import DetokenizeServer
from tests.support.ports import free_port
from tests.support.tokenizers import TOKENIZERS, tokenizer


def chatml() -> Any:
    return tokenizer("chatml")


PROMPT = "<|im_start|>system\nBe kind. 뷁뷁<|im_end|>\n<|im_start|>user\n안녕하세요<|im_end|>\n"


def prompt_tokens() -> array[int]:
    return array("I", chatml().encode(PROMPT, add_special_tokens=False))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def state_of(breaker: CircuitBreaker) -> BreakerState:
    return breaker.state  # a call, so that mypy does not narrow the property across calls


async def detokenize_once(url: str, engine: Engine, **kw: Any) -> str:
    """The text of `prompt_tokens()` from a new client, closed after the call."""
    client = HttpDetokenizer(url, engine, **kw)
    try:
        return await client.detokenize(prompt_tokens())
    finally:
        await client.close()


# --- wire shapes ----------------------------------------------------------------------------------


async def test_vllm_shape() -> None:
    async with DetokenizeServer(chatml(), "vllm") as server:
        assert await detokenize_once(server.url, Engine.VLLM, model="tiny") == PROMPT
    assert server.requests == [{"model": "tiny", "tokens": prompt_tokens().tolist()}]


async def test_sglang_shape_keeps_special_tokens() -> None:
    async with DetokenizeServer(chatml(), "sglang") as server:
        assert await detokenize_once(server.url, Engine.SGLANG, model="tiny") == PROMPT
        assert server.requests[0]["skip_special_tokens"] is False
        # Why the flag matters: SGLang's default drops the role markers.
        async with aiohttp.ClientSession() as session, session.post(
                server.url, json={"tokens": prompt_tokens().tolist()}) as resp:
            text = (await resp.json())["text"]
        assert "<|im_start|>" not in text and "안녕하세요" in text


async def test_shared_session_is_not_closed() -> None:
    async with DetokenizeServer(chatml()) as server, aiohttp.ClientSession() as session:
        client = HttpDetokenizer(server.url, Engine.VLLM, session=session)
        assert await client.detokenize(prompt_tokens()) == PROMPT
        await client.close()
        assert not session.closed
        assert "model" not in server.requests[0]


@pytest.mark.parametrize(("engine", "body", "text"), [
    (Engine.VLLM, {"prompt": "p"}, "p"),
    (Engine.SGLANG, {"text": "t"}, "t"),
    (Engine.SGLANG, {"text": ["t"]}, "t"),
    (Engine.VLLM, {"text": "proxy"}, "proxy"),
])
def test_parse_response_shapes(engine: Engine, body: Any, text: str) -> None:
    assert parse_detokenize_response(engine, body) == text


@pytest.mark.parametrize("body", [None, [], {"prompt": 3}, {"text": ["a", "b"]}, {}, "x"])
def test_parse_response_rejects(body: Any) -> None:
    with pytest.raises(DetokenizeError) as info:
        parse_detokenize_response(Engine.VLLM, body)
    assert info.value.reason.value == "bad_response"


def test_trtllm_has_no_detokenize() -> None:
    with pytest.raises(ValueError, match="no /detokenize"):
        HttpDetokenizer("http://127.0.0.1:1/detokenize", Engine.TRTLLM)


# --- failures, retries --------------------------------------------------------------------------


async def _fails(server: DetokenizeServer, **kw: Any) -> tuple[str, HttpDetokenizer]:
    client = HttpDetokenizer(server.url, Engine.VLLM, backoff_initial_s=0.001, **kw)
    try:
        with pytest.raises(DetokenizeError) as info:
            await client.detokenize(prompt_tokens())
    finally:
        await client.close()
    return info.value.reason.value, client


async def test_4xx_is_not_retried() -> None:
    async with DetokenizeServer(chatml()) as server:
        server.script = [400]
        reason, client = await _fails(server, retries=3)
    assert reason == "http_4xx" and len(server.requests) == 1
    assert state_of(client.breaker) is BreakerState.CLOSED


async def test_out_of_range_token_is_a_4xx() -> None:
    async with DetokenizeServer(chatml()) as server:
        client = HttpDetokenizer(server.url, Engine.VLLM)
        try:
            with pytest.raises(DetokenizeError) as info:
                await client.detokenize(array("I", [10**6]))
        finally:
            await client.close()
    assert info.value.reason.value == "http_4xx"


async def test_5xx_and_429_are_retried_until_success() -> None:
    async with DetokenizeServer(chatml()) as server:
        server.script = [500, 429]
        client = HttpDetokenizer(server.url, Engine.VLLM, retries=2, backoff_initial_s=0.001)
        try:
            assert await client.detokenize(prompt_tokens()) == PROMPT
        finally:
            await client.close()
    assert len(server.requests) == 3 and client.attempts == 3


async def test_5xx_after_last_retry() -> None:
    async with DetokenizeServer(chatml()) as server:
        server.script = [502, 502, 502, 502]
        reason, _client = await _fails(server, retries=2)
    assert reason == "http_5xx" and len(server.requests) == 3


async def test_retry_pauses_double_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pauses between attempts come from the shared `Backoff`: `backoff_initial_s`,
    doubling, capped at `backoff_max_s`, no jitter (as the inline loop it replaced)."""
    slept: list[float] = []

    async def recording_sleep(delay: float) -> None:
        slept.append(delay)
        await asyncio.sleep(delay)

    # Only this module's asyncio is replaced: the servers' and aiohttp's sleeps are left alone.
    monkeypatch.setattr(detokenize, "asyncio",
                        SimpleNamespace(sleep=recording_sleep, to_thread=asyncio.to_thread))
    async with DetokenizeServer(chatml()) as server:
        server.script = [503] * 6
        reason, client = await _fails(server, retries=4, backoff_max_s=0.004,
                                      breaker=CircuitBreaker(failure_threshold=10))
    assert reason == "http_5xx" and client.attempts == 5
    assert slept == [0.001, 0.002, 0.004, 0.004]
    slept.clear()
    async with DetokenizeServer(chatml()) as server:  # each call starts again from the initial
        server.script = [503, 503]
        client = HttpDetokenizer(server.url, Engine.VLLM, retries=2, backoff_initial_s=0.001)
        try:
            await client.detokenize(prompt_tokens())
            assert slept == [0.001, 0.002]
            server.script = [503]
            await client.detokenize(prompt_tokens())
        finally:
            await client.close()
    assert slept == [0.001, 0.002, 0.001]


@pytest.mark.parametrize(("initial_s", "max_s"), [(0.0, 2.0), (-1.0, 2.0), (0.5, 0.1)])
def test_bad_backoff_fails_at_construction(initial_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        HttpDetokenizer("http://127.0.0.1:1/detokenize", Engine.VLLM,
                        backoff_initial_s=initial_s, backoff_max_s=max_s)


async def test_timeout() -> None:
    async with DetokenizeServer(chatml()) as server:
        server.script = ["hold"]
        reason, _client = await _fails(server, retries=0, timeout_s=0.2)
    assert reason == "timeout"


async def test_connect_error() -> None:
    client = HttpDetokenizer(f"http://127.0.0.1:{free_port()}/detokenize", Engine.VLLM,
                             retries=1, backoff_initial_s=0.001)
    try:
        with pytest.raises(DetokenizeError) as info:
            await client.detokenize(prompt_tokens())
    finally:
        await client.close()
    assert info.value.reason.value == "connect_error" and client.attempts == 2


@pytest.mark.parametrize("step", ["garbage", "wrong-shape", "deep", "redirect"])
async def test_bad_answers(step: str) -> None:
    async with DetokenizeServer(chatml()) as server:
        server.script = [step]
        reason, _client = await _fails(server, retries=0)
    assert reason == "bad_response"
    assert len(server.requests) == 1  # a redirect is not followed


async def test_oversized_answer() -> None:
    async with DetokenizeServer(chatml()) as server:
        reason, _client = await _fails(server, retries=0, max_response_bytes=16)
    assert reason == "bad_response"


# --- circuit breaker ------------------------------------------------------------------------------


def test_breaker_states() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=clock)
    assert breaker.allow() and state_of(breaker) is BreakerState.CLOSED
    assert not breaker.record_failure()
    breaker.record_success()  # resets the consecutive count
    assert not breaker.record_failure()
    assert breaker.record_failure()  # second in a row opens it
    assert state_of(breaker) is BreakerState.OPEN and not breaker.allow()
    clock.now += 5.0
    assert state_of(breaker) is BreakerState.HALF_OPEN
    assert breaker.allow()  # one trial
    assert not breaker.allow()  # and only one
    assert breaker.record_failure()  # trial failed: open again
    assert state_of(breaker) is BreakerState.OPEN
    clock.now += 5.0
    assert breaker.allow()
    breaker.release()  # trial without a verdict
    assert breaker.allow()
    breaker.record_success()
    assert state_of(breaker) is BreakerState.CLOSED and breaker.opened_count == 2
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)


async def test_circuit_opens_stops_calling_then_half_opens() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=30.0, clock=clock)
    async with DetokenizeServer(chatml()) as server:
        server.script = [500] * 4
        client = HttpDetokenizer(server.url, Engine.VLLM, retries=0, breaker=breaker)
        try:
            reasons = []
            for _ in range(5):
                with pytest.raises(DetokenizeError) as info:
                    await client.detokenize(prompt_tokens())
                reasons.append(info.value.reason.value)
            assert reasons == ["http_5xx"] * 3 + ["circuit_open"] * 2
            assert len(server.requests) == 3  # nothing sent while open
            clock.now += 30.0  # cool-down over: one trial goes out, fails, re-opens
            with pytest.raises(DetokenizeError) as info:
                await client.detokenize(prompt_tokens())
            assert info.value.reason.value == "http_5xx" and len(server.requests) == 4
            with pytest.raises(DetokenizeError) as info:
                await client.detokenize(prompt_tokens())
            assert info.value.reason.value == "circuit_open"
            clock.now += 30.0  # next trial succeeds: closed again
            assert await client.detokenize(prompt_tokens()) == PROMPT
            assert state_of(breaker) is BreakerState.CLOSED
            assert await client.detokenize(prompt_tokens()) == PROMPT
        finally:
            await client.close()


async def test_retries_stop_when_the_circuit_opens() -> None:
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=60.0, clock=FakeClock())
    async with DetokenizeServer(chatml()) as server:
        server.script = [500] * 10
        reason, _client = await _fails(server, retries=5, breaker=breaker)
    assert reason == "http_5xx" and len(server.requests) == 2


# --- local tokenizer ------------------------------------------------------------------------------


async def test_local_detokenizer_matches_the_tokenizer_and_runs_off_loop() -> None:
    threads: list[int] = []
    real = chatml()

    class Recording:
        """The real tokenizer, recording which thread decodes."""

        def __len__(self) -> int:
            return len(real)

        def decode(self, ids: list[int], **kw: Any) -> str:
            threads.append(threading.get_ident())
            return str(real.decode(ids, **kw))

    local = LocalDetokenizer(Recording())
    assert await local.detokenize(prompt_tokens()) == PROMPT
    assert threads and threads[0] != threading.get_ident()
    await local.close()


async def test_local_detokenizer_from_path_keeps_special_tokens() -> None:
    local = LocalDetokenizer(TOKENIZERS / "llama3")
    text = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n뷁<|eot_id|>"
    ids = array("I", local.tokenizer.encode(text, add_special_tokens=False))
    assert await local.detokenize(ids) == text
    # A cut inside the 3-byte character decodes to U+FFFD at the end.
    assert (await local.detokenize(ids[:-2])).endswith("\ufffd")


async def test_local_detokenizer_bad_tokens() -> None:
    local = LocalDetokenizer(chatml())
    with pytest.raises(DetokenizeError) as info:
        await local.detokenize(array("I", [1, 2, 10**6]))
    assert info.value.reason.value == "bad_tokens"


async def test_local_detokenizer_tokenizer_error() -> None:
    class Broken:
        def __len__(self) -> int:
            return 10

        def decode(self, ids: list[int], **kw: Any) -> str:
            raise RuntimeError("backend exploded")

    with pytest.raises(DetokenizeError) as info:
        await LocalDetokenizer(Broken()).detokenize(array("I", [1]))
    assert info.value.reason.value == "local_error"


# --- tokenizer_info, labels -------------------------------------------------------------------------


class InfoServer(DetokenizeServer):
    """The test server with a scripted `/tokenizer_info`: per request, an HTTP status,
    "garbage" (HTML), "list" (JSON, not an object), "redirect" or "hold" (wait for
    `release`); then the normal answer."""

    def __init__(self, tokenizer: Any, tokenizer_info: dict[str, Any] | None) -> None:
        super().__init__(tokenizer, tokenizer_info=tokenizer_info)
        self.info_script: list[int | str] = []

    async def __aenter__(self) -> InfoServer:
        await self.start()
        return self

    async def _tokenizer_info(self, request: web.Request) -> web.StreamResponse:
        step = self.info_script.pop(0) if self.info_script else None
        if step == "hold":
            await self.release.wait()
        elif step == "garbage":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        elif step == "list":
            return web.json_response(["not", "an", "object"])
        elif step == "redirect":
            raise web.HTTPFound("/elsewhere")
        elif isinstance(step, int):
            return web.json_response({"detail": "scripted"}, status=step)
        return await super()._tokenizer_info(request)


async def test_probe_tokenizer_info_tells_final_from_transient() -> None:
    info = {"chat_template": "{{ x }}", "bos_token": "<s>"}
    found, absent = TokenizerInfoStatus.FOUND, TokenizerInfoStatus.ABSENT
    unreachable = TokenizerInfoStatus.UNREACHABLE
    async with InfoServer(chatml(), info) as server, aiohttp.ClientSession() as session:
        url = tokenizer_info_url(server.url)
        server.info_script = [404, 403, "garbage", "list", "redirect", 503, 502, 429, "hold"]
        got = [await probe_tokenizer_info(session, url, 0.5) for _ in range(9)]
        server.release.set()
        last = await probe_tokenizer_info(session, url)
    assert [(a.status, a.detail) for a in got] == [
        (absent, "status 404"), (absent, "status 403"), (absent, "not JSON"),
        (absent, "not a JSON object"), (absent, "status 302"),
        (unreachable, "status 503"), (unreachable, "status 502"), (unreachable, "status 429"),
        (unreachable, "timeout")]
    assert all(a.info is None for a in got)
    assert last == TokenizerInfoAnswer(found, info=info)
    async with aiohttp.ClientSession() as session:
        refused = await probe_tokenizer_info(
            session, f"http://127.0.0.1:{free_port()}/tokenizer_info", 1.0)
    assert refused.status is unreachable and refused.info is None


async def test_fetch_tokenizer_info() -> None:
    info = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{{ x }}",
            "bos_token": "<s>"}
    async with DetokenizeServer(chatml(), tokenizer_info=info) as server, \
            aiohttp.ClientSession() as session:
        assert await fetch_tokenizer_info(session, tokenizer_info_url(server.url)) == info
        server.tokenizer_info = None
        assert await fetch_tokenizer_info(session, tokenizer_info_url(server.url)) is None
        assert await fetch_tokenizer_info(
            session, f"http://127.0.0.1:{free_port()}/tokenizer_info", 1.0) is None


@pytest.mark.parametrize(("url", "expected"), [
    ("http://h:8000/detokenize", "http://h:8000/tokenizer_info"),
    ("http://h:8000/v1/detokenize", "http://h:8000/v1/tokenizer_info"),
    ("http://h:8000/", "http://h:8000/tokenizer_info"),
])
def test_tokenizer_info_url(url: str, expected: str) -> None:
    assert tokenizer_info_url(url) == expected


def test_endpoint_label_hides_credentials_and_path() -> None:
    assert endpoint_label("http://user:pw@10.0.0.1:8000/detokenize?x=1") == "http://10.0.0.1:8000"
    assert endpoint_label("https://[::1]/detokenize") == "https://[::1]"


async def test_concurrent_calls_share_one_session() -> None:
    async with DetokenizeServer(chatml()) as server:
        client = HttpDetokenizer(server.url, Engine.VLLM)
        try:
            texts = await asyncio.gather(*(client.detokenize(prompt_tokens()) for _ in range(8)))
        finally:
            await client.close()
    assert texts == [PROMPT] * 8 and len(server.requests) == 8
