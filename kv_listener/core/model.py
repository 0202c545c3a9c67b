"""The one normalized, typed model of KV-cache events, whatever engine or encoding they came from.

Decoders (`core.decode`) produce these; sources put them on their queue; the tracker consumes
them. Hashes are always normalized to unsigned 64-bit ints (wire-formats §1 rule 4). Token IDs
are kept as `array('I')` (4 bytes each), never a list of Python ints.

The types are frozen `msgspec.Struct`s, not dataclasses: a busy engine makes one or two of them
per block, and a Struct is built in C (0.1 us for `BlockStored`; a frozen dataclass's
`__init__` took 1.5 us). `gc=False` where a value can never be part of a reference cycle (it
holds only ints, strings, tuples and arrays), so the cyclic GC does not walk them. Use
`msgspec.structs.replace` for a modified copy.
"""

from __future__ import annotations

import enum
from array import array
from typing import Any

import msgspec

U64_MASK = (1 << 64) - 1


class Engine(enum.StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


#: Media that mean "in GPU memory". Anything else (vLLM CPU/STORAGE, SGLang CPU_PINNED/DISK/
#: EXTERNAL, TRT-LLM cache_level 1) is a storage tier. `None` (engines before the medium field:
#: vLLM < 0.10.2, SGLang < 0.5.9) means GPU.
MEDIUM_GPU = "GPU"
#: TRT-LLM reports `cache_level` 0 (primary, GPU) or 1 (secondary, host); we name level 1 so.
MEDIUM_TRTLLM_HOST = "HOST"


def is_gpu_medium(medium: str | None) -> bool:
    return medium is None or medium == MEDIUM_GPU


def normalize_hash(value: int | bytes) -> int:
    """Engine block hash -> unsigned 64-bit int (bytes: last 8 bytes big-endian; ints: mod 2^64)."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & U64_MASK


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """One or more chained blocks stored (vLLM/SGLang `BlockStored`, TRT-LLM `stored`).

    `block_hashes[i]`'s parent is `block_hashes[i-1]`, the first one's is `parent_hash`.
    `token_ids` are the tokens of the whole event (vLLM may include tokens of masked blocks that
    have no hash; offload placeholders have none).
    """

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: array[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None
    extra_keys: tuple[Any, ...] | None = None
    cache_salt: str | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks evicted from `medium` (None: every medium / the engine did not say)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The engine dropped its whole prefix cache (vLLM `reset_prefix_cache`, ...)."""


class CacheCreated(msgspec.Struct, frozen=True, gc=False):
    """TRT-LLM `created`: the KV cache (re)initialised; `num_blocks_per_cache_level` per tier."""

    num_blocks_per_cache_level: tuple[int, ...] = ()


class BlockUpdated(msgspec.Struct, frozen=True, gc=False):
    """TRT-LLM `updated`: a block moved between cache levels (0 = GPU, 1 = host)."""

    block_hash: int
    old_medium: str | None
    new_medium: str | None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | CacheCreated | BlockUpdated


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One engine batch. `seq` is the ZMQ sequence (None for TRT-LLM HTTP, where each event has
    its own `event_id`); `dp_rank` is vLLM `data_parallel_rank` / SGLang `attn_dp_rank` /
    TRT-LLM `attention_dp_rank`."""

    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    seq: int | None = None


class ClearReason(enum.StrEnum):
    """Why a source's whole state was dropped. Values are metric labels."""

    ENGINE_CLEARED = "engine_cleared"  # AllBlocksCleared / TRT-LLM created
    ENGINE_RESTART = "engine_restart"  # sequence went backwards
    GAP = "gap"  # sequence gap that replay could not cover
    OVERFLOW = "overflow"  # our own bounded queue overflowed
    SOURCE_RESTART = "source_restart"  # the source task (re)started
    WINDOW_CHANGED = "window_changed"  # TRT-LLM VSWA: a larger attention window appeared
    ENGINE_DOWN = "engine_down"  # no sign of life for engine_down_after (liveness watch)


class SourceCleared(msgspec.Struct, frozen=True, gc=False):
    """Put on a source's queue before the batch that revealed a gap/restart: drop everything."""

    reason: ClearReason


SourceItem = EventBatch | SourceCleared


class Drops(msgspec.Struct):
    """Counted drops of one decode call: reason label -> count."""

    counts: dict[str, int] = msgspec.field(default_factory=dict)

    def add(self, reason: str, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n


# --- Resolution contract between the tracker (pure) and the resolver (async edge) -------------


class ResolveStatus(enum.StrEnum):
    RESOLVED = "resolved"  # key found (S or M rule)
    PENDING = "pending"  # chat prompt, but its content is not complete yet: retry when it grows
    UNATTRIBUTED = "unattributed"  # not a chat prompt / no usable text: never a key
    FAILED = "failed"  # detokenize failed (timeout, 5xx, circuit open): stays pending, counted


class ResolveRequest(msgspec.Struct, frozen=True, gc=False):
    """Ask the resolver for the prefix key of the chain root..`head` (tokens in order)."""

    head: int
    model: str
    tokens: array[int]


class ResolveOutcome(msgspec.Struct, frozen=True, gc=False):
    """Answer to a `ResolveRequest`. `reason` is a metric label from a fixed set
    (e.g. `template_unknown`, `not_chat`, `detokenize_error`, `timeout`, `circuit_open`)."""

    head: int
    status: ResolveStatus
    key: bytes | None = None
    reason: str | None = None
    #: RESOLVED only, optional: how many leading tokens of the request already decide the key
    #: (end of the system / first-message content and its delimiter, or the max_prefix_length
    #: cut). Lets the tracker give the key to later chains sharing those tokens without asking.
    key_tokens: int | None = None


# --- Tracker output: prefix transitions, consumed by the per-backend event log -----------------


class Tier(enum.StrEnum):
    GPU_HOT = "gpu_hot"
    STORAGE_WARM = "storage_warm"


class TransitionKind(enum.StrEnum):
    CREATED = "created"  # prefix became live: goes out at once
    TOKEN_COUNT = "token_count"  # live prefix, same tier, token_count changed: coalesced
    TIER = "tier"  # live prefix moved between GPU and storage: goes out at once
    EVICTED = "evicted"  # last attributed block gone: goes out at once
    CLEARED = "cleared"  # whole backend state gone: goes out at once


class PrefixTransition(msgspec.Struct, frozen=True, gc=False):
    kind: TransitionKind
    prefix_hash: str | None = None  # 64 lowercase hex; None for CLEARED
    token_count: int = 0
    tier: Tier | None = None
