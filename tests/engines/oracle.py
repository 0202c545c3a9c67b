"""The convergence oracle of the real-engine tests: what a listener's view of one backend must
be, computed from the very messages the engine published (SPEC §2-§4), without the tracker.

`EngineTruth` is fed every live message the engine sent (`feed_frames`, tapped before the
listener gets it, so a batch the tap withheld from the listener still counts), or decoded
batches (`feed_batch`, for publishers driven in-process). It remembers every block stored since
the last clear (hash -> parent, own token segment, model) and the media that hold each block now.
`expected()` then attributes every held block on its own: the chain root..block is rebuilt from
the remembered segments (evicted ancestors included), decoded with the engine's tokenizer
(`skip_special_tokens=False`, as the engines' `/detokenize` does), parsed with the project's
`PromptParser`, and keyed with `prefix_key`; or, for a salted chain, keyed by the root block's
salt when a secret is given (an invalid salt leaves the chain unattributed). A key's
token_count is the longest held chain attributed to it, its tier `gpu_hot` when one of those
blocks is in GPU memory.

Only the real decoder (`kv_listener.core.decode`) and the pure key functions are shared with
the listener: the tracker, the resolver and their bounds are what is under test. The oracle
assumes the tracker's limits are not reached (the tests keep far below them). Nothing here
logs, and messages never quote token IDs or salts.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_listener.core.decode import decode_zmq_payload, vllm_salt_candidates
from kv_listener.core.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    CacheCreated,
    Engine,
    EventBatch,
    ResolveStatus,
    Tier,
    is_gpu_medium,
)
from kv_listener.core.prefix import prefix_hash, prefix_key
from kv_listener.core.salt import SALT_PREFIX, verify_cache_salt
from kv_listener.resolver.template import PromptParser

#: vLLM group kinds that the listener tracks (one full-attention group, SPEC §4).
_FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention",
                                   "unknown"})
#: A root block's salt verdict: no salt (decode the chain), or the chain's key, or rejected.
_NO_SALT = object()
_REJECTED = object()


@dataclass(slots=True)
class _Block:
    parent: int | None
    segment: array[int] | None  # None: the event's token count did not fit its block size
    length: int  # own token count
    model: str
    salt: object = _NO_SALT  # root blocks only: _NO_SALT, _REJECTED or the 32-byte key


class EngineTruth:
    """What one engine holds, and which prefixes a correct listener must therefore show."""

    def __init__(
        self,
        *,
        engine: Engine,
        model: str,
        tokenizer: Any,
        parser: PromptParser,
        salt_secret: bytes | None = None,
        backend: str | None = None,
        max_prefix_length: int = 1024,
    ) -> None:
        if salt_secret is not None and backend is None:
            raise ValueError("a salt secret needs the backend name the salts are issued for")
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.parser = parser
        self.salt_secret = salt_secret
        self.backend = backend
        self.max_prefix_length = max_prefix_length
        self.messages = 0  # live messages fed
        self.clears = 0  # clears seen (AllBlocksCleared, sequence going back, clear())
        self._blocks: dict[int, _Block] = {}
        self._held: dict[int, set[str | None]] = {}  # hash -> media holding it now
        self._group: int | None = None
        self._last_seq: int | None = None
        self._keys: dict[int, bytes | None] = {}  # hash -> key of root..hash (memo)

    # --- feeding ----------------------------------------------------------------------------

    def feed_frames(self, frames: Sequence[bytes]) -> None:
        """One live ZMQ message `[topic, seq (8 bytes BE), payload]` as the engine sent it."""
        if len(frames) != 3 or len(frames[1]) != 8:
            raise AssertionError(f"engine sent a message of {len(frames)} frames, not [topic, seq, payload]")
        seq = int.from_bytes(frames[1], "big")
        self.messages += 1
        self.feed_batch(decode_zmq_payload(self.engine, frames[2], seq).batch)

    def feed_batch(self, batch: EventBatch) -> None:
        """One decoded batch. A sequence number that does not continue the stream (going back,
        or 0 again) means the publisher restarted: everything before it is gone."""
        if batch.seq is not None:
            if self._last_seq is not None and batch.seq <= self._last_seq:
                self._drop_all()
            self._last_seq = batch.seq
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            elif isinstance(ev, (AllBlocksCleared, CacheCreated)):
                self._drop_all()
            elif isinstance(ev, BlockUpdated):
                media = self._held.get(ev.block_hash)
                if media is not None:
                    media.discard(ev.old_medium)
                    media.add(ev.new_medium)

    def clear(self) -> None:
        """The engine's whole state is gone (engine stopped or restarted)."""
        self._drop_all()
        self._last_seq = None

    def _drop_all(self) -> None:
        self._blocks.clear()
        self._held.clear()
        self._keys.clear()
        self.clears += 1

    def _accept_group(self, ev: BlockStored) -> bool:
        if ev.group_idx is None:
            return True
        if self._group is None and (ev.kv_cache_spec_kind is None
                                    or ev.kv_cache_spec_kind in _FULL_ATTENTION_KINDS):
            self._group = ev.group_idx
        return ev.group_idx == self._group

    def _segments(self, ev: BlockStored) -> list[array[int] | None]:
        n, toks, bs = len(ev.block_hashes), ev.token_ids, ev.block_size
        total = len(toks)
        if self.engine is Engine.VLLM:
            fits = bs > 0 and total >= bs * n and total % bs == 0
        elif self.engine is Engine.SGLANG:
            fits = bs > 0 and total == bs * n
        else:
            fits = bs > 0 and bs * (n - 1) < total <= bs * n
        if not fits:
            return [None] * n
        # vLLM may carry the tokens of masked blocks: the last hashed block takes the rest.
        cuts = [bs * i for i in range(n)] + [total]
        return [toks[cuts[i]:cuts[i + 1]] for i in range(n)]

    def _salt_verdict(self, ev: BlockStored) -> object:
        if self.salt_secret is None:
            return _NO_SALT
        if self.engine is Engine.VLLM:
            salts = [s for s in vllm_salt_candidates(ev) if s.startswith(SALT_PREFIX)]
            if ev.cache_salt is not None and ev.cache_salt.startswith(SALT_PREFIX):
                salts.append(ev.cache_salt)
            salt = salts[-1] if salts else None
        else:
            salt = ev.cache_salt
        if salt is None:
            return _NO_SALT
        assert self.backend is not None
        key = verify_cache_salt(self.salt_secret, self.backend, salt)
        return _REJECTED if key is None else key

    def _stored(self, ev: BlockStored) -> None:
        if not ev.block_hashes or not self._accept_group(ev):
            return
        if len(ev.token_ids) == 0:  # offload placeholder: a medium for blocks already known
            for h in ev.block_hashes:
                media = self._held.get(h)
                if media is not None:
                    media.add(ev.medium)
                elif h in self._blocks:
                    self._held[h] = {ev.medium}
            return
        model = ev.lora_name or self.model
        parent = ev.parent_hash
        for i, (h, seg) in enumerate(zip(ev.block_hashes, self._segments(ev), strict=True)):
            if h not in self._blocks:
                length = len(ev.token_ids) // len(ev.block_hashes) if seg is None else len(seg)
                rec = _Block(parent, seg, length, model)
                if i == 0 and parent is None:
                    rec.salt = self._salt_verdict(ev)
                self._blocks[h] = rec
            self._held.setdefault(h, set()).add(ev.medium)
            parent = h

    def _removed(self, ev: BlockRemoved) -> None:
        for h in ev.block_hashes:
            media = self._held.get(h)
            if media is None:
                continue
            if ev.medium is None:
                media.clear()
            else:
                media.discard(ev.medium)
                if ev.medium == "GPU":
                    media.discard(None)  # a block stored without a medium is in GPU memory
            if not media:
                del self._held[h]

    # --- the expected view ------------------------------------------------------------------

    def _chain(self, h: int) -> list[_Block] | None:
        """root..h, or None when an ancestor was never seen (an orphan)."""
        out: list[_Block] = []
        cur: int | None = h
        seen = 0
        while cur is not None:
            rec = self._blocks.get(cur)
            if rec is None or seen > len(self._blocks):
                return None
            out.append(rec)
            cur = rec.parent
            seen += 1
        out.reverse()
        return out

    def _key_of(self, chain: list[_Block]) -> bytes | None:
        root = chain[0]
        if root.salt is _REJECTED:
            return None
        if isinstance(root.salt, bytes):
            return root.salt
        tokens = array("I")
        for rec in chain:
            if rec.segment is None:
                return None
            tokens.extend(rec.segment)
        text = self.tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
        parsed = self.parser.parse_prompt(text, self.max_prefix_length)
        if parsed.status is not ResolveStatus.RESOLVED:
            return None
        return prefix_key(chain[-1].model, parsed.system_text, parsed.first_text,
                          self.max_prefix_length)

    def key_of_block(self, h: int) -> bytes | None:
        """The key block `h` is attributed to (None: unattributed)."""
        if h in self._keys:
            return self._keys[h]
        chain = self._chain(h)
        key: bytes | None = None
        if chain is not None:
            tainted = [i for i, rec in enumerate(chain) if rec.segment is None]
            if not tainted:
                key = self._key_of(chain)
            elif tainted[0] == len(chain) - 1 and len(chain) > 1:
                # A block whose tokens did not fit stays attributed when its parent was (SPEC §4);
                # its descendants are not.
                key = self.key_of_block(chain[-1].parent)  # type: ignore[arg-type]
        self._keys[h] = key
        return key

    def expected(self) -> dict[str, tuple[int, str]]:
        """prefix_hash -> (token_count, tier value) of every prefix the engine holds now."""
        best: dict[bytes, list[Any]] = {}
        for h, media in self._held.items():
            key = self.key_of_block(h)
            if key is None:
                continue
            chain = self._chain(h)
            assert chain is not None
            length = sum(rec.length for rec in chain)
            gpu = any(is_gpu_medium(m) for m in media)
            entry = best.setdefault(key, [0, False])
            entry[0] = max(entry[0], length)
            entry[1] = entry[1] or gpu
        return {
            prefix_hash(key): (n, (Tier.GPU_HOT if gpu else Tier.STORAGE_WARM).value)
            for key, (n, gpu) in best.items()
        }

    # --- for scenario checks ----------------------------------------------------------------

    @property
    def held(self) -> int:
        """Blocks the engine holds now."""
        return len(self._held)

    @property
    def remembered(self) -> int:
        """Blocks stored since the last clear (held or evicted)."""
        return len(self._blocks)

    def note(self, ph: str) -> str:
        """What the engine did with key `ph` (for failure messages): the longest chain of it
        held now, and whether longer ones were evicted (a tail-first eviction)."""
        held = max((n for k, lens in self.held_chain_lengths().items() if k == ph for n in lens),
                   default=0)
        longest = 0
        for h in self._blocks:
            key = self.key_of_block(h)
            chain = self._chain(h)
            if key is not None and chain is not None and prefix_hash(key) == ph:
                longest = max(longest, sum(rec.length for rec in chain))
        if longest > held:
            return f"the engine evicted its chain's tail: {held} of {longest} tokens held"
        return ""

    def held_chain_lengths(self) -> dict[str, list[int]]:
        """prefix_hash -> sorted chain lengths of the held blocks attributed to it."""
        out: dict[str, list[int]] = {}
        for h in self._held:
            key = self.key_of_block(h)
            chain = self._chain(h)
            if key is not None and chain is not None:
                out.setdefault(prefix_hash(key), []).append(sum(rec.length for rec in chain))
        return {k: sorted(v) for k, v in out.items()}
