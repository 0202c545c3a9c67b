"""What a tracked block's state can be, and the per-key aggregates (part of `core.tracker`).

A record's state is a `KeyAggregate` (attributed to a prefix key), a `Chain` (not resolved yet,
or resolved with blocks shorter than its key-determining length), or None (unattributed). A key's
aggregate counts its attributed blocks, those in GPU memory and the longest chain, which is all a
`PrefixTransition` needs; `Ask` is a request handed to the resolver. Pure data: the rules that
move records between states live in `core.blocks`, `core.chains` and `core.tracker`.
"""

from __future__ import annotations

import enum
from array import array
from bisect import bisect_left
from collections.abc import Callable
from typing import Final, NamedTuple

from kv_listener.core.model import Tier

# Media of a record: bit 0 = GPU, bits 1..5 = storage media in the order first seen, bit 6 = any
# further medium, bit 7 = TAINT (descendants unattributed). Staying below 256 keeps the value a
# cached small int: no allocation per record.
GPU_BIT: Final = 0x01
OVERFLOW_BIT: Final = 0x40
TAINT: Final = 0x80
MEDIA_MASK: Final = 0x7F
FIRST_STORAGE_BIT: Final = 0x02


# Chain status
PENDING: Final = 0
RESOLVED: Final = 1
DISCARDED: Final = 2
DEAD: Final = 3  # every block of a pending chain went before it was settled

# What the last answer for a chain was
LAST_NONE: Final = 0
LAST_PENDING: Final = 1
LAST_FAILED: Final = 2


#: No record (slots are 0 .. 2^31 - 2; `max_tracked_blocks` is at most 2^30). The columns of slot
#: numbers (`core.blocks`: the index and the pruning order) are `librt.vecs` vectors of i32:
#: compiled, an item is read or written in C, not through `array`'s generic item access (about
#: 250 instructions each, several per block).
NO_SLOT: Final = -1


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


class KeyAggregate:
    """An interned prefix key (its hex, the records' `prefix_hash`) and the aggregates of its
    attributed blocks.

    The blocks' chain lengths are counted so that `max_len` is known again when the longest
    goes, in the smallest of three forms that holds them:
    - `lengths` None and `step` 0: every block has `max_len` (a salted single-block chain, the
      first block of any key);
    - `lengths` None and `step` > 0, a run: one block at each of `base`, `base + step`, ...,
      `max_len` (a chain of one request, whose blocks are removed from either end: an LRU's
      oldest is its root, an engine's free queue gives its tail first). Two ints, where the
      packed counts of a 16-block chain took 250 bytes (15 B a block);
    - `lengths`, anything else: an `array("Q")` of `length << 32 | count` sorted by length
      (8 bytes per distinct length, where a dict took about 40); a length of 2^32 tokens or
      more (never seen, but not excluded by the bounds) or more than `_PACKED_MAX` distinct
      lengths, a dict of length -> count for good. A count fits in 32 bits (a source tracks
      fewer than 2^32 - 1 records: slots are u32)."""

    __slots__ = ("base", "blocks", "gpu", "lengths", "max_len", "prefix_hash", "step")

    def __init__(self, prefix_hash: str) -> None:
        self.prefix_hash = prefix_hash
        self.blocks = 0  # attributed blocks retained
        self.gpu = 0  # ... of which in GPU memory
        self.lengths: array[int] | dict[int, int] | None = None
        self.max_len = 0
        self.step = 0  # > 0: a run (see above), from `base` to `max_len`
        self.base = 0

    def tier(self) -> Tier:
        return Tier.GPU_HOT if self.gpu else Tier.STORAGE_WARM

    def add(self, chain_len: int, gpu: bool) -> None:
        if gpu:
            self.gpu += 1
        lengths = self.lengths
        if lengths is None:
            step = self.step
            if step:
                if chain_len == self.max_len + step:  # the run goes on: the common case
                    self.blocks += 1
                    self.max_len = chain_len
                    return
                lengths = self.lengths = self._run_counts()
                self.step = 0
            elif not self.blocks or chain_len == self.max_len:
                self.blocks += 1
                self.max_len = chain_len
                return
            elif self.blocks == 1:  # a second length: a run of two
                if chain_len > self.max_len:
                    self.base, self.step, self.max_len = self.max_len, chain_len - self.max_len, chain_len
                else:
                    self.base, self.step = chain_len, self.max_len - chain_len
                self.blocks = 2
                return
            else:
                lengths = self.lengths = _counts(self.max_len, self.blocks)
        self.blocks += 1
        if isinstance(lengths, array) and (chain_len >= _PACKABLE or (
                len(lengths) >= _PACKED_MAX and chain_len != self.max_len)):
            lengths = self.lengths = {v >> _COUNT_BITS: v & _COUNT_MASK for v in lengths}
        if isinstance(lengths, dict):
            lengths[chain_len] = lengths.get(chain_len, 0) + 1
            if chain_len > self.max_len:  # noqa: PLR1730 (no call to max on the hot path)
                self.max_len = chain_len
            return
        if chain_len > self.max_len:  # a chain grows: the common case
            lengths.append(chain_len << _COUNT_BITS | 1)
            self.max_len = chain_len
            return
        i = len(lengths) - 1 if chain_len == self.max_len else bisect_left(
            lengths, chain_len << _COUNT_BITS)
        if lengths[i] >> _COUNT_BITS == chain_len:
            lengths[i] += 1
        else:
            lengths.insert(i, chain_len << _COUNT_BITS | 1)

    def remove(self, chain_len: int, gpu: bool) -> None:
        if gpu:
            self.gpu -= 1
        lengths = self.lengths
        if lengths is None:
            step = self.step
            if not step:  # every block had max_len
                self.blocks -= 1
                if not self.blocks:
                    self.max_len = 0
                return
            end = True  # an end of the run
            if chain_len == self.base:
                self.base += step
            elif chain_len == self.max_len:
                self.max_len -= step
            else:
                end = False
            if end:
                self.blocks -= 1
                if self.blocks == 1:
                    self.step = 0
                return
            lengths = self.lengths = self._run_counts()  # from its middle
            self.step = 0
        self.blocks -= 1
        if not self.blocks:  # none left: the first form again
            self.lengths = None
            self.max_len = 0
            return
        if isinstance(lengths, dict):
            left = lengths[chain_len] - 1
            if left:
                lengths[chain_len] = left
                return
            del lengths[chain_len]
            if chain_len == self.max_len:
                # O(distinct lengths of this key), only when its longest block goes.
                self.max_len = max(lengths) if lengths else 0
            return
        i = len(lengths) - 1 if chain_len == self.max_len else bisect_left(
            lengths, chain_len << _COUNT_BITS)
        v = lengths[i] - 1
        if v & _COUNT_MASK:
            lengths[i] = v
            return
        del lengths[i]
        if chain_len == self.max_len:
            self.max_len = lengths[-1] >> _COUNT_BITS if lengths else 0

    def _run_counts(self) -> array[int] | dict[int, int]:
        """The run's blocks as `lengths` (it is left for good: one more length came)."""
        base, step, n = self.base, self.step, self.blocks
        if self.max_len < _PACKABLE and n < _PACKED_MAX:
            return array("Q", [(base + i * step) << _COUNT_BITS | 1 for i in range(n)])
        return {base + i * step: 1 for i in range(n)}


_COUNT_BITS: Final = 32
_COUNT_MASK: Final = (1 << 32) - 1
_PACKABLE: Final = 1 << 32  # chain lengths below this share a u64 with their count
# More distinct lengths than this and a key's counts become a dict: a binary search on an
# `array` is a call through Python with a boxed int per probe, and a key with that many lengths
# has that many blocks at least (the chat workload's shared prompts: 4,900 instructions more
# per block with arrays of hundreds of lengths).
_PACKED_MAX: Final = 32


def _counts(length: int, blocks: int) -> array[int] | dict[int, int]:
    """`KeyAggregate.lengths` when a second length comes: one length with its blocks."""
    if length < _PACKABLE:
        return array("Q", (length << _COUNT_BITS | blocks,))
    return {length: blocks}


class Chain:
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
        self.status = PENDING
        self.head: int | None = None  # deepest block
        self.nblocks = 0  # blocks whose state is this chain
        self.fork_at = fork_at  # the block (of another chain) this one starts under
        # pending chains started under our blocks (while pending); most chains never have one,
        # so the shared empty tuple stands for none (a list per chain costs 56 bytes)
        self.forks: list[Chain] | tuple[()] = ()
        # request bookkeeping
        self.inflight: int | None = None  # head of the outstanding request
        self.requested = 0  # tokens sent in the last request
        self.asked_len = 0  # chain length (capped) when it was sent: a probe sends fewer tokens
        self.last = LAST_NONE
        self.wanted = False  # queued for take_resolve_requests
        self.waiting = False  # waits for the answer of the chain it forked from
        self.probe_q: int | None = None  # next request asks for root..probe_q only
        self.probing = False  # the outstanding request is such a probe
        self.base: Chain | None = None  # resolved chain a probe may tighten
        # resolution
        self.key: bytes | None = None
        self.d = 0  # tokens root..d determine the key
        self.anchor: int | None = None  # shallowest attributed block of the chain
        self.tokens: array[int] | None = None  # root..d while pre-anchor blocks exist

    def busy(self) -> bool:
        return self.inflight is not None or self.wanted or self.waiting


State = KeyAggregate | Chain | None  # None: unattributed


class Ask:
    """A request handed to the resolver and not answered yet. It outlives its chain (settled,
    gone, cleared): the resolver still holds the head and drops another request for it, so the
    same head is not asked again until this answer arrives (a new chain with the same head, i.e.
    the same tokens, adopts it when it asks for the same tokens)."""

    __slots__ = ("chain", "n", "probing")

    def __init__(self, chain: Chain, n: int, probing: bool) -> None:
        self.chain: Chain | None = chain
        self.n = n
        self.probing = probing


def even_split(total: int, n: int) -> list[int]:
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


class BlockView(NamedTuple):
    """One record as `Tracker.records()` shows it (tests, debugging): a copy, not the record."""

    parent: int | None
    chain_len: int
    media: int
    state: State
    tokens: array[int]
