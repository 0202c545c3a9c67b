"""The router's key of a request body equals the listener's key of the same request's KV
chain (SPEC §2), for several chat templates.

Router side: `request_prefix_key(body)`. Listener side: the conversation rendered with the
template (`apply_chat_template`, as the engine does), tokenized with the tiny tokenizer, cut
into 16-token blocks; each chain root..block goes through `ChainResolver`, which decodes it via
a real HTTP `/detokenize` server (vLLM and SGLang shapes) and parses the template. Every chain
must come out PENDING or with exactly the router's key, and resolve once enough is known.
"""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

import pytest

from kv_listener.core.model import Engine, ResolveOutcome, ResolveRequest, ResolveStatus
from kv_listener.core.prefix import content_text, prefix_hash, request_prefix_key
from kv_listener.resolver.detokenize import HttpDetokenizer
from kv_listener.resolver.resolver import ChainResolver
from tests.support.detokenize_server import DetokenizeServer
from tests.support.tokenizers import parser, tokenizer

BLOCK = 16
SYSTEM_TEMPLATES = ["chatml", "llama3", "llama3-dated", "default-system"]
ALL_TEMPLATES = [*SYSTEM_TEMPLATES, "no-system"]


# Later turns make sure the first message's end lies inside full blocks (engines publish full
# blocks only).
PADDING = [{"role": "assistant", "content": "네, 알겠습니다. What is the capital of France?"},
           {"role": "user", "content": "Explain how prefix caching works in vLLM and SGLang. "
                                       "The KV cache stores keys and values. " * 3}]


def engine_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """What the engine renders: list contents become their text parts joined with "\\n"
    (vLLM's string content format)."""
    out = []
    for msg in body["messages"]:
        text = content_text(msg["content"])
        out.append({"role": msg["role"], "content": text or ""})
    return out


def chain_tokens(name: str, body: dict[str, Any]) -> tuple[str, array[int]]:
    tok = tokenizer(name)
    text = tok.apply_chat_template(engine_messages(body), tokenize=False,
                                   add_generation_prompt=True)
    return text, array("I", tok.encode(text, add_special_tokens=False))


async def resolve_chains(name: str, engine: str, model: str, tokens: array[int],
                         max_prefix_length: int = 1024) -> dict[int, ResolveOutcome]:
    """Outcome per number of full blocks k (chain root..block k)."""
    queue: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
    n_blocks = len(tokens) // BLOCK
    async with DetokenizeServer(tokenizer(name), engine) as server:
        resolver = ChainResolver(
            detokenizer=HttpDetokenizer(server.url, Engine(engine), model=model),
            parser=parser(name), on_outcome=queue.put_nowait,
            max_prefix_length=max_prefix_length)
        try:
            for k in range(1, n_blocks + 1):
                resolver.submit(ResolveRequest(head=k, model=model,
                                               tokens=tokens[: k * BLOCK]))
            outcomes = [await asyncio.wait_for(queue.get(), 10) for _ in range(n_blocks)]
        finally:
            await resolver.close()
    return {o.head: o for o in outcomes}


def check_chains(outcomes: dict[int, ResolveOutcome], expected: bytes) -> int:
    """Every chain is PENDING or has the router's key; once resolved, longer chains stay
    resolved; the full chain resolves. Returns the first resolving block count."""
    statuses = [outcomes[k].status for k in sorted(outcomes)]
    for k in sorted(outcomes):
        o = outcomes[k]
        assert o.status in (ResolveStatus.PENDING, ResolveStatus.RESOLVED), (k, o)
        if o.status is ResolveStatus.RESOLVED:
            assert o.key is not None and prefix_hash(o.key) == prefix_hash(expected), k
    assert statuses[-1] is ResolveStatus.RESOLVED
    first = statuses.index(ResolveStatus.RESOLVED)
    assert all(s is ResolveStatus.RESOLVED for s in statuses[first:])
    return first + 1


def body_of(messages: list[dict[str, Any]], model: str = "tiny") -> dict[str, Any]:
    return {"model": model, "messages": [*messages, *PADDING]}


CONVERSATIONS_WITH_SYSTEM: dict[str, list[dict[str, Any]]] = {
    "system_and_user": [{"role": "system", "content": "You are a careful assistant. 답은 한국어로."},
                        {"role": "user", "content": "안녕하세요, 도와주세요"}],
    "developer_role": [{"role": "developer", "content": "Answer in three sentences."},
                       {"role": "user", "content": "Summarize the following text."}],
    "list_content": [{"role": "system", "content": [{"type": "text", "text": "Cite sources."},
                                                    {"type": "text", "text": "친절하게."}]},
                     {"role": "user", "content": [{"type": "text", "text": "질문"}]}],
    "empty_system": [{"role": "system", "content": ""},
                     {"role": "user", "content": "The quick brown fox 뷁"}],
}
CONVERSATIONS_ANY: dict[str, list[dict[str, Any]]] = {
    "user_only": [{"role": "user", "content": "안녕하세요, 도와주세요 뷁뷁"}],
    "user_list_content": [{"role": "user", "content": [{"type": "text", "text": "line one"},
                                                       {"type": "text", "text": "둘째 줄"}]}],
}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", SYSTEM_TEMPLATES)
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS_WITH_SYSTEM))
async def test_system_conversations(name: str, engine: str, conversation: str) -> None:
    body = body_of(CONVERSATIONS_WITH_SYSTEM[conversation])
    expected = request_prefix_key(body)
    assert expected is not None
    _text, tokens = chain_tokens(name, body)
    check_chains(await resolve_chains(name, engine, "tiny", tokens), expected)


@pytest.mark.parametrize("name", ALL_TEMPLATES)
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS_ANY))
async def test_first_message_conversations(name: str, conversation: str) -> None:
    body = body_of(CONVERSATIONS_ANY[conversation])
    expected = request_prefix_key(body)
    assert expected is not None
    _text, tokens = chain_tokens(name, body)
    check_chains(await resolve_chains(name, "vllm", "tiny", tokens), expected)


def test_anthropic_body_has_the_same_key_as_the_openai_one() -> None:
    openai = body_of(CONVERSATIONS_WITH_SYSTEM["system_and_user"])
    anthropic = {"model": "tiny", "system": [{"type": "text",
                                              "text": "You are a careful assistant. 답은 한국어로."}],
                 "messages": openai["messages"][1:]}
    assert request_prefix_key(anthropic, api="anthropic") == request_prefix_key(openai)


@pytest.mark.parametrize("name", ["chatml", "llama3", "no-system"])
async def test_lora_model_name(name: str) -> None:
    if name == "no-system":
        messages = [{"role": "user", "content": "SELECT 1; 안녕"}]
    else:
        messages = [{"role": "system", "content": "You write SQL."},
                    {"role": "user", "content": "SELECT 1; 안녕"}]
    # The router addresses the adapter by its name; vLLM's events carry it as lora_name and the
    # tracker puts it into the request's model.
    body = body_of(messages, model="tiny-sql-lora")
    expected = request_prefix_key(body)
    base = request_prefix_key(body, model="tiny")
    assert expected is not None and expected != base
    _text, tokens = chain_tokens(name, body)
    check_chains(await resolve_chains(name, "vllm", "tiny-sql-lora", tokens), expected)


def known_content_bytes(tok: Any, text: str, content: str, tokens: array[int], k: int) -> int:
    """Bytes of `content` a chain of k blocks reveals, counted independently of the parser:
    whole characters decoded, plus one for a character cut at the block boundary."""
    start = len(text[: text.index(content)].encode())
    decoded = tok.decode(tokens[: k * BLOCK].tolist(), skip_special_tokens=False)
    whole = decoded.rstrip("\ufffd")
    cut = 1 if len(whole) != len(decoded) else 0
    return max(0, len(whole.encode()) - start + cut)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", ALL_TEMPLATES)
async def test_long_korean_prefix_pending_then_resolved(name: str, engine: str) -> None:
    # 600 x 뷁 (not in the tokenizer's corpus: one token per byte, so block boundaries cut
    # characters) = 1800 bytes, longer than max_prefix_length: the key covers 1023 bytes.
    long_text = "뷁" * 600
    role = "user" if name == "no-system" else "system"
    messages = [{"role": role, "content": long_text}]
    if role == "system":
        messages.append({"role": "user", "content": "hi"})
    body = body_of(messages)
    expected = request_prefix_key(body)
    assert expected is not None
    text, tokens = chain_tokens(name, body)
    outcomes = await resolve_chains(name, engine, "tiny", tokens)
    first = check_chains(outcomes, expected)
    # PENDING while fewer than 1024 bytes of the prefix are known, RESOLVED from the first
    # chain that reveals them: the system prompt is longer than the early chains.
    tok = tokenizer(name)
    assert first > 1
    assert known_content_bytes(tok, text, long_text, tokens, first) >= 1024
    assert known_content_bytes(tok, text, long_text, tokens, first - 1) < 1024


@pytest.mark.parametrize("name", ["chatml", "llama3"])
async def test_resolution_exactly_at_a_cut_character(name: str) -> None:
    """Sweep max_prefix_length over a block's worth of values: the resolving chain then ends
    inside a character for some of them, and the key is still the router's."""
    long_text = "뷁" * 600
    body = body_of([{"role": "system", "content": long_text}, {"role": "user", "content": "hi"}])
    text, tokens = chain_tokens(name, body)
    tok = tokenizer(name)
    cut_at_resolution = 0
    for limit in range(1016, 1032):
        expected = request_prefix_key(body, max_prefix_length=limit)
        assert expected is not None
        first = check_chains(await resolve_chains(name, "vllm", "tiny", tokens, limit), expected)
        assert known_content_bytes(tok, text, long_text, tokens, first) >= limit
        assert known_content_bytes(tok, text, long_text, tokens, first - 1) < limit
        decoded = tok.decode(tokens[: first * BLOCK].tolist(), skip_special_tokens=False)
        cut_at_resolution += decoded.endswith("\ufffd")
    assert cut_at_resolution > 0


async def test_default_system_prompt_is_no_system_on_both_sides() -> None:
    body = body_of([{"role": "user", "content": "안녕하세요, 도와주세요"}])
    text, tokens = chain_tokens("default-system", body)
    assert "You are Tiny" in text  # injected by the template, unknown to the router
    expected = request_prefix_key(body)
    assert expected is not None
    check_chains(await resolve_chains("default-system", "vllm", "tiny", tokens), expected)
