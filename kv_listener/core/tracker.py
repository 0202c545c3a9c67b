"""Per-source block-chain tracker: engine KV blocks in, router prefix transitions out (SPEC §4).

Owns, for one source (one engine instance):

- the block records (hash, parent, own token segment, chain length in tokens, media, resolution
  state) and their bounds (`Limits`): the oldest records are pruned one by one;
- the resolution of chains into prefix keys: by a verified cache salt on the chain's first block
  (SPEC §3, no tokens needed), or by `ResolveRequest`s that the resolver answers with
  `ResolveOutcome`s (detokenize + chat-template parsing happen outside, asynchronously);
- per-key aggregates (attributed blocks, GPU blocks, longest attributed chain) and the
  `PrefixTransition`s that describe how the set of live prefixes changes.

The house: `core.record_state` (what a record's state is, per-key aggregates), `core.blocks`
(records and bounds), `core.chains` (resolution), this module (events in, the public API).

Pure: no I/O, no clock, no logging. Once-per-source warnings are handed out by `take_notices`.

Rules and choices, with the engine behaviour they come from (reference/wire-formats.md):

- *Hash alone is the key.* A source is one engine instance; different data-parallel ranks are
  different sources with their own sequence spaces, so `dp_rank` is not part of the key.
- *One KV-cache group.* vLLM >= 0.20 hybrid models publish one `BlockStored` per KV-cache group for
  the same token range (§2.5), with their own hashes and block sizes. Tracking several would
  resolve every prompt once per group and mix block sizes in one chain, so the tracker locks onto
  the first group that announces a full-attention kind (`full_attention`, `mla_attention`,
  `sink_full_attention`, `unknown`) or no kind at all (vLLM 0.20-0.21); events of other groups
  are skipped and counted (`group_skipped`). vLLM orders groups by the first layer of each type, so
  group 0 is not necessarily full attention (Gemma 3 starts with sliding-window layers). Events
  without `group_idx` (SGLang, TRT-LLM, vLLM < 0.20) are always tracked. A model whose only group
  is sliding-window is therefore not tracked: its out-of-window blocks are freed and its chains
  would not name a reusable prefix anyway.
- *Token counts.* SGLang: `len(token_ids) == block_size * n`. vLLM full path: at least
  `block_size * n`, in whole blocks: the tokens of masked / sliding blocks stay in `token_ids`
  (§2.5); they are kept in order, the hashed blocks but the last take `block_size` each and the
  last takes the rest, so the chain length at the event's last block is exact. vLLM partial path:
  one hash, `block_size == hash_block_size`. TRT-LLM: one block per event, `block_size` = its own
  token count (the decoder's normalization). An event whose non-empty token count does not fit
  keeps chain lengths only (`len(token_ids)`, spread evenly over its hashes), drops its tokens,
  counts `token_count_mismatch`, raises the `TOKEN_COUNT_MISMATCH` notice once, and its
  descendants are unattributed (the block itself stays attributed when its parent was).
- *Offload.* An event without tokens is a placeholder (vLLM offloading connector, 0.11+): it adds
  its medium to hashes already known and is otherwise ignored (it carries no parent). Under a
  known explicit parent (and a non-zero `block_size`) an unknown tokenless block grows the chain
  by `block_size`. A `BlockStored` of a known hash adds its medium (SGLang `CPU_PINNED`,
  self-describing vLLM offload events); `BlockUpdated` (TRT-LLM) moves a block to its new level;
  `BlockRemoved` with a medium removes that medium only; a record goes when no medium holds it.
- *Idempotence.* A known hash stored again (vLLM `kv_cache_report_mode="full"` re-announces
  cached prefixes from token 0 with no parent, 0.26+) changes nothing but its media and age.
- *Salts.* Only the chain's first stored block (no parent) counts: the `cache_salt` field
  (SGLang >= 0.5.18, TRT-LLM PR #13051) or, for vLLM, a string starting with `crs1:` in the first
  block's `extra_keys` entry, after the LoRA name (vLLM >= 0.17, untagged on the wire). With a
  verifier configured: valid => the whole chain takes the key, no tokens kept; invalid => the
  chain is discarded (`salt_rejected`). Without a verifier salts are ignored. Without
  detokenization (`can_detokenize=False`: trtllm with no local tokenizer) a chain with no valid
  salt is discarded.
- *Memory.* A block keeps tokens only while they may be sent to the resolver (pending chains,
  within `max_chain_tokens`); a resolved chain whose blocks shorter than d remain keeps one copy
  of root..d instead of theirs; attributed and discarded blocks keep none. How records are laid
  out and pruned: `core.blocks`. How chains resolve and what happens to requests out:
  `core.chains`.
"""

from __future__ import annotations

from array import array
from typing import Any, Final

from msgspec.structs import astuple

from kv_listener.core.chains import ChainResolution
from kv_listener.core.decode import vllm_salt_candidates
from kv_listener.core.limits import Limits
from kv_listener.core.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    CacheCreated,
    Engine,
    EventBatch,
    PrefixTransition,
    SourceCleared,
    Tier,
    TransitionKind,
)
from kv_listener.core.record_state import (
    GPU_BIT,
    MEDIA_MASK,
    NO_SLOT,
    PENDING,
    RESOLVED,
    TAINT,
    BlockView,
    Chain,
    KeyAggregate,
    SaltVerifier,
    State,
    TrackerNotice,
    UnattributedReason,
    common_prefix_len,
    even_split,
)
from kv_listener.core.salt import KEY_BYTES, SALT_PREFIX
from kv_listener.core.salt import SaltVerifier as CacheSaltVerifier
from kv_listener.core.structs import fields_in_order

__all__ = ["BlockView", "SaltVerifier", "Tracker", "TrackerNotice", "UnattributedReason",
           "common_prefix_len"]

# Final: compiled (setup.py), a C static; `Engine.VLLM` is a class attribute read through
# EnumType's `__getattr__` hook (~0.1 us), once per salted root before.
_VLLM: Final = Engine.VLLM
_SGLANG: Final = Engine.SGLANG
_FULL_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention", "unknown"})
# A C static (not a module attribute lookup per call); the hot path reads an event's fields as
# one tuple of them, in this order (checked at import).
_astuple: Final[Any] = astuple
_STORED_FIELDS: Final = fields_in_order(BlockStored, (
    "block_hashes", "parent_hash", "token_ids", "block_size", "lora_id", "lora_name", "medium",
    "group_idx", "extra_keys", "cache_salt", "kv_cache_spec_kind"))

# What a store does for a chain once all the event's blocks are in
_STEP_GROW: Final = 0  # grew at its head
_STEP_NEW: Final = 1  # a new pending chain (root, or branch under a pending chain)
_STEP_COMPARE: Final = 2  # a branch under a resolved chain's pre-anchor block


class Tracker(ChainResolution):
    """Bounded block-chain tracker of one source. Not thread-safe: one owner calls everything.

    Events in (`apply`), transitions out; resolve requests out (`take_resolve_requests`) and
    their answers in (`on_resolved`, in `core.chains`). Records live in columns
    (`core.blocks`): about 60 bytes per block.
    """

    _group: int | None

    def __init__(
        self,
        *,
        engine: Engine,
        model: str,
        limits: Limits,
        salt_verifier: SaltVerifier | None = None,
        can_detokenize: bool = True,
    ) -> None:
        super().__init__(limits)
        self._engine = engine
        self._model = model
        self._verify = salt_verifier
        self._can_detokenize = can_detokenize
        self._noticed: set[TrackerNotice] = set()
        self._notices: list[TrackerNotice] = []
        # counters (monotonic, survive clears)
        self.salt_rejected = 0
        self.token_count_mismatch = 0
        self.removed_unknown = 0  # BlockRemoved / BlockUpdated of a hash we do not track
        self.placeholders_unknown = 0  # tokenless stores of unknown hashes, ignored
        self.group_skipped = 0  # events of an untracked KV-cache group
        self.clears = 0
        self._reset()

    # --- public API -----------------------------------------------------------------------

    @property
    def blocks_tracked(self) -> int:
        return self._live

    @property
    def tokens_retained(self) -> int:
        """Tokens held in block segments and resolved chains' copies (4 bytes each)."""
        return self._tokens

    @property
    def prefixes_live(self) -> int:
        return len(self._keys)

    def stats(self) -> dict[str, int]:
        """Gauges and counters for /stats and metrics (plain ints). The `limit_*` entries are the
        configured bounds, so that `blocks_tracked` and `tokens_retained` can be read (and alerted
        on) as a fraction of them."""
        return {
            "blocks_tracked": self.blocks_tracked,
            "tokens_retained": self.tokens_retained,
            "limit_max_tracked_blocks": self._max_blocks,
            "limit_max_retained_tokens": self._max_tokens,
            "limit_max_chain_tokens": self._max_chain,
            "prefixes_live": self.prefixes_live,
            "pending": self.pending,
            "inflight": self.inflight,
            "salt_rejected": self.salt_rejected,
            "token_count_mismatch": self.token_count_mismatch,
            "unattributed": self.unattributed,
            "pruned": self.pruned,
            "removed_unknown": self.removed_unknown,
            "placeholders_unknown": self.placeholders_unknown,
            "group_skipped": self.group_skipped,
            "resolve_requests": self.resolve_requests,
            "resolve_failed": self.resolve_failed,
            "stale_outcomes": self.stale_outcomes,
            "bad_outcomes": self.bad_outcomes,
            "clears": self.clears,
        }

    def apply(self, item: EventBatch | SourceCleared) -> list[PrefixTransition]:
        """Apply one engine batch (events in order) or a source clear; return the transitions.

        Bounds are enforced after each event. Transitions are computed per batch: a prefix that
        appears and goes within one batch produces nothing; a clear supersedes what came before
        it in the batch.
        """
        out: list[PrefixTransition] = []
        if not isinstance(item, EventBatch):
            self._clear(out)
            return out
        max_blocks = self._max_blocks
        max_tokens = self._max_tokens
        for ev in item.events:
            if type(ev) is BlockStored:
                self._on_stored(ev)
            elif type(ev) is BlockRemoved:
                self._on_removed(ev)
                continue  # removing never exceeds a bound
            elif type(ev) is BlockUpdated:
                self._on_updated(ev)
            elif type(ev) is AllBlocksCleared or type(ev) is CacheCreated:
                self._clear(out)
                continue
            if self._live > max_blocks or self._tokens > max_tokens:
                self._enforce_bounds()
        if self._touched:
            self._flush(out)
        return out

    def snapshot(self) -> dict[str, tuple[int, Tier]]:
        """Live prefixes: prefix_hash -> (token_count, tier)."""
        return {k.prefix_hash: (k.max_len, k.tier()) for k in self._keys.values() if k.blocks}

    def take_notices(self) -> list[TrackerNotice]:
        """Conditions seen since the last call, each reported once per tracker lifetime."""
        out, self._notices = self._notices, []
        return out

    # --- state ----------------------------------------------------------------------------

    def _reset(self) -> None:
        self._reset_blocks()
        self._reset_chains()
        self._group = None  # the KV-cache group tracked (None: not locked yet)

    def _clear(self, out: list[PrefixTransition]) -> None:
        self._reset()
        self.clears += 1
        out.clear()  # anything earlier in this batch is superseded
        out.append(PrefixTransition(TransitionKind.CLEARED))

    def _notice(self, notice: TrackerNotice) -> None:
        if notice not in self._noticed:
            self._noticed.add(notice)
            self._notices.append(notice)

    def _accept_group(self, group: int, kind: str | None) -> bool:
        if self._group is None:
            if kind is None or kind in _FULL_KINDS:
                self._group = group
                return True
            return False
        return group == self._group

    # --- events ---------------------------------------------------------------------------

    def _split(self, n: int, total: int, block_size: int) -> list[int] | None:
        """Tokens per hashed block, or None when the count does not fit the engine's rule."""
        if block_size <= 0:
            if n == 1:
                return [total]
            return [total // n] * n if total % n == 0 else None
        full = block_size * n
        engine = self._engine
        if engine is _SGLANG:
            ok = total == full
        elif engine is _VLLM:
            ok = total >= full and total % block_size == 0
        else:  # TRT-LLM: the last block of an event may be partial (§4.2)
            ok = full - block_size < total <= full
        if not ok:
            return None
        return [block_size] * (n - 1) + [total - block_size * (n - 1)]

    def _salt_of(self, ev: BlockStored) -> str | None:
        if self._engine is _VLLM:
            if ev.cache_salt is not None and ev.cache_salt.startswith(SALT_PREFIX):
                return ev.cache_salt
            for s in reversed(vllm_salt_candidates(ev)):  # the salt comes last (§2.6)
                if s.startswith(SALT_PREFIX):
                    return s
            return None
        return ev.cache_salt

    def _on_stored(self, ev: BlockStored) -> None:
        # the event's fields as one tuple (compiled, each attribute of a msgspec Struct is a
        # generic lookup, ~160 instructions; `_STORED_FIELDS` pins their order)
        f: tuple[Any, ...] = _astuple(ev)
        hashes: tuple[int, ...] = f[0]
        n = len(hashes)
        if n == 0:
            return
        group = f[7]
        if group is not None and not self._accept_group(group, f[10]):
            self.group_skipped += 1
            self._notice(TrackerNotice.GROUP_SKIPPED)
            return
        medium = f[6]
        bit = GPU_BIT if medium is None else self._media_bits.get(medium) or self._medium_bit(medium)
        prev = NO_SLOT
        parent_hash: int | None = f[1]
        if parent_hash is not None:
            prev = self._find(parent_hash)
            if prev != NO_SLOT:
                self._refresh(prev)  # a child under it: it is in use
        tokens: array[int] = f[2]
        total = len(tokens)
        if total == 0:
            self._on_tokenless(ev, prev, bit)
            return
        bs: int = f[3]
        seglens: list[int] | None = None  # None: every block takes `bs` tokens
        if not (bs > 0 and total == bs * n) or tokens.typecode != "I":
            seglens = self._split(n, total, bs)
            mismatch = seglens is None or tokens.typecode != "I"
            if seglens is None or mismatch:
                self.token_count_mismatch += 1
                self._notice(TrackerNotice.TOKEN_COUNT_MISMATCH)
                seglens = even_split(total, n)
        else:
            mismatch = False
        media = bit | (TAINT if mismatch else 0)
        lora_name: str | None = f[5]
        model = lora_name or self._model
        max_chain = self._max_chain
        state_ = self._state  # (the media column is read through self: a new block may grow it)
        offset = 0
        seglen = bs
        # chains this event started or extended -> what to do once all its blocks are in
        todo: dict[Chain, int] | None = None
        for i in range(n):
            h = hashes[i]
            if seglens is not None:
                seglen = seglens[i]
            r = self._find(h)
            if r != NO_SLOT:  # stored again: idempotent, adds its medium, refreshes its age
                old: int = self._media[r]  # int: u8 arithmetic would refuse ~bit
                if old | bit != old:
                    self._set_media(r, old | bit)
                self._refresh(r)
                prev = r
                offset += seglen
                continue
            if (prev != NO_SLOT and type(pst := state_[prev]) is KeyAggregate
                    and not self._media[prev] & TAINT):
                # the common case: the chain goes on under an attributed block
                prev = self._new_block(h, self._hash_of(prev), self._len_of(prev) + seglen, media,
                                       pst, None)
                offset += seglen
                continue
            if prev == NO_SLOT:  # a chain's first block, or an orphan
                parent_len = 0
                if i == 0 and parent_hash is None:
                    state, reason, step = self._root_state(ev, model, mismatch, f)
                else:
                    state, reason, step = None, UnattributedReason.ORPHAN, None
            else:
                parent_len = self._len_of(prev)
                state, reason, step = self._place(prev, model, mismatch)
            if type(state) is Chain:
                keep = min(seglen, max(0, max_chain - parent_len))
                if step is not None:
                    if todo is None:
                        todo = {}
                    if state not in todo:
                        todo[state] = step
            else:
                keep = 0
            prev = self._new_block(
                h, parent_hash if prev == NO_SLOT else self._hash_of(prev), parent_len + seglen, media,
                state, tokens[offset : offset + keep] if keep else None,
            )
            if reason is not None:
                self._count_unattributed(reason)
            offset += seglen
        if todo is None:
            return
        for ch, step in todo.items():
            if ch.status != PENDING:
                continue
            if step == _STEP_COMPARE:
                self._match_resolved_fork(ch)
            elif step == _STEP_NEW:
                if not ch.waiting:
                    self._want_request(ch)
            else:
                self._on_growth(ch)

    def _place(
        self, prev: int, model: str, mismatch: bool
    ) -> tuple[State, UnattributedReason | None, int | None]:
        """State of a new block under record `prev` (a chain's first block and an orphan are
        `_on_stored`'s own cases): (state, reason to count if discarded, next step)."""
        if self._media[prev] & TAINT:
            return None, None, None  # under a block whose tokens did not fit
        st = self._state[prev]
        if type(st) is KeyAggregate:
            return st, None, None
        if type(st) is not Chain:
            return None, None, None  # under an unattributed block
        if st.status == PENDING:
            if mismatch:
                return None, UnattributedReason.TOKEN_COUNT_MISMATCH, None
            prev_hash = self._hash_of(prev)
            if st.head == prev_hash:
                return st, None, _STEP_GROW
            # A branch under a chain being resolved waits for its answer (SPEC §4: one call per
            # distinct chain); under an idle pending chain it asks for itself.
            fork = self._new_chain(model, prev_hash)
            forks = st.forks
            if not isinstance(forks, list):
                st.forks = forks = []
            elif len(forks) >= 64 and not len(forks) & (len(forks) - 1):  # at 64, 128, 256, ...
                st.forks = forks = [w for w in forks if w.status == PENDING]
            forks.append(fork)
            fork.waiting = st.busy()
            return fork, None, _STEP_NEW
        if st.status == RESOLVED and st.key is not None:
            if self._len_of(prev) >= st.d:  # tightened below it after it was stored
                k = self._intern(st.key.hex())
                self._attribute(prev, k)
                self._chain_lost_block(st, prev)
                return k, None, None
            if mismatch:
                return None, UnattributedReason.TOKEN_COUNT_MISMATCH, None
            return self._new_chain(model, self._hash_of(prev)), None, _STEP_COMPARE
        return None, None, None  # under a discarded chain

    def _root_state(
        self, ev: BlockStored, model: str, mismatch: bool, f: tuple[Any, ...]
    ) -> tuple[State, UnattributedReason | None, int | None]:
        """State of a new first block of a chain (no parent): the salt decides first. `f`:
        the event's fields (`_astuple(ev)`)."""
        verify = self._verify
        if verify is not None:
            extra: tuple[Any, ...] | None = f[8]
            if (f[9] is None and extra and type(first := extra[0]) is tuple
                    and len(first) == 1 and f[5] is None and type(first[0]) is str
                    and self._engine is _VLLM):
                # _salt_of's common case (a salted vLLM root: its salt alone), without the calls
                salt: str | None = first[0] if first[0].startswith(SALT_PREFIX) else None
            else:
                salt = self._salt_of(ev)
            if salt is not None:
                # The daemon's verifier through its method (compiled, setup.py: a method call is
                # a direct C call, a callable object's a call through Python), which gives the
                # key's hex, the salt's own text: no bytes of the key are kept.
                if isinstance(verify, CacheSaltVerifier):
                    prefix_hash = verify.verify_hex(salt)
                else:
                    key = verify(salt)
                    ok = isinstance(key, bytes) and len(key) == KEY_BYTES
                    prefix_hash = key.hex() if ok else None  # type: ignore[union-attr]
                if prefix_hash is not None:
                    k = self._keys.get(prefix_hash)
                    if k is None:
                        # _intern without its touch: the caller stores the block at once, which
                        # touches the key (a key is never left without a block here)
                        k = self._keys[prefix_hash] = KeyAggregate(prefix_hash)
                    return k, None, None
                self.salt_rejected += 1
                self._notice(TrackerNotice.SALT_REJECTED)
                return None, UnattributedReason.SALT_REJECTED, None
        if not self._can_detokenize:
            return None, UnattributedReason.NO_SALT, None
        if mismatch:
            return None, UnattributedReason.TOKEN_COUNT_MISMATCH, None
        return self._new_chain(model, None), None, _STEP_NEW

    def _on_tokenless(self, ev: BlockStored, prev: int, bit: int) -> None:
        """Placeholder stores (offload) and tokenless blocks."""
        chainable = ev.parent_hash is not None and prev != NO_SLOT and ev.block_size > 0
        for h in ev.block_hashes:
            r = self._find(h)
            if r != NO_SLOT:
                m: int = self._media[r]
                self._set_media(r, m | bit)
                self._refresh(r)
                prev = r
                continue
            if not chainable or prev == NO_SLOT:
                self.placeholders_unknown += 1
                prev = NO_SLOT
                continue
            # No tokens: only an attributed chain can continue (by block_size, §4).
            st = self._state[prev]
            state: State = st if type(st) is KeyAggregate and not self._media[prev] & TAINT else None
            prev = self._new_block(h, self._hash_of(prev), self._len_of(prev) + ev.block_size, bit,
                                   state, None)

    def _on_removed(self, ev: BlockRemoved) -> None:
        if ev.group_idx is not None and self._group is not None and ev.group_idx != self._group:
            self.group_skipped += 1
            return
        medium = ev.medium  # (_medium_bit's known media inline: vLLM sends one event per block)
        bit = None if medium is None else self._media_bits.get(medium) or self._medium_bit(medium)
        for h in ev.block_hashes:
            r = self._find(h)
            if r == NO_SLOT:
                self.removed_unknown += 1
                continue
            if bit is None:
                self._remove(r)
                continue
            old: int = self._media[r]
            if not old & bit:
                continue  # not held in that medium
            media = old & ~bit
            if media & MEDIA_MASK:
                self._set_media(r, media)
            else:
                self._remove(r)

    def _on_updated(self, ev: BlockUpdated) -> None:
        r = self._find(ev.block_hash)
        if r == NO_SLOT:
            self.removed_unknown += 1
            return
        new_bit = self._medium_bit(ev.new_medium)
        old: int = self._media[r]
        if ev.old_medium is None:
            # Old level not reported: TRT-LLM blocks live in one level at a time.
            media = (old & TAINT) | new_bit
        else:
            media = (old & ~self._medium_bit(ev.old_medium)) | new_bit
        self._set_media(r, media)
