"""The resolution of a tracker's chains into prefix keys (part of `core.tracker`).

A chain without a valid salt is resolved by the resolver, outside and asynchronously: the
tracker hands out `ResolveRequest`s (`take_resolve_requests`) and applies the `ResolveOutcome`s
(`on_resolved`). This module holds those rules; `core.blocks` holds the records they act on.

- *Resolution.* An unresolved chain asks once for its head (tokens root..head, at most
  `max_chain_tokens`); blocks stored under it while the request is out join it and inherit the
  answer, and so do blocks that fork from it (they wait for the answer instead of asking). A
  `RESOLVED` outcome for tokens root..d attributes the chain's blocks whose chain length is >= d;
  the shorter ones keep a copy of the tokens root..d in the chain object. A later branch that
  forks below d is compared with those tokens: when it agrees through d it takes the key with no
  request at all; when it diverges at q < d the tracker asks for root..q only (a *probe*), and a
  probe that resolves to the same key tightens d to q for every later branch. That is how many
  users who share a system prompt cost about two requests, not one each. A resolver that knows
  how many leading tokens determine the key can say so (`key_tokens`), which saves the probe.
  `PENDING` and `FAILED` leave the chain pending until it grows; `UNATTRIBUTED` discards it and
  its descendants; a chain that reaches `max_chain_tokens` still pending is discarded.
- *Requests out.* The resolver keeps one call per head and drops a second request for a head it
  holds, so a head is never asked again while its answer is out, even after the chain that asked
  is gone (cleared, pruned): a new chain with that head (the same tokens) adopts the answer, or
  asks once it is in. An answer is applied only to the path it was asked for: when a block on
  root..head goes while the request is out, the chain asks again for what is left. After the
  resolver is replaced, `forget_requests()` makes every chain ask again.
"""

from __future__ import annotations

from array import array
from collections import Counter

from kv_listener.core.blocks import BlockTable
from kv_listener.core.limits import Limits
from kv_listener.core.model import PrefixTransition, ResolveOutcome, ResolveRequest, ResolveStatus
from kv_listener.core.record_state import (
    DEAD,
    DISCARDED,
    LAST_FAILED,
    LAST_PENDING,
    NO_SLOT,
    PENDING,
    RESOLVED,
    Ask,
    Chain,
    UnattributedReason,
    common_prefix_len,
)
from kv_listener.core.salt import KEY_BYTES


class ChainResolution(BlockTable):
    """Chains waiting for a key, the requests out for them, and what an answer does. The base
    of `Tracker`; not used alone."""

    _want: list[Chain]
    _failed: list[Chain]

    def __init__(self, limits: Limits) -> None:
        super().__init__(limits)
        self._max_chain = limits.max_chain_tokens
        # counters (monotonic, survive clears)
        self.unattributed = 0  # chains discarded (one per decision, descendants not recounted)
        self.unattributed_reasons: Counter[str] = Counter()
        self.resolve_requests = 0
        self.resolve_failed = 0  # FAILED outcomes
        self.stale_outcomes = 0  # outcomes for a chain no longer waiting for one
        self.bad_outcomes = 0  # RESOLVED without a 32-byte key (treated as FAILED)
        self._inflight: dict[int, Ask] = {}  # request head -> request (kept across clears)

    @property
    def pending(self) -> int:
        """Chains waiting for a key (asking, waiting for growth, or waiting for an ancestor)."""
        return self._n_pending

    @property
    def inflight(self) -> int:
        """Requests handed out and not answered yet (also those whose chain is gone)."""
        return len(self._inflight)

    def _reset_chains(self) -> None:
        """No chains (a clear); answers still out become stale."""
        self._want = []  # chains to ask for at the next take_resolve_requests
        self._failed = []  # chains whose last answer was FAILED
        for ask in self._inflight.values():
            ask.chain = None  # answers may still come: they are stale
        self._n_pending = 0

    def forget_requests(self) -> None:
        """Consider every request handed out lost (call when the resolver was replaced and will
        never answer them): their chains ask again at the next `take_resolve_requests`."""
        asks, self._inflight = self._inflight, {}
        for ask in asks.values():
            ch = ask.chain
            if ch is not None and ch.status == PENDING:
                ch.inflight = None
                ch.probing = False
                self._want_request(ch)

    def retry_failed(self) -> int:
        """Ask again for the chains whose last answer was FAILED (the resolver was down or
        overloaded) and that did not grow since: call it now and then (the daemon does every
        few seconds), so that pending chains resolve once `/detokenize` is back, not only when
        their engine stores more blocks. Returns how many were queued."""
        failed, self._failed = self._failed, []
        n = 0
        for ch in failed:
            if ch.status == PENDING and ch.last == LAST_FAILED and not ch.busy():
                self._want_request(ch)
                n += 1
        return n

    def take_resolve_requests(self) -> list[ResolveRequest]:
        """New work for the resolver: at most one request per unresolved chain, built now from
        its current head (so a chain that grew since it was queued asks for all of it)."""
        want, self._want = self._want, []
        out: list[ResolveRequest] = []
        later: list[Chain] = []
        for ch in want:
            ch.wanted = False
            if ch.status != PENDING or ch.inflight is not None or ch.waiting:
                continue
            head = self._find(ch.head) if ch.head is not None else NO_SLOT
            if head == NO_SLOT:
                continue
            head_hash = self._hash_of(head)
            limited = min(self._len_of(head), self._max_chain)
            if ch.probe_q is not None and ch.probe_q > limited:  # its branch lost blocks since
                ch.probe_q = None
                ch.base = None
            n = ch.probe_q if ch.probe_q is not None else limited
            if ch.probe_q is None and ch.last == LAST_PENDING and limited <= ch.requested:
                if limited >= self._max_chain:
                    self._discard_chain(ch, UnattributedReason.TOO_LONG)
                continue
            tokens = self._collect(head, n)
            if tokens is None or len(tokens) < n:
                self._discard_chain(ch, UnattributedReason.TOKENS_UNAVAILABLE)
                continue
            probing = ch.probe_q is not None
            ask = self._inflight.get(head_hash)
            if ask is not None:
                if ask.chain is not None or ask.n != n or ask.probing != probing:
                    later.append(ch)  # the resolver would drop it: ask once that answer is in
                    ch.wanted = True
                    continue
                ask.chain = ch  # same head, same tokens: that answer is ours
            else:
                self._inflight[head_hash] = Ask(ch, n, probing)
                out.append(ResolveRequest(head=head_hash, model=ch.model, tokens=tokens))
            ch.inflight = head_hash
            ch.requested = n
            ch.asked_len = limited
            ch.probing = probing
        self._want.extend(later)
        self.resolve_requests += len(out)
        return out

    def on_resolved(
        self, outcome: ResolveOutcome, key_tokens: int | None = None
    ) -> list[PrefixTransition]:
        """Apply the resolver's answer to a request from `take_resolve_requests`.

        `key_tokens` (optional; also read from an outcome attribute of that name): how many
        leading tokens of the request already determine the key (end of the system / first
        message content and its delimiter, or the `max_prefix_length` cut). It must be such that
        resolving those tokens alone gives the same key; it lets later branches that share them
        take the key without any request.
        """
        out: list[PrefixTransition] = []
        if key_tokens is None:
            hint = getattr(outcome, "key_tokens", None)
            key_tokens = hint if isinstance(hint, int) else None
        ask = self._inflight.pop(outcome.head, None)
        ch = None if ask is None else ask.chain
        if ch is None or ch.status != PENDING or ch.inflight != outcome.head:
            self.stale_outcomes += 1
            return out
        ch.inflight = None
        probe = ch.probing
        ch.probing = False
        status = outcome.status
        key = outcome.key
        if status is ResolveStatus.RESOLVED and not (isinstance(key, bytes) and len(key) == KEY_BYTES):
            self.bad_outcomes += 1
            status = ResolveStatus.FAILED
        if status is ResolveStatus.RESOLVED:
            assert key is not None
            d = ch.requested
            if key_tokens is not None and not isinstance(key_tokens, bool) and 0 < key_tokens < d:
                d = key_tokens
            base = ch.base
            self._resolve_chain(ch, key, d)
            if probe and base is not None and base.key == key:
                self._tighten(base, d)
        elif probe and status is not ResolveStatus.FAILED:
            # root..divergence alone did not give the key: ask again with the whole chain (its
            # waiters keep waiting for that answer).
            ch.probe_q = None
            ch.base = None
            self._want_request(ch)
        elif status is ResolveStatus.UNATTRIBUTED:
            self._discard_chain(ch, UnattributedReason.RESOLVER)
        else:
            if status is ResolveStatus.PENDING:
                ch.last = LAST_PENDING
            else:
                self.resolve_failed += 1
                ch.last = LAST_FAILED
                failed = self._failed
                failed.append(ch)
                if len(failed) > 1024 and len(failed) > 2 * self._n_pending:
                    # Nobody calls retry_failed: keep only chains still waiting, once each.
                    self._failed = list({id(w): w for w in failed
                                         if w.status == PENDING and w.last == LAST_FAILED}.values())
            self._release_waiters(ch, ask=status is ResolveStatus.PENDING)
            self._after_answer(ch)
        # A resolved chain keeps a copy of root..d, which may include ancestors' tokens.
        self._enforce_bounds()
        self._flush(out)
        return out

    # --- chains ---------------------------------------------------------------------------

    def _new_chain(self, model: str, fork_at: int | None) -> Chain:
        self._n_pending += 1
        return Chain(model, fork_at)

    def _count_unattributed(self, reason: UnattributedReason) -> None:
        self.unattributed += 1
        self.unattributed_reasons[reason.value] += 1

    def _want_request(self, ch: Chain) -> None:
        if not ch.wanted:
            ch.wanted = True
            self._want.append(ch)

    def _head_len(self, ch: Chain) -> int | None:
        """Chain length of `ch`'s head record, or None when it has none."""
        head = self._find(ch.head) if ch.head is not None else NO_SLOT
        return None if head == NO_SLOT else self._len_of(head)

    def _on_growth(self, ch: Chain) -> None:
        """A block joined the head of pending `ch`."""
        if ch.busy():
            return  # the outstanding answer covers it
        head_len = self._head_len(ch)
        if head_len is None:
            return
        limited = min(head_len, self._max_chain)
        if ch.probe_q is None and ch.last == LAST_PENDING and limited <= ch.requested:
            if limited >= self._max_chain:
                self._discard_chain(ch, UnattributedReason.TOO_LONG)
            return
        self._want_request(ch)

    def _after_answer(self, ch: Chain) -> None:
        """After PENDING / FAILED: ask again at once if the chain grew meanwhile (since it was
        asked: a probe asked for fewer tokens than the chain had, which is no growth)."""
        head_len = self._head_len(ch)
        if head_len is None:
            return
        limited = min(head_len, self._max_chain)
        if limited > ch.asked_len:
            self._want_request(ch)
        elif ch.last == LAST_PENDING and limited >= self._max_chain:
            self._discard_chain(ch, UnattributedReason.TOO_LONG)

    def _release_waiters(self, ch: Chain, *, ask: bool) -> None:
        """Forks waiting for `ch`'s answer learn nothing from it: they ask themselves (PENDING)
        or wait for their own growth (FAILED: do not multiply calls to a failing resolver)."""
        keep: list[Chain] = []
        for w in ch.forks:
            if w.status != PENDING:
                continue
            keep.append(w)
            if w.waiting:
                w.waiting = False
                if ask:
                    self._want_request(w)
        ch.forks = keep or ()

    def _chain_blocks(self, ch: Chain) -> list[int]:
        """The chain's records, deepest first."""
        out: list[int] = []
        state, haspar, par = self._state, self._haspar, self._par
        cur = self._find(ch.head) if ch.head is not None else NO_SLOT
        while cur != NO_SLOT and state[cur] is ch:
            out.append(cur)
            cur = self._slot_of(par[cur]) if haspar[cur] else NO_SLOT
        return out

    def _collect(self, r: int, n: int) -> array[int] | None:
        """The first `n` tokens of the chain root..r, or None when some are gone."""
        max_chain = self._max_chain
        tlen, state = self._tlen, self._state
        segs: list[array[int]] = []
        cur = r
        while True:
            st = state[cur]
            if type(st) is not Chain:
                return None
            cur_len = self._len_of(cur)
            if st.status == RESOLVED:
                ref = st.tokens
                if ref is None or len(ref) < min(cur_len, max_chain):
                    return None
                segs.append(ref[: min(cur_len, max_chain)])
                break
            if st.status != PENDING:
                return None
            parent = NO_SLOT
            parent_len = 0
            if self._haspar[cur]:
                parent = self._slot_of(self._par[cur])
                if parent == NO_SLOT:
                    return None
                parent_len = self._len_of(parent)
            if tlen[cur] != min(cur_len, max_chain) - min(parent_len, max_chain):
                return None
            if tlen[cur]:
                segs.append(self._tokens_of(cur))
            if parent == NO_SLOT:
                break
            cur = parent
        out: array[int] = array("I")
        for s in reversed(segs):
            out.extend(s)
        if len(out) > n:
            del out[n:]
        return out

    def _fork_tokens(self, w: Chain) -> tuple[int, array[int]] | None:
        """The fork record and `w`'s own tokens after it, or None when its path is broken."""
        path = self._chain_blocks(w)
        if not path or w.fork_at is None or self._parent_of(path[-1]) != w.fork_at:
            return None
        fork = self._find(w.fork_at)
        if fork == NO_SLOT:
            return None
        toks: array[int] = array("I")
        for r in reversed(path):
            toks.extend(self._tokens_of(r))
        return fork, toks

    def _match_resolved_fork(self, w: Chain) -> None:
        """`w` starts under a pre-anchor block of a resolved chain: compare, then take its key,
        probe at the divergence, or ask with the whole chain."""
        fork = self._find(w.fork_at) if w.fork_at is not None else NO_SLOT
        base = self._state[fork] if fork != NO_SLOT else None
        if type(base) is not Chain or base.status != RESOLVED or base.key is None:
            self._ask_alone(w)
            return
        d = self._compare(w, base)
        if d is not None:
            self._resolve_chain(w, base.key, d)

    def _compare(self, w: Chain, base: Chain) -> int | None:
        """Compare branch `w` with resolved `base`'s tokens root..d. Returns d when `w` agrees
        through it (the caller settles `w`); otherwise schedules a probe at the first differing
        token, or a request with the whole chain when no difference is known, and returns None.
        """
        got = self._fork_tokens(w)
        ref = base.tokens
        if got is None or ref is None:
            self._ask_alone(w)
            return None
        fork, toks = got
        c0 = self._len_of(fork)
        d = base.d
        span = min(d, len(ref)) - c0
        if span <= 0:
            self._ask_alone(w)
            return None
        common = common_prefix_len(ref[c0 : c0 + span], toks)
        if common == d - c0:
            return d
        if common < len(toks) and common < span and w.inflight is None:
            w.base = base
            w.probe_q = c0 + common
        self._ask_alone(w)
        return None

    def _ask_alone(self, w: Chain) -> None:
        w.waiting = False
        if w.inflight is None:
            self._want_request(w)

    def _resolve_chain(self, chain: Chain, key: bytes, d: int) -> None:
        """Settle `chain` as resolved at d, and through it the branches that waited for it."""
        k = self._intern(key.hex())
        work = [(chain, d)]
        while work:
            ch, d = work.pop()
            if ch.status != PENDING:
                continue
            recs = self._chain_blocks(ch)
            tokens = None
            if recs and self._len_of(recs[-1]) < d:  # some blocks stay pre-anchor: keep root..d
                tokens = self._collect(recs[0], min(d, self._len_of(recs[0]), self._max_chain))
                if tokens is not None:
                    tokens = array("I", tokens)  # exact size
                    self._tokens += len(tokens)
            ch.status = RESOLVED
            self._n_pending -= 1
            self._cancel_request(ch)
            ch.key = key
            ch.d = d
            ch.tokens = tokens
            anchor = NO_SLOT
            for r in recs:
                if self._len_of(r) >= d:
                    self._attribute(r, k)
                    ch.nblocks -= 1
                    anchor = r
                else:
                    self._drop_tokens(r)  # `ch.tokens` has them
            ch.anchor = None if anchor == NO_SLOT else self._hash_of(anchor)
            if ch.nblocks == 0:
                self._free_chain_tokens(ch)
            forks, ch.forks = ch.forks, ()
            for w in forks:
                if w.status != PENDING:
                    continue
                fork = self._find(w.fork_at) if w.fork_at is not None else NO_SLOT
                fork_state = self._state[fork] if fork != NO_SLOT else None
                if fork_state is k:  # under an attributed block
                    work.append((w, 0))
                elif fork != NO_SLOT and fork_state is ch:
                    wd = self._compare(w, ch)
                    if wd is not None:
                        work.append((w, wd))
                else:
                    self._ask_alone(w)

    def _tighten(self, ch: Chain, d: int) -> None:
        """A probe showed that root..d (d < ch.d) already determines `ch`'s key."""
        if ch.status != RESOLVED or ch.key is None or d >= ch.d:
            return
        k = self._intern(ch.key.hex())
        ch.d = d
        if ch.tokens is not None and len(ch.tokens) > d:
            self._tokens -= len(ch.tokens) - d
            ch.tokens = ch.tokens[:d]
        state = self._state
        anchor = self._find(ch.anchor) if ch.anchor is not None else NO_SLOT
        if anchor != NO_SLOT:
            cur = self._slot_of(self._par[anchor]) if self._haspar[anchor] else NO_SLOT
            while cur != NO_SLOT and state[cur] is ch and self._len_of(cur) >= d:
                parent = self._parent_of(cur)
                self._attribute(cur, k)
                ch.nblocks -= 1
                ch.anchor = self._hash_of(cur)
                cur = self._find(parent) if parent is not None else NO_SLOT
        # Pre-anchor blocks not reachable from the anchor are attributed when a child arrives.
        if ch.nblocks == 0:
            self._free_chain_tokens(ch)

    def _discard_chain(
        self, chain: Chain, reason: UnattributedReason, *, count: bool = True
    ) -> None:
        """Settle `chain` and every pending chain under it as unattributed."""
        if chain.status != PENDING:
            return
        if count:
            self._count_unattributed(reason)
        work = [chain]
        while work:
            ch = work.pop()
            if ch.status != PENDING:
                continue
            ch.status = DISCARDED
            self._n_pending -= 1
            self._cancel_request(ch)
            for r in self._chain_blocks(ch):
                self._state[r] = None
                ch.nblocks -= 1
                self._drop_tokens(r)
            work.extend(ch.forks)
            ch.forks = ()

    def _cancel_request(self, ch: Chain) -> None:
        if ch.inflight is not None:
            ask = self._inflight.get(ch.inflight)
            if ask is not None and ask.chain is ch:
                ask.chain = None  # its answer will be stale
            ch.inflight = None
        ch.waiting = False
        ch.base = None
        ch.probe_q = None
        ch.probing = False

    def _free_chain_tokens(self, ch: Chain) -> None:
        if ch.tokens is not None:
            self._tokens -= len(ch.tokens)
            ch.tokens = None

    def _chain_lost_block(self, ch: Chain, r: int) -> None:
        """Record `r` (state `ch`) was removed or pruned (already out of the index), or
        attributed."""
        ch.nblocks -= 1
        if ch.status == RESOLVED:
            if ch.nblocks == 0:
                self._free_chain_tokens(ch)
            return
        if ch.status != PENDING:
            return
        h = self._hash_of(r)
        lost = {h}
        if ch.head != h:
            # A block in the middle went: the blocks below it lost their path to the root.
            below = self._chain_blocks(ch)  # stops at the gap `r` left
            for b in below:
                self._state[b] = None
                ch.nblocks -= 1
                self._drop_tokens(b)
                lost.add(self._hash_of(b))
            if below:
                self._count_unattributed(UnattributedReason.TOKENS_UNAVAILABLE)
        parent = self._slot_of(self._par[r]) if self._haspar[r] else NO_SLOT
        ch.head = self._hash_of(parent) if parent != NO_SLOT and self._state[parent] is ch else None
        if ch.inflight is not None and ch.inflight in lost and ch.head is not None:
            # The answer out is about a path the chain no longer has: what grows from its new
            # head may be another branch. Ask again for what is left.
            self._cancel_request(ch)
            self._release_waiters(ch, ask=True)
            self._want_request(ch)
        cut = [w for w in ch.forks if w.fork_at in lost or ch.head is None]
        ch.forks = [w for w in ch.forks if w.status == PENDING and w not in cut] or ()
        self._discard_lost(cut)
        if ch.head is None:
            ch.status = DEAD
            self._n_pending -= 1
            self._cancel_request(ch)

    def _discard_lost(self, forks: list[Chain]) -> None:
        """Branches whose fork block went: no path to the root, so nothing to resolve."""
        live = [w for w in forks if w.status == PENDING]
        if live:
            self._count_unattributed(UnattributedReason.TOKENS_UNAVAILABLE)
        for w in live:
            self._discard_chain(w, UnattributedReason.TOKENS_UNAVAILABLE, count=False)
