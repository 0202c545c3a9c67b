"""Run with the engines' venv: vLLM's own `ZmqEventPublisher` (the class a vLLM engine publishes
its KV events with, PUB + replay ROUTER) holding `n` batches in its replay buffer, each one
`BlockStored` of `tokens` token IDs; prints `ready <buffered>` and serves until killed.

    .venv-engines/bin/python tests/engines/vllm_replay_publisher.py PUB_PORT REPLAY_PORT N TOKENS
"""

from __future__ import annotations

import sys
import time

from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher


def main() -> None:
    pub_port, replay_port, n, tokens = (int(arg) for arg in sys.argv[1:5])
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{pub_port}",
                                  replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                                  topic="kv-events")
    for i in range(n):
        event = BlockStored(block_hashes=[1000 + i], parent_block_hash=None,
                            token_ids=[(i * 7 + j) % 30000 for j in range(tokens)],
                            block_size=tokens, lora_id=None, medium="GPU", lora_name=None)
        publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
    deadline = time.monotonic() + 120
    while len(publisher._buffer) < min(n, 10_000) and time.monotonic() < deadline:
        time.sleep(0.05)  # the publisher thread moves the queue into the buffer
    print("ready", len(publisher._buffer), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
