"""A simulated vLLM engine: automatic prefix caching over a fixed block pool, publishing its
KV-cache events on the real wire (the demo's engines, and tests that want real event streams).

Owns the engine behaviour of `shared/seeds/002` (vLLM V1 prefix caching, `vllm/v1/core/
block_pool.py` and `kv_cache_manager.py`, 0.10 .. 0.33), reduced to what produces events:

- A pool of `num_blocks` blocks of `block_size` tokens, all created up front. A full block gets a
  chained hash: `sha256(parent_digest ++ token_ids as u32 LE)`, the first block's parent being a
  fixed `NONE_HASH` (vLLM's with PYTHONHASHSEED set, so every engine of a fleet hashes alike).
  On the wire the hash is the digest's low 64 bits, as vLLM >= 0.10.2 sends it.
- A new request looks up the longest run of its full prompt blocks in the cache; the hit is
  capped so that the prompt's last token is always computed (vLLM recomputes it to get logits).
  The hit blocks are *touched* (reference count + 1, out of the free queue), then new blocks are
  popped from the free queue's head; a popped block that still holds a cached hash is evicted
  (`BlockRemoved`, medium `GPU`). Newly full blocks are cached at once (so concurrent requests
  share them) and announced in one `BlockStored` per step (parent hash, their tokens,
  block size, medium `GPU`).
- A request may carry a `cache_salt` (vLLM >= 0.9's request field): it is hashed into the
  chain's first block (so a salted prompt shares no block with the same unsalted prompt) and
  announced on the chain's root `BlockStored` (the model's `cache_salt`; on vLLM's wire it moves
  to the root block's `extra_keys`, see `SimEngine`).
- Decoding appends output tokens; blocks that fill up are cached and announced the same way (the
  last sampled token has no KV yet, so it never fills a block).
- A finished request frees its blocks in reverse order onto the free queue's tail: a request's
  last blocks (the least shareable) are evicted first, and a parent is always evicted after its
  children. That is the LRU order of the seed's example.

One deliberate simplification: vLLM keeps two blocks with one hash when two requests computed the
same content before either was cached; here a newly full block whose hash is already cached stays
uncached and unannounced. With prefix lookups at admission and caching at allocation that case
does not arise in the demo's workload (a child is never more recent than its parent).

`BlockPool` and `EngineCore` are pure (no I/O, no clock); `SimEngine` adds the tokenizer, a
`SimPublisher` (ZMQ, vLLM's frames and replay) and a simple timing model for the demo.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import msgspec

from kv_listener.core.model import MEDIUM_GPU, BlockRemoved, BlockStored, KvEvent
from kv_listener.sim.encode import encode_sglang_batch, encode_vllm_batch
from kv_listener.sim.lifecycle import AsyncLifecycle
from kv_listener.sim.publisher import SimPublisher

#: vLLM's default block size (tokens per KV block).
DEFAULT_BLOCK_SIZE = 16
#: The parent digest of a chain's first block. vLLM derives it from PYTHONHASHSEED when set (else
#: random per process); a fixed value makes every simulated engine hash identical prompts alike.
NONE_HASH = hashlib.sha256(b"continuum-kv-listener sim NONE_HASH").digest()
#: vLLM release whose wire layout the engine publishes (map-encoded events).
WIRE_VERSION = "0.33"
#: The ZMQ engines' current release layouts (SGLang 0.5.22+: map-encoded, `cache_salt` field).
WIRE_VERSIONS = {"vllm": WIRE_VERSION, "sglang": "0.5.23"}

ZmqWire = Literal["vllm", "sglang"]
#: Takes the events of one engine step instead of the ZMQ publisher (a TRT-LLM engine's queue).
EventSink = Callable[[list[KvEvent]], None]


def block_digest(parent: bytes, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """The chained hash of one full block: sha256(parent digest ++ token IDs as u32 LE), with
    the request's cache salt appended for a chain's first block (vLLM hashes it in as an extra
    key of block 0 only)."""
    extra = b"" if salt is None else b"\x00salt\x00" + salt.encode("utf-8")
    return hashlib.sha256(parent + array("I", tokens).tobytes() + extra).digest()


def wire_hash(digest: bytes) -> int:
    """The hash vLLM >= 0.10.2 puts on the wire: the digest's low 64 bits, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def chain_digests(tokens: Sequence[int], block_size: int, *, start: int = 0,
                  parent: bytes = NONE_HASH, salt: str | None = None) -> list[bytes]:
    """Digests of the full blocks of `tokens` from block index `start` on; `parent` is the digest
    of block `start - 1` (NONE_HASH for the first block); `salt` goes into block 0's digest."""
    out: list[bytes] = []
    for i in range(start, len(tokens) // block_size):
        parent = block_digest(parent, tokens[i * block_size:(i + 1) * block_size],
                              salt if i == 0 else None)
        out.append(parent)
    return out


class NoFreeBlocksError(Exception):
    """Not enough free (or evictable) blocks for a request right now; retry when one finishes."""


class KvBlock:
    """One block of the pool. `digest` is set while the block is cached (full and hashed)."""

    __slots__ = ("block_id", "digest", "hash", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.digest: bytes | None = None
        self.hash: int | None = None  # wire hash of `digest`
        self.ref_cnt = 0


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    free: int  # blocks in the free queue (cached or not)
    cached: int  # blocks holding a cached hash (in use or free)
    in_use: int  # blocks referenced by a running request
    stored: int  # blocks announced with BlockStored so far
    evicted: int  # cached blocks evicted (BlockRemoved) so far


class BlockPool:
    """The block pool, its free queue (LRU order, head = next to evict) and the cache map."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KvBlock(i) for i in range(num_blocks)]
        # An OrderedDict is the doubly linked free list: O(1) pop at the head, append at the
        # tail, and removal from the middle (a touched cached block).
        self._free: OrderedDict[int, KvBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KvBlock] = {}  # wire hash -> block
        self._events: list[KvEvent] = []
        self._stored = 0
        self._evicted = 0

    # --- queries ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_order(self) -> list[int]:
        """Block IDs of the free queue, head (next to evict) first."""
        return list(self._free)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def is_cached(self, digest: bytes) -> bool:
        return wire_hash(digest) in self._cached

    def stats(self) -> PoolStats:
        return PoolStats(num_blocks=self.num_blocks, free=len(self._free),
                         cached=len(self._cached),
                         in_use=sum(1 for b in self.blocks if b.ref_cnt > 0),
                         stored=self._stored, evicted=self._evicted)

    # --- operations ---------------------------------------------------------------------

    def lookup(self, digests: Sequence[bytes]) -> list[KvBlock]:
        """The cached blocks of the longest cached run of `digests` from the first."""
        hits: list[KvBlock] = []
        for d in digests:
            block = self._cached.get(wire_hash(d))
            if block is None or block.digest != d:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Sequence[KvBlock]) -> None:
        """A request uses these cached blocks: they must not be evicted while it runs."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KvBlock]:
        """Pop `n` blocks from the free queue's head, evicting cached ones (BlockRemoved)."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"{n} blocks wanted, {len(self._free)} free")
        out: list[KvBlock] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.hash is not None:
                del self._cached[block.hash]
                # vLLM emits one BlockRemoved per evicted block (block_pool.py).
                self._events.append(BlockRemoved(block_hashes=(block.hash,), medium=MEDIUM_GPU))
                self._evicted += 1
                block.digest = block.hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def cache_full_blocks(self, blocks: Sequence[KvBlock], digests: Sequence[bytes],
                          parent: bytes | None, tokens: Sequence[int],
                          cache_salt: str | None = None) -> None:
        """Cache `blocks` (newly full, in chain order) under `digests` and announce them in one
        BlockStored; `parent` is the digest of the block before the first (None: chain root),
        `tokens` their tokens (len(blocks) * block_size). `cache_salt` is announced on a root
        event only (engines echo it on the chain's first block)."""
        assert len(blocks) == len(digests) and len(tokens) == len(blocks) * self.block_size
        hashes: list[int] = []
        kept_tokens = array("I")
        for i, (block, digest) in enumerate(zip(blocks, digests, strict=True)):
            h = wire_hash(digest)
            if h in self._cached:
                # Already cached by another block (see the module docstring): keep this one
                # uncached; a later block of the chain cannot be announced without it.
                break
            block.digest, block.hash = digest, h
            self._cached[h] = block
            hashes.append(h)
            kept_tokens.extend(tokens[i * self.block_size:(i + 1) * self.block_size])
        if hashes:
            self._events.append(BlockStored(
                block_hashes=tuple(hashes),
                parent_hash=wire_hash(parent) if parent is not None else None,
                token_ids=kept_tokens, block_size=self.block_size, medium=MEDIUM_GPU,
                cache_salt=cache_salt if parent is None else None))
            self._stored += len(hashes)

    def free(self, blocks: Sequence[KvBlock]) -> None:
        """Release a request's blocks: in reverse order onto the free queue's tail."""
        for b in reversed(blocks):
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def reset(self) -> None:
        """Drop every cached hash (vLLM `reset_prefix_cache`); only when nothing runs."""
        if any(b.ref_cnt for b in self.blocks):
            raise RuntimeError("reset with running requests")
        for b in self.blocks:
            b.digest = b.hash = None
        self._cached.clear()

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events


@dataclass(frozen=True, slots=True)
class ServeResult:
    """What one request cost: `hit_tokens` of `prompt_tokens` came from the prefix cache."""

    request_id: int
    prompt_tokens: int
    hit_tokens: int
    output_tokens: int


class RunningRequest:
    __slots__ = ("blocks", "cache_salt", "decoded", "digests", "hit_tokens", "prompt_len",
                 "request_id", "tokens")

    def __init__(self, request_id: int, tokens: array[int], blocks: list[KvBlock],
                 digests: list[bytes], hit_tokens: int, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.blocks = blocks  # block table, in order
        self.digests = digests  # digests of the request's cached (full) blocks, in order
        self.hit_tokens = hit_tokens
        self.decoded = 0  # output tokens appended so far
        self.cache_salt = cache_salt


class EngineCore:
    """Request admission and completion over a `BlockPool` (vLLM's KV cache manager, reduced)."""

    def __init__(self, num_blocks: int = 512, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self._ids = itertools.count(1)
        self.requests = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def admit(self, prompt: Sequence[int], cache_salt: str | None = None) -> RunningRequest:
        """Look up the prompt's cached prefix, allocate the rest, cache its full blocks.
        Raises NoFreeBlocksError (nothing changed) when the pool cannot hold it now."""
        if not prompt:
            raise ValueError("empty prompt")
        bs = self.block_size
        tokens = array("I", prompt)
        digests = chain_digests(tokens, bs, salt=cache_salt)
        # vLLM: the last prompt token is always computed, so a whole-prompt hit is cut by a block.
        hits = self.pool.lookup(digests[: (len(tokens) - 1) // bs])
        needed = self._blocks_for(len(tokens)) - len(hits)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if needed > self.pool.num_free - evictable_hits:
            raise NoFreeBlocksError(f"prompt needs {needed} new blocks")
        self.pool.touch(hits)
        new = self.pool.allocate(needed)
        blocks = hits + new
        n_full = len(digests)
        start = len(hits)
        self.pool.cache_full_blocks(blocks[start:n_full], digests[start:n_full],
                                    digests[start - 1] if start else None,
                                    tokens[start * bs:n_full * bs], cache_salt)
        req = RunningRequest(next(self._ids), tokens, blocks, digests, len(hits) * bs,
                             cache_salt)
        self.requests += 1
        self.prompt_tokens += len(tokens)
        self.hit_tokens += req.hit_tokens
        return req

    def append(self, req: RunningRequest, output: Sequence[int]) -> int:
        """One decode step (or several): append sampled `output` tokens, allocating blocks as
        needed and caching the blocks that fill up. Returns the tokens appended: a pool too full
        for another block ends decoding early (vLLM would preempt; the demo only needs the cache
        to stay consistent)."""
        bs = self.block_size
        done = 0
        for tok in output:
            if len(req.tokens) == len(req.blocks) * bs:
                try:
                    req.blocks.extend(self.pool.allocate(1))
                except NoFreeBlocksError:
                    break
            req.tokens.append(tok)
            done += 1
        req.decoded += done
        # The last sampled token has no KV yet: only the tokens before it can fill a block.
        computed = len(req.tokens) - 1 if req.decoded else len(req.tokens)
        start = len(req.digests)
        if computed // bs > start:
            parent = req.digests[-1] if req.digests else None
            more = chain_digests(req.tokens[:computed], bs, start=start,
                                 parent=parent if parent is not None else NONE_HASH,
                                 salt=req.cache_salt)
            self.pool.cache_full_blocks(req.blocks[start:start + len(more)], more, parent,
                                        req.tokens[start * bs:(start + len(more)) * bs],
                                        req.cache_salt)
            req.digests.extend(more)
        return done

    def release(self, req: RunningRequest) -> None:
        """The request finished: free its blocks (reverse order, see BlockPool.free)."""
        self.pool.free(req.blocks)
        req.blocks = []

    def finish(self, req: RunningRequest, output: Sequence[int]) -> int:
        """Decode `output`, then release the request; returns the tokens decoded."""
        done = self.append(req, output)
        self.release(req)
        return done

    def serve(self, prompt: Sequence[int], output: Sequence[int] = ()) -> ServeResult:
        """Admit, decode and finish one request at once."""
        req = self.admit(prompt)
        done = self.finish(req, output)
        return ServeResult(req.request_id, req.prompt_len, req.hit_tokens, done)

    def take_events(self) -> list[KvEvent]:
        return self.pool.take_events()


# --- the engine process of the demo ------------------------------------------------------------


def _vllm_salted(event: KvEvent) -> KvEvent:
    """vLLM (>= 0.17, §2.6) carries a request's cache salt in the root block's `extra_keys`
    entry, not in a field of its own."""
    if not isinstance(event, BlockStored) or event.cache_salt is None:
        return event
    rest = (None,) * (len(event.block_hashes) - 1)
    return msgspec.structs.replace(event, cache_salt=None,
                                   extra_keys=((event.cache_salt,), *rest))


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> array[int]:
    """Token IDs of a chat request as vLLM's chat endpoint builds them: the tokenizer's chat
    template with the generation prompt, then tokenized without adding special tokens again."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return array("I", ids)


@dataclass(frozen=True, slots=True)
class Timing:
    """How long a simulated request takes: a fixed step overhead, prefill of the tokens not
    served from the cache, and one decode step per output token."""

    overhead_s: float = 0.005
    prefill_s_per_token: float = 0.0003
    decode_s_per_token: float = 0.003

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.overhead_s + uncached_tokens * self.prefill_s_per_token

    def decode_s(self, output_tokens: int) -> float:
        return output_tokens * self.decode_s_per_token


class SimEngine(AsyncLifecycle):
    """One simulated vLLM instance: chat tokenization, the block pool, and a ZMQ publisher that
    sends one event batch per scheduling step (vLLM 0.33 map encoding, replay buffer served).

    `endpoint` defaults to an ephemeral port the engine binds (read `endpoint` back after
    `start()`); with `mode="connect"` the engine connects to a listener that bound it (vLLM's
    `tcp://host:port` form). The replay ROUTER always binds, by default on an ephemeral port.
    `topic` is the first frame of every message. `wire="sglang"` publishes SGLang's layout
    instead (`wire_version` picks a release; default the current one of `WIRE_VERSIONS`). With a
    `sink` the steps' events go there instead and no socket is opened (a TRT-LLM engine).
    `generate()` runs a request with simulated time and at most `max_num_seqs` at once;
    `serve()` runs one synchronously.
    """

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        *,
        num_blocks: int = 512,
        block_size: int = DEFAULT_BLOCK_SIZE,
        endpoint: str = "tcp://127.0.0.1:0",
        mode: Literal["bind", "connect"] = "bind",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "",
        wire: ZmqWire = "vllm",
        wire_version: str | None = None,
        sink: EventSink | None = None,
        max_num_seqs: int = 16,
        timing: Timing | None = None,
        seed: int = 0,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.core = EngineCore(num_blocks, block_size)
        self.publisher = SimPublisher(endpoint, mode=mode, replay_endpoint=replay_endpoint,
                                      topic=topic)
        self.wire: ZmqWire = wire
        self.wire_version = wire_version or WIRE_VERSIONS[wire]
        self.sink = sink
        self.timing = timing or Timing()
        self.max_num_seqs = max_num_seqs
        self.running = 0
        self.batches = 0  # event batches published
        self._rng = random.Random(seed)  # noqa: S311 - simulated output tokens, not secrets
        self._vocab = len(tokenizer)
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._freed = asyncio.Condition()

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    async def start(self) -> Self:
        if self.sink is None:
            await self.publisher.start()
        return self

    async def close(self) -> None:
        await self.publisher.close()

    def tokenize(self, messages: Sequence[Mapping[str, Any]]) -> array[int]:
        return render_chat(self.tokenizer, messages)

    def sample_output(self, n: int) -> list[int]:
        """`n` simulated output tokens (IDs past the special tokens)."""
        return [self._rng.randrange(3, self._vocab) for _ in range(n)]

    def publish_step(self) -> int | None:
        """Publish the events of the last step as one batch; None when there were none."""
        events = self.core.take_events()
        if not events:
            return None
        self.batches += 1
        if self.sink is not None:
            self.sink(events)
            return None
        if self.wire == "sglang":
            payload = encode_sglang_batch(events, ts=time.time(), version=self.wire_version)
        else:
            payload = encode_vllm_batch([_vllm_salted(e) for e in events], ts=time.time(),
                                        version=self.wire_version)
        return self.publisher.publish(payload)

    def serve(self, messages: Sequence[Mapping[str, Any]], output_tokens: int = 0) -> ServeResult:
        """Run one request at once (no simulated time); publishes its events."""
        result = self.core.serve(self.tokenize(messages), self.sample_output(output_tokens))
        self.publish_step()
        return result

    async def generate(self, messages: Sequence[Mapping[str, Any]],
                       output_tokens: int) -> ServeResult:
        """Run one request the way a busy engine does: wait for a sequence slot and for blocks,
        prefill (time grows with the tokens not served from the cache), decode, finish. Events
        are published at admission and at the end."""
        prompt = self.tokenize(messages)
        async with self._slots:
            while True:
                try:
                    req = self.core.admit(prompt)
                    break
                except NoFreeBlocksError:
                    async with self._freed:
                        await self._freed.wait()
            self.running += 1
            output: list[int] = []
            try:
                self.publish_step()
                await asyncio.sleep(self.timing.prefill_s(req.prompt_len - req.hit_tokens))
                output = self.sample_output(output_tokens)
                await asyncio.sleep(self.timing.decode_s(len(output)))
            finally:
                done = self.core.finish(req, output)
                self.publish_step()
                self.running -= 1
                async with self._freed:
                    self._freed.notify_all()
        return ServeResult(req.request_id, req.prompt_len, req.hit_tokens, done)
