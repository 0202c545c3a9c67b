"""Run with the engines' venv: vLLM's own `ZmqEventPublisher` (the class a vLLM engine publishes
its KV events with: a PUB that connects to `PUB_ENDPOINT`, a replay ROUTER bound on
`REPLAY_ENDPOINT`). Prints `ready`, then for each line `N TOKENS` read from stdin publishes N
batches of one `BlockStored` of TOKENS token IDs each (block hashes 1000, 1001, ... in order)
and prints `published <batches in the replay buffer>` once they are in it; ends at EOF.

    .venv-engines/bin/python tests/engines/vllm_replay_publisher.py PUB_ENDPOINT REPLAY_ENDPOINT
"""

from __future__ import annotations

import sys
import time

from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher


def main() -> None:
    publisher = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2],
                                  topic="kv-events")
    print("ready", flush=True)
    sent = 0
    for line in sys.stdin:
        n, tokens = (int(word) for word in line.split())
        for i in range(sent, sent + n):
            event = BlockStored(block_hashes=[1000 + i], parent_block_hash=None,
                                token_ids=[(i * 7 + j) % 30000 for j in range(tokens)],
                                block_size=tokens, lora_id=None, medium="GPU", lora_name=None)
            publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
        sent += n
        deadline = time.monotonic() + 120
        while len(publisher._buffer) < min(sent, 10_000) and time.monotonic() < deadline:
            time.sleep(0.05)  # the publisher thread moves its queue into the buffer
        print("published", len(publisher._buffer), flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    main()
