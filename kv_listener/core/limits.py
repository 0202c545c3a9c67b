"""The bounds of one source's pipeline (the `limits:` block of a source in the config file).

They live in the core, with the decoder and the tracker that enforce them, so that the core
imports no configuration module: `kv_listener.config` reads and validates them from YAML and
hands this frozen value over. `batch_weight` is what a source's queue bounds count.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_listener.core.decode import DEFAULT_MAX_EVENT_HASHES, DEFAULT_MAX_EVENT_TOKENS
from kv_listener.core.model import BlockRemoved, BlockStored, EventBatch, SourceItem


@dataclass(frozen=True, slots=True)
class Limits:
    max_chain_tokens: int = 16384
    max_tracked_blocks: int = 100000
    max_retained_tokens: int = 16777216
    #: A ZMQ batch payload above this is dropped on receipt and counted (message_too_large).
    max_message_bytes: int = 8 << 20
    #: An event with more token IDs or block hashes than this is dropped and counted; an array
    #: over twice as long makes the whole message undecodable (nothing that big is built).
    max_event_tokens: int = DEFAULT_MAX_EVENT_TOKENS
    max_event_hashes: int = DEFAULT_MAX_EVENT_HASHES


def batch_weight(item: SourceItem) -> tuple[int, int]:
    """(token IDs, block hashes) held by a queue item: what a source's queue bounds count
    (`stats.queued_tokens`, `stats.queued_hashes`). The hashes are those of stored and of
    removed blocks: a removal carries no token IDs, so only this count bounds a queue of them.
    Taken twice per batch (queued, then applied), so it is here, compiled with the core
    (setup.py), and one pass gives both."""
    if not isinstance(item, EventBatch):
        return 0, 0
    tokens = hashes = 0
    for ev in item.events:
        if type(ev) is BlockStored:
            tokens += len(ev.token_ids)
            hashes += len(ev.block_hashes)
        elif type(ev) is BlockRemoved:
            hashes += len(ev.block_hashes)
    return tokens, hashes
