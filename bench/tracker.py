"""Tracker figures: memory per block and per retained token, throughput, resolve requests.

    .venv/bin/python bench/tracker.py [--users N] [--quick]

Prints:
- bytes per tracked block (tokens excluded) and per retained token, measured with tracemalloc
  with the default bounds filled (100,000 blocks of 16 tokens): everything the tracker holds
  (records, hash and length ints, the hash index, keys, chain objects) after the events are gone;
- blocks per second through `Tracker.apply`: salted chains (the no-detokenize fast path) and a
  chat workload with an engine that evicts (LRU) and a resolver answering after every batch;
- resolve requests per distinct prefix for that chat workload (many users, few system
  prompts), with a synchronous stand-in resolver that parses a synthetic token layout
  (`SYS system END USER message END ASSIST reply ...`), answering with and without the
  key-determining length (`key_tokens`).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import time
import tracemalloc
from array import array
from collections import OrderedDict
from collections.abc import Callable
from functools import partial

from quiet import quiet_libraries

from kv_listener.core.limits import Limits
from kv_listener.core.model import (
    BlockRemoved,
    BlockStored,
    Engine,
    EventBatch,
    KvEvent,
    ResolveOutcome,
    ResolveRequest,
    ResolveStatus,
)
from kv_listener.core.prefix import DEFAULT_MAX_PREFIX_LENGTH, prefix_key
from kv_listener.core.salt import SaltVerifier, issue_cache_salt
from kv_listener.core.tracker import Tracker

BS = 16
SYS, USER, END, ASSIST = 1, 2, 3, 4
SECRET = b"bench-secret"
BACKEND = "vllm-1"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def block_hash(parent: int, tokens: list[int] | array[int]) -> int:
    d = hashlib.blake2b(parent.to_bytes(8, "big") + bytes(array("I", tokens)), digest_size=8)
    return int.from_bytes(d.digest(), "big")


# --- memory -----------------------------------------------------------------------------------


def traced(fill: Callable[[Tracker], None], tracker: Callable[[], Tracker]) -> tuple[int, Tracker]:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t = tracker()
        fill(t)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base, t
    finally:
        tracemalloc.stop()


def salted_fill(t: Tracker, n_blocks: int, chain_blocks: int, n_keys: int) -> None:
    salts = [issue_cache_salt(SECRET, BACKEND, hashlib.sha256(b"k%d" % i).digest())
             for i in range(n_keys)]
    c = 0
    while t.blocks_tracked < n_blocks:
        parent, first = c + 1, True
        for _ in range(min(chain_blocks, n_blocks - t.blocks_tracked)):
            toks = array("I", range(c % 50000, c % 50000 + BS))
            h = block_hash(parent, toks)
            ev = BlockStored((h,), None if first else parent, toks, BS, medium="GPU",
                             extra_keys=((salts[c % n_keys],),) if first else None)
            t.apply(EventBatch(0.0, (ev,)))
            parent, first = h, False
        c += 1


def pending_fill(t: Tracker, n_blocks: int, chain_blocks: int) -> None:
    """Chains nobody resolves: every block keeps its 16 tokens."""
    c = 0
    while t.blocks_tracked < n_blocks:
        n = min(chain_blocks, n_blocks - t.blocks_tracked)
        toks = array("I", [(c * 7919 + i) % 50000 for i in range(n * BS)])
        hashes, parent = [], c + 1
        for i in range(n):
            parent = block_hash(parent, toks[i * BS : (i + 1) * BS])
            hashes.append(parent)
        t.apply(EventBatch(0.0, (BlockStored(tuple(hashes), None, toks, BS, medium="GPU"),)))
        c += 1


def resolve_all(t: Tracker) -> None:
    """Answer every pending chain: all blocks attributed, their tokens dropped."""
    key = hashlib.sha256(b"k").digest()
    for req in t.take_resolve_requests():
        t.on_resolved(ResolveOutcome(req.head, ResolveStatus.RESOLVED, key=key), key_tokens=1)


def bench_memory(n_blocks: int) -> None:
    limits = Limits()
    mk = partial(Tracker, engine=Engine.VLLM, model=MODEL, limits=limits)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t = mk()
        pending_fill(t, n_blocks, 64)
        gc.collect()
        with_tokens = tracemalloc.get_traced_memory()[0] - base
        tokens = t.tokens_retained
        assert t.blocks_tracked == n_blocks and tokens == n_blocks * BS
        resolve_all(t)  # the same records, attributed: no tokens kept
        gc.collect()
        without = tracemalloc.get_traced_memory()[0] - base
        assert t.tokens_retained == 0 and t.blocks_tracked == n_blocks and t.pending == 0
    finally:
        tracemalloc.stop()
    verify = SaltVerifier(SECRET, BACKEND)
    salted, t2 = traced(lambda t: salted_fill(t, n_blocks, 64, 100),
                        partial(mk, salt_verifier=verify))
    assert t2.blocks_tracked == n_blocks and t2.tokens_retained == 0
    bound = min(limits.max_retained_tokens, limits.max_tracked_blocks * limits.max_chain_tokens)
    print(f"memory, {n_blocks:,} blocks of {BS} tokens (default bounds, tracemalloc):")
    print(f"  pending chains, tokens kept:   {with_tokens / 2**20:6.1f} MiB")
    print(f"  same blocks once attributed:   {without / 2**20:6.1f} MiB"
          f" = {without / n_blocks:6.1f} bytes per block (tokens excluded)")
    print(f"  difference: {(with_tokens - without) / tokens:.2f} bytes per retained token"
          f" ({tokens:,} tokens, incl. the pending chains' objects)")
    print(f"  salted chains, 100 keys:       {salted / 2**20:6.1f} MiB"
          f" = {salted / n_blocks:6.1f} bytes per block")
    print(f"  retained token memory bound: {bound * 4 / 2**20:.0f} MiB"
          f" (min(max_retained_tokens, max_tracked_blocks * max_chain_tokens) x 4)")


# --- chat workload ----------------------------------------------------------------------------


def standin_resolve(req: ResolveRequest) -> tuple[ResolveOutcome, int]:
    """The synthetic layout's parser: RESOLVED when the system (else first user) content is
    complete or has `max_prefix_length` bytes, PENDING before, UNATTRIBUTED for non-chat.
    Returns the key-determining token count too."""
    t = req.tokens
    if not t or t[0] not in (SYS, USER):
        return ResolveOutcome(req.head, ResolveStatus.UNATTRIBUTED, reason="not_chat"), 0
    rule_system = t[0] == SYS
    parts: list[str] = []
    size, end = 0, None
    for i in range(1, len(t)):
        if t[i] == END:
            end = i + 1
            break
        s = str(t[i])
        size += len(s) + (1 if parts else 0)
        parts.append(s)
        if size >= DEFAULT_MAX_PREFIX_LENGTH:
            end = i + 1
            break
    if end is None:
        return ResolveOutcome(req.head, ResolveStatus.PENDING), 0
    text = " ".join(parts)
    key = prefix_key(req.model, text if rule_system else None, None if rule_system else text)
    return ResolveOutcome(req.head, ResolveStatus.RESOLVED, key=key), end


class EngineSim:
    """An engine with prefix caching: full blocks stored once (cache hits not re-announced),
    one event per prefill and per decoded block, LRU eviction at `capacity` blocks."""

    def __init__(self, capacity: int) -> None:
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.evicted = 0

    def run(self, tokens: list[int]) -> list[KvEvent]:
        """Events of one step that processes `tokens` (prefill or one more block)."""
        events: list[KvEvent] = []
        n_full = len(tokens) // BS
        parent, start, hashes = 0, None, []
        for i in range(n_full):
            parent = block_hash(parent, tokens[i * BS : (i + 1) * BS])
            hashes.append(parent)
            if start is None and parent not in self.cache:
                start = i
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        if start is not None:
            events.append(BlockStored(tuple(hashes[start:]), hashes[start - 1] if start else None,
                                      array("I", tokens[start * BS : n_full * BS]), BS,
                                      medium="GPU"))
        while len(self.cache) > self.capacity:
            h, _ = self.cache.popitem(last=False)
            events.append(BlockRemoved((h,), medium="GPU"))
            self.evicted += 1
        return events


def bench_chat(n_users: int, n_prompts: int, hint: bool, seed: int = 7) -> None:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 50000) for _ in range(rng.choice((40, 120, 300, 800)))]
               for _ in range(n_prompts)]
    t = Tracker(engine=Engine.VLLM, model=MODEL, limits=Limits())
    engine = EngineSim(capacity=60000)
    stored = apply_s = 0.0
    n_stored = 0
    keys: set[str] = set()
    used: set[int] = set()

    def step(tokens: list[int]) -> None:
        nonlocal apply_s, n_stored
        events = engine.run(tokens)
        if not events:
            return
        n_stored += sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
        t0 = time.perf_counter()
        out = t.apply(EventBatch(0.0, tuple(events)))
        for req in t.take_resolve_requests():
            outcome, kt = standin_resolve(req)
            out += t.on_resolved(outcome, key_tokens=kt if hint else None)
        apply_s += time.perf_counter() - t0
        keys.update(x.prefix_hash for x in out if x.prefix_hash)

    for _ in range(n_users):
        p = min(int(rng.paretovariate(1.2)) - 1, n_prompts - 1)  # a few popular prompts
        used.add(p)
        convo = [SYS, *systems[p], END]
        for _turn in range(rng.choice((1, 1, 2, 3))):
            convo += [USER, *(rng.randrange(100, 50000) for _ in range(rng.randrange(10, 200))),
                      END, ASSIST]
            step(convo)  # prefill
            for _ in range(rng.randrange(20, 300)):  # decode: one event per filled block
                convo.append(rng.randrange(100, 50000))
                if len(convo) % BS == 0:
                    step(convo)
            convo.append(END)
    stored = n_stored
    s = t.stats()
    label = "with key_tokens" if hint else "without key_tokens (probes)"
    print(f"chat workload {label}: {n_users:,} users, {len(used)} distinct system prompts used")
    print(f"  resolve requests {s['resolve_requests']:,} for {len(keys)} distinct prefixes"
          f" = {s['resolve_requests'] / max(1, len(keys)):.2f} per prefix"
          f" (engine evictions {engine.evicted:,}, still pending {s['pending']})")
    print(f"  {stored:,.0f} blocks stored in {apply_s:.2f} s of tracker time"
          f" = {stored / apply_s:,.0f} blocks/s (apply + take + on_resolved)")


def bench_salted_throughput(n_blocks: int) -> None:
    verify = SaltVerifier(SECRET, BACKEND)
    t = Tracker(engine=Engine.VLLM, model=MODEL, limits=Limits(), salt_verifier=verify)
    salt = issue_cache_salt(SECRET, BACKEND, hashlib.sha256(b"k").digest())
    batches = []
    for c in range(n_blocks // 64):
        toks = array("I", [(c + i) % 50000 for i in range(64 * BS)])
        hashes, parent = [], c + 1
        for i in range(64):
            parent = block_hash(parent, toks[i * BS : (i + 1) * BS])
            hashes.append(parent)
        ev = BlockStored(tuple(hashes[:32]), None, toks[: 32 * BS], BS, medium="GPU",
                         extra_keys=((salt,),))
        ev2 = BlockStored(tuple(hashes[32:]), hashes[31], toks[32 * BS :], BS, medium="GPU")
        batches.append(EventBatch(0.0, (ev, ev2)))
    t0 = time.perf_counter()
    for b in batches:
        t.apply(b)
    dt = time.perf_counter() - t0
    print(f"salted chains (32-block events, {n_blocks:,} blocks): {n_blocks / dt:,.0f} blocks/s"
          f" ({t.stats()['pruned']:,} pruned)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=3000)
    ap.add_argument("--quick", action="store_true", help="10,000 blocks, 500 users")
    args = ap.parse_args()
    n_blocks = 10_000 if args.quick else 100_000
    users = 500 if args.quick else args.users
    bench_memory(n_blocks)
    bench_salted_throughput(2 * n_blocks)
    bench_chat(users, 30, hint=True)
    bench_chat(users, 30, hint=False)


if __name__ == "__main__":
    quiet_libraries()
    main()
