"""The convergence oracle on its own (no engine): the real-engine tests are only as good as
`EngineTruth`, so its rules are pinned here on hand-made vLLM batches (SPEC §2-§4)."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from kv_listener.core.model import AllBlocksCleared, BlockRemoved, BlockStored, Engine, EventBatch
from kv_listener.core.prefix import prefix_hash, prefix_key
from kv_listener.core.salt import issue_cache_salt
from kv_listener.resolver.template import build_prompt_parser, load_tokenizer
from kv_listener.sim.encode import encode_vllm_batch
from tests.engines.oracle import EngineTruth
from tests.engines.paths import LLAMA3_TOKENIZER

pytestmark = pytest.mark.engines

BS = 16
MODEL = "tiny"
TOK = load_tokenizer(LLAMA3_TOKENIZER)
PARSER = build_prompt_parser(tokenizer=TOK, name="oracle-test")
SECRET = b"oracle-secret"
SYSTEM = "You are a helpful assistant. Answer the question using the documents below."
KEY = prefix_hash(prefix_key(MODEL, SYSTEM, None))  # type: ignore[arg-type]


def prompt_tokens(system: str = SYSTEM, user: str = "The quick brown fox jumps over the lazy dog "
                  * 6) -> list[int]:
    text = TOK.apply_chat_template([{"role": "system", "content": system},
                                    {"role": "user", "content": user.strip()}],
                                   tokenize=False, add_generation_prompt=True)
    ids = list(TOK.encode(text, add_special_tokens=False))
    return ids[: len(ids) // BS * BS]


def deciding_block(tokens: list[int]) -> int:
    """Index of the first block whose chain root..block contains the system prompt's end."""
    for i in range(len(tokens) // BS):
        if PARSER.parse_prompt(TOK.decode(tokens[: (i + 1) * BS], skip_special_tokens=False)
                               ).system_text:
            return i
    raise AssertionError("the system prompt never ends")


def stored(tokens: list[int], base: int = 1000, parent: int | None = None,
           salt: str | None = None, **kw: Any) -> BlockStored:
    n = len(tokens) // BS
    extra = None if salt is None else tuple([(salt,)] + [None] * (n - 1))
    return BlockStored(tuple(range(base, base + n)), parent, array("I", tokens), BS,
                       extra_keys=extra, **kw)


def truth(**kw: Any) -> EngineTruth:
    return EngineTruth(engine=Engine.VLLM, model=MODEL, tokenizer=TOK, parser=PARSER, **kw)


def batch(*events: Any, seq: int | None = None) -> EventBatch:
    return EventBatch(0.0, tuple(events), 0, seq)


def test_blocks_before_the_deciding_one_are_not_attributed_and_tails_lower_the_count() -> None:
    toks = prompt_tokens()
    d = deciding_block(toks)
    n = len(toks) // BS
    assert 0 < d < n - 2
    t = truth()
    t.feed_batch(batch(stored(toks), seq=0))
    assert t.expected() == {KEY: (n * BS, "gpu_hot")}
    assert t.held_chain_lengths()[KEY] == [BS * (i + 1) for i in range(d, n)]
    # vLLM evicts the tail first: the key stays with the shorter chain ...
    t.feed_batch(batch(BlockRemoved(tuple(range(1000 + d + 1, 1000 + n)), "GPU"), seq=1))
    assert t.expected() == {KEY: ((d + 1) * BS, "gpu_hot")}
    assert f"{(d + 1) * BS} of {n * BS} tokens held" in t.note(KEY)
    # ... until the deciding block goes (its ancestors alone decide nothing).
    t.feed_batch(batch(BlockRemoved((1000 + d,), "GPU"), seq=2))
    assert t.expected() == {}
    assert t.held == d and t.remembered == n


def test_evicted_ancestors_still_give_their_tokens() -> None:
    toks = prompt_tokens()
    d = deciding_block(toks)
    t = truth()
    t.feed_batch(batch(stored(toks[:BS * d]), seq=0))  # the blocks before the key is decided
    assert t.expected() == {}
    t.feed_batch(batch(BlockRemoved((1000,), "GPU"), seq=1))  # the root goes, its tokens stay
    t.feed_batch(batch(stored(toks[BS * d:], base=1000 + d, parent=1000 + d - 1), seq=2))
    assert t.expected() == {KEY: (len(toks), "gpu_hot")}


def test_storage_tier_and_medium_specific_removal() -> None:
    toks = prompt_tokens()
    n = len(toks) // BS
    t = truth()
    t.feed_batch(batch(stored(toks, medium="GPU"),
                       BlockStored(tuple(range(1000, 1000 + n)), None, array("I"), BS,
                                   medium="CPU"), seq=0))
    t.feed_batch(batch(BlockRemoved(tuple(range(1000, 1000 + n)), "GPU"), seq=1))
    assert t.expected() == {KEY: (len(toks), "storage_warm")}
    t.feed_batch(batch(BlockRemoved(tuple(range(1000, 1000 + n)), "CPU"), seq=2))
    assert t.expected() == {}


@pytest.mark.parametrize(("backend", "mangle", "attributed"), [
    ("vllm-1", False, True),
    ("vllm-2", False, False),  # issued for another backend
    ("vllm-1", True, False),  # forged MAC
])
def test_salted_chains(backend: str, mangle: bool, attributed: bool) -> None:
    claimed = prefix_key(MODEL, "Some other system prompt.", None)
    assert claimed is not None
    salt = issue_cache_salt(SECRET, backend, claimed)
    if mangle:
        salt = salt[:-1] + ("0" if salt[-1] != "0" else "1")
    toks = prompt_tokens()
    t = truth(salt_secret=SECRET, backend="vllm-1")
    t.feed_batch(batch(stored(toks, salt=salt), seq=0))
    # A valid salt gives its key to every block of the chain, whatever the tokens say.
    assert t.expected() == ({prefix_hash(claimed): (len(toks), "gpu_hot")} if attributed else {})
    # Without a secret the salt is ignored and the tokens decide.
    t2 = truth()
    t2.feed_batch(batch(stored(toks, salt=salt), seq=0))
    assert t2.expected() == {KEY: (len(toks), "gpu_hot")}


def test_restart_and_clears() -> None:
    toks = prompt_tokens()
    other = prompt_tokens(system="Summarize the following text in three sentences.")
    other_key = prefix_hash(prefix_key(MODEL, "Summarize the following text in three sentences.",
                                       None))  # type: ignore[arg-type]
    t = truth()
    t.feed_batch(batch(stored(toks), seq=0))
    # A publisher restarted after exactly one batch sends seq 0 again: a restart, not a repeat.
    t.feed_batch(batch(stored(other, base=5000), seq=0))
    assert set(t.expected()) == {other_key}
    t.feed_batch(batch(AllBlocksCleared(), stored(toks), seq=1))
    assert set(t.expected()) == {KEY}
    t.clear()
    assert t.expected() == {} and t.remembered == 0


def test_feed_frames_decodes_the_real_wire_format() -> None:
    toks = prompt_tokens()
    t = truth()
    payload = encode_vllm_batch([stored(toks, medium="GPU", group_idx=0,
                                        kv_cache_spec_kind="full_attention")], ts=1.0)
    t.feed_frames([b"kv-events", (7).to_bytes(8, "big"), payload])
    assert t.messages == 1 and t.expected() == {KEY: (len(toks), "gpu_hot")}
    with pytest.raises(AssertionError):
        t.feed_frames([b"kv-events", payload])
