"""Tail eviction with an HTTP `/detokenize` only (issue #10, bug 1): the blocks from the point
where a chain's key is decided belong to the key, so an engine that frees tails first (vLLM under
memory pressure) lowers the prefix's `token_count` and evicts it only when the deciding block
goes. The real tracker and resolver against the engine stand-in's `/detokenize` and `/tokenize`
(aiohttp on 127.0.0.1, backed by the llama3 fixture tokenizer); no local tokenizer, as in the
default deployment. The deciding block is computed here independently, by decoding every block
boundary with the tokenizer."""

from __future__ import annotations

import asyncio
from array import array
from pathlib import Path
from typing import Any

import pytest

from kv_listener.core.limits import Limits
from kv_listener.core.model import (
    BlockRemoved,
    BlockStored,
    Engine,
    EventBatch,
    PrefixTransition,
    ResolveOutcome,
    ResolveStatus,
    TransitionKind,
)
from kv_listener.core.prefix import prefix_key, request_prefix_key
from kv_listener.core.tracker import Tracker
from kv_listener.resolver.detokenize import HttpDetokenizer
from kv_listener.resolver.resolver import ChainResolver
from kv_listener.resolver.template import PromptParser, learn_from_tokenizer, load_tokenizer
from kv_listener.sim.detokenize_server import DetokenizeServer
from kv_listener.stats import SourceStats

LLAMA3 = Path(__file__).resolve().parent.parent / "fixtures" / "tokenizers" / "llama3"
BLOCK = 16
MODEL = "tiny-llama"
_cache: dict[str, Any] = {}


def tok() -> Any:
    if "tok" not in _cache:
        _cache["tok"] = load_tokenizer(LLAMA3)
        _cache["parser"] = PromptParser(learn_from_tokenizer(_cache["tok"], name="llama3"))
    return _cache["tok"]


def parser() -> PromptParser:
    tok()
    p: PromptParser = _cache["parser"]
    return p


def chat_tokens(messages: list[dict[str, Any]]) -> array[int]:
    """Token IDs as the engine's chat server makes them, cut to whole blocks."""
    text = tok().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok().encode(text, add_special_tokens=False)
    return array("I", ids[: len(ids) // BLOCK * BLOCK])


def deciding_block(tokens: array[int], key: bytes) -> int:
    """Index of the first block whose chain (root..block) decodes to `key`."""
    for i in range(len(tokens) // BLOCK):
        text = tok().decode(tokens[: (i + 1) * BLOCK].tolist(), skip_special_tokens=False)
        parsed = parser().parse_prompt(text)
        if parsed.status is ResolveStatus.RESOLVED and \
                prefix_key(MODEL, parsed.system_text, parsed.first_text) == key:
            return i
    raise AssertionError("no block decides the key")


class Pipeline:
    """Tracker + resolver wired as the daemon wires them (one owner, outcomes applied in turn)."""

    def __init__(self, server: DetokenizeServer) -> None:
        self.stats = SourceStats(engine="vllm")
        self.outcomes: asyncio.Queue[ResolveOutcome] = asyncio.Queue()
        self.tracker = Tracker(engine=Engine.VLLM, model=MODEL, limits=Limits())
        self.resolver = ChainResolver(
            detokenizer=HttpDetokenizer(server.url, Engine.VLLM), parser=parser(),
            on_outcome=self.outcomes.put_nowait, stats=self.stats)
        self.next_hash = 1

    async def apply(self, *events: Any) -> list[PrefixTransition]:
        out = self.tracker.apply(EventBatch(ts=0.0, events=events))
        for req in self.tracker.take_resolve_requests():
            self.resolver.submit(req)
        await self.resolver.wait_idle()
        while not self.outcomes.empty():
            out.extend(self.tracker.on_resolved(self.outcomes.get_nowait()))
            for req in self.tracker.take_resolve_requests():
                self.resolver.submit(req)
            await self.resolver.wait_idle()
        return out

    def store(self, tokens: array[int], parent: int | None = None, start: int = 0
              ) -> tuple[BlockStored, list[int]]:
        """One vLLM BlockStored for the blocks of `tokens` from block `start` on."""
        n = len(tokens) // BLOCK - start
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        ev = BlockStored(block_hashes=tuple(hashes), parent_hash=parent,
                         token_ids=tokens[start * BLOCK:], block_size=BLOCK)
        return ev, hashes


SYSTEM = "You are the support assistant of a hardware shop. Answer briefly, politely, in English."


@pytest.mark.parametrize("system", [SYSTEM, "가" * 400 + "!"], ids=["short", "over-1024-bytes"])
async def test_tail_eviction_keeps_the_key_until_its_deciding_block_goes(system: str) -> None:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "My order 4411 arrived broken. " * 12}]
    tokens = chat_tokens(messages)
    key = request_prefix_key({"model": MODEL, "messages": messages})
    assert key is not None
    decide = deciding_block(tokens, key)
    nblocks = len(tokens) // BLOCK
    assert decide < nblocks - 3  # the chain goes well beyond the deciding block

    async with DetokenizeServer(tok()) as server:
        p = Pipeline(server)
        try:
            ev, hashes = p.store(tokens)
            created = await p.apply(ev)
            assert created == [PrefixTransition(TransitionKind.CREATED, key.hex(),
                                                nblocks * BLOCK, created[0].tier)]
            # The engine frees the tail first, two blocks at a time, down to the deciding block.
            for keep in range(nblocks - 2, decide, -2):
                out = await p.apply(BlockRemoved(block_hashes=tuple(hashes[keep:keep + 2])))
                assert [t.kind for t in out] == [TransitionKind.TOKEN_COUNT], (keep, out)
                assert out[0].token_count == keep * BLOCK
                assert p.tracker.snapshot() == {key.hex(): (keep * BLOCK, out[0].tier)}
            remaining = p.tracker.snapshot()[key.hex()][0] // BLOCK
            tail = tuple(hashes[decide + 1:remaining])
            if tail:
                await p.apply(BlockRemoved(block_hashes=tail))
            assert p.tracker.snapshot()[key.hex()][0] == (decide + 1) * BLOCK
            # Only when the deciding block goes is the key gone.
            out = await p.apply(BlockRemoved(block_hashes=(hashes[decide],)))
            assert [t.kind for t in out] == [TransitionKind.EVICTED]
            assert p.tracker.snapshot() == {}
        finally:
            await p.resolver.close()
        assert server.answered == 1  # one /detokenize for the chain
        assert p.stats.tokenize_calls == 1  # and one /tokenize for its deciding point


async def test_users_sharing_a_system_prompt_need_no_further_call_over_http() -> None:
    users = [f"Question number {i}: where is my parcel {i * 7919}?" for i in range(6)]
    chats = [chat_tokens([{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": u * 3}]) for u in users]
    key = request_prefix_key({"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": users[0]}]})
    assert key is not None
    decide = deciding_block(chats[0], key)
    async with DetokenizeServer(tok()) as server:
        p = Pipeline(server)
        try:
            ev, first = p.store(chats[0])
            await p.apply(ev)
            for chat in chats[1:]:
                common = 0
                while chats[0][common] == chat[common]:
                    common += 1
                shared = common // BLOCK  # blocks identical to the first chain's
                assert shared > decide
                ev, _ = p.store(chat, parent=first[shared - 1], start=shared)
                await p.apply(ev)
            assert p.tracker.snapshot()[key.hex()][0] == max(len(c) for c in chats)
        finally:
            await p.resolver.close()
        assert (server.answered, p.stats.tokenize_calls) == (1, 1)
