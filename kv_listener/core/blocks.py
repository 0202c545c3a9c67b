"""The block records of one source's tracker and their bounds (part of `core.tracker`).

Records are not objects: a record is a slot number, its fields live in typed columns (`librt.vecs`
vectors for the hash, parent, chain length, media and pruning order, `array` for the token offsets
and counts, a list for the state), found by hash through an open-addressing index of slot numbers
(positions from a keyed hash, so that a hostile engine cannot make its hashes collide), and the
tokens of the records that keep some lie in one token arena (4 bytes per token), compacted when
half of it is dropped tokens. About 60 bytes per block instead of the ~230 that a record object,
its dict entry and its int objects cost, and nothing per block for the cyclic GC to walk (it paused
the loop 40-80 ms at 100k records).
`bench/tracker.py` prints the figures.

Bounds: when `max_tracked_blocks` or `max_retained_tokens` is exceeded, the least recently stored
records go first (a record is refreshed when stored again or when a child is stored under it, so
hot shared prefixes outlive cold tails). Attributing a record to a key updates the key's
aggregates (`core.record_state.KeyAggregate`), and `_flush` turns the keys touched since the last
flush into `PrefixTransition`s: a prefix is evicted only when its last attributed block goes.
"""

from __future__ import annotations

import random
from array import array
from typing import Any, Final

from librt.vecs import vec
from mypy_extensions import i32, i64, u8

from kv_listener.core.limits import Limits
from kv_listener.core.model import MEDIUM_GPU, PrefixTransition, Tier, TransitionKind
from kv_listener.core.record_state import (
    FIRST_STORAGE_BIT,
    GPU_BIT,
    NO_SLOT,
    OVERFLOW_BIT,
    BlockView,
    Chain,
    KeyAggregate,
    State,
)

# The index is open addressing with linear probing and no tombstones: a removal moves the
# records after it in their run back into the gap (Knuth's algorithm R, TAOCP 6.4), so a lookup
# stops at the first empty position and the index is rebuilt only to grow. (With tombstones a
# steady churn rebuilt it over and over, each time removals had left about a quarter of it to
# them; a rebuild walks every record: 0.45 s of CPU at a million blocks here, a stalled loop.)
_EMPTY: Final = NO_SLOT  # index position that holds no record
_U64: Final = (1 << 64) - 1
# The hash columns are i64 vectors: a u64 hash is kept as the i64 of the same bits.
_I64_MAX: Final = (1 << 63) - 1
_TWO64: Final = 1 << 64
# The chain length column is i32 (4 bytes a block less than i64): a length of 2^31 - 1 tokens
# or more, which only absurd block sizes reach, is kept in a dict by slot, the column holding
# this marker.
_BIG_LEN: Final = (1 << 31) - 1
# Index positions: the block hash's 64 bits cut into four 13-bit pieces and a 12-bit one, then
# Dietzfelbinger's multiply-add-shift with random 44-bit coefficients (universal for up to 2^31
# positions). Compiled, that is machine arithmetic (`i64`: every product and sum stays under 2^60);
# the classic form, a 64-bit multiply by a random odd number, is arbitrary-precision arithmetic
# here and cost 2-3k instructions per probe.
_PIECE: Final = (1 << 13) - 1
_TOP: Final = (1 << 12) - 1
_MIX_BITS: Final = 44
_MIX_MASK: Final = (1 << 44) - 1
_MIN_INDEX: Final = 64
# `array`'s append and pop, looked up once: compiled, `a.append(x)` on an `array` (a class mypyc
# does not know) is a call by name, a method lookup each time; a method descriptor held as a C
# static is called directly (a store and a removal take one or ten such calls).
_append: Final[Any] = array.append
_pop: Final[Any] = array.pop
#: Compact the token arena once this many dropped tokens lie in it and they are at least half.
_ARENA_SLACK: Final = 1 << 16
# Module constants: `Tier.GPU_HOT` is a class attribute lookup through EnumType (~0.1 us on
# CPython 3.11), a global is a dict lookup; a few per block on the hot path.
_GPU_HOT: Final = Tier.GPU_HOT
_STORAGE_WARM: Final = Tier.STORAGE_WARM
_CREATED: Final = TransitionKind.CREATED
_EVICTED: Final = TransitionKind.EVICTED


def _slot_column(n: int) -> vec[i32]:
    """A column of `n` slot numbers, all NO_SLOT, of exactly that capacity."""
    return vec[i32]([NO_SLOT] * n)  # compiled: filled in C, no list is built


def _signed(h: int) -> i64:
    """A u64 hash as the i64 of the same bits (what the hash columns hold)."""
    return h - _TWO64 if h > _I64_MAX else h  # (int arithmetic, then one checked conversion)


def _unsigned(x: i64) -> int:
    """The u64 hash of a hash column's i64."""
    n: int = x  # an arbitrary-precision int: the sum is not i64 arithmetic
    return n + _TWO64 if n < 0 else n


class BlockTable:
    """Block records in columns, their hash index, token arena, pruning order and bounds; the
    per-key aggregates of attributed records. The base of `Tracker`; not used alone."""

    _hash: vec[i64]
    _par: vec[i64]
    _haspar: vec[u8]
    _clen: vec[i32]
    _media: vec[u8]
    _big_len: dict[int, int]
    _state: list[State]
    _toff: array[int]
    _tlen: array[int]
    _older: vec[i32]
    _newer: vec[i32]
    _free: array[int]
    _idx: vec[i32]
    _arena: array[int]
    _keys: dict[str, KeyAggregate]  # by prefix_hash (the key's hex: the key's only copy)
    _touched: dict[KeyAggregate, tuple[bool, int, bool]]

    def __init__(self, limits: Limits) -> None:
        self._max_blocks = limits.max_tracked_blocks
        self._max_tokens = limits.max_retained_tokens
        # Offsets into the arena: it holds at most about twice the retained tokens.
        self._offset_code = "I" if limits.max_retained_tokens < (1 << 30) else "Q"
        # A record keeps at most `max_chain_tokens` of its own tokens (the resolver reads no
        # further): 2 bytes a block for their count at the default 16,384.
        self._count_code = "H" if limits.max_chain_tokens < (1 << 16) else "I"
        self._arena_slack = _ARENA_SLACK
        self._media_bits: dict[str, int] = {MEDIUM_GPU: GPU_BIT}
        # A keyed index hash: engines' hashes are not chosen to spread over an index, and a
        # hostile source must not be able to make them collide.
        rnd = random.getrandbits
        self._k0: i64 = rnd(_MIX_BITS)
        self._k1: i64 = rnd(_MIX_BITS)
        self._k2: i64 = rnd(_MIX_BITS)
        self._k3: i64 = rnd(_MIX_BITS)
        self._k4: i64 = rnd(_MIX_BITS)
        self._k5: i64 = rnd(_MIX_BITS)
        self.pruned = 0  # records dropped to honour a bound (monotonic, survives clears)

    def _reset_blocks(self) -> None:
        """No records, no keys (a clear)."""
        # record columns, by slot. The vectors (`librt.vecs`: compiled, their items are read
        # and written in C, where an `array` item costs a boxed index, a boxed value and the
        # generic item protocol, about 250 instructions) have room for `len(self._hash)` slots
        # (`_grow_columns`); the arrays and the state list hold the slots in use.
        self._hash = vec[i64]()  # block hash (`_signed`)
        self._par = vec[i64]()  # parent hash (meaningful when _haspar[slot])
        self._haspar = vec[u8]()
        self._clen = vec[i32]()  # chain length in tokens, root..this block (see _len_of)
        self._big_len = {}  # slot -> chain length >= _BIG_LEN
        self._media = vec[u8]()  # media bits and TAINT
        self._state = []
        self._toff = array(self._offset_code)  # own tokens: arena[toff:toff+tlen]
        self._tlen = array(self._count_code)
        self._older = vec[i32]()  # pruning order: least recently stored first
        self._newer = vec[i32]()
        self._oldest = NO_SLOT
        self._newest = NO_SLOT
        self._free = array("I")  # slots of removed records, reused first
        self._live = 0
        # index: hash -> slot, open addressing with linear probing
        self._idx = _slot_column(_MIN_INDEX)
        self._mask = _MIN_INDEX - 1
        self._shift = _MIX_BITS - (_MIN_INDEX.bit_length() - 1)
        # tokens of the records that keep some; `_garbage` of them belong to no record any more
        self._arena = array("I")
        self._garbage = 0
        self._tokens = 0  # tokens retained (block segments + resolved chains' copies)
        self._keys = {}  # interned keys with attributed blocks (or touched)
        self._touched = {}  # key -> (live, count, in GPU memory) before

    def records(self) -> dict[int, BlockView]:
        """Every record by hash, in pruning order (oldest first): copies, for tests."""
        out: dict[int, BlockView] = {}
        r = self._oldest
        while r != NO_SLOT:
            out[self._hash_of(r)] = BlockView(self._parent_of(r), self._len_of(r), self._media[r],
                                           self._state[r], self._tokens_of(r))
            r = self._newer[r]
        return out

    def _medium_bit(self, medium: str | None) -> int:
        if medium is None:
            return GPU_BIT  # engines before the medium field: GPU
        bit = self._media_bits.get(medium)
        if bit is None:
            n = len(self._media_bits)  # GPU + storage media seen so far
            bit = FIRST_STORAGE_BIT << (n - 1) if n <= 5 else OVERFLOW_BIT
            if n <= 5:
                self._media_bits[medium] = bit
        return bit

    # --- records: index, columns, token arena ----------------------------------------------

    def _pos(self, h: i64, shift: int) -> int:
        """The home position of hash `h` (`_signed`) in an index of 2^(44 - `shift`) positions."""
        return ((self._k0 + (h & _PIECE) * self._k1 + ((h >> 13) & _PIECE) * self._k2
                 + ((h >> 26) & _PIECE) * self._k3 + ((h >> 39) & _PIECE) * self._k4
                 + ((h >> 52) & _TOP) * self._k5) & _MIX_MASK) >> shift

    def _find(self, h: int) -> int:
        """The slot of the record of hash `h`, or NO_SLOT."""
        return self._slot_of(_signed(h))

    def _slot_of(self, h: i64) -> int:
        """The slot of the record of hash `h` (`_signed`), or NO_SLOT."""
        idx = self._idx
        hashes = self._hash
        mask = self._mask
        i = self._pos(h, self._shift)
        while True:
            s: int = idx[i]
            if s == _EMPTY:
                return NO_SLOT
            if hashes[s] == h:
                return s
            i = (i + 1) & mask

    def _hash_of(self, r: int) -> int:
        """The block hash of record `r`."""
        return _unsigned(self._hash[r])

    def _grow_columns(self, n: int) -> None:
        """Room for an eighth more slots than the `n` in use in every vector column: grown by
        this copy, not by `librt.vecs.append`, which doubles a full vector's capacity (up to
        half of a column unused; `array` grows by about a sixteenth)."""
        cap = n + n // 8 + 64
        hashes, par, clen = vec[i64]([0] * cap), vec[i64]([0] * cap), vec[i32]([0] * cap)
        haspar, media = vec[u8]([0] * cap), vec[u8]([0] * cap)
        older, newer = _slot_column(cap), _slot_column(cap)
        old_hashes, old_par, old_clen = self._hash, self._par, self._clen
        old_haspar, old_media = self._haspar, self._media
        old_older, old_newer = self._older, self._newer
        for i in range(n):  # compiled: a C loop, a few ms per million slots
            hashes[i] = old_hashes[i]
            par[i] = old_par[i]
            clen[i] = old_clen[i]
            haspar[i] = old_haspar[i]
            media[i] = old_media[i]
            older[i] = old_older[i]
            newer[i] = old_newer[i]
        self._hash, self._par, self._clen = hashes, par, clen
        self._haspar, self._media = haspar, media
        self._older, self._newer = older, newer

    def _len_of(self, r: int) -> int:
        """The chain length of record `r`, root..r, in tokens."""
        n: int = self._clen[r]
        return n if n != _BIG_LEN else self._big_len[r]

    def _parent_of(self, r: int) -> int | None:
        return _unsigned(self._par[r]) if self._haspar[r] else None

    def _tokens_of(self, r: int) -> array[int]:
        off = self._toff[r]
        return self._arena[off:off + self._tlen[r]]

    def _new_block(
        self, h: int, parent: int | None, chain_len: int, media: int, state: State,
        tokens: array[int] | None,
    ) -> int:
        """Add the record of `h` (not tracked yet) as the newest; returns its slot."""
        column_len = chain_len
        if chain_len >= _BIG_LEN:  # absurd block sizes only
            if chain_len > _U64:  # noqa: PLR1730 (as it was with a u64 column)
                chain_len = _U64
            column_len = _BIG_LEN
        free = self._free
        if free:
            r: int = _pop(free)
        else:
            r = len(self._state)
            if r >= len(self._hash):
                self._grow_columns(r)
            self._state.append(None)
            _append(self._toff, 0)
            _append(self._tlen, 0)
        hs = _signed(h)
        self._hash[r] = hs
        if parent is None:
            self._haspar[r] = 0
        else:
            self._par[r] = _signed(parent)
            self._haspar[r] = 1
        self._clen[r] = column_len
        self._media[r] = media
        if column_len == _BIG_LEN:
            self._big_len[r] = chain_len
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
        self._newer[r] = NO_SLOT
        if newest == NO_SLOT:
            self._oldest = r
        else:
            self._newer[newest] = r
        self._newest = r
        # index it (the hash is not there: the first empty position takes it)
        idx = self._idx
        mask = self._mask
        i = self._pos(hs, self._shift)
        while idx[i] != _EMPTY:
            i = (i + 1) & mask
        idx[i] = r
        # grown past half full (to a quarter): runs stay short, and a removal walks its run
        # (salted chains: 13k instructions per removal at 61% full, 7.7k at 30%)
        if self._live * 2 > len(idx):
            self._rebuild_index()
        if type(state) is KeyAggregate:
            touched = self._touched
            if state not in touched:
                touched[state] = (state.blocks > 0, state.max_len, state.gpu > 0)
            self._state[r] = state
            if state.lengths is None and (not state.blocks
                                          or chain_len == state.max_len + state.step):
                # KeyAggregate.add's common cases, inline: its first block, one more of the same
                # length (step 0), or the next block of its run
                state.blocks += 1
                state.max_len = chain_len
                if media & GPU_BIT:
                    state.gpu += 1
            else:
                state.add(chain_len, bool(media & GPU_BIT))
            if tokens:
                self._drop_tokens(r)
        elif type(state) is Chain:
            self._state[r] = state
            state.nblocks += 1
            state.head = h
        return r

    def _rebuild_index(self) -> None:
        """A fresh index at most half full: the smallest power of two of at least twice the
        records."""
        size = _MIN_INDEX
        while size < 2 * self._live:
            size <<= 1
        idx = _slot_column(size)
        mask = size - 1
        shift = _MIX_BITS - (size.bit_length() - 1)
        hashes = self._hash
        r = self._oldest
        newer = self._newer
        while r != NO_SLOT:
            i = self._pos(hashes[r], shift)
            while idx[i] != _EMPTY:
                i = (i + 1) & mask
            idx[i] = r
            r = newer[r]
        self._idx, self._mask, self._shift = idx, mask, shift

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
        while r != NO_SLOT:
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
        older: int = older_[r]
        newer: int = newer_[r]  # not NO_SLOT: r is not the newest
        if older == NO_SLOT:
            self._oldest = newer
        else:
            newer_[older] = newer
        older_[newer] = older
        newest = self._newest
        older_[r] = newest
        newer_[r] = NO_SLOT
        newer_[newest] = r
        self._newest = r

    def _enforce_bounds(self) -> None:
        while self._live > self._max_blocks or self._tokens > self._max_tokens:
            victim = self._oldest
            if victim == NO_SLOT:
                break
            self._remove(victim)
            self.pruned += 1

    def _remove(self, r: int) -> None:
        h = self._hash[r]
        idx = self._idx
        mask = self._mask
        shift = self._shift
        i = self._pos(h, shift)
        while idx[i] != r:
            i = (i + 1) & mask
        # Close the gap at i: a later record of the run whose home is not cyclically within
        # (i, j] was placed past i only because i was taken; it moves back into it.
        hashes = self._hash
        j = i
        while True:
            j = (j + 1) & mask
            s: int = idx[j]
            if s == _EMPTY:
                break
            home = self._pos(hashes[s], shift)
            if (home <= i or home > j) if i <= j else (home <= i and home > j):
                idx[i] = s
                i = j
        idx[i] = _EMPTY
        if self._tlen[r]:
            self._drop_tokens(r)
        st = self._state[r]
        if type(st) is KeyAggregate:
            touched = self._touched
            if st not in touched:
                touched[st] = (st.blocks > 0, st.max_len, st.gpu > 0)
            if st.lengths is None and not st.step:  # KeyAggregate.remove's case of one length
                st.blocks -= 1
                if self._media[r] & GPU_BIT:
                    st.gpu -= 1
                if not st.blocks:
                    st.max_len = 0
            else:
                st.remove(self._len_of(r), bool(self._media[r] & GPU_BIT))
        elif type(st) is Chain:
            self._chain_lost_block(st, r)
        # unlink from the pruning order, give the slot back
        older: int = self._older[r]
        newer: int = self._newer[r]
        if older == NO_SLOT:
            self._oldest = newer
        else:
            self._newer[older] = newer
        if newer == NO_SLOT:
            self._newest = older
        else:
            self._older[newer] = older
        if self._big_len and self._clen[r] == _BIG_LEN:
            del self._big_len[r]
        self._state[r] = None
        _append(self._free, r)
        self._live -= 1

    def _chain_lost_block(self, ch: Chain, r: int) -> None:
        """Record `r` (state `ch`) was removed or pruned, or attributed: `core.chains` decides."""
        raise NotImplementedError

    # --- per-key aggregates and transitions -----------------------------------------------

    def _intern(self, prefix_hash: str) -> KeyAggregate:
        k = self._keys.get(prefix_hash)
        if k is None:
            k = self._keys[prefix_hash] = KeyAggregate(prefix_hash)
            self._touch_key(k)  # so that a key that never gets a block is dropped at flush
        return k

    def _touch_key(self, k: KeyAggregate) -> None:
        if k not in self._touched:
            self._touched[k] = (k.blocks > 0, k.max_len, k.gpu > 0)

    def _flush(self, out: list[PrefixTransition]) -> None:
        keys = self._keys
        for k, (was_live, old_len, was_gpu) in self._touched.items():
            if k.blocks:
                gpu = k.gpu > 0
                tier = _GPU_HOT if gpu else _STORAGE_WARM
                if not was_live:
                    out.append(PrefixTransition(_CREATED, k.prefix_hash, k.max_len, tier))
                elif gpu is not was_gpu:
                    out.append(PrefixTransition(TransitionKind.TIER, k.prefix_hash, k.max_len, tier))
                elif k.max_len != old_len:
                    out.append(
                        PrefixTransition(TransitionKind.TOKEN_COUNT, k.prefix_hash, k.max_len, tier)
                    )
            else:
                if was_live:
                    out.append(PrefixTransition(_EVICTED, k.prefix_hash))
                if keys.get(k.prefix_hash) is k:
                    del keys[k.prefix_hash]
        self._touched.clear()

    def _attribute(self, r: int, k: KeyAggregate) -> None:
        """Attribute a record (new or pre-anchor) to `k`; its tokens are no longer needed."""
        if k not in self._touched:
            self._touch_key(k)
        self._state[r] = k
        k.add(self._len_of(r), bool(self._media[r] & GPU_BIT))
        if self._tlen[r]:
            self._drop_tokens(r)

    def _set_media(self, r: int, media: int) -> None:
        old: int = self._media[r]
        if old == media:
            return
        st = self._state[r]
        if type(st) is KeyAggregate and (old ^ media) & GPU_BIT:
            self._touch_key(st)
            st.gpu += 1 if media & GPU_BIT else -1
        self._media[r] = media
