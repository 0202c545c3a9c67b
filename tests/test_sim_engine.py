"""The simulated vLLM engine: block-pool invariants (the seed's LRU example step by step), the
cached-prefix hit it reports, and the events it emits, decoded by the real decoder back to the
expected hash chain; then the whole engine over real ZMQ and its chat tokenization."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kv_listener.core.decode import decode_zmq_payload
from kv_listener.core.model import MEDIUM_GPU, BlockRemoved, BlockStored, Engine
from kv_listener.core.sequence import parse_event_frames
from kv_listener.prefix import prefix_hash, request_prefix_key
from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.engine import (
    NONE_HASH,
    BlockPool,
    EngineCore,
    NoFreeBlocksError,
    SimEngine,
    block_digest,
    chain_digests,
    render_chat,
    wire_hash,
)
from kv_listener.sim.workload import SYSTEM_PROMPTS, ChatWorkload

_tok: list[Any] = []


def tokenizer() -> Any:
    if not _tok:
        _tok.append(load_tokenizer(DEMO_TOKENIZER_DIR))
    return _tok[0]


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def hashes_of(tokens: list[int], bs: int) -> list[int]:
    return [wire_hash(d) for d in chain_digests(tokens, bs)]


def decoded(events: list[Any]) -> list[Any]:
    """Events through the real wire: vLLM 0.33 encoding, then the listener's decoder."""
    batch = decode_zmq_payload(Engine.VLLM, encode_vllm_batch(events, ts=1.0))
    assert not batch.drops
    return list(batch.batch.events)


def test_chain_digests_chain_each_block_to_its_parent() -> None:
    tokens = toks(10, 40)
    d = chain_digests(tokens, 16)
    assert len(d) == 2  # 40 tokens: two full blocks, a partial one is never hashed
    assert d[0] == block_digest(NONE_HASH, tokens[:16])
    assert d[1] == block_digest(d[0], tokens[16:32])
    assert chain_digests(tokens, 16, start=1, parent=d[0]) == d[1:]
    assert wire_hash(d[0]) == int.from_bytes(d[0][-8:], "big") < 1 << 64
    # Same tokens at another position hash differently (the chain, not the content, decides).
    assert chain_digests(tokens[16:32] * 2, 16)[1] != d[1]


def test_the_seeds_lru_example_step_by_step() -> None:
    """shared/seeds/002 "예시": 10 blocks of 4 tokens; the block IDs, the free queue and the one
    eviction come out exactly as the seed describes them."""
    core = EngineCore(num_blocks=10, block_size=4)
    pool = core.pool
    r0_prompt = toks(100, 15)
    # Time 1: 4 blocks, 3 full (cached), the 4th holds 3 of 4 tokens.
    r0 = core.admit(r0_prompt)
    assert [b.block_id for b in r0.blocks] == [0, 1, 2, 3] and r0.hit_tokens == 0
    stored = decoded(core.take_events())
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert list(stored[0].block_hashes) == hashes_of(r0_prompt, 4)
    assert stored[0].parent_hash is None and stored[0].token_ids == array("I", r0_prompt[:12])
    assert stored[0].block_size == 4 and stored[0].medium == MEDIUM_GPU
    # Time 2: request 0 fills block 3 and needs block 4 to go on decoding: block 3 is cached.
    assert core.append(r0, [900, 901]) == 2
    assert [b.block_id for b in r0.blocks] == [0, 1, 2, 3, 4]
    (ev,) = decoded(core.take_events())
    r0_tokens = [*r0_prompt, 900]
    assert isinstance(ev, BlockStored)
    assert list(ev.block_hashes) == hashes_of(r0_tokens, 4)[3:]
    assert ev.parent_hash == hashes_of(r0_tokens, 4)[2]
    assert ev.token_ids == array("I", r0_tokens[12:16])
    # Time 3: request 1, 14 tokens, the first 10 as request 0's: only 2 blocks (8 tokens) hit.
    r1_prompt = r0_prompt[:10] + toks(500, 4)
    r1 = core.admit(r1_prompt)
    assert r1.hit_tokens == 8
    assert [b.block_id for b in r1.blocks] == [0, 1, 5, 6]
    # Time 4: request 0 finishes: blocks 2, 3, 4 go to the free queue's tail in reverse order
    # (0 and 1 are still used by request 1).
    core.release(r0)
    assert pool.free_order() == [7, 8, 9, 4, 3, 2]
    # Time 5: request 1 finishes.
    core.release(r1)
    assert pool.free_order() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    core.take_events()
    # Time 6: request 2, 29 tokens, the first 12 as request 0's: hits 0, 1, 2 are touched out of
    # the queue; 7, 8, 9, 4, 3 are allocated and 3 (cached) is evicted.
    r2 = core.admit(r0_prompt[:12] + toks(700, 17))
    assert r2.hit_tokens == 12
    assert [b.block_id for b in r2.blocks] == [0, 1, 2, 7, 8, 9, 4, 3]
    events = decoded(core.take_events())
    assert events[0] == BlockRemoved(block_hashes=(hashes_of(r0_tokens, 4)[3],), medium=MEDIUM_GPU)
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert pool.free_order() == [6, 5]


def test_hit_is_the_longest_cached_block_prefix_and_spares_the_last_token() -> None:
    core = EngineCore(num_blocks=64, block_size=16)
    prompt = toks(3, 50)
    assert core.serve(prompt).hit_tokens == 0
    assert core.serve(prompt).hit_tokens == 48  # three full blocks of the 50 tokens
    # A prompt of whole blocks cannot be served entirely from the cache: vLLM recomputes the
    # last token, so the hit is one block short.
    exact = toks(1000, 48)
    core.serve(exact)
    assert core.serve(exact).hit_tokens == 32
    # A shared first block only.
    assert core.serve(prompt[:20] + toks(2000, 30)).hit_tokens == 16
    assert core.serve(toks(5000, 50)).hit_tokens == 0
    assert core.hit_tokens == 48 + 32 + 16
    # Output blocks are cached too: the same prompt plus its output hits them.
    out = toks(7000, 40)
    core.serve(prompt, out)
    assert core.serve(prompt + out[:-1] + [1]).hit_tokens == 80  # 89 tokens, 5 whole blocks


def test_the_same_content_is_cached_once_and_its_tokens_are_announced_once() -> None:
    core = EngineCore(num_blocks=64, block_size=4)
    prompt = toks(10, 8)  # two whole blocks: the second is recomputed by a repeat
    core.serve(prompt)
    core.take_events()
    core.serve(prompt)
    assert core.take_events() == []  # block 2 again: already cached, nothing to announce
    assert len(core.pool.cached_hashes()) == 2


def test_eviction_takes_the_least_recently_used_blocks_last_block_first() -> None:
    core = EngineCore(num_blocks=12, block_size=4)
    pool = core.pool
    a, b, c = toks(100, 16), toks(200, 16), toks(300, 24)
    core.serve(a)  # blocks 0-3
    core.serve(b)  # blocks 4-7
    core.serve(a + toks(900, 3))  # touches a (and takes block 8): a is more recent than b
    assert pool.free_order() == [9, 10, 11, 7, 6, 5, 4, 8, 3, 2, 1, 0]
    core.take_events()
    core.serve(c)  # 6 blocks: 9, 10, 11 never held anything, then b's least recently used
    events = core.take_events()
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    hb = hashes_of(b, 4)
    # b freed in reverse: its last block is evicted first; the rest of b stays cached.
    assert removed == [hb[3], hb[2], hb[1]]
    assert pool.cached_hashes() >= set(hashes_of(a, 4)) | {hb[0]}
    stats = pool.stats()
    assert stats.free == 12 and stats.in_use == 0
    assert stats.cached == len(pool.cached_hashes())


def test_running_requests_keep_their_blocks_and_a_full_pool_refuses_admission() -> None:
    core = EngineCore(num_blocks=4, block_size=4)
    r = core.admit(toks(1, 12))  # 3 blocks in use
    with pytest.raises(NoFreeBlocksError):
        core.admit(toks(100, 8))  # needs 2, only 1 free
    assert core.pool.num_free == 1 and core.requests == 1  # the refusal changed nothing
    assert core.append(r, toks(50, 10)) == 4  # block 4 is the last one: decoding stops there
    core.release(r)
    assert core.pool.num_free == 4
    assert core.serve([*toks(1, 12), 9]).hit_tokens == 12


def test_pool_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="empty prompt"):
        EngineCore(8).admit([])


def test_chat_tokenization_is_the_templated_prompt_and_prompts_span_many_blocks() -> None:
    tok = tokenizer()
    req = ChatWorkload(seed=3).next()
    ids = render_chat(tok, req.messages)
    text = tok.decode(ids.tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n" + next(
        p.text for p in SYSTEM_PROMPTS if p.name == req.system))
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # Every system prompt is a few hundred tokens: many shared 16-token blocks.
    for p in SYSTEM_PROMPTS:
        n = len(render_chat(tok, [{"role": "system", "content": p.text}]))
        assert 300 <= n <= 600, (p.name, n)


def test_workload_is_deterministic_and_keys_requests_by_system_prompt() -> None:
    a = [ChatWorkload(seed=5).next() for _ in range(1)]
    w1, w2 = ChatWorkload(seed=5), ChatWorkload(seed=5)
    seq1 = [w1.next() for _ in range(50)]
    seq2 = [w2.next() for _ in range(50)]
    assert seq1 == seq2 and seq1[0] == a[0]
    hashes = w1.prefix_hashes()
    assert len(set(hashes.values())) == 5
    for r in seq1:
        key = request_prefix_key(r.body)
        assert key is not None and prefix_hash(key) == r.prefix_hash == hashes[r.system]
    assert len({r.system for r in seq1}) >= 3 and len({r.user for r in seq1}) >= 30
    with pytest.raises(ValueError):
        ChatWorkload(k=0)


async def test_engine_publishes_real_frames_that_decode_to_the_chain() -> None:
    async with SimEngine("vllm-1", tokenizer(), num_blocks=128) as engine:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(engine.endpoint)
            await engine.publisher.wait_for_subscriber()
            req = ChatWorkload(seed=1).next()
            first = engine.serve(req.messages, output_tokens=20)
            second = engine.serve(req.messages, output_tokens=20)
            prompt = render_chat(tokenizer(), req.messages)
            assert first.hit_tokens == 0 and first.prompt_tokens == len(prompt)
            assert second.hit_tokens == (len(prompt) - 1) // 16 * 16
            frames = [await sub.recv_multipart() for _ in range(engine.batches)]
        finally:
            sub.close(linger=0)
            ctx.term()
    seqs = []
    stored: list[BlockStored] = []
    for raw in frames:
        _, seq, payload = parse_event_frames(raw)
        seqs.append(seq)
        stored += [e for e in decode_zmq_payload(Engine.VLLM, payload).batch.events
                   if isinstance(e, BlockStored)]
    assert seqs == list(range(len(frames)))
    # The first request announced its prompt's whole blocks from the root, then its output
    # blocks as their continuation; every event names its parent, so the chain is connected.
    chain = [h for e in stored for h in e.block_hashes]
    expected = [wire_hash(d) for d in chain_digests(prompt, 16)]
    assert chain[: len(expected)] == expected
    assert stored[0].parent_hash is None and stored[1].parent_hash == expected[-1]
    announced: set[int] = set()
    for ev in stored:
        assert ev.parent_hash is None or ev.parent_hash in announced
        announced.update(ev.block_hashes)
    assert sum(len(e.token_ids) for e in stored) == 16 * len(chain)
