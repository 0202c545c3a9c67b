"""Hypothesis: the tracker against an engine simulation and a reference of what must hold.

An engine with prefix caching stores random chat prompts (a few system prompts shared by many
users, salted and unsalted, plain completions), offloads blocks to CPU, evicts blocks from any
medium (also in the middle of a chain), re-announces cached prefixes, and clears. A resolver
answers the tracker's requests late, out of order, sometimes with FAILED and sometimes with the
key-determining length. Limits are tiny so pruning happens all the time. After every step:

- bounds hold (records, retained tokens);
- the transitions emitted so far, replayed from the start, equal `snapshot()`, and each one is
  legal where it occurs (CREATED only for a prefix not live, EVICTED only for a live one, ...);
- every live prefix has an attributed retained block, and its token_count / tier are those of
  the reference: the longest chain (in the engine's own token count) and the media of the
  retained blocks attributed to it;
- every attribution is sound: the block's real tokens root..block resolve to that key (or its
  chain carried that key's salt).

At the end the engine evicts everything: no prefix stays live.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from functools import partial

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_listener.core import model
from kv_listener.core.limits import Limits
from kv_listener.core.prefix import prefix_key
from kv_listener.core.salt import issue_cache_salt, verify_cache_salt
from kv_listener.core.tracker import Tracker

SYS, USER, END, ASSIST = 1, 2, 3, 4
BS = 4
SECRET = b"k"
BACKEND = "b"
# System prompts that share prefixes: 1 leaves 0 inside its content, 3 extends 0 where 0 ends
# (so they first differ at 0's END), 4 differs from 0 in its last content token.
SYSTEMS = [list(range(10, 19)), [*range(10, 16), 40, 41, 42], list(range(50, 56)),
           [*range(10, 19), 77, 78], [*range(10, 18), 99]]
MODEL = "m"


def text_of(tokens: list[int]) -> str:
    return " ".join(map(str, tokens))


def truth(tokens: tuple[int, ...]) -> tuple[model.ResolveStatus, bytes | None, int]:
    """What the synthetic chat layout says about tokens root..n: status, key, determining length."""
    if not tokens or tokens[0] not in (SYS, USER):
        return model.ResolveStatus.UNATTRIBUTED, None, 0
    if END not in tokens:
        return model.ResolveStatus.PENDING, None, 0
    end = tokens.index(END)
    text = text_of(list(tokens[1:end]))
    k = prefix_key(MODEL, text, None) if tokens[0] == SYS else prefix_key(MODEL, None, text)
    return model.ResolveStatus.RESOLVED, k, end + 1


def prompt(sys_idx: int | None, user: int, completion: bool, length: int) -> list[int]:
    if completion:
        body = [60 + user % 5, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]
    else:
        body = [] if sys_idx is None else [SYS, *SYSTEMS[sys_idx], END]
        body += [USER, 100 + user, 101, 102, END, ASSIST, 200, 201, 202, 203, 204, 205, 206]
    return body[: max(BS, length)]


@dataclass
class Sim:
    """The engine side: which hashes it holds in which media, and every block's real tokens."""

    tracker: Tracker
    held: dict[int, set[str]] = field(default_factory=dict)
    tokens_of: dict[int, tuple[int, ...]] = field(default_factory=dict)  # hash -> root..block
    salt_key: dict[int, bytes] = field(default_factory=dict)  # hash -> key of its chain's salt
    live: dict[str, tuple[int, model.Tier]] = field(default_factory=dict)  # replayed transitions
    outstanding: list[model.ResolveRequest] = field(default_factory=list)
    asked: set[int] = field(default_factory=set)  # heads with a request out (this generation)

    def send(self, *events: model.KvEvent) -> None:
        self.replay(self.tracker.apply(model.EventBatch(0.0, tuple(events))))

    def replay(self, out: list[model.PrefixTransition]) -> None:
        for t in out:
            if t.kind is model.TransitionKind.CLEARED:
                self.live.clear()
                continue
            assert t.prefix_hash is not None
            if t.kind is model.TransitionKind.EVICTED:
                assert t.prefix_hash in self.live, "evicted a prefix that was not live"
                del self.live[t.prefix_hash]
                continue
            assert t.tier is not None
            if t.kind is model.TransitionKind.CREATED:
                assert t.prefix_hash not in self.live, "created a prefix already live"
            else:
                assert t.prefix_hash in self.live, f"{t.kind} for a prefix not live"
                old = self.live[t.prefix_hash]
                if t.kind is model.TransitionKind.TIER:
                    assert old[1] is not t.tier
                else:
                    assert old[1] is t.tier and old[0] != t.token_count
            self.live[t.prefix_hash] = (t.token_count, t.tier)


def hash_chain(tokens: list[int], seed: int) -> list[int]:
    out, h = [], seed
    for i in range(0, len(tokens) - len(tokens) % BS, BS):
        d = hashlib.sha256(repr((h, tokens[i : i + BS])).encode()).digest()
        h = int.from_bytes(d[:8], "big")
        out.append(h)
    return out


store_op = st.tuples(
    st.just("store"),
    st.sampled_from([None, 0, 0, 0, 1, 2, 3, 4]),  # system prompt (mostly a shared one)
    st.integers(0, 5),  # user
    st.sampled_from([False] * 5 + [True]),  # plain completion
    st.integers(4, 32),  # tokens so far
    st.sampled_from(["none", "none", "none", "valid", "forged"]),  # salt
    st.booleans(),  # "full" report mode: re-announce from token 0
)
answer_op = st.tuples(st.just("answer"), st.integers(0, 10_000), st.booleans(),
                      st.sampled_from([False, False, False, True]))  # FAILED one time in four
take_op = st.tuples(st.just("take"))
serve_op = st.tuples(st.just("serve"), st.booleans())  # take and answer everything, correctly
remove_op = st.tuples(st.just("remove"), st.integers(0, 10_000),
                      st.sampled_from([None, "GPU", "CPU"]))
offload_op = st.tuples(st.just("offload"), st.integers(0, 10_000))
_OPS: dict[str, st.SearchStrategy[tuple[object, ...]]] = {
    "store": store_op, "take": take_op, "answer": answer_op, "serve": serve_op,
    "remove": remove_op, "offload": offload_op, "clear": st.tuples(st.just("clear")),
}
_WEIGHTS = {"store": 10, "take": 2, "answer": 3, "serve": 4, "remove": 3, "offload": 2, "clear": 1}
ops = st.lists(
    st.sampled_from([k for k, w in _WEIGHTS.items() for _ in range(w)]).flatmap(_OPS.__getitem__),
    min_size=20,
    max_size=80,
)


def salt_for(key: bytes, forged: bool) -> str:
    s = issue_cache_salt(SECRET, BACKEND, key)
    return s[:-1] + ("1" if s[-1] == "0" else "0") if forged else s


def do_store(sim: Sim, op: tuple[object, ...]) -> None:
    _, sys_idx, user, completion, length, salt, full = op
    toks = prompt(sys_idx, user, bool(completion), int(length))  # type: ignore[call-overload]
    salt_key = None
    if salt != "none" and not completion and sys_idx is not None:
        salt_key = prefix_key(MODEL, text_of(SYSTEMS[sys_idx]), None)  # type: ignore[index]
    assert salt_key is None or isinstance(salt_key, bytes)
    # engines mix the salt into the root block's hash (vLLM extra keys, SGLang seed)
    seed = 0
    if salt_key is not None:
        digest = hashlib.sha256(salt_for(salt_key, salt == "forged").encode()).digest()
        seed = int.from_bytes(digest[:8], "big")
    hs = hash_chain(toks, seed)
    for i, h in enumerate(hs):
        sim.tokens_of[h] = tuple(toks[: (i + 1) * BS])
        if salt == "valid" and salt_key is not None:
            sim.salt_key[h] = salt_key
    start = 0
    if not full:
        while start < len(hs) and "GPU" in sim.held.get(hs[start], ()):
            start += 1
        if start == len(hs):
            return
    extra = None
    if start == 0 and salt_key is not None:
        extra = ((salt_for(salt_key, salt == "forged"),),) + (None,) * (len(hs) - 1)
    ev = model.BlockStored(tuple(hs[start:]), hs[start - 1] if start else None,
                           array("I", toks[start * BS : len(hs) * BS]), BS, medium="GPU",
                           extra_keys=extra)
    for h in hs[start:]:
        sim.held.setdefault(h, set()).add("GPU")
    sim.send(ev)


def do_take(sim: Sim) -> None:
    reqs = sim.tracker.take_resolve_requests()
    heads = [r.head for r in reqs]
    assert len(set(heads)) == len(heads), "two requests for one head"
    assert not sim.asked & set(heads), "asked again for a head whose answer is still out"
    for r in reqs:
        toks = tuple(r.tokens)
        assert toks == sim.tokens_of[r.head][: len(toks)], "request tokens are not the chain's"
    sim.asked |= set(heads)
    sim.outstanding.extend(reqs)


def do_answer(sim: Sim, pick: int, hint: bool, fail: bool) -> None:
    if not sim.outstanding:
        return
    req = sim.outstanding.pop(pick % len(sim.outstanding))
    sim.asked.discard(req.head)
    if fail:
        outcome = model.ResolveOutcome(req.head, model.ResolveStatus.FAILED, reason="timeout")
        sim.replay(sim.tracker.on_resolved(outcome))
        return
    status, key, kt = truth(tuple(req.tokens))
    outcome = model.ResolveOutcome(req.head, status, key=key)
    sim.replay(sim.tracker.on_resolved(outcome, key_tokens=kt if hint else None))


def check(sim: Sim, limits: Limits) -> None:
    t = sim.tracker
    assert t.blocks_tracked <= limits.max_tracked_blocks
    assert t.tokens_retained <= limits.max_retained_tokens
    snap = t.snapshot()
    assert snap == sim.live
    assert t.prefixes_live == len(snap)
    # reference: recompute every live prefix from the retained attributed blocks
    ref: dict[str, tuple[int, bool]] = {}
    records = t.records()
    for h, rec in records.items():
        ph = getattr(rec.state, "prefix_hash", None)
        if ph is not None:  # attributed: the key's hex is all a key aggregate keeps
            assert isinstance(ph, str)
            k = bytes.fromhex(ph)
            real = sim.tokens_of[h]
            assert rec.chain_len == len(real)
            if h in sim.salt_key:
                assert sim.salt_key[h] == k
            else:
                status, key, _ = truth(real)
                assert status is model.ResolveStatus.RESOLVED and key == k, "unsound attribution"
            n, gpu = ref.get(k.hex(), (0, False))
            ref[k.hex()] = (max(n, rec.chain_len), gpu or bool(rec.media & 1))
    assert {p: (n, model.Tier.GPU_HOT if g else model.Tier.STORAGE_WARM) for p, (n, g) in ref.items()} == snap
    held = sum(len(r.tokens) for r in records.values())
    chains = {id(r.state): r.state for r in records.values() if hasattr(r.state, "tokens")}
    held += sum(len(c.tokens) for c in chains.values() if c.tokens is not None)  # type: ignore[union-attr]
    assert held == t.tokens_retained


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    script=ops,
    limits=st.sampled_from([
        Limits(max_chain_tokens=16, max_tracked_blocks=12, max_retained_tokens=40),
        Limits(max_chain_tokens=24, max_tracked_blocks=30, max_retained_tokens=64),
        Limits(max_chain_tokens=64, max_tracked_blocks=200, max_retained_tokens=10_000),
    ]),
    salted=st.booleans(),
    arena_slack=st.sampled_from([1, 16, 1 << 16]),
)
def test_tracker_matches_the_reference(
    script: list[tuple[object, ...]], limits: Limits, salted: bool, arena_slack: int
) -> None:
    t = Tracker(engine=model.Engine.VLLM, model=MODEL, limits=limits,
                salt_verifier=partial(verify_cache_salt, SECRET, BACKEND) if salted else None)
    t._arena_slack = arena_slack  # compact the token arena as often as that lets it
    sim = Sim(t)
    for op in script:
        kind = op[0]
        if kind == "store":
            do_store(sim, op)
        elif kind == "remove":
            if sim.held:
                h = sorted(sim.held)[int(op[1]) % len(sim.held)]  # type: ignore[call-overload]
                medium = op[2]
                media = sim.held[h]
                if medium is None:
                    media.clear()
                else:
                    media.discard(str(medium))
                if not media:
                    del sim.held[h]
                sim.send(model.BlockRemoved((h,), medium=None if medium is None else str(medium)))
        elif kind == "offload":
            gpu = sorted(h for h, m in sim.held.items() if "GPU" in m)
            if gpu:
                h = gpu[int(op[1]) % len(gpu)]  # type: ignore[call-overload]
                sim.held[h].add("CPU")
                sim.send(model.BlockStored((h,), None, array("I"), 0, medium="CPU"))
        elif kind == "answer":
            do_answer(sim, int(op[1]), bool(op[2]), bool(op[3]))  # type: ignore[call-overload]
        elif kind == "take":
            do_take(sim)
        elif kind == "serve":
            do_take(sim)
            while sim.outstanding:
                do_answer(sim, 0, bool(op[1]), False)
        else:
            sim.held.clear()  # answers still out may arrive later: they must be harmless
            sim.send(model.AllBlocksCleared())
        check(sim, limits)
    # the engine evicts everything that is left: nothing may stay live
    do_take(sim)
    while sim.outstanding:
        do_answer(sim, 0, True, False)
        check(sim, limits)
    sim.send(model.BlockRemoved(tuple(sorted(sim.held))))
    sim.send(model.BlockRemoved(tuple(sorted(t.records()))))  # and whatever it never told us about
    check(sim, limits)
    assert sim.live == {} and t.blocks_tracked == 0 and t.tokens_retained == 0
    assert t.pending == 0


# Chain lengths a key's counts meet: block multiples, repeats, the tracker's chain-length column
# edge (2^31 - 1), and past 2^32 (the key's dict form).
_LENGTHS = st.one_of(st.sampled_from([16, 32, 48, 64, 80, 7, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
                                      1 << 32, (1 << 40) + 16]),
                     st.integers(1, 40).map(lambda i: i * 16))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), _LENGTHS, st.booleans(), st.integers(0, 1 << 16)),
                max_size=80))
def test_key_aggregate_counts_match_a_multiset(ops: list[tuple[bool, int, bool, int]]) -> None:
    """`KeyAggregate` against a `Counter` of the (length, gpu) of its blocks: blocks, gpu and
    the longest chain after every add and every removal of a block it holds, whichever form its
    counts are in (none, a run, packed u64s, dict)."""
    _check_against_a_multiset(ops)


# A chain's blocks as (add, jump, gpu, pick): an add of jump 0 is the chain's next block, -1 a
# length it has or had, 1 or 2 a step ahead (then a repeat, or a gap), 40 one off the grid; a
# removal picks its root (0), its tail (-1) or a middle block (1, 7) of the lengths held.
_CHAIN_OPS = st.lists(st.tuples(st.booleans(), st.sampled_from([0, 0, 0, 1, 2, -1, 40]),
                                st.booleans(), st.sampled_from([0, -1, 0, -1, 1, 7])),
                      max_size=80)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([16, 4, (1 << 31) + 16]), st.integers(1, 3), _CHAIN_OPS)
def test_key_aggregate_runs_match_a_multiset(
    step: int, base_steps: int, ops: list[tuple[bool, int, bool, int]],
) -> None:
    """The run form (one block per length, base .. max_len) against a `Counter` as chains
    grow, lose their root or tail (or a middle block), meet a repeat or an off-grid length."""
    grown = base_steps
    translated: list[tuple[bool, int, bool, int]] = []
    for add, jump, gpu, pick in ops:
        if add:
            if jump == 0:
                grown += 1
                length = grown * step
            else:
                length = max(1, (grown + jump) * step + (jump == 40))
            translated.append((True, length, gpu, 0))
        else:
            translated.append((False, 0, gpu, pick))
    _check_against_a_multiset(translated)


def _check_against_a_multiset(ops: list[tuple[bool, int, bool, int]]) -> None:
    from collections import Counter  # noqa: PLC0415

    from kv_listener.core.record_state import KeyAggregate  # noqa: PLC0415

    k = KeyAggregate("ab" * 32)
    held: Counter[tuple[int, bool]] = Counter()
    for add, length, gpu, pick in ops:
        if add or not held:
            k.add(length, gpu)
            held[(length, gpu)] += 1
        else:
            items = sorted(held.elements())
            gone = items[pick % len(items)]
            k.remove(*gone)
            held[gone] -= 1
            held += Counter()  # drop the zero counts
        assert k.blocks == sum(held.values())
        assert k.gpu == sum(n for (_, g), n in held.items() if g)
        assert k.max_len == max((n for n, _ in held), default=0)
        per_len: Counter[int] = Counter()
        for (n, _), c in held.items():
            per_len[n] += c
        assert _counts_of(k) == dict(per_len)


def _counts_of(k: object) -> dict[int, int]:
    """A `KeyAggregate`'s blocks per chain length, whichever form it holds them in."""
    lengths = getattr(k, "lengths")  # noqa: B009 (typed loosely: a compiled class)
    if lengths is None:
        step = k.step  # type: ignore[attr-defined]
        if step:  # a run: one block per length, base .. max_len
            assert k.blocks >= 2  # type: ignore[attr-defined]
            assert k.base + (k.blocks - 1) * step == k.max_len  # type: ignore[attr-defined]
            return {k.base + i * step: 1 for i in range(k.blocks)}  # type: ignore[attr-defined]
        return {k.max_len: k.blocks} if k.blocks else {}  # type: ignore[attr-defined]
    if isinstance(lengths, dict):
        return dict(lengths)
    return {v >> 32: v & 0xFFFFFFFF for v in lengths}
