"""Cutting one engine batch into pieces the tracker applies one after another, so a daemon can
yield to its event loop in between (SPEC §4: one source's batch must not hold the other sources
or the HTTP server). A legal batch can be large: 64 Ki block hashes in one `BlockStored`, or a
quarter of a million one-block events in an 8 MiB frame, each of which takes the tracker a
few hundred milliseconds.

Applying the pieces in order reaches the state the whole batch reaches: events keep their
order; a `BlockStored` of n chained blocks is the same as consecutive `BlockStored`s of its
runs, each run's parent being the previous run's last hash, each with its own tokens and
per-block `extra_keys`. A `BlockStored` whose token count does not fit its block size (vLLM's
masked blocks) is never cut: which tokens belong to which block is then unknown. Only the
records may differ: the tracker coalesces transitions per applied batch, so a prefix that comes
and goes inside one big batch may show as created then evicted instead of nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from kv_listener.core.model import BlockRemoved, BlockStored, EventBatch, KvEvent

#: Blocks (stored or removed; another event counts as one) per piece: about 1-2 ms of tracker
#: work on this project's reference machine.
PIECE_BLOCKS = 512


def _weight(ev: KvEvent) -> int:
    if isinstance(ev, BlockStored | BlockRemoved):
        return max(1, len(ev.block_hashes))
    return 1


def _cut_stored(ev: BlockStored, size: int) -> Iterator[BlockStored]:
    hashes = ev.block_hashes
    bs = ev.block_size
    if bs <= 0 or len(ev.token_ids) != len(hashes) * bs or (
            ev.extra_keys is not None and len(ev.extra_keys) != len(hashes)):
        yield ev  # which tokens belong to which block is unknown: kept whole
        return
    parent = ev.parent_hash
    for i in range(0, len(hashes), size):
        j = min(i + size, len(hashes))
        yield msgspec.structs.replace(
            ev, block_hashes=hashes[i:j], parent_hash=parent, token_ids=ev.token_ids[i * bs:j * bs],
            extra_keys=None if ev.extra_keys is None else ev.extra_keys[i:j])
        parent = hashes[j - 1]


def _cut_removed(ev: BlockRemoved, size: int) -> Iterator[BlockRemoved]:
    for i in range(0, len(ev.block_hashes), size):
        yield msgspec.structs.replace(ev, block_hashes=ev.block_hashes[i:i + size])


def pieces(batch: EventBatch, size: int = PIECE_BLOCKS) -> Iterator[EventBatch]:
    """`batch` as consecutive batches of about `size` blocks each (the batch itself when it is
    small enough); each piece keeps the batch's ts, dp_rank and seq."""
    if size < 1:
        raise ValueError("size must be at least 1")
    total = 0
    for ev in batch.events:  # inline `_weight`: this runs for every batch
        t = type(ev)
        total += (len(ev.block_hashes) or 1) if t is BlockStored or t is BlockRemoved else 1  # type: ignore[union-attr]
    if total <= size:
        yield batch
        return
    current: list[KvEvent] = []
    weight = 0
    for ev in batch.events:
        parts: Iterator[KvEvent]
        if isinstance(ev, BlockStored) and len(ev.block_hashes) > size:
            parts = _cut_stored(ev, size)
        elif isinstance(ev, BlockRemoved) and len(ev.block_hashes) > size:
            parts = _cut_removed(ev, size)
        else:
            parts = iter((ev,))
        for part in parts:
            w = _weight(part)
            if current and weight + w > size:
                yield msgspec.structs.replace(batch, events=tuple(current))
                current, weight = [], 0
            current.append(part)
            weight += w
    if current:
        yield msgspec.structs.replace(batch, events=tuple(current))
