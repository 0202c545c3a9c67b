"""ChainResolver: de-duplication, bounded concurrency and backlog, outcome delivery, stats,
and construction from a source's config; against a real aiohttp /detokenize server and the
tiny fixture tokenizers."""

from __future__ import annotations

import asyncio
from array import array
from pathlib import Path
from typing import Any

import pytest

from kv_listener.config import SourceConfig
from kv_listener.core.model import Engine, ResolveOutcome, ResolveRequest, ResolveStatus
from kv_listener.core.prefix import prefix_key
from kv_listener.resolver.detokenize import HttpDetokenizer, LocalDetokenizer
from kv_listener.resolver.resolver import BACKLOG_FULL, INTERNAL_ERROR, ChainResolver
from kv_listener.resolver.template import (
    DEMO_TOKENIZER_DIR,
    PromptParser,
    learn_from_tokenizer,
    load_tokenizer,
)
from kv_listener.stats import SourceStats
from tests.support.detokenize_server import DetokenizeServer

TOKENIZERS = Path(__file__).resolve().parent.parent / "fixtures" / "tokenizers"
_tok: dict[str, Any] = {}


def chatml() -> Any:
    if "chatml" not in _tok:
        _tok["chatml"] = load_tokenizer(TOKENIZERS / "chatml")
        _tok["parser"] = PromptParser(learn_from_tokenizer(_tok["chatml"], name="chatml"))
    return _tok["chatml"]


def chatml_parser() -> PromptParser:
    chatml()
    parser: PromptParser = _tok["parser"]
    return parser


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
    assert got[11] == ResolveOutcome(11, ResolveStatus.RESOLVED,
                                     key=prefix_key("tiny", "Be kind.", None))
    assert got[12] == ResolveOutcome(12, ResolveStatus.RESOLVED,
                                     key=prefix_key("tiny", None, "안녕하세요"))
    assert stats.detokenize_calls == 2 and not stats.detokenize_errors
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
