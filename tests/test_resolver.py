"""ChainResolver: de-duplication, bounded concurrency and backlog, outcome delivery, stats,
and construction from a source's config; against a real aiohttp /detokenize server and the
tiny fixture tokenizers."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from kv_listener.config import SourceConfig
from kv_listener.core.model import Engine, ResolveOutcome, ResolveRequest, ResolveStatus
from kv_listener.core.prefix import prefix_key, request_prefix_key
from kv_listener.resolver.detokenize import CircuitBreaker, HttpDetokenizer, LocalDetokenizer
from kv_listener.resolver.parser import PromptParser
from kv_listener.resolver.probe import DEMO_TOKENIZER_DIR, load_tokenizer
from kv_listener.resolver.resolver import (
    BACKLOG_FULL,
    DEFAULT_TEMPLATE_RETRY_S,
    INTERNAL_ERROR,
    TEMPLATE_RETRIES,
    ChainResolver,
)
from kv_listener.sim.detokenize_server import DetokenizeServer as SimDetokenizeServer
from kv_listener.sim.detokenize_server import tokenizer_info
from kv_listener.stats import SourceStats
from tests.support.detokenize_server import DetokenizeServer
from tests.support.ports import free_port
from tests.support.tokenizers import TOKENIZERS, parser, tokenizer


def chatml() -> Any:
    return tokenizer("chatml")


def chatml_parser() -> PromptParser:
    return parser("chatml")


def tokens_of(messages: list[dict[str, str]]) -> array[int]:
    text = chatml().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return array("I", chatml().encode(text, add_special_tokens=False))


SYSTEM_CHAT = tokens_of([{"role": "system", "content": "Be kind."},
                         {"role": "user", "content": "안녕하세요"}])
USER_CHAT = tokens_of([{"role": "user", "content": "안녕하세요"}])


class Gate:
    """A test-side detokenizer in front of the real local one: holds every call until the gate
    opens and records how many run at once (what the resolver must bound)."""

    def __init__(self) -> None:
        self.inner = LocalDetokenizer(chatml())
        self.open = asyncio.Event()
        self.active = 0
        self.max_active = 0
        self.calls = 0
        self.changed = asyncio.Condition()
        self.closed = False

    async def detokenize(self, tokens: array[int]) -> str:
        self.calls += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        async with self.changed:
            self.changed.notify_all()
        try:
            await self.open.wait()
            return await self.inner.detokenize(tokens)
        finally:
            self.active -= 1

    async def wait_active(self, n: int) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.active >= n), 5)

    async def close(self) -> None:
        self.closed = True


async def next_outcome(queue: asyncio.Queue[ResolveOutcome]) -> ResolveOutcome:
    return await asyncio.wait_for(queue.get(), 5)


# --- resolution through the real HTTP endpoint --------------------------------------------------


async def test_resolves_system_and_first_message_rules_over_http() -> None:
    stats = SourceStats(engine="vllm")
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    async with DetokenizeServer(chatml()) as server:
        resolver = ChainResolver(
            detokenizer=HttpDetokenizer(server.url, Engine.VLLM, model="tiny"),
            parser=chatml_parser(), on_outcome=queue.put_nowait, stats=stats)
        try:
            resolver.submit(ResolveRequest(head=11, model="tiny", tokens=SYSTEM_CHAT))
            resolver.submit(ResolveRequest(head=12, model="tiny", tokens=USER_CHAT))
            got = {o.head: o for o in [await next_outcome(queue), await next_outcome(queue)]}
        finally:
            await resolver.close()
    # The deciding point comes from the engine's /tokenize; it is the one a local copy of the
    # tokenizer finds by bisection.
    local = ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=chatml_parser(),
                          on_outcome=lambda _: None, local_tokenizer=chatml())
    try:
        want11 = await local.resolve(ResolveRequest(11, "tiny", SYSTEM_CHAT))
        want12 = await local.resolve(ResolveRequest(12, "tiny", USER_CHAT))
    finally:
        await local.close()
    assert want11.key_tokens is not None and want12.key_tokens is not None
    assert got[11] == ResolveOutcome(11, ResolveStatus.RESOLVED,
                                     key=prefix_key("tiny", "Be kind.", None),
                                     key_tokens=want11.key_tokens)
    assert got[12] == ResolveOutcome(12, ResolveStatus.RESOLVED,
                                     key=prefix_key("tiny", None, "안녕하세요"),
                                     key_tokens=want12.key_tokens)
    assert stats.detokenize_calls == 2 and not stats.detokenize_errors
    assert stats.tokenize_calls == 2
    assert resolver.counters["resolved:S"] == 1 and resolver.counters["resolved:M"] == 1


async def test_key_uses_the_request_model_for_lora() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    resolver = ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=chatml_parser(),
                             on_outcome=queue.put_nowait)
    try:
        resolver.submit(ResolveRequest(head=1, model="sql-lora", tokens=SYSTEM_CHAT))
        outcome = await next_outcome(queue)
    finally:
        await resolver.close()
    assert outcome.key == prefix_key("sql-lora", "Be kind.", None)
    assert outcome.key != prefix_key("tiny", "Be kind.", None)


async def test_max_prefix_length_is_applied() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    long_system = "Be kind and precise. " * 10
    tokens = tokens_of([{"role": "system", "content": long_system},
                        {"role": "user", "content": "x"}])
    resolver = ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=chatml_parser(),
                             on_outcome=queue.put_nowait, max_prefix_length=32)
    try:
        # Only the first 24 tokens: the system prompt is incomplete but longer than 32 bytes.
        resolver.submit(ResolveRequest(head=1, model="m", tokens=tokens[:24]))
        outcome = await next_outcome(queue)
    finally:
        await resolver.close()
    assert outcome.status is ResolveStatus.RESOLVED
    assert outcome.key == prefix_key("m", long_system, None, 32)


async def test_pending_and_unattributed_outcomes() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    stats = SourceStats(engine="vllm")
    resolver = ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=chatml_parser(),
                             on_outcome=queue.put_nowait, stats=stats)
    plain = array("I", chatml().encode("The quick brown fox jumps over the lazy dog."))
    try:
        resolver.submit(ResolveRequest(head=1, model="m", tokens=SYSTEM_CHAT[:4]))
        assert await next_outcome(queue) == ResolveOutcome(1, ResolveStatus.PENDING)
        resolver.submit(ResolveRequest(head=2, model="m", tokens=plain))
        assert await next_outcome(queue) == ResolveOutcome(
            2, ResolveStatus.UNATTRIBUTED, reason="not_chat")
        empty = tokens_of([{"role": "user", "content": ""}])
        resolver.submit(ResolveRequest(head=3, model="m", tokens=empty))
        assert await next_outcome(queue) == ResolveOutcome(
            3, ResolveStatus.UNATTRIBUTED, reason="no_text")
    finally:
        await resolver.close()
    assert stats.detokenize_calls == 3
    assert resolver.counters["pending"] == 1
    assert resolver.counters["unattributed:not_chat"] == 1


async def test_detokenize_failure_is_counted_and_reported() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    stats = SourceStats(engine="sglang")
    async with DetokenizeServer(chatml(), "sglang") as server:
        server.script = [500]
        resolver = ChainResolver(
            detokenizer=HttpDetokenizer(server.url, Engine.SGLANG, retries=0),
            parser=chatml_parser(), on_outcome=queue.put_nowait, stats=stats)
        try:
            resolver.submit(ResolveRequest(head=5, model="m", tokens=SYSTEM_CHAT))
            assert await next_outcome(queue) == ResolveOutcome(
                5, ResolveStatus.FAILED, reason="http_5xx")
            # The head is free again: the tracker may retry it, and this time it works.
            resolver.submit(ResolveRequest(head=5, model="m", tokens=SYSTEM_CHAT))
            assert (await next_outcome(queue)).status is ResolveStatus.RESOLVED
        finally:
            await resolver.close()
    assert stats.detokenize_calls == 2
    assert stats.detokenize_errors == {"http_5xx": 1}


# --- de-duplication, bounds -----------------------------------------------------------------------


async def test_a_head_in_flight_is_not_submitted_twice() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    stats = SourceStats(engine="vllm")
    async with DetokenizeServer(chatml()) as server:
        server.script = ["hold"]
        resolver = ChainResolver(detokenizer=HttpDetokenizer(server.url, Engine.VLLM),
                                 parser=chatml_parser(), on_outcome=queue.put_nowait,
                                 stats=stats)
        try:
            req = ResolveRequest(head=7, model="m", tokens=SYSTEM_CHAT)
            resolver.submit(req)
            await asyncio.wait_for(server.arrived.wait(), 5)
            resolver.submit(req)
            resolver.submit(ResolveRequest(head=7, model="m", tokens=SYSTEM_CHAT))
            assert resolver.in_flight == 1
            server.release.set()
            outcome = await next_outcome(queue)
            await resolver.wait_idle()
        finally:
            await resolver.close()
    assert outcome.head == 7 and outcome.status is ResolveStatus.RESOLVED
    assert queue.empty()
    assert len(server.requests) == 1 and stats.detokenize_calls == 1
    assert resolver.counters["deduplicated"] == 2


async def test_concurrency_is_bounded() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    gate = Gate()
    resolver = ChainResolver(detokenizer=gate, parser=chatml_parser(),
                             on_outcome=queue.put_nowait, max_concurrency=2)
    try:
        for head in range(6):
            resolver.submit(ResolveRequest(head=head, model="m", tokens=USER_CHAT))
        await gate.wait_active(2)
        for _ in range(20):  # let every ready task run: none may start a third call
            await asyncio.sleep(0)
        assert gate.active == 2 and gate.calls == 2 and resolver.in_flight == 6
        gate.open.set()
        heads = sorted([(await next_outcome(queue)).head for _ in range(6)])
        await resolver.wait_idle()
    finally:
        await resolver.close()
    assert heads == list(range(6)) and gate.max_active == 2 and gate.calls == 6
    assert gate.closed


async def test_full_backlog_answers_failed_at_once() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    gate = Gate()
    resolver = ChainResolver(detokenizer=gate, parser=chatml_parser(),
                             on_outcome=queue.put_nowait, max_concurrency=1, max_backlog=1)
    try:
        for head in (1, 2, 3):
            resolver.submit(ResolveRequest(head=head, model="m", tokens=USER_CHAT))
        assert queue.empty()  # never delivered from inside submit()
        refused = await next_outcome(queue)
        assert refused == ResolveOutcome(3, ResolveStatus.FAILED, reason=BACKLOG_FULL)
        gate.open.set()
        done = sorted([(await next_outcome(queue)).head for _ in range(2)])
    finally:
        await resolver.close()
    assert done == [1, 2] and resolver.counters[BACKLOG_FULL] == 1


async def test_nothing_is_delivered_after_close() -> None:
    outcomes: list[ResolveOutcome] = []
    gate = Gate()
    resolver = ChainResolver(detokenizer=gate, parser=chatml_parser(),
                             on_outcome=outcomes.append)
    resolver.submit(ResolveRequest(head=1, model="m", tokens=USER_CHAT))
    await gate.wait_active(1)
    await resolver.close()
    await resolver.close()  # idempotent
    resolver.submit(ResolveRequest(head=2, model="m", tokens=USER_CHAT))
    gate.open.set()
    await resolver.wait_idle()
    assert outcomes == [] and gate.closed and resolver.in_flight == 0


async def test_a_failing_callback_does_not_kill_the_worker() -> None:
    seen: list[int] = []
    done = asyncio.Event()

    def on_outcome(outcome: ResolveOutcome) -> None:
        seen.append(outcome.head)
        if outcome.head == 1:
            raise RuntimeError("consumer bug")
        done.set()

    resolver = ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=chatml_parser(),
                             on_outcome=on_outcome, max_concurrency=1)
    try:
        resolver.submit(ResolveRequest(head=1, model="m", tokens=USER_CHAT))
        resolver.submit(ResolveRequest(head=2, model="m", tokens=USER_CHAT))
        await asyncio.wait_for(done.wait(), 5)
    finally:
        await resolver.close()
    assert seen == [1, 2] and resolver.counters["callback_errors"] == 1


async def test_an_internal_error_becomes_a_failed_outcome() -> None:
    class BrokenParser(PromptParser):
        def parse_prompt(self, text: str, max_prefix_length: int = 1024) -> Any:
            raise KeyError("bug")

    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    resolver = ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=BrokenParser(None),
                             on_outcome=queue.put_nowait)
    try:
        resolver.submit(ResolveRequest(head=9, model="m", tokens=USER_CHAT))
        assert await next_outcome(queue) == ResolveOutcome(9, ResolveStatus.FAILED,
                                                           reason=INTERNAL_ERROR)
    finally:
        await resolver.close()


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=chatml_parser(),
                      on_outcome=lambda o: None, max_concurrency=0)


@pytest.mark.parametrize("bound", ["max_concurrency", "max_decode_tokens"])
def test_constructor_names_the_bound_below_one(bound: str) -> None:
    with pytest.raises(ValueError, match=f"^{bound} must be >= 1$"):
        ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=chatml_parser(),
                      on_outcome=lambda o: None, **{bound: 0})


# --- construction from SourceConfig ---------------------------------------------------------------


def source(**kw: Any) -> SourceConfig:
    base: dict[str, Any] = {"backend_name": "vllm-1", "engine": Engine.VLLM, "model": "tiny",
                            "zmq_endpoint": "tcp://127.0.0.1:5557"}
    base.update(kw)
    return SourceConfig(**base)


async def test_for_source_http_decoder_with_local_template() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    async with DetokenizeServer(chatml()) as server:
        resolver = await ChainResolver.for_source(
            source(detokenize_endpoint=server.url, tokenizer=str(TOKENIZERS / "chatml")),
            on_outcome=queue.put_nowait)
        try:
            assert isinstance(resolver.detokenizer, HttpDetokenizer)
            assert resolver.parser.source == "vllm-1:tokenizer"
            resolver.submit(ResolveRequest(head=1, model="tiny", tokens=SYSTEM_CHAT))
            assert (await next_outcome(queue)).key == prefix_key("tiny", "Be kind.", None)
        finally:
            await resolver.close()
    assert "model" not in server.requests[0]  # the engine's default model decodes


async def test_for_source_local_tokenizer_only() -> None:
    resolver = await ChainResolver.for_source(
        source(engine=Engine.TRTLLM, zmq_endpoint=None,
               trtllm_endpoint="http://127.0.0.1:1/kv_cache_events",
               tokenizer=str(TOKENIZERS / "llama3")),
        on_outcome=lambda o: None)
    try:
        assert isinstance(resolver.detokenizer, LocalDetokenizer)
        assert resolver.parser.source == "vllm-1:tokenizer"
    finally:
        await resolver.close()


async def test_for_source_template_from_tokenizer_info() -> None:
    template = (TOKENIZERS / "chatml" / "chat_template.jinja").read_text()
    async with DetokenizeServer(chatml(), tokenizer_info={"chat_template": template}) as server:
        resolver = await ChainResolver.for_source(source(detokenize_endpoint=server.url),
                                                  on_outcome=lambda o: None)
        await resolver.close()
        assert resolver.parser.source == "vllm-1:tokenizer_info"
        server.tokenizer_info = None  # endpoint disabled: built-in recognizers
        resolver = await ChainResolver.for_source(source(detokenize_endpoint=server.url),
                                                  on_outcome=lambda o: None)
        await resolver.close()
        assert resolver.parser.source == "builtin"


async def test_for_source_unusable_template_falls_back_to_builtins(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ 'no user here' }}")
    resolver = await ChainResolver.for_source(
        source(tokenizer=str(TOKENIZERS / "chatml"), chat_template=str(bad)),
        on_outcome=lambda o: None)
    await resolver.close()
    assert resolver.parser.source == "builtin"


async def test_for_source_needs_a_decoder() -> None:
    with pytest.raises(ValueError, match="no detokenize_endpoint and no tokenizer"):
        await ChainResolver.for_source(source(), on_outcome=lambda o: None)


async def test_only_the_first_max_decode_tokens_are_decoded() -> None:
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    long_chat = tokens_of([{"role": "system", "content": "Be kind."},
                           {"role": "user", "content": "The quick brown fox. " * 200}])
    assert len(long_chat) > 64
    async with DetokenizeServer(chatml()) as server:
        resolver = ChainResolver(detokenizer=HttpDetokenizer(server.url, Engine.VLLM),
                                 parser=chatml_parser(), on_outcome=queue.put_nowait,
                                 max_decode_tokens=32)
        try:
            resolver.submit(ResolveRequest(head=1, model="m", tokens=long_chat))
            assert (await next_outcome(queue)).key == prefix_key("m", "Be kind.", None)
            # A chain still pending within the limit can never resolve: say so.
            long_system = tokens_of([{"role": "system", "content": "Be kind. " * 100},
                                     {"role": "user", "content": "x"}])
            resolver.submit(ResolveRequest(head=2, model="m", tokens=long_system))
            assert await next_outcome(queue) == ResolveOutcome(
                2, ResolveStatus.UNATTRIBUTED, reason="beyond_decode_limit")
            # Within the limit, the same prefix is merely pending.
            resolver.submit(ResolveRequest(head=3, model="m", tokens=long_system[:32]))
            assert (await next_outcome(queue)).status is ResolveStatus.PENDING
        finally:
            await resolver.close()
    assert [len(r["tokens"]) for r in server.requests] == [32, 32, 32]


def test_demo_tokenizer_is_shipped() -> None:
    demo = load_tokenizer(DEMO_TOKENIZER_DIR)
    text = "<|im_start|>user\n안녕<|im_end|>\n"
    assert demo.decode(demo.encode(text, add_special_tokens=False)) == text
    assert demo.chat_template == chatml().chat_template


async def test_key_tokens_is_the_shortest_deciding_prefix_with_a_local_tokenizer() -> None:
    outcomes: list[ResolveOutcome] = []
    tok = chatml()
    resolver = ChainResolver(detokenizer=LocalDetokenizer(tok), parser=chatml_parser(),
                             on_outcome=outcomes.append, local_tokenizer=tok)
    try:
        out = await resolver.resolve(ResolveRequest(1, "m", SYSTEM_CHAT))
    finally:
        await resolver.close()
    assert out.status is ResolveStatus.RESOLVED
    n = out.key_tokens
    assert n is not None and 0 < n < len(SYSTEM_CHAT)
    parser = chatml_parser()
    at = parser.parse_prompt(tok.decode(SYSTEM_CHAT[:n].tolist(), skip_special_tokens=False))
    before = parser.parse_prompt(tok.decode(SYSTEM_CHAT[:n - 1].tolist(),
                                            skip_special_tokens=False))
    assert prefix_key("m", at.system_text, at.first_text) == out.key
    assert before.status is not ResolveStatus.RESOLVED
    # the deciding prefix ends with the system turn's end delimiter
    assert tok.decode(SYSTEM_CHAT[:n].tolist(), skip_special_tokens=False).endswith("<|im_end|>")


async def test_no_key_tokens_without_a_local_tokenizer() -> None:
    resolver = ChainResolver(detokenizer=LocalDetokenizer(chatml()), parser=chatml_parser(),
                             on_outcome=lambda _: None)
    try:
        out = await resolver.resolve(ResolveRequest(1, "m", SYSTEM_CHAT))
    finally:
        await resolver.close()
    assert out.status is ResolveStatus.RESOLVED and out.key_tokens is None


# --- the engine's template, learned late (engine unreachable at start) ---------------------------

DEFAULT_SYSTEM_DIR = TOKENIZERS / "default-system"
#: What the default-system fixture template injects when a request has no system message.
INJECTED_DEFAULT = "You are Tiny, a small model trained for tests. You are a helpful assistant."
NO_SYSTEM_BODY: dict[str, Any] = {"model": "tiny",
                                  "messages": [{"role": "user", "content": "안녕하세요, 도와주세요"}]}


def default_system() -> Any:
    return tokenizer("default-system")


def no_system_tokens() -> array[int]:
    tok = default_system()
    text = tok.apply_chat_template(NO_SYSTEM_BODY["messages"], tokenize=False,
                                   add_generation_prompt=True)
    assert INJECTED_DEFAULT in text
    return array("I", tok.encode(text, add_special_tokens=False))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class InfoServer(DetokenizeServer):
    """The test server with a scripted `/tokenizer_info` (per request: an HTTP status, or "hold"
    until `info_release`; then the normal answer), counting its requests."""

    def __init__(self, tokenizer: Any, tokenizer_info: dict[str, Any] | None) -> None:
        super().__init__(tokenizer, tokenizer_info=tokenizer_info)
        self.info_script: list[int | str] = []
        self.info_requests = 0
        self.info_arrived = asyncio.Event()
        self.info_release = asyncio.Event()

    async def __aenter__(self) -> InfoServer:
        await self.start()
        return self

    async def _tokenizer_info(self, request: web.Request) -> web.StreamResponse:
        self.info_requests += 1
        self.info_arrived.set()
        step = self.info_script.pop(0) if self.info_script else None
        if step == "hold":
            await self.info_release.wait()
        elif isinstance(step, int):
            return web.json_response({"detail": "scripted"}, status=step)
        return await super()._tokenizer_info(request)

    async def close(self) -> None:
        self.info_release.set()
        await super().close()


def learned_late(logs: list[MutableMapping[str, Any]]) -> int:
    return sum(1 for e in logs if e["event"] == "chat_template_learned_late")


async def test_template_unreachable_at_start_is_learned_later() -> None:
    clock = FakeClock()
    want = request_prefix_key(NO_SYSTEM_BODY)
    # The built-ins read the fixture's injected default as a real system prompt (only Qwen
    # 2.5's default is built in): an S key of that text, not the router's M key.
    builtin_key = prefix_key("tiny", INJECTED_DEFAULT, None)
    assert want is not None and want == prefix_key("tiny", None, "안녕하세요, 도와주세요")
    assert builtin_key != want
    req = ResolveRequest(head=1, model="tiny", tokens=no_system_tokens())
    async with InfoServer(default_system(), tokenizer_info(DEFAULT_SYSTEM_DIR)) as server:
        server.info_script = [503, 503]  # a proxy in front of an engine still loading
        with capture_logs() as logs:
            resolver = await ChainResolver.for_source(
                source(detokenize_endpoint=server.url), on_outcome=lambda o: None,
                clock=clock, template_retry_s=30.0, timeout_s=20.0)
            try:
                assert resolver.parser.source == "builtin" and resolver.template_pending
                assert (await resolver.resolve(req)).key == builtin_key
                clock.now += 29.9  # not due yet: no request
                assert (await resolver.resolve(req)).key == builtin_key
                assert server.info_requests == 1 and resolver.counters[TEMPLATE_RETRIES] == 0
                clock.now += 0.1  # due: still 503, built-ins meanwhile
                assert (await resolver.resolve(req)).key == builtin_key
                assert server.info_requests == 2 and resolver.counters[TEMPLATE_RETRIES] == 1
                clock.now += 30.0  # the engine answers now
                out = await resolver.resolve(req)
                assert out.status is ResolveStatus.RESOLVED and out.key == want
                assert resolver.parser.source == "vllm-1:tokenizer_info"
                assert not resolver.template_pending
                clock.now += 300.0  # learned: never asked again
                assert (await resolver.resolve(req)).key == want
            finally:
                await resolver.close()
    assert server.info_requests == 3 and resolver.counters[TEMPLATE_RETRIES] == 2
    assert learned_late(logs) == 1
    assert [e["event"] for e in logs].count("chat_template_fetch_deferred") == 1
    assert not any(e["event"] == "chat_template_round_trip_inexact" for e in logs)


async def test_engine_listening_later_on_its_port() -> None:
    """Connection refused at start (nothing listens yet), then the engine comes up there."""
    clock = FakeClock()
    port = free_port()
    url = f"http://127.0.0.1:{port}/detokenize"
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    resolver = await ChainResolver.for_source(
        source(detokenize_endpoint=url), on_outcome=queue.put_nowait, clock=clock,
        timeout_s=20.0, retries=0)
    engine = SimDetokenizeServer(default_system(), info=tokenizer_info(DEFAULT_SYSTEM_DIR),
                                 port=port)
    try:
        assert resolver.template_pending
        resolver.submit(ResolveRequest(head=1, model="tiny", tokens=no_system_tokens()))
        assert await next_outcome(queue) == ResolveOutcome(1, ResolveStatus.FAILED,
                                                           reason="connect_error")
        await engine.start()
        clock.now += DEFAULT_TEMPLATE_RETRY_S
        resolver.submit(ResolveRequest(head=1, model="tiny", tokens=no_system_tokens()))
        out = await next_outcome(queue)
    finally:
        await resolver.close()
        await engine.close()
    assert out.key == request_prefix_key(NO_SYSTEM_BODY)
    assert resolver.counters[TEMPLATE_RETRIES] == 1 and not resolver.template_pending


async def test_a_retry_in_flight_does_not_hold_other_resolutions() -> None:
    clock = FakeClock()
    want = request_prefix_key(NO_SYSTEM_BODY)
    req = ResolveRequest(head=1, model="tiny", tokens=no_system_tokens())
    async with InfoServer(default_system(), tokenizer_info(DEFAULT_SYSTEM_DIR)) as server:
        server.info_script = [503, "hold"]
        resolver = await ChainResolver.for_source(
            source(detokenize_endpoint=server.url), on_outcome=lambda o: None, clock=clock,
            timeout_s=20.0)
        try:
            clock.now += DEFAULT_TEMPLATE_RETRY_S
            server.info_arrived.clear()
            first = asyncio.create_task(resolver.resolve(req))
            await asyncio.wait_for(server.info_arrived.wait(), 5)
            # The retry waits for the engine; another resolution goes on with the built-ins
            # and does not start a second request.
            other = await resolver.resolve(ResolveRequest(head=2, model="tiny",
                                                          tokens=req.tokens))
            assert other.key == prefix_key("tiny", INJECTED_DEFAULT, None)
            assert not first.done() and server.info_requests == 2
            server.info_release.set()
            assert (await asyncio.wait_for(first, 5)).key == want
        finally:
            await resolver.close()
    assert resolver.counters[TEMPLATE_RETRIES] == 1


async def test_a_disabled_endpoint_is_final() -> None:
    clock = FakeClock()
    req = ResolveRequest(head=1, model="tiny", tokens=no_system_tokens())
    async with InfoServer(default_system(), None) as server:  # 404: flag not set
        with capture_logs() as logs:
            resolver = await ChainResolver.for_source(
                source(detokenize_endpoint=server.url), on_outcome=lambda o: None,
                clock=clock)
            try:
                assert resolver.parser.source == "builtin" and not resolver.template_pending
                server.tokenizer_info = tokenizer_info(DEFAULT_SYSTEM_DIR)
                clock.now += 10 * DEFAULT_TEMPLATE_RETRY_S
                out = await resolver.resolve(req)
            finally:
                await resolver.close()
    assert out.key == prefix_key("tiny", INJECTED_DEFAULT, None)  # the built-ins' answer
    assert server.info_requests == 1 and resolver.counters[TEMPLATE_RETRIES] == 0
    assert learned_late(logs) == 0


async def test_a_final_answer_on_retry_stops_retrying() -> None:
    clock = FakeClock()
    req = ResolveRequest(head=1, model="tiny", tokens=no_system_tokens())
    async with InfoServer(default_system(), None) as server:
        server.info_script = [503]  # then 404
        resolver = await ChainResolver.for_source(
            source(detokenize_endpoint=server.url), on_outcome=lambda o: None, clock=clock,
            timeout_s=20.0)
        try:
            assert resolver.template_pending
            for _ in range(3):
                clock.now += DEFAULT_TEMPLATE_RETRY_S
                assert (await resolver.resolve(req)).key == prefix_key("tiny", INJECTED_DEFAULT,
                                                                       None)
            assert not resolver.template_pending
        finally:
            await resolver.close()
    assert server.info_requests == 2 and resolver.counters[TEMPLATE_RETRIES] == 1


async def test_no_retries_when_disabled_or_when_the_template_is_local() -> None:
    clock = FakeClock()
    async with InfoServer(default_system(), tokenizer_info(DEFAULT_SYSTEM_DIR)) as server:
        server.info_script = [503]
        resolver = await ChainResolver.for_source(
            source(detokenize_endpoint=server.url), on_outcome=lambda o: None, clock=clock,
            template_retry_s=None)
        await resolver.close()
        assert not resolver.template_pending and resolver.parser.source == "builtin"
        resolver = await ChainResolver.for_source(
            source(detokenize_endpoint=server.url, tokenizer=str(DEFAULT_SYSTEM_DIR)),
            on_outcome=lambda o: None, clock=clock)
        await resolver.close()
        assert not resolver.template_pending and resolver.parser.source == "vllm-1:tokenizer"
    assert server.info_requests == 1


class NoTokenizeServer(DetokenizeServer):
    """An engine without `/tokenize` (SGLang < 0.5.4, or a proxy that only forwards
    `/detokenize`): 404, as aiohttp answers for an unknown route."""

    tokenize_requests = 0

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        self.tokenize_requests += 1
        return web.json_response({"detail": "Not Found"}, status=404)


async def test_an_engine_without_tokenize_is_asked_once_and_keys_still_resolve() -> None:
    stats = SourceStats(engine="vllm")
    async with NoTokenizeServer(chatml()) as server:
        resolver = ChainResolver(detokenizer=HttpDetokenizer(server.url, Engine.VLLM),
                                 parser=chatml_parser(), on_outcome=lambda _: None, stats=stats)
        try:
            with capture_logs() as logs:
                first = await resolver.resolve(ResolveRequest(1, "m", SYSTEM_CHAT))
                second = await resolver.resolve(ResolveRequest(2, "m", SYSTEM_CHAT))
        finally:
            await resolver.close()
    for out in (first, second):
        assert out.status is ResolveStatus.RESOLVED and out.key_tokens is None
        assert out.key == prefix_key("m", "Be kind.", None)
    assert server.tokenize_requests == 1
    assert [e["event"] for e in logs if e["event"] == "tokenize_unavailable"] == \
        ["tokenize_unavailable"]


async def test_an_open_circuit_holds_requests_until_the_endpoint_is_back() -> None:
    # After failures open the circuit, a request waits for the breaker's trial instead of
    # failing at once (which made the tracker ask again at once: the daemon spun, issue #11),
    # and resolves as soon as the endpoint answers again, without being asked twice.
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    async with DetokenizeServer(chatml()) as server:
        server.script = [500, 500]
        http = HttpDetokenizer(server.url, Engine.VLLM, retries=0,
                               breaker=CircuitBreaker(failure_threshold=2, cooldown_s=0.3))
        resolver = ChainResolver(detokenizer=http, parser=chatml_parser(),
                                 on_outcome=queue.put_nowait, max_concurrency=1)
        try:
            for head in (1, 2):
                resolver.submit(ResolveRequest(head, "m", SYSTEM_CHAT))
                out = await next_outcome(queue)
                assert (out.head, out.status, out.reason) == (head, ResolveStatus.FAILED, "http_5xx")
            assert http.breaker.state.value == "open"
            resolver.submit(ResolveRequest(3, "m", SYSTEM_CHAT))
            out = await next_outcome(queue)
        finally:
            await resolver.close()
    assert (out.head, out.status) == (3, ResolveStatus.RESOLVED)
    assert len(server.requests) == 3  # two failures, then the one trial that succeeded
    assert resolver.counters["circuit_waits"] >= 1


async def test_queued_requests_hold_a_bounded_number_of_tokens() -> None:
    # A flood of chains whose /detokenize never answers: the requests waiting hold at most
    # max_backlog_tokens tokens, each at most max_decode_tokens (+1) of them (issue #11).
    gate = Gate()  # never opened: no answer ever comes
    outcomes: list[ResolveOutcome] = []
    resolver = ChainResolver(detokenizer=gate, parser=chatml_parser(), on_outcome=outcomes.append,
                             max_concurrency=1, max_decode_tokens=100, max_backlog_tokens=1000)
    long_chain = array("I", list(SYSTEM_CHAT) * 200)  # thousands of tokens
    try:
        for head in range(1, 31):
            resolver.submit(ResolveRequest(head, "m", long_chain))
        await gate.wait_active(1)
        await asyncio.sleep(0)  # the backlog_full answers are delivered by call_soon
        held = resolver.held_tokens
        queued = resolver.in_flight
    finally:
        await resolver.close()
    assert held <= 1000 and queued == 1000 // 101
    assert {o.reason for o in outcomes} == {BACKLOG_FULL}
    assert len(outcomes) == 30 - queued
