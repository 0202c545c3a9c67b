"""Detokenize calls per distinct prefix in a chat workload (targets: <= 1.5, issue 4; <= 1.2 over
HTTP only, issue 10).

Many users share a few long system prompts. A simulated vLLM block pool (prefix caching, LRU
eviction; kv_listener.sim.engine) serves the seeded demo workload; its KV events go through the
real `Tracker` and the real `ChainResolver`, which calls a real `/detokenize` HTTP server on
127.0.0.1 backed by the demo tokenizer. Two set-ups are measured:

- `http`: the engine's HTTP endpoints only (the default deployment). The resolver finds where a
  prompt's key is decided with one `/tokenize` call of the text the key depends on (issue #10),
  so later users of the same prompt need no call; `/tokenize` calls are printed separately.
- `http+local`: the same, plus the source's local `tokenizer:`, which lets the resolver report
  `key_tokens` (bisection with local decodes), so later users need no call.

Every resolved key is checked against the router-side key of the request (`request_prefix_key`):
a wrong key would be counted in `wrong_keys`.

Run: .venv/bin/python bench/detokenize_calls.py [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from quiet import quiet_libraries

from kv_listener.core.limits import Limits
from kv_listener.core.model import (
    Engine,
    EventBatch,
    PrefixTransition,
    ResolveOutcome,
    TransitionKind,
)
from kv_listener.core.tracker import Tracker
from kv_listener.resolver.detokenize import HttpDetokenizer
from kv_listener.resolver.resolver import ChainResolver
from kv_listener.resolver.template import (
    DEMO_TOKENIZER_DIR,
    build_prompt_parser,
    load_tokenizer,
)
from kv_listener.sim.detokenize_server import DetokenizeServer
from kv_listener.sim.engine import EngineCore, render_chat
from kv_listener.sim.workload import ChatWorkload
from kv_listener.stats import SourceStats


async def run(mode: str, n_requests: int, tokenizer: object) -> dict[str, float]:
    workload = ChatWorkload(seed=11, k=5, users=500)
    engine = EngineCore(num_blocks=512)
    tracker = Tracker(engine=Engine.VLLM, model=workload.model, limits=Limits())
    stats = SourceStats(engine="vllm")
    expected = set(workload.prefix_hashes().values())
    created: set[str] = set()
    wrong = 0

    def take(transitions: list[PrefixTransition]) -> None:
        nonlocal wrong
        for t in transitions:
            if t.kind is TransitionKind.CREATED and t.prefix_hash is not None:
                created.add(t.prefix_hash)
                wrong += t.prefix_hash not in expected

    outcomes: list[ResolveOutcome] = []
    async with DetokenizeServer(tokenizer) as server:
        resolver = ChainResolver(
            detokenizer=HttpDetokenizer(server.url, Engine.VLLM),
            parser=build_prompt_parser(tokenizer=tokenizer, name="bench"),
            on_outcome=outcomes.append, stats=stats,
            local_tokenizer=tokenizer if mode == "http+local" else None)
        started = time.perf_counter()
        try:
            for _ in range(n_requests):
                req = workload.next()
                engine.serve(render_chat(tokenizer, req.messages), range(req.output_tokens))
                take(tracker.apply(EventBatch(ts=0.0, events=tuple(engine.take_events()))))
                for r in tracker.take_resolve_requests():
                    resolver.submit(r)
                await resolver.wait_idle()
                while outcomes:
                    take(tracker.on_resolved(outcomes.pop(0)))
                    for r in tracker.take_resolve_requests():
                        resolver.submit(r)
                    await resolver.wait_idle()
        finally:
            await resolver.close()
        elapsed = time.perf_counter() - started
    return {"calls": stats.detokenize_calls, "tokenize": stats.tokenize_calls,
            "distinct": len(created), "wrong": wrong,
            "live": tracker.prefixes_live, "seconds": elapsed,
            "evicted_blocks": engine.pool.stats().evicted}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    args = parser.parse_args()
    tokenizer = load_tokenizer(DEMO_TOKENIZER_DIR)
    print(f"chat workload: {args.requests} requests, 5 system prompts, 500 users, "
          "512-block vLLM-like pool (LRU eviction)")
    for mode in ("http", "http+local"):
        r = await run(mode, args.requests, tokenizer)
        per = r["calls"] / max(r["distinct"], 1)
        tok = r["tokenize"] / max(r["distinct"], 1)
        print(f"  {mode:<11} detokenize calls {r['calls']:>5}  distinct prefixes "
              f"{r['distinct']:>3}  calls/prefix {per:5.2f}  (+ /tokenize {r['tokenize']}, "
              f"{tok:4.2f}/prefix)  wrong keys {r['wrong']}  "
              f"blocks evicted {r['evicted_blocks']}  ({r['seconds']:.1f} s)")


if __name__ == "__main__":
    quiet_libraries()
    asyncio.run(main())
