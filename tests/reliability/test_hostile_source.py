"""A hostile publisher on a third source of the same listener, while the two honest engines go
on: random bytes, msgpack bombs, frames over the size caps, enormous token lists, a 20,000-block
parent chain, hash collisions and parent cycles. The honest backends must converge as if nothing
happened, the hostile one's input must show as counted drops, the listener must keep answering
and its memory must stay within the documented bound."""

from __future__ import annotations

import random
from array import array
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from kv_listener.core.model import BlockRemoved, BlockStored
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.reliability.conftest import running_stack
from tests.reliability.harness import Stack
from tests.support.ports import free_port

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

HOSTILE_PORT = free_port()
HOSTILE_LIMITS = {"max_message_bytes": 1 << 20, "max_event_tokens": 100_000,
                  "max_event_hashes": 10_000, "max_tracked_blocks": 5_000,
                  "max_retained_tokens": 200_000}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hostile_stack(tmp_path_factory: pytest.TempPathFactory
                        ) -> AsyncIterator[tuple[Stack, SimPublisher]]:
    tmp: Path = tmp_path_factory.mktemp("hostile")
    hostile_source = {"backend_name": "hostile", "engine": "vllm", "model": "demo",
                      "zmq_endpoint": f"tcp://127.0.0.1:{HOSTILE_PORT}", "zmq_mode": "bind",
                      "allowed_publishers": ["127.0.0.1"], "limits": HOSTILE_LIMITS,
                      "engine_down_after": None}
    async with running_stack(tmp, extra_sources=[hostile_source]) as (st, cleanup):
        pub = await cleanup.enter_async_context(
            SimPublisher(f"tcp://127.0.0.1:{HOSTILE_PORT}", mode="connect"))
        await pub.wait_for_subscriber()
        await st.converge()
        yield st, pub


def stored(hashes: tuple[int, ...], parent: int | None, n_tokens: int, block_size: int = 16,
           token: int = 7) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_hash=parent,
                       token_ids=array("I", [token] * n_tokens), block_size=block_size,
                       medium="GPU")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_hostile_frames_leave_honest_sources_true(
        hostile_stack: tuple[Stack, SimPublisher]) -> None:
    stack, pub = hostile_stack
    assert stack.listener.proc is not None
    pid = stack.listener.proc.pid
    rss_before = rss_kib(pid)
    rng = random.Random(11)
    frames: list[list[bytes]] = []
    for i in range(200):  # random bytes, in the payload or as the whole message
        junk = rng.randbytes(rng.randint(0, 300))
        frames.append([b"", i.to_bytes(8, "big"), junk] if i % 2 else [junk])
    bombs = [b"\xdd\x00\x98\x96\x80",  # an array header claiming 10M elements
             b"\x93\xcb\x41\xd9\x00\x00\x00\x00\x00\x00\xdd\xff\xff\xff\xff\xc0"]
    big_tokens = encode_vllm_batch([stored((1,), None, 150_000, 150_000)], ts=1.0)
    over_socket_cap = b"\x00" * (3 << 20)  # over 2 x max_message_bytes: refused by libzmq
    over_message_cap = encode_vllm_batch([stored((2,), None, 80_000, 80_000, 70_000)] * 3,
                                         ts=1.0)
    assert (1 << 20) < len(over_message_cap) < (2 << 20)
    chain = [stored(tuple(range(10_000 + j * 500, 10_000 + (j + 1) * 500)),
                    None if j == 0 else 10_000 + j * 500 - 1, 500 * 16) for j in range(40)]
    collisions = [stored((5,), None, 16), stored((5,), 9, 16), stored((5,), 5, 16)]
    cycle = [stored((6,), 7, 16), stored((7,), 6, 16), BlockRemoved((6,), "GPU"),
             stored((6,), 7, 16)]

    honest = iter(range(10_000))
    for n, item in enumerate([*frames, *bombs, big_tokens, over_message_cap,
                              *[encode_vllm_batch([ev], ts=2.0) for ev in chain],
                              encode_vllm_batch(collisions, ts=3.0),
                              encode_vllm_batch(cycle, ts=4.0), over_socket_cap]):
        if isinstance(item, list):
            pub.send_raw(item)
        else:
            pub.publish(item)
        if n % 20 == 0:  # the honest engines go on meanwhile
            for e in stack.engines.values():
                e.traffic(1, seed=next(honest))
    await pub.wait_for_subscriber(count=2)  # the frame over the socket cap cost a connection
    await stack.converge(timeout_s=45)
    assert await stack.healthz() == 200
    st = (await stack.listener_stats())["sources"]["hostile"]
    assert st["zmq_disconnects"] == 1
    dropped = st["events_dropped"]
    assert dropped.get("too_many_tokens") == 1 and dropped.get("message_too_large") == 1, dropped
    assert sum(dropped.values()) >= 150, dropped
    assert st["blocks_tracked"] <= HOSTILE_LIMITS["max_tracked_blocks"]
    assert st["tokens_retained"] <= HOSTILE_LIMITS["max_retained_tokens"]
    # The documented bound for this source: blocks x 550 B (every block its own prefix, the
    # worst case) + tokens x 4 B + 44 MiB + 10 x
    # max_message_bytes (a frame being received and its decoded form); the honest sources'
    # trackers are small. RSS growth stays within it.
    bound_kib = (5_000 * 550 + 200_000 * 4) // 1024 + 44 * 1024 + 10 * 1024
    assert rss_kib(pid) - rss_before < bound_kib, (rss_before, rss_kib(pid))
