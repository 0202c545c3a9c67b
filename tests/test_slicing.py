"""`core.slicing.pieces`: a large batch applied in pieces leaves the tracker exactly where the
whole batch does (issue #11, finding 4: one source's large batch must not hold the loop), and
the daemon's pump really lets the loop run between the pieces of one batch."""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_listener.config import parse_config
from kv_listener.core.limits import Limits
from kv_listener.core.model import BlockRemoved, BlockStored, Engine, EventBatch, KvEvent
from kv_listener.core.prefix import prefix_key
from kv_listener.core.salt import issue_cache_salt, verify_cache_salt
from kv_listener.core.slicing import pieces
from kv_listener.core.tracker import Tracker
from kv_listener.outputs.streams import StreamHub
from kv_listener.runtime import SourceRuntime
from tests.support.ports import free_port

SECRET, BACKEND, BS = b"slicing-secret", "vllm-1", 4


def h(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def tracker() -> Tracker:
    return Tracker(engine=Engine.VLLM, model="m", limits=Limits(max_tracked_blocks=400),
                   salt_verifier=partial(verify_cache_salt, SECRET, BACKEND),
                   can_detokenize=False)


def chain_event(chain: int, start: int, n: int, salted: bool, masked: bool) -> BlockStored:
    hashes = tuple(h(chain, i) for i in range(start, start + n))
    parent = h(chain, start - 1) if start else None
    extra: tuple[object, ...] | None = None
    if salted and start == 0:
        salt = issue_cache_salt(SECRET, BACKEND, prefix_key("m", f"system {chain}", None))
        extra = ((salt,), *([None] * (n - 1)))
    tokens = array("I", [chain % 50 + 5] * (n * BS + (1 if masked else 0)))
    return BlockStored(block_hashes=hashes, parent_hash=parent, token_ids=tokens, block_size=BS,
                       medium="GPU", extra_keys=extra)


event = st.one_of(
    st.builds(chain_event, st.integers(0, 5), st.integers(0, 12), st.integers(1, 30),
              st.sampled_from([True, True, False]), st.sampled_from([False] * 5 + [True])),
    st.builds(lambda c, idx: BlockRemoved(tuple(h(c, i) for i in idx), "GPU"),
              st.integers(0, 5), st.lists(st.integers(0, 40), min_size=1, max_size=25)),
)


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(st.lists(event, min_size=1, max_size=8), min_size=1, max_size=6),
       size=st.integers(1, 9))
def test_pieces_reach_the_state_of_the_whole_batch(batches: list[list[KvEvent]],
                                                   size: int) -> None:
    whole, cut = tracker(), tracker()
    for seq, events in enumerate(batches):
        batch = EventBatch(1.0, tuple(events), 0, seq)
        parts = list(pieces(batch, size))
        assert all(p.seq == seq and p.dp_rank == 0 and p.ts == 1.0 for p in parts)
        whole.apply(batch)
        for p in parts:
            cut.apply(p)
        assert cut.snapshot() == whole.snapshot()
        assert cut.blocks_tracked == whole.blocks_tracked
        assert cut.tokens_retained == whole.tokens_retained


def test_a_small_batch_is_one_piece_and_a_masked_event_is_never_cut() -> None:
    small = EventBatch(0.0, (chain_event(1, 0, 3, True, False),), 0, 0)
    assert list(pieces(small, 3)) == [small]
    masked = chain_event(1, 0, 10, False, True)
    assert [p.events for p in pieces(EventBatch(0.0, (masked,)), 3)] == [(masked,)]
    with pytest.raises(ValueError):
        list(pieces(small, 0))


async def test_the_pump_lets_the_loop_run_inside_one_large_batch() -> None:
    # Before: one 60,000-block batch was applied in one go (~130-300 ms without a yield).
    cfg = parse_config({"sources": [{"backend_name": BACKEND, "engine": "vllm", "model": "m",
                                     "zmq_endpoint": f"tcp://127.0.0.1:{free_port()}"}]})
    hub = StreamHub.from_config(cfg)
    rt = SourceRuntime(cfg.sources[0], cfg, hub, SECRET)
    n = 60_000
    rt.queue.put_nowait(EventBatch(0.0, (chain_event(9, 0, n, True, False),), 0, 0))
    seen: list[int] = []  # the tracker's block count each time another task got to run

    async def probe() -> None:
        while not seen or seen[-1] < min(n, cfg.sources[0].limits.max_tracked_blocks):
            seen.append(rt.tracker.blocks_tracked)
            await asyncio.sleep(0)

    pump = asyncio.create_task(rt._pump())
    try:
        async with asyncio.timeout(20):
            await probe()
    finally:
        pump.cancel()
        hub.close()
    assert any(0 < s < seen[-1] for s in seen), "the batch was applied without a yield"
