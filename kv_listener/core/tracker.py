"""Per-source block-chain tracker: engine KV blocks in, router prefix transitions out (SPEC §4).

Owns, for one source (one engine instance):

- the block records (hash, parent, own token segment, chain length in tokens, media, resolution
  state) and their bounds (`Limits`): the oldest records are pruned one by one;
- the resolution of chains into prefix keys: by a verified cache salt on the chain's first block
  (SPEC §3, no tokens needed), or by `ResolveRequest`s that the resolver answers with
  `ResolveOutcome`s (detokenize + chat-template parsing happen outside, asynchronously);
- per-key aggregates (attributed blocks, GPU blocks, longest attributed chain) and the
  `PrefixTransition`s that describe how the set of live prefixes changes.

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
- *Memory.* A block keeps tokens only while they may be sent to the resolver (pending chains,
  within `max_chain_tokens`); a resolved chain whose blocks shorter than d remain keeps one copy
  of root..d instead of theirs; attributed and discarded blocks keep none. Records are not
  Python objects but slots in typed columns (hash, parent, chain length, media, state, pruning
  links: about 50 bytes), found through an open-addressing index of slot numbers (hashed with a
  random multiplier, so a hostile engine cannot make its hashes collide), and the segments kept
  lie in one token arena (4 bytes per token), compacted when half of it is dropped tokens. No
  per-block object for the cyclic GC to walk (it paused the loop 40-80 ms at 100k records).
  `bench/tracker.py` prints the figures. When `max_tracked_blocks` or `max_retained_tokens` is
  exceeded after an event or an answer, the least recently stored records go first (a record is
  refreshed when stored again or when a child is stored under it, so hot shared prefixes outlive
  cold tails); a prefix is evicted only when its last attributed block goes.
"""

from __future__ import annotations

import enum
import random
from array import array
from collections import Counter
from collections.abc import Callable
from typing import Final, NamedTuple

from kv_listener.core.decode import vllm_salt_candidates
from kv_listener.core.limits import Limits
from kv_listener.core.model import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    CacheCreated,
    Engine,
    EventBatch,
    PrefixTransition,
    ResolveOutcome,
    ResolveRequest,
    ResolveStatus,
    SourceCleared,
    Tier,
    TransitionKind,
)
from kv_listener.core.salt import KEY_BYTES, SALT_PREFIX

# Media of a record: bit 0 = GPU, bits 1..5 = storage media in the order first seen, bit 6 = any
# further medium, bit 7 = TAINT (descendants unattributed). Staying below 256 keeps the value a
# cached small int: no allocation per record.
_GPU_BIT: Final = 0x01
_OVERFLOW_BIT: Final = 0x40
_TAINT: Final = 0x80
_MEDIA: Final = 0x7F
_FIRST_STORAGE_BIT: Final = 0x02

_FULL_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention", "unknown"})

# Chain status
_PENDING: Final = 0
_RESOLVED: Final = 1
_DISCARDED: Final = 2
_DEAD: Final = 3  # every block of a pending chain went before it was settled

# What the last answer for a chain was
_LAST_NONE: Final = 0
_LAST_PENDING: Final = 1
_LAST_FAILED: Final = 2

# What a store does for a chain once all the event's blocks are in
_STEP_GROW: Final = 0  # grew at its head
_STEP_NEW: Final = 1  # a new pending chain (root, or branch under a pending chain)
_STEP_COMPARE: Final = 2  # a branch under a resolved chain's pre-anchor block


class UnattributedReason(enum.StrEnum):
    """Why a chain was discarded (never gets a key). Values are metric labels."""

    SALT_REJECTED = "salt_rejected"  # salt failed verification (forged, other backend)
    NO_SALT = "no_salt"  # no valid salt and nothing can detokenize (trtllm without tokenizer)
    RESOLVER = "resolver"  # the resolver answered UNATTRIBUTED (not a chat prompt, ...)
    TOO_LONG = "too_long"  # still pending at max_chain_tokens
    TOKENS_UNAVAILABLE = "tokens_unavailable"  # an ancestor went (pruned/evicted) before resolution
    ORPHAN = "orphan"  # stored under a parent the tracker does not know
    TOKEN_COUNT_MISMATCH = "token_count_mismatch"  # tokens did not fit the block size


class TrackerNotice(enum.StrEnum):
    """Conditions the edge should log once per source (`take_notices`)."""

    TOKEN_COUNT_MISMATCH = "token_count_mismatch"
    GROUP_SKIPPED = "group_skipped"
    SALT_REJECTED = "salt_rejected"


SaltVerifier = Callable[[str], bytes | None]


class _Key:
    """An interned prefix key and the aggregates of its attributed blocks.

    `lengths` counts the attributed blocks per chain length, so that `max_len` is known again
    when the longest goes; it stays None while every block has the same length (a salted
    single-block chain, the first block of any key), which saves a dict per such key."""

    __slots__ = ("blocks", "gpu", "key", "lengths", "max_len", "prefix_hash")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.prefix_hash = key.hex()
        self.blocks = 0  # attributed blocks retained
        self.gpu = 0  # ... of which in GPU memory
        self.lengths: dict[int, int] | None = None  # chain length -> attributed blocks with it
        self.max_len = 0

    def tier(self) -> Tier:
        return Tier.GPU_HOT if self.gpu else Tier.STORAGE_WARM

    def add(self, chain_len: int, gpu: bool) -> None:
        if gpu:
            self.gpu += 1
        lengths = self.lengths
        if lengths is None:
            if not self.blocks or chain_len == self.max_len:
                self.blocks += 1
                self.max_len = chain_len
                return
            lengths = self.lengths = {self.max_len: self.blocks}
        self.blocks += 1
        lengths[chain_len] = lengths.get(chain_len, 0) + 1
        if chain_len > self.max_len:  # noqa: PLR1730 (no call to max on the hot path)
            self.max_len = chain_len

    def remove(self, chain_len: int, gpu: bool) -> None:
        self.blocks -= 1
        if gpu:
            self.gpu -= 1
        lengths = self.lengths
        if lengths is None:  # every block had max_len
            if not self.blocks:
                self.max_len = 0
            return
        left = lengths[chain_len] - 1
        if left:
            lengths[chain_len] = left
            return
        del lengths[chain_len]
        if chain_len == self.max_len:
            # O(distinct lengths of this key), only when its longest block goes.
            self.max_len = max(lengths) if lengths else 0


class _Chain:
    """A path of blocks resolved together.

    Pending: every block on the path from its first block to `head` has this chain as state and
    keeps its tokens. Resolved: the blocks shorter than `d` (pre-anchor) keep this chain as state
    and `tokens` holds root..d for comparing and probing later branches; the rest are attributed.
    """

    __slots__ = (
        "anchor", "asked_len", "base", "d", "fork_at", "forks", "head", "inflight", "key", "last",
        "model", "nblocks", "probe_q", "probing", "requested", "status", "tokens", "waiting",
        "wanted",
    )

    def __init__(self, model: str, fork_at: int | None = None) -> None:
        self.model = model
        self.status = _PENDING
        self.head: int | None = None  # deepest block
        self.nblocks = 0  # blocks whose state is this chain
        self.fork_at = fork_at  # the block (of another chain) this one starts under
        self.forks: list[_Chain] = []  # pending chains started under our blocks (while pending)
        # request bookkeeping
        self.inflight: int | None = None  # head of the outstanding request
        self.requested = 0  # tokens sent in the last request
        self.asked_len = 0  # chain length (capped) when it was sent: a probe sends fewer tokens
        self.last = _LAST_NONE
        self.wanted = False  # queued for take_resolve_requests
        self.waiting = False  # waits for the answer of the chain it forked from
        self.probe_q: int | None = None  # next request asks for root..probe_q only
        self.probing = False  # the outstanding request is such a probe
        self.base: _Chain | None = None  # resolved chain a probe may tighten
        # resolution
        self.key: bytes | None = None
        self.d = 0  # tokens root..d determine the key
        self.anchor: int | None = None  # shallowest attributed block of the chain
        self.tokens: array[int] | None = None  # root..d while pre-anchor blocks exist

    def busy(self) -> bool:
        return self.inflight is not None or self.wanted or self.waiting


_State = _Key | _Chain | None  # None: unattributed


class _Ask:
    """A request handed to the resolver and not answered yet. It outlives its chain (settled,
    gone, cleared): the resolver still holds the head and drops another request for it, so the
    same head is not asked again until this answer arrives (a new chain with the same head, i.e.
    the same tokens, adopts it when it asks for the same tokens)."""

    __slots__ = ("chain", "n", "probing")

    def __init__(self, chain: _Chain, n: int, probing: bool) -> None:
        self.chain: _Chain | None = chain
        self.n = n
        self.probing = probing


def _even_split(total: int, n: int) -> list[int]:
    q, r = divmod(total, n)
    return [q] * (n - 1) + [q + r]


def common_prefix_len(a: array[int], b: array[int]) -> int:
    """Length of the common prefix of two token arrays (slice compares run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference is in [lo, hi)
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    for i in range(lo, hi):
        if a[i] != b[i]:
            return i
    return hi



_NONE: Final = -1  # no record (slot numbers are >= 0)
_EMPTY: Final = -1  # index position never used
_GONE: Final = -2  # index position whose record went (tombstone)
_U64: Final = (1 << 64) - 1
_MIN_INDEX: Final = 64
#: Compact the token arena once this many dropped tokens lie in it and they are at least half.
_ARENA_SLACK: Final = 1 << 16


class BlockView(NamedTuple):
    """One record as `Tracker.records()` shows it (tests, debugging): a copy, not the record."""

    parent: int | None
    chain_len: int
    media: int
    state: object
    tokens: array[int]


class Tracker:
    """Bounded block-chain tracker of one source. Not thread-safe: one owner calls everything.

    Records are not objects: a record is a slot number, its fields live in typed columns
    (`array`, `bytearray`, and lists for the state object), found by hash through an open-
    addressing index of slot numbers, and the tokens of the records that keep some lie in one
    token arena. About 60 bytes per block instead of the ~230 that a record object, its dict
    entry and its int objects cost, and nothing per block for the cyclic GC to walk.
    """

    _hash: array[int]
    _par: array[int]
    _clen: array[int]
    _state: list[_State]
    _toff: array[int]
    _tlen: array[int]
    _older: array[int]
    _newer: array[int]
    _free: array[int]
    _idx: array[int]
    _arena: array[int]
    _keys: dict[bytes, _Key]
    _touched: dict[_Key, tuple[bool, int, Tier]]
    _want: list[_Chain]
    _failed: list[_Chain]
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
        self._engine = engine
        self._model = model
        self._max_chain = limits.max_chain_tokens
        self._max_blocks = limits.max_tracked_blocks
        self._max_tokens = limits.max_retained_tokens
        # Offsets into the arena: it holds at most about twice the retained tokens.
        self._offset_code = "I" if limits.max_retained_tokens < (1 << 30) else "Q"
        self._arena_slack = _ARENA_SLACK
        self._verify = salt_verifier
        self._can_detokenize = can_detokenize
        self._media_bits: dict[str, int] = {MEDIUM_GPU: _GPU_BIT}
        self._noticed: set[TrackerNotice] = set()
        self._notices: list[TrackerNotice] = []
        # Multiplicative hashing with a random odd multiplier: engines' hashes are not chosen
        # to spread over an index, and a hostile source must not be able to make them collide.
        self._mult = random.getrandbits(64) | 1
        # counters (monotonic, survive clears)
        self.salt_rejected = 0
        self.token_count_mismatch = 0
        self.unattributed = 0  # chains discarded (one per decision, descendants not recounted)
        self.unattributed_reasons: Counter[str] = Counter()
        self.pruned = 0  # records dropped to honour a bound
        self.removed_unknown = 0  # BlockRemoved / BlockUpdated of a hash we do not track
        self.placeholders_unknown = 0  # tokenless stores of unknown hashes, ignored
        self.group_skipped = 0  # events of an untracked KV-cache group
        self.resolve_requests = 0
        self.resolve_failed = 0  # FAILED outcomes
        self.stale_outcomes = 0  # outcomes for a chain no longer waiting for one
        self.bad_outcomes = 0  # RESOLVED without a 32-byte key (treated as FAILED)
        self.clears = 0
        self._inflight: dict[int, _Ask] = {}  # request head -> request (kept across clears)
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

    @property
    def pending(self) -> int:
        """Chains waiting for a key (asking, waiting for growth, or waiting for an ancestor)."""
        return self._n_pending

    @property
    def inflight(self) -> int:
        """Requests handed out and not answered yet (also those whose chain is gone)."""
        return len(self._inflight)

    def records(self) -> dict[int, BlockView]:
        """Every record by hash, in pruning order (oldest first): copies, for tests."""
        out: dict[int, BlockView] = {}
        r = self._oldest
        while r != _NONE:
            out[self._hash[r]] = BlockView(self._parent_of(r), self._clen[r], self._media[r],
                                           self._state[r], self._tokens_of(r))
            r = self._newer[r]
        return out

    def forget_requests(self) -> None:
        """Consider every request handed out lost (call when the resolver was replaced and will
        never answer them): their chains ask again at the next `take_resolve_requests`."""
        asks, self._inflight = self._inflight, {}
        for ask in asks.values():
            ch = ask.chain
            if ch is not None and ch.status == _PENDING:
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
            if ch.status == _PENDING and ch.last == _LAST_FAILED and not ch.busy():
                self._want_request(ch)
                n += 1
        return n

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

    def take_resolve_requests(self) -> list[ResolveRequest]:
        """New work for the resolver: at most one request per unresolved chain, built now from
        its current head (so a chain that grew since it was queued asks for all of it)."""
        want, self._want = self._want, []
        out: list[ResolveRequest] = []
        later: list[_Chain] = []
        for ch in want:
            ch.wanted = False
            if ch.status != _PENDING or ch.inflight is not None or ch.waiting:
                continue
            head = self._find(ch.head) if ch.head is not None else _NONE
            if head == _NONE:
                continue
            head_hash = self._hash[head]
            limited = min(self._clen[head], self._max_chain)
            if ch.probe_q is not None and ch.probe_q > limited:  # its branch lost blocks since
                ch.probe_q = None
                ch.base = None
            n = ch.probe_q if ch.probe_q is not None else limited
            if ch.probe_q is None and ch.last == _LAST_PENDING and limited <= ch.requested:
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
                self._inflight[head_hash] = _Ask(ch, n, probing)
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
        if ch is None or ch.status != _PENDING or ch.inflight != outcome.head:
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
                ch.last = _LAST_PENDING
            else:
                self.resolve_failed += 1
                ch.last = _LAST_FAILED
                failed = self._failed
                failed.append(ch)
                if len(failed) > 1024 and len(failed) > 2 * self._n_pending:
                    # Nobody calls retry_failed: keep only chains still waiting, once each.
                    self._failed = list({id(w): w for w in failed
                                         if w.status == _PENDING and w.last == _LAST_FAILED}.values())
            self._release_waiters(ch, ask=status is ResolveStatus.PENDING)
            self._after_answer(ch)
        # A resolved chain keeps a copy of root..d, which may include ancestors' tokens.
        self._enforce_bounds()
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
        # record columns, by slot
        self._hash = array("Q")
        self._par = array("Q")  # parent hash (meaningful when _haspar[slot])
        self._haspar = bytearray()
        self._clen = array("Q")  # chain length in tokens, root..this block
        self._media = bytearray()  # media bits and _TAINT
        self._state = []
        self._toff = array(self._offset_code)  # own tokens: arena[toff:toff+tlen]
        self._tlen = array("I")
        self._older = array("i")  # pruning order: least recently stored first
        self._newer = array("i")
        self._oldest = _NONE
        self._newest = _NONE
        self._free = array("i")  # slots of removed records, reused first
        self._live = 0
        # index: hash -> slot, open addressing with linear probing
        self._idx = array("i", [_EMPTY]) * _MIN_INDEX
        self._mask = _MIN_INDEX - 1
        self._shift = 64 - (_MIN_INDEX.bit_length() - 1)
        self._filled = 0  # index positions not _EMPTY (records and tombstones)
        # tokens of the records that keep some; `_garbage` of them belong to no record any more
        self._arena = array("I")
        self._garbage = 0
        self._tokens = 0  # tokens retained (block segments + resolved chains' copies)
        self._keys = {}  # interned keys with attributed blocks (or touched)
        self._touched = {}  # key -> (live, count, tier) before
        self._want = []  # chains to ask for at the next take_resolve_requests
        self._failed = []  # chains whose last answer was FAILED
        for ask in self._inflight.values():
            ask.chain = None  # answers may still come: they are stale
        self._n_pending = 0
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

    def _medium_bit(self, medium: str | None) -> int:
        if medium is None:
            return _GPU_BIT  # engines before the medium field: GPU
        bit = self._media_bits.get(medium)
        if bit is None:
            n = len(self._media_bits)  # GPU + storage media seen so far
            bit = _FIRST_STORAGE_BIT << (n - 1) if n <= 5 else _OVERFLOW_BIT
            if n <= 5:
                self._media_bits[medium] = bit
        return bit

    def _accept_group(self, group: int, kind: str | None) -> bool:
        if self._group is None:
            if kind is None or kind in _FULL_KINDS:
                self._group = group
                return True
            return False
        return group == self._group

    # --- records: index, columns, token arena ----------------------------------------------

    def _find(self, h: int) -> int:
        """The slot of the record of hash `h`, or _NONE."""
        idx = self._idx
        hashes = self._hash
        mask = self._mask
        i = ((h * self._mult) & _U64) >> self._shift
        while True:
            s = idx[i]
            if s >= 0:
                if hashes[s] == h:
                    return s
            elif s == _EMPTY:
                return _NONE
            i = (i + 1) & mask

    def _parent_of(self, r: int) -> int | None:
        return self._par[r] if self._haspar[r] else None

    def _tokens_of(self, r: int) -> array[int]:
        off = self._toff[r]
        return self._arena[off:off + self._tlen[r]]

    def _new_block(
        self, h: int, parent: int | None, chain_len: int, media: int, state: _State,
        tokens: array[int] | None,
    ) -> int:
        """Add the record of `h` (not tracked yet) as the newest; returns its slot."""
        if chain_len > _U64:  # noqa: PLR1730 (no call to min on the hot path)
            chain_len = _U64  # absurd tokenless block sizes only
        free = self._free
        if free:
            r = free.pop()
            self._hash[r] = h
            if parent is None:
                self._haspar[r] = 0
            else:
                self._par[r] = parent
                self._haspar[r] = 1
            self._clen[r] = chain_len
            self._media[r] = media
        else:
            r = len(self._hash)
            self._hash.append(h)
            self._par.append(0 if parent is None else parent)
            self._haspar.append(parent is not None)
            self._clen.append(chain_len)
            self._media.append(media)
            self._state.append(None)
            self._toff.append(0)
            self._tlen.append(0)
            self._older.append(_NONE)
            self._newer.append(_NONE)
        if tokens:
            arena = self._arena
            self._toff[r] = len(arena)
            self._tlen[r] = n = len(tokens)
            arena.extend(tokens)
            self._tokens += n
        self._live += 1
        # link as newest (before indexing it: a rebuild of the index walks this order)
        newest = self._newest
        self._older[r] = newest
        self._newer[r] = _NONE
        if newest == _NONE:
            self._oldest = r
        else:
            self._newer[newest] = r
        self._newest = r
        # index it (the hash is not there: the first free position takes it)
        idx = self._idx
        mask = self._mask
        i = ((h * self._mult) & _U64) >> self._shift
        while (s := idx[i]) >= 0:
            i = (i + 1) & mask
        idx[i] = r
        if s == _EMPTY:
            self._filled += 1
            if self._filled * 4 > 3 * len(idx):
                self._rebuild_index()
        if type(state) is _Key:
            touched = self._touched
            if state not in touched:
                touched[state] = (state.blocks > 0, state.max_len,
                                  Tier.GPU_HOT if state.gpu else Tier.STORAGE_WARM)
            self._state[r] = state
            state.add(chain_len, bool(media & _GPU_BIT))
            if tokens:
                self._drop_tokens(r)
        elif type(state) is _Chain:
            self._state[r] = state
            state.nblocks += 1
            state.head = h
        return r

    def _rebuild_index(self) -> None:
        """A fresh index at most half full (tombstones dropped): the smallest power of two of at
        least twice the records."""
        size = _MIN_INDEX
        while size < 2 * self._live:
            size <<= 1
        idx: array[int] = array("i", [_EMPTY]) * size
        mask = size - 1
        shift = 64 - (size.bit_length() - 1)
        mult = self._mult
        hashes = self._hash
        r = self._oldest
        newer = self._newer
        while r != _NONE:
            i = ((hashes[r] * mult) & _U64) >> shift
            while idx[i] != _EMPTY:
                i = (i + 1) & mask
            idx[i] = r
            r = newer[r]
        self._idx, self._mask, self._shift, self._filled = idx, mask, shift, self._live

    def _drop_tokens(self, r: int) -> None:
        n = self._tlen[r]
        if n:
            self._tokens -= n
            self._tlen[r] = 0
            self._garbage += n
            if self._garbage >= self._arena_slack and 2 * self._garbage >= len(self._arena):
                self._compact_arena()

    def _compact_arena(self) -> None:
        """Copy the tokens still held to a new arena (their order: pruning order)."""
        arena = self._arena
        new: array[int] = array("I")
        toff, tlen, newer = self._toff, self._tlen, self._newer
        r = self._oldest
        while r != _NONE:
            n = tlen[r]
            if n:
                off = toff[r]
                toff[r] = len(new)
                new.extend(arena[off:off + n])
            r = newer[r]
        self._arena = new
        self._garbage = 0

    def _refresh(self, r: int) -> None:
        if r == self._newest:
            return
        older_, newer_ = self._older, self._newer
        older, newer = older_[r], newer_[r]  # newer is not _NONE: r is not the newest
        if older == _NONE:
            self._oldest = newer
        else:
            newer_[older] = newer
        older_[newer] = older
        newest = self._newest
        older_[r] = newest
        newer_[r] = _NONE
        newer_[newest] = r
        self._newest = r

    def _enforce_bounds(self) -> None:
        while self._live > self._max_blocks or self._tokens > self._max_tokens:
            victim = self._oldest
            if victim == _NONE:
                break
            self._remove(victim)
            self.pruned += 1

    def _remove(self, r: int) -> None:
        h = self._hash[r]
        idx = self._idx
        mask = self._mask
        i = ((h * self._mult) & _U64) >> self._shift
        while idx[i] != r:
            i = (i + 1) & mask
        idx[i] = _GONE
        if self._tlen[r]:
            self._drop_tokens(r)
        st = self._state[r]
        if type(st) is _Key:
            touched = self._touched
            if st not in touched:
                touched[st] = (st.blocks > 0, st.max_len,
                               Tier.GPU_HOT if st.gpu else Tier.STORAGE_WARM)
            st.remove(self._clen[r], bool(self._media[r] & _GPU_BIT))
        elif type(st) is _Chain:
            self._chain_lost_block(st, r)
        # unlink from the pruning order, give the slot back
        older, newer = self._older[r], self._newer[r]
        if older == _NONE:
            self._oldest = newer
        else:
            self._newer[older] = newer
        if newer == _NONE:
            self._newest = older
        else:
            self._older[newer] = older
        self._state[r] = None
        self._free.append(r)
        self._live -= 1

    # --- per-key aggregates and transitions -----------------------------------------------

    def _intern(self, key: bytes) -> _Key:
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = _Key(key)
            self._touch_key(k)  # so that a key that never gets a block is dropped at flush
        return k

    def _touch_key(self, k: _Key) -> None:
        if k not in self._touched:
            self._touched[k] = (k.blocks > 0, k.max_len, Tier.GPU_HOT if k.gpu else Tier.STORAGE_WARM)

    def _flush(self, out: list[PrefixTransition]) -> None:
        keys = self._keys
        for k, (was_live, old_len, old_tier) in self._touched.items():
            if k.blocks:
                tier = Tier.GPU_HOT if k.gpu else Tier.STORAGE_WARM
                if not was_live:
                    out.append(PrefixTransition(TransitionKind.CREATED, k.prefix_hash, k.max_len, tier))
                elif tier is not old_tier:
                    out.append(PrefixTransition(TransitionKind.TIER, k.prefix_hash, k.max_len, tier))
                elif k.max_len != old_len:
                    out.append(
                        PrefixTransition(TransitionKind.TOKEN_COUNT, k.prefix_hash, k.max_len, tier)
                    )
            else:
                if was_live:
                    out.append(PrefixTransition(TransitionKind.EVICTED, k.prefix_hash))
                if keys.get(k.key) is k:
                    del keys[k.key]
        self._touched.clear()

    def _attribute(self, r: int, k: _Key) -> None:
        """Attribute a record (new or pre-anchor) to `k`; its tokens are no longer needed."""
        if k not in self._touched:
            self._touch_key(k)
        self._state[r] = k
        k.add(self._clen[r], bool(self._media[r] & _GPU_BIT))
        if self._tlen[r]:
            self._drop_tokens(r)

    def _set_media(self, r: int, media: int) -> None:
        old = self._media[r]
        if old == media:
            return
        st = self._state[r]
        if type(st) is _Key and (old ^ media) & _GPU_BIT:
            self._touch_key(st)
            st.gpu += 1 if media & _GPU_BIT else -1
        self._media[r] = media

    # --- events ---------------------------------------------------------------------------

    def _split(self, n: int, total: int, block_size: int) -> list[int] | None:
        """Tokens per hashed block, or None when the count does not fit the engine's rule."""
        if block_size <= 0:
            if n == 1:
                return [total]
            return [total // n] * n if total % n == 0 else None
        full = block_size * n
        engine = self._engine
        if engine is Engine.SGLANG:
            ok = total == full
        elif engine is Engine.VLLM:
            ok = total >= full and total % block_size == 0
        else:  # TRT-LLM: the last block of an event may be partial (§4.2)
            ok = full - block_size < total <= full
        if not ok:
            return None
        return [block_size] * (n - 1) + [total - block_size * (n - 1)]

    def _salt_of(self, ev: BlockStored) -> str | None:
        if self._engine is Engine.VLLM:
            if ev.cache_salt is not None and ev.cache_salt.startswith(SALT_PREFIX):
                return ev.cache_salt
            for s in reversed(vllm_salt_candidates(ev)):  # the salt comes last (§2.6)
                if s.startswith(SALT_PREFIX):
                    return s
            return None
        return ev.cache_salt

    def _on_stored(self, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return
        if ev.group_idx is not None and not self._accept_group(ev.group_idx, ev.kv_cache_spec_kind):
            self.group_skipped += 1
            self._notice(TrackerNotice.GROUP_SKIPPED)
            return
        find = self._find
        bit = self._medium_bit(ev.medium)
        prev = _NONE
        parent_hash = ev.parent_hash
        if parent_hash is not None:
            prev = find(parent_hash)
            if prev != _NONE:
                self._refresh(prev)  # a child under it: it is in use
        tokens = ev.token_ids
        total = len(tokens)
        if total == 0:
            self._on_tokenless(ev, prev, bit)
            return
        bs = ev.block_size
        seglens: list[int] | None = None  # None: every block takes `bs` tokens
        if not (bs > 0 and total == bs * n) or tokens.typecode != "I":
            seglens = self._split(n, total, bs)
            mismatch = seglens is None or tokens.typecode != "I"
            if seglens is None or mismatch:
                self.token_count_mismatch += 1
                self._notice(TrackerNotice.TOKEN_COUNT_MISMATCH)
                seglens = _even_split(total, n)
        else:
            mismatch = False
        media = bit | (_TAINT if mismatch else 0)
        model = ev.lora_name or self._model
        max_chain = self._max_chain
        clen, media_, state_, hash_ = self._clen, self._media, self._state, self._hash
        new_block = self._new_block
        offset = 0
        seglen = bs
        # chains this event started or extended -> what to do once all its blocks are in
        todo: dict[_Chain, int] | None = None
        for i in range(n):
            h = hashes[i]
            if seglens is not None:
                seglen = seglens[i]
            r = find(h)
            if r != _NONE:  # stored again: idempotent, adds its medium, refreshes its age
                old = media_[r]
                if old | bit != old:
                    self._set_media(r, old | bit)
                self._refresh(r)
                prev = r
                offset += seglen
                continue
            if prev != _NONE and type(pst := state_[prev]) is _Key and not media_[prev] & _TAINT:
                # the common case: the chain goes on under an attributed block
                prev = new_block(h, hash_[prev], clen[prev] + seglen, media, pst, None)
                offset += seglen
                continue
            parent_len = 0 if prev == _NONE else clen[prev]
            state, reason, step = self._place(ev, prev, i, model, mismatch)
            if type(state) is _Chain:
                keep = min(seglen, max(0, max_chain - parent_len))
                if step is not None:
                    if todo is None:
                        todo = {}
                    if state not in todo:
                        todo[state] = step
            else:
                keep = 0
            prev = new_block(
                h, parent_hash if prev == _NONE else hash_[prev], parent_len + seglen, media,
                state, tokens[offset : offset + keep] if keep else None,
            )
            if reason is not None:
                self._count_unattributed(reason)
            offset += seglen
        if todo is None:
            return
        for ch, step in todo.items():
            if ch.status != _PENDING:
                continue
            if step == _STEP_COMPARE:
                self._match_resolved_fork(ch)
            elif step == _STEP_NEW:
                if not ch.waiting:
                    self._want_request(ch)
            else:
                self._on_growth(ch)

    def _place(
        self, ev: BlockStored, prev: int, i: int, model: str, mismatch: bool
    ) -> tuple[_State, UnattributedReason | None, int | None]:
        """State of a new block under `prev`: (state, reason to count if discarded, next step)."""
        if prev == _NONE:
            if i == 0 and ev.parent_hash is None:
                return self._root_state(ev, model, mismatch)
            return None, UnattributedReason.ORPHAN, None
        if self._media[prev] & _TAINT:
            return None, None, None  # under a block whose tokens did not fit
        st = self._state[prev]
        if type(st) is _Key:
            return st, None, None
        if type(st) is not _Chain:
            return None, None, None  # under an unattributed block
        if st.status == _PENDING:
            if mismatch:
                return None, UnattributedReason.TOKEN_COUNT_MISMATCH, None
            prev_hash = self._hash[prev]
            if st.head == prev_hash:
                return st, None, _STEP_GROW
            # A branch under a chain being resolved waits for its answer (SPEC §4: one call per
            # distinct chain); under an idle pending chain it asks for itself.
            fork = self._new_chain(model, prev_hash)
            forks = st.forks
            if len(forks) >= 64 and not len(forks) & (len(forks) - 1):  # at 64, 128, 256, ...
                st.forks = forks = [w for w in forks if w.status == _PENDING]
            forks.append(fork)
            fork.waiting = st.busy()
            return fork, None, _STEP_NEW
        if st.status == _RESOLVED and st.key is not None:
            if self._clen[prev] >= st.d:  # tightened below it after it was stored
                k = self._intern(st.key)
                self._attribute(prev, k)
                self._chain_lost_block(st, prev)
                return k, None, None
            if mismatch:
                return None, UnattributedReason.TOKEN_COUNT_MISMATCH, None
            return self._new_chain(model, self._hash[prev]), None, _STEP_COMPARE
        return None, None, None  # under a discarded chain

    def _root_state(
        self, ev: BlockStored, model: str, mismatch: bool
    ) -> tuple[_State, UnattributedReason | None, int | None]:
        """State of a new first block of a chain (no parent): the salt decides first."""
        if self._verify is not None:
            salt = self._salt_of(ev)
            if salt is not None:
                key = self._verify(salt)
                if isinstance(key, bytes) and len(key) == KEY_BYTES:
                    return self._intern(key), None, None
                self.salt_rejected += 1
                self._notice(TrackerNotice.SALT_REJECTED)
                return None, UnattributedReason.SALT_REJECTED, None
        if not self._can_detokenize:
            return None, UnattributedReason.NO_SALT, None
        if mismatch:
            return None, UnattributedReason.TOKEN_COUNT_MISMATCH, None
        return self._new_chain(model, None), None, _STEP_NEW

    def _new_chain(self, model: str, fork_at: int | None) -> _Chain:
        self._n_pending += 1
        return _Chain(model, fork_at)

    def _on_tokenless(self, ev: BlockStored, prev: int, bit: int) -> None:
        """Placeholder stores (offload) and tokenless blocks."""
        chainable = ev.parent_hash is not None and prev != _NONE and ev.block_size > 0
        for h in ev.block_hashes:
            r = self._find(h)
            if r != _NONE:
                self._set_media(r, self._media[r] | bit)
                self._refresh(r)
                prev = r
                continue
            if not chainable or prev == _NONE:
                self.placeholders_unknown += 1
                prev = _NONE
                continue
            # No tokens: only an attributed chain can continue (by block_size, §4).
            st = self._state[prev]
            state: _State = st if type(st) is _Key and not self._media[prev] & _TAINT else None
            prev = self._new_block(h, self._hash[prev], self._clen[prev] + ev.block_size, bit,
                                   state, None)

    def _on_removed(self, ev: BlockRemoved) -> None:
        if ev.group_idx is not None and self._group is not None and ev.group_idx != self._group:
            self.group_skipped += 1
            return
        find = self._find
        bit = None if ev.medium is None else self._medium_bit(ev.medium)
        for h in ev.block_hashes:
            r = find(h)
            if r == _NONE:
                self.removed_unknown += 1
                continue
            if bit is None:
                self._remove(r)
                continue
            old = self._media[r]
            if not old & bit:
                continue  # not held in that medium
            media = old & ~bit
            if media & _MEDIA:
                self._set_media(r, media)
            else:
                self._remove(r)

    def _on_updated(self, ev: BlockUpdated) -> None:
        r = self._find(ev.block_hash)
        if r == _NONE:
            self.removed_unknown += 1
            return
        new_bit = self._medium_bit(ev.new_medium)
        if ev.old_medium is None:
            # Old level not reported: TRT-LLM blocks live in one level at a time.
            media = (self._media[r] & _TAINT) | new_bit
        else:
            media = (self._media[r] & ~self._medium_bit(ev.old_medium)) | new_bit
        self._set_media(r, media)

    # --- chains ---------------------------------------------------------------------------

    def _count_unattributed(self, reason: UnattributedReason) -> None:
        self.unattributed += 1
        self.unattributed_reasons[reason.value] += 1

    def _want_request(self, ch: _Chain) -> None:
        if not ch.wanted:
            ch.wanted = True
            self._want.append(ch)

    def _head_len(self, ch: _Chain) -> int | None:
        """Chain length of `ch`'s head record, or None when it has none."""
        head = self._find(ch.head) if ch.head is not None else _NONE
        return None if head == _NONE else self._clen[head]

    def _on_growth(self, ch: _Chain) -> None:
        """A block joined the head of pending `ch`."""
        if ch.busy():
            return  # the outstanding answer covers it
        head_len = self._head_len(ch)
        if head_len is None:
            return
        limited = min(head_len, self._max_chain)
        if ch.probe_q is None and ch.last == _LAST_PENDING and limited <= ch.requested:
            if limited >= self._max_chain:
                self._discard_chain(ch, UnattributedReason.TOO_LONG)
            return
        self._want_request(ch)

    def _after_answer(self, ch: _Chain) -> None:
        """After PENDING / FAILED: ask again at once if the chain grew meanwhile (since it was
        asked: a probe asked for fewer tokens than the chain had, which is no growth)."""
        head_len = self._head_len(ch)
        if head_len is None:
            return
        limited = min(head_len, self._max_chain)
        if limited > ch.asked_len:
            self._want_request(ch)
        elif ch.last == _LAST_PENDING and limited >= self._max_chain:
            self._discard_chain(ch, UnattributedReason.TOO_LONG)

    def _release_waiters(self, ch: _Chain, *, ask: bool) -> None:
        """Forks waiting for `ch`'s answer learn nothing from it: they ask themselves (PENDING)
        or wait for their own growth (FAILED: do not multiply calls to a failing resolver)."""
        keep: list[_Chain] = []
        for w in ch.forks:
            if w.status != _PENDING:
                continue
            keep.append(w)
            if w.waiting:
                w.waiting = False
                if ask:
                    self._want_request(w)
        ch.forks = keep

    def _chain_blocks(self, ch: _Chain) -> list[int]:
        """The chain's records, deepest first."""
        out: list[int] = []
        find, state, haspar, par = self._find, self._state, self._haspar, self._par
        cur = find(ch.head) if ch.head is not None else _NONE
        while cur != _NONE and state[cur] is ch:
            out.append(cur)
            cur = find(par[cur]) if haspar[cur] else _NONE
        return out

    def _collect(self, r: int, n: int) -> array[int] | None:
        """The first `n` tokens of the chain root..r, or None when some are gone."""
        max_chain = self._max_chain
        clen, tlen, state = self._clen, self._tlen, self._state
        segs: list[array[int]] = []
        cur = r
        while True:
            st = state[cur]
            if type(st) is not _Chain:
                return None
            cur_len = clen[cur]
            if st.status == _RESOLVED:
                ref = st.tokens
                if ref is None or len(ref) < min(cur_len, max_chain):
                    return None
                segs.append(ref[: min(cur_len, max_chain)])
                break
            if st.status != _PENDING:
                return None
            parent = _NONE
            parent_len = 0
            if self._haspar[cur]:
                parent = self._find(self._par[cur])
                if parent == _NONE:
                    return None
                parent_len = clen[parent]
            if tlen[cur] != min(cur_len, max_chain) - min(parent_len, max_chain):
                return None
            if tlen[cur]:
                segs.append(self._tokens_of(cur))
            if parent == _NONE:
                break
            cur = parent
        out: array[int] = array("I")
        for s in reversed(segs):
            out.extend(s)
        if len(out) > n:
            del out[n:]
        return out

    def _fork_tokens(self, w: _Chain) -> tuple[int, array[int]] | None:
        """The fork record and `w`'s own tokens after it, or None when its path is broken."""
        path = self._chain_blocks(w)
        if not path or w.fork_at is None or self._parent_of(path[-1]) != w.fork_at:
            return None
        fork = self._find(w.fork_at)
        if fork == _NONE:
            return None
        toks: array[int] = array("I")
        for r in reversed(path):
            toks.extend(self._tokens_of(r))
        return fork, toks

    def _match_resolved_fork(self, w: _Chain) -> None:
        """`w` starts under a pre-anchor block of a resolved chain: compare, then take its key,
        probe at the divergence, or ask with the whole chain."""
        fork = self._find(w.fork_at) if w.fork_at is not None else _NONE
        base = self._state[fork] if fork != _NONE else None
        if type(base) is not _Chain or base.status != _RESOLVED or base.key is None:
            self._ask_alone(w)
            return
        d = self._compare(w, base)
        if d is not None:
            self._resolve_chain(w, base.key, d)

    def _compare(self, w: _Chain, base: _Chain) -> int | None:
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
        c0 = self._clen[fork]
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

    def _ask_alone(self, w: _Chain) -> None:
        w.waiting = False
        if w.inflight is None:
            self._want_request(w)

    def _resolve_chain(self, chain: _Chain, key: bytes, d: int) -> None:
        """Settle `chain` as resolved at d, and through it the branches that waited for it."""
        k = self._intern(key)
        clen = self._clen
        work = [(chain, d)]
        while work:
            ch, d = work.pop()
            if ch.status != _PENDING:
                continue
            recs = self._chain_blocks(ch)
            tokens = None
            if recs and clen[recs[-1]] < d:  # some blocks stay pre-anchor: keep root..d
                tokens = self._collect(recs[0], min(d, clen[recs[0]], self._max_chain))
                if tokens is not None:
                    tokens = array("I", tokens)  # exact size
                    self._tokens += len(tokens)
            ch.status = _RESOLVED
            self._n_pending -= 1
            self._cancel_request(ch)
            ch.key = key
            ch.d = d
            ch.tokens = tokens
            anchor = _NONE
            for r in recs:
                if clen[r] >= d:
                    self._attribute(r, k)
                    ch.nblocks -= 1
                    anchor = r
                else:
                    self._drop_tokens(r)  # `ch.tokens` has them
            ch.anchor = None if anchor == _NONE else self._hash[anchor]
            if ch.nblocks == 0:
                self._free_chain_tokens(ch)
            forks, ch.forks = ch.forks, []
            for w in forks:
                if w.status != _PENDING:
                    continue
                fork = self._find(w.fork_at) if w.fork_at is not None else _NONE
                fork_state = self._state[fork] if fork != _NONE else None
                if fork_state is k:  # under an attributed block
                    work.append((w, 0))
                elif fork != _NONE and fork_state is ch:
                    wd = self._compare(w, ch)
                    if wd is not None:
                        work.append((w, wd))
                else:
                    self._ask_alone(w)

    def _tighten(self, ch: _Chain, d: int) -> None:
        """A probe showed that root..d (d < ch.d) already determines `ch`'s key."""
        if ch.status != _RESOLVED or ch.key is None or d >= ch.d:
            return
        k = self._intern(ch.key)
        ch.d = d
        if ch.tokens is not None and len(ch.tokens) > d:
            self._tokens -= len(ch.tokens) - d
            ch.tokens = ch.tokens[:d]
        find, state, clen = self._find, self._state, self._clen
        anchor = find(ch.anchor) if ch.anchor is not None else _NONE
        if anchor != _NONE:
            cur = find(self._par[anchor]) if self._haspar[anchor] else _NONE
            while cur != _NONE and state[cur] is ch and clen[cur] >= d:
                parent = self._parent_of(cur)
                self._attribute(cur, k)
                ch.nblocks -= 1
                ch.anchor = self._hash[cur]
                cur = find(parent) if parent is not None else _NONE
        # Pre-anchor blocks not reachable from the anchor are attributed when a child arrives.
        if ch.nblocks == 0:
            self._free_chain_tokens(ch)

    def _discard_chain(
        self, chain: _Chain, reason: UnattributedReason, *, count: bool = True
    ) -> None:
        """Settle `chain` and every pending chain under it as unattributed."""
        if chain.status != _PENDING:
            return
        if count:
            self._count_unattributed(reason)
        work = [chain]
        while work:
            ch = work.pop()
            if ch.status != _PENDING:
                continue
            ch.status = _DISCARDED
            self._n_pending -= 1
            self._cancel_request(ch)
            for r in self._chain_blocks(ch):
                self._state[r] = None
                ch.nblocks -= 1
                self._drop_tokens(r)
            work.extend(ch.forks)
            ch.forks = []

    def _cancel_request(self, ch: _Chain) -> None:
        if ch.inflight is not None:
            ask = self._inflight.get(ch.inflight)
            if ask is not None and ask.chain is ch:
                ask.chain = None  # its answer will be stale
            ch.inflight = None
        ch.waiting = False
        ch.base = None
        ch.probe_q = None
        ch.probing = False

    def _free_chain_tokens(self, ch: _Chain) -> None:
        if ch.tokens is not None:
            self._tokens -= len(ch.tokens)
            ch.tokens = None

    def _chain_lost_block(self, ch: _Chain, r: int) -> None:
        """Record `r` (state `ch`) was removed or pruned (already out of the index), or
        attributed."""
        ch.nblocks -= 1
        if ch.status == _RESOLVED:
            if ch.nblocks == 0:
                self._free_chain_tokens(ch)
            return
        if ch.status != _PENDING:
            return
        h = self._hash[r]
        lost = {h}
        if ch.head != h:
            # A block in the middle went: the blocks below it lost their path to the root.
            below = self._chain_blocks(ch)  # stops at the gap `r` left
            for b in below:
                self._state[b] = None
                ch.nblocks -= 1
                self._drop_tokens(b)
                lost.add(self._hash[b])
            if below:
                self._count_unattributed(UnattributedReason.TOKENS_UNAVAILABLE)
        parent = self._find(self._par[r]) if self._haspar[r] else _NONE
        ch.head = self._hash[parent] if parent != _NONE and self._state[parent] is ch else None
        if ch.inflight is not None and ch.inflight in lost and ch.head is not None:
            # The answer out is about a path the chain no longer has: what grows from its new
            # head may be another branch. Ask again for what is left.
            self._cancel_request(ch)
            self._release_waiters(ch, ask=True)
            self._want_request(ch)
        cut = [w for w in ch.forks if w.fork_at in lost or ch.head is None]
        ch.forks = [w for w in ch.forks if w.status == _PENDING and w not in cut]
        self._discard_lost(cut)
        if ch.head is None:
            ch.status = _DEAD
            self._n_pending -= 1
            self._cancel_request(ch)

    def _discard_lost(self, forks: list[_Chain]) -> None:
        """Branches whose fork block went: no path to the root, so nothing to resolve."""
        live = [w for w in forks if w.status == _PENDING]
        if live:
            self._count_unattributed(UnattributedReason.TOKENS_UNAVAILABLE)
        for w in live:
            self._discard_chain(w, UnattributedReason.TOKENS_UNAVAILABLE, count=False)
