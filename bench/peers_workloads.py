"""The frames of the peers benchmark (`bench/peers.py`): built once per run, replayed byte for byte.

Every stream is a list of vLLM 0.33 map-encoded `KVEventBatch` payloads (`kv_listener.sim.encode`,
the encoding Dynamo's standalone indexer reads) split into phases, and every phase ends with a
*marker*: a salted single-block chain root whose 16 token IDs appear nowhere else. A consumer
has applied a phase when its marker is there: Dynamo's `POST /query` with the marker's tokens
scores it, our daemon's SSE stream carries the `cache_created` of the marker's prefix (both apply
a source's batches in order, so the last one applied means every one before it was).

- `salted_chains`: every stored block is the root of a new chain with its own valid
  `cache_salt` (so our daemon needs no `/detokenize`), `per_frame` of them per frame, the oldest
  evicted first once `live` are cached (one `BlockRemoved` per frame, before the stores, as an
  engine frees blocks before it fills them). Each chain has its own tokens: Dynamo keys its
  radix tree on a hash of the tokens (not on the engine's block hash), so identical tokens would
  fold every chain into one node. The marker is the phase's last block.
- `chat_streams`: a prefix-caching engine (`sim.engine.EngineCore`, vLLM's LRU: a request's last
  blocks go first, a parent after its children, which Dynamo needs since it removes a block's
  whole subtree) serving multi-turn conversations of the demo's ChatML tokenizer: `prompts`
  system prompts of Zipf popularity shared by many users, 1-4 turns each (a turn's prompt is the
  whole history), `step_requests` requests per engine step (one frame per step). Built once, then
  encoded twice with identical hashes and tokens: salted (the first block of every chain root
  carries its system prompt's `cache_salt`) and unsalted (our daemon resolves the prompts through
  `/detokenize`). A marker frame closes each phase.
- `memory_chunks`: salted chains of `chain_blocks` blocks (1: every block a prefix of its own)
  without eviction, in chunks whose last chain is the marker; the memory figures are read at
  given totals.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_listener.core.model import BlockRemoved, BlockStored, KvEvent
from kv_listener.core.salt import issue_cache_salt
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.engine import EngineCore, NoFreeBlocksError
from kv_listener.sim.workload import SYSTEM_PROMPTS

BLOCK = 16
BACKEND = "vllm-1"
MODEL = "bench-model"
SECRET = b"bench-secret"
WIRE_VERSION = "0.33"
TS = 1_796_000_000.0  # a fixed batch timestamp: the bytes of a run do not depend on the clock
#: Token IDs of markers start here: above every workload's tokens (salted chains reach 16 x the
#: block count, the chat vocabulary is 896), so a marker's tokens are found by Dynamo only once
#: the marker itself is applied.
MARKER_TOKEN_BASE = 1_000_000_000
SALTED_TOKEN_BASE = 1000


@dataclass(frozen=True, slots=True)
class Marker:
    tokens: tuple[int, ...]  # its chain's token IDs: what Dynamo's /query looks up
    prefix_hash: str  # hex of the key its salt carries: our daemon's cache_created record


@dataclass(slots=True)
class Phase:
    frames: list[bytes] = field(default_factory=list)
    blocks: int = 0  # blocks stored by these frames (markers included)
    stored_events: int = 0  # BlockStored events on the wire (Dynamo counts these)
    removed_events: int = 0  # BlockRemoved events on the wire
    removed_blocks: int = 0
    marker: Marker | None = None

    def add(self, events: Sequence[KvEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self.stored_events += 1
                self.blocks += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.removed_events += 1
                self.removed_blocks += len(ev.block_hashes)
        self.frames.append(encode_vllm_batch(events, ts=TS, version=WIRE_VERSION))

    @property
    def bytes(self) -> int:
        return sum(map(len, self.frames))

    def summary(self) -> dict[str, Any]:
        return {"frames": len(self.frames), "blocks": self.blocks, "bytes": self.bytes,
                "stored_events": self.stored_events, "removed_events": self.removed_events,
                "removed_blocks": self.removed_blocks}


@dataclass(frozen=True, slots=True)
class Stream:
    name: str
    title: str
    warmup: Phase
    timed: Phase
    salted: bool  # False: our daemon resolves through /detokenize
    info: dict[str, Any] = field(default_factory=dict)


def salted_root(key: bytes, tokens: array[int],
                block_hashes: tuple[int, ...]) -> tuple[BlockStored, Marker]:
    """A chain root whose first block carries a valid `cache_salt` for `key` (SPEC §3), and the
    chain as a marker (Dynamo's /query matches a chain from its root: all its tokens)."""
    salt = issue_cache_salt(SECRET, BACKEND, key)
    extra = ((salt,), *([None] * (len(block_hashes) - 1)))
    ev = BlockStored(block_hashes=block_hashes, parent_hash=None, token_ids=tokens,
                     block_size=BLOCK, medium="GPU", extra_keys=extra)
    return ev, Marker(tuple(tokens), key.hex())


class SaltedChains:
    """Salted chains of `chain_blocks` blocks (one `BlockStored` each: its first block carries the
    salt), each with its own key and tokens; evicts the oldest chains, leaf first, beyond `live`
    cached blocks (None: never)."""

    def __init__(self, live: int | None, *, per_frame: int = 50, chain_blocks: int = 1,
                 seed: int = 1) -> None:
        self.rng = random.Random(seed)  # reproducible block hashes, not secrets
        self.live = live
        self.per_frame = per_frame
        self.chain_blocks = chain_blocks
        self.cached: deque[tuple[int, ...]] = deque()  # block hashes of each chain, oldest first
        self.cached_blocks = 0
        self.n = 0  # chains made
        self.blocks = 0  # blocks made (token IDs are unique per block)

    def chain(self, n_blocks: int) -> tuple[BlockStored, Marker]:
        key = hashlib.sha256(b"%s\x00Speers system prompt %d" % (MODEL.encode(), self.n)).digest()
        self.n += 1
        start = SALTED_TOKEN_BASE + self.blocks * BLOCK
        self.blocks += n_blocks
        tokens = array("I", range(start, start + n_blocks * BLOCK))
        hashes = tuple(self.rng.getrandbits(64) for _ in range(n_blocks))
        self.cached.append(hashes)
        self.cached_blocks += n_blocks
        return salted_root(key, tokens, hashes)

    def phase(self, n_blocks: int) -> Phase:
        phase = Phase()
        while phase.blocks < n_blocks:
            stores: list[KvEvent] = []
            in_frame = 0
            while in_frame < self.per_frame and phase.blocks + in_frame < n_blocks:
                n = min(self.chain_blocks, n_blocks - phase.blocks - in_frame)
                ev, phase.marker = self.chain(n)
                stores.append(ev)
                in_frame += n
            old: list[int] = []
            while self.live is not None and self.cached_blocks > self.live:
                hashes = self.cached.popleft()
                old.extend(reversed(hashes))  # leaf first, as vLLM frees them
                self.cached_blocks -= len(hashes)
            evictions: list[KvEvent] = [BlockRemoved(block_hashes=tuple(old), medium="GPU")]
            phase.add((evictions if old else []) + stores)
        return phase


def salted_chains(live: int, timed: int, per_frame: int) -> Stream:
    gen = SaltedChains(live, per_frame=per_frame)
    warmup = gen.phase(live)
    timed_phase = gen.phase(timed)
    return Stream("salted", f"salted single-block chains ({per_frame} per frame, {live:,} live, "
                  f"{timed:,} timed)", warmup, timed_phase, salted=True)


@dataclass(slots=True)
class MemoryChunk:
    frames: list[bytes]
    total_blocks: int  # blocks stored once this chunk is applied
    marker: Marker
    stored_events: int  # BlockStored events published up to this chunk, included


def memory_chunks(total: int, chunk_blocks: int, chain_blocks: int = 1,
                  per_frame: int = 50) -> list[MemoryChunk]:
    gen = SaltedChains(None, per_frame=per_frame, chain_blocks=chain_blocks, seed=2)
    out: list[MemoryChunk] = []
    done = events = 0
    while done < total:
        phase = gen.phase(min(chunk_blocks, total - done))
        done += phase.blocks
        events += phase.stored_events
        assert phase.marker is not None
        out.append(MemoryChunk(phase.frames, done, phase.marker, events))
    return out


# --- the chat workload ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Session:
    prompt: int  # index into the system prompts
    turns_left: int
    tokens: list[int]  # the conversation so far (history of the next turn's prompt)


@dataclass(slots=True)
class _Step:
    """One engine step's events, with the system prompt behind each chain root stored."""

    events: list[KvEvent]
    root_prompt: dict[int, int]  # index in events of a root BlockStored -> its prompt


class ChatEngine:
    """Runs the conversations on an `EngineCore` and records each step's events."""

    def __init__(self, tokenizer: Any, *, pool_blocks: int, prompts: int, step_requests: int,
                 sessions: int = 64, seed: int = 7) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)  # a reproducible workload
        self.core = EngineCore(num_blocks=pool_blocks, block_size=BLOCK)
        self.step_requests = step_requests
        self.vocab = len(tokenizer)
        self.im_end, self.newline = self._ids("<|im_end|>\n")
        self.assistant = self._ids("<|im_start|>assistant\n")
        base = [p.text for p in SYSTEM_PROMPTS]
        # A distinct first block per prompt: chains of different prompts never share a block,
        # so salted and unsalted frames have the same hashes.
        self.system_texts = [f"[assistant {i}] {base[i % len(base)]}" for i in range(prompts)]
        self.system_ids = [self._ids(f"<|im_start|>system\n{t}<|im_end|>\n")
                           for t in self.system_texts]
        self.weights = [1.0 / (i + 1) ** 1.1 for i in range(prompts)]
        self.sessions = [self._new_session() for _ in range(sessions)]
        self.requests = 0

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _new_session(self) -> _Session:
        p = self.rng.choices(range(len(self.system_ids)), weights=self.weights)[0]
        return _Session(p, self.rng.choice((1, 1, 2, 3, 4)), list(self.system_ids[p]))

    def _user(self) -> list[int]:
        n = self.rng.randrange(100_000)
        text = f"Hi, this is user {n}. Question {self.rng.randrange(1000)}: what about item {n % 97}?"
        return self._ids(f"<|im_start|>user\n{text}<|im_end|>\n")

    def step(self) -> _Step:
        """`step_requests` sessions take a turn: admitted together (prefill), decoded, finished."""
        core = self.core
        events: list[KvEvent] = []
        roots: dict[int, int] = {}

        def take(prompt: int) -> None:
            for ev in core.take_events():
                if isinstance(ev, BlockStored) and ev.parent_hash is None:
                    roots[len(events)] = prompt
                events.append(ev)

        picked = self.rng.sample(range(len(self.sessions)), self.step_requests)
        running = []
        for i in picked:
            s = self.sessions[i]
            prompt = s.tokens + self._user() + self.assistant
            try:
                req = core.admit(prompt)
            except NoFreeBlocksError:  # the pool is smaller than this step's prompts
                take(s.prompt)
                continue
            take(s.prompt)
            running.append((i, req))
        for i, req in running:
            s = self.sessions[i]
            output = [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randrange(16, 256))]
            core.finish(req, output)
            take(s.prompt)
            s.tokens = [*req.tokens, self.im_end, self.newline]
            s.turns_left -= 1
            if s.turns_left == 0:
                self.sessions[i] = self._new_session()
            self.requests += 1
        return _Step(events, roots)


def _salted_events(step: _Step, salts: Sequence[str]) -> list[KvEvent]:
    out = list(step.events)
    for i, p in step.root_prompt.items():
        ev = out[i]
        assert isinstance(ev, BlockStored)
        extra = ((salts[p],), *([None] * (len(ev.block_hashes) - 1)))
        # built anew, not copied: the model's types are changing (dataclass -> struct)
        out[i] = BlockStored(block_hashes=ev.block_hashes, parent_hash=None,
                             token_ids=ev.token_ids, block_size=ev.block_size, medium=ev.medium,
                             extra_keys=extra)
    return out


def _marker(k: int) -> tuple[BlockStored, Marker]:
    key = hashlib.sha256(b"peers marker %d" % k).digest()
    start = MARKER_TOKEN_BASE + k * BLOCK
    h = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
    return salted_root(key, array("I", range(start, start + BLOCK)), (h,))


def chat_streams(tokenizer: Any, *, pool_blocks: int, timed: int, prompts: int = 64,
                 step_requests: int = 8) -> tuple[Stream, Stream]:
    """(salted, unsalted): the same conversations; warm-up until the pool first evicts."""
    engine = ChatEngine(tokenizer, pool_blocks=pool_blocks, prompts=prompts,
                        step_requests=step_requests)
    keys = [hashlib.sha256(b"%s\x00S%s" % (MODEL.encode(), t.encode())).digest()
            for t in engine.system_texts]
    salts = [issue_cache_salt(SECRET, BACKEND, k) for k in keys]
    phases = {True: (Phase(), Phase()), False: (Phase(), Phase())}
    warm = True
    warmup_requests = 0
    while True:
        step = engine.step()
        if warm and engine.core.pool.stats().evicted > 0:  # the first eviction starts the clock
            warm = False
            warmup_requests = engine.requests
        idx = 0 if warm else 1
        if step.events:
            phases[True][idx].add(_salted_events(step, salts))
            phases[False][idx].add(step.events)
        if not warm and phases[True][1].blocks >= timed:
            break
    for k, (salted, unsalted) in enumerate(zip(phases[True], phases[False], strict=True)):
        ev, marker = _marker(k)
        for ph in (salted, unsalted):
            ph.add([ev])
            ph.marker = marker
    stats = engine.core.pool.stats()
    info = {"requests": engine.requests, "warmup_requests": warmup_requests, "prompts": prompts,
            "pool_blocks": pool_blocks, "evicted_blocks": stats.evicted,
            "step_requests": step_requests}
    title = (f"chat: {prompts} shared system prompts, multi-turn, {step_requests} requests per "
             f"frame, LRU pool of {pool_blocks:,} blocks, {phases[True][1].blocks:,} timed")
    return (Stream("chat", title, *phases[True], salted=True, info=info),
            Stream("resolver", title.replace("chat:", "chat without cache_salt (resolver path):"),
                   *phases[False], salted=False, info=info))
