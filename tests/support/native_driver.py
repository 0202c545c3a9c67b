"""One seeded engine workload through the hot path, printed as a digest (tests/test_native.py).

    python tests/support/native_driver.py SEED

Builds vLLM 0.33 frames (chains with shared prefixes, valid, forged and missing salts, tails
evicted, a storage medium, a clear) and runs them through `decode_zmq_payload`,
`Tracker.apply` (tight limits, so records are pruned), the resolver's answers,
`EventLog.record` and `encode_record_list`. Prints one JSON line: the SHA-256 of every SSE byte
and of the tracker's final snapshot and counters, how many records and frames went
through, the counters, and whether the tracker module ran compiled.
Run once with the compiled core and once with a pure-Python copy of the package on PYTHONPATH,
the two lines must be equal. The stream is built with the random module only, so both runs see
the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from array import array

from kv_listener.core import tracker as tracker_module
from kv_listener.core.decode import decode_zmq_payload
from kv_listener.core.eventlog import EventLog
from kv_listener.core.limits import Limits
from kv_listener.core.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Engine,
    KvEvent,
    ResolveOutcome,
    ResolveStatus,
)
from kv_listener.core.salt import SaltVerifier, issue_cache_salt
from kv_listener.core.sse import encode_record_list
from kv_listener.core.tracker import Tracker
from kv_listener.sim.encode import encode_vllm_batch

SECRET = b"native-driver-secret"
BACKEND = "vllm-1"
MODEL = "m"
BS = 4  # tokens per block


def frames(seed: int, n_frames: int = 400) -> list[bytes]:
    rng = random.Random(seed)
    live: list[tuple[int, ...]] = []  # chains still held, block hashes root first
    next_hash = 1
    out: list[bytes] = []
    for step in range(n_frames):
        events: list[KvEvent] = []
        if step == n_frames // 2:  # the engine resets its prefix cache once
            events.append(AllBlocksCleared())
            live = []
        for _ in range(rng.randint(1, 6)):
            roll = rng.random()
            if roll < 0.55 or not live:  # a new chain, maybe under a held prefix
                parent_chain = rng.choice(live) if live and rng.random() < 0.5 else ()
                cut = rng.randint(1, len(parent_chain)) if parent_chain else 0
                prefix = parent_chain[:cut]
                n = rng.randint(1, 5)
                hashes = tuple(range(next_hash, next_hash + n))
                next_hash += n
                tokens = array("I", [rng.randrange(10, 500) for _ in range(n * BS)])
                salt = None
                if not prefix:
                    kind = rng.random()
                    key = hashlib.sha256(bytes([rng.randrange(8)])).digest()
                    if kind < 0.5:
                        salt = issue_cache_salt(SECRET, BACKEND, key)
                    elif kind < 0.6:
                        salt = issue_cache_salt(SECRET, "other-backend", key)
                # vLLM carries the salt in the first block's extra keys (SPEC §3)
                extra = None if salt is None else ((salt,), *([None] * (n - 1)))
                events.append(BlockStored(hashes, prefix[-1] if prefix else None, tokens, BS,
                                          medium="GPU", extra_keys=extra))
                live.append(prefix + hashes)
            elif roll < 0.85:  # the tail of a held chain goes (LRU: last blocks first)
                chain = live.pop(rng.randrange(len(live)))
                k = rng.randint(1, len(chain))
                events.append(BlockRemoved(chain[-k:], medium="GPU"))
                if k < len(chain):
                    live.append(chain[:-k])
            else:  # a held block copied to CPU memory, or dropped from it
                chain = rng.choice(live)
                if rng.random() < 0.7:
                    events.append(BlockStored(chain[-1:], None, array("I"), BS, medium="CPU"))
                else:
                    events.append(BlockRemoved(chain[-1:], medium="CPU"))
        out.append(encode_vllm_batch(events, ts=float(step)))
    return out


def run(seed: int) -> dict[str, object]:
    limits = Limits(max_tracked_blocks=300, max_retained_tokens=600, max_chain_tokens=64)
    tracker = Tracker(engine=Engine.VLLM, model=MODEL, limits=limits,
                      salt_verifier=SaltVerifier(SECRET, BACKEND))
    log = EventLog(BACKEND, "native", 10_000, 0.0)
    sse = hashlib.sha256()
    records = 0
    all_frames = frames(seed)
    for i, frame in enumerate(all_frames):
        transitions = tracker.apply(decode_zmq_payload(Engine.VLLM, frame).batch)
        for req in tracker.take_resolve_requests():
            if req.tokens[0] % 5 == 0:
                outcome = ResolveOutcome(req.head, ResolveStatus.UNATTRIBUTED, reason="not_chat")
            else:
                key = hashlib.sha256(req.tokens[:BS].tobytes()).digest()
                outcome = ResolveOutcome(req.head, ResolveStatus.RESOLVED, key=key,
                                         key_tokens=BS)
            transitions += tracker.on_resolved(outcome)
        out = log.record(transitions, 1000.0 + i)
        records += len(out)
        for chunk in encode_record_list(out):
            sse.update(chunk)
    state = json.dumps({"snapshot": {k: [n, str(t)] for k, (n, t) in tracker.snapshot().items()},
                        "stats": tracker.stats()}, sort_keys=True)
    return {"sse": sse.hexdigest(), "state": hashlib.sha256(state.encode()).hexdigest(),
            "records": records, "frames": len(all_frames), "live": len(tracker.snapshot()),
            "compiled": not tracker_module.__file__.endswith(".py"), "stats": tracker.stats()}


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1])), sort_keys=True))
