"""One source's runtime owns its counting: each `SourceStats` counter moves in one method, the
parts of a source call those methods, and what `/stats`, `/readyz/{backend}` and `/metrics` show
of the queue and the tracker is read from them when asked."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import ctypes
import dataclasses
import subprocess
import sys
from array import array
from collections import Counter
from pathlib import Path

import pytest

from kv_listener import runtime as runtime_module
from kv_listener.config import parse_config
from kv_listener.core.liveness import LivenessChange
from kv_listener.core.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ClearReason,
    EventBatch,
    SourceCleared,
)
from kv_listener.metrics import ListenerCollector, new_registry, render
from kv_listener.outputs.streams import StreamHub
from kv_listener.runtime import SourceRuntime
from kv_listener.sources.common import QueueFeeder
from kv_listener.stats import SourceStats
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1] / "kv_listener"
BACKEND = "vllm-1"


def runtime() -> SourceRuntime:
    cfg = parse_config({"sources": [{"backend_name": BACKEND, "engine": "vllm", "model": "m",
                                     "zmq_endpoint": f"tcp://127.0.0.1:{free_port()}"}]})
    return SourceRuntime(cfg.sources[0], cfg, StreamHub.from_config(cfg), None)


def stored(h: int, n_tokens: int) -> BlockStored:
    return BlockStored(block_hashes=(h,), parent_hash=None, token_ids=array("I", range(n_tokens)),
                       block_size=n_tokens)


def test_each_fact_moves_its_own_counters() -> None:
    st = SourceStats(engine="vllm")
    st.frame_received()
    st.received(5, 3, Counter({"unknown_tag": 2}), 12.5)
    st.received(1, 1, Counter(), None)  # no time: the last batch's stays
    assert (st.batches_received, st.events_received, st.events_decoded) == (1, 6, 4)
    assert (st.last_event_at, st.events_dropped) == (12.5, {"unknown_tag": 2})
    st.dropped("bad_seq")
    st.dropped_by_reason({"unknown_tag": 1})
    assert st.events_dropped == {"unknown_tag": 3, "bad_seq": 1}
    st.gap_found()
    st.gap_found(2)
    st.replay_ended(covered=True)
    st.replay_ended(covered=False)
    st.replay_ended(covered=False)
    assert (st.gaps, st.replays, st.replay_failures) == (3, 1, 2)
    st.startup_replayed("partial", 4, 7)
    st.startup_replayed("timeout")  # a later empty one keeps what the first applied
    assert (st.startup_replay, st.startup_replay_batches, st.startup_replay_from_seq) == \
        ("timeout", 4, 7)
    st.publisher_refused()
    st.publishers_now(2)
    st.publishers_now(1, lost=True)
    assert (st.refused_publishers, st.publishers_connected, st.zmq_disconnects) == (1, 1, 1)
    st.attached(True)
    st.poll_failed("timeout")
    assert not st.ready and st.poll_errors == {"timeout": 1}
    st.poll_succeeded(3.0)
    assert st.ready and st.last_ok_at == 3.0
    st.engine_is("down", went_down=True)
    st.engine_is("up")
    assert (st.engine_state, st.engine_downs) == ("up", 1)
    st.queued(10, 3)
    st.queued(-4, -1)
    st.cleared("gap")
    st.cleared("engine_cleared", 2)
    st.restarted()
    st.salt_rejections(5)
    assert (st.queued_tokens, st.queued_hashes) == (6, 2)
    assert (st.clears, st.ready) == ({"gap": 1, "engine_cleared": 2}, False)
    assert (st.source_restarts, st.salt_rejected) == (1, 5)
    st.detokenize_called()
    st.tokenize_called()
    st.detokenize_failed("timeout")
    assert (st.detokenize_calls, st.tokenize_calls, st.detokenize_errors) == (1, 1, {"timeout": 1})


def _stats_writes(source: str, fields: set[str]) -> list[int]:
    """Lines of `x.stats.<field> = / += ...` (or `stats.<field>[k] += ...`) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        for written in targets:
            target = written.value if isinstance(written, ast.Subscript) else written
            if isinstance(target, ast.Attribute) and target.attr in fields and \
                    ast.unparse(target.value).endswith("stats"):
                found.append(node.lineno)
    return found


def test_no_part_of_a_source_assigns_a_counter_itself() -> None:
    fields = {f.name for f in dataclasses.fields(SourceStats)} - {"engine"}
    modules = [*sorted((ROOT / "sources").glob("*.py")), ROOT / "runtime.py", ROOT / "app.py"]
    writes = {m.name: w for m in modules if (w := _stats_writes(m.read_text(), fields))}
    assert writes == {}
    # the check itself sees such writes
    assert _stats_writes("self.stats.gaps += 1\nx = 1\nself._stats.clears['gap'] += 1\n"
                         "stats.ready = True\n", fields) == [1, 3, 4]


def test_queue_depth_is_read_from_the_queue_when_asked() -> None:
    rt = runtime()
    for _ in range(3):
        rt.queue.put_nowait(SourceCleared(ClearReason.GAP))
    assert rt.stats_entry()["queue_depth"] == 3
    assert rt.view().queue_depth == 3
    text = render(new_registry(ListenerCollector(lambda: [rt.view()]))).decode()
    assert f'continuum_kv_listener_queue_depth{{backend="{BACKEND}"}} 3.0' in text
    rt.queue.get_nowait()
    assert rt.stats_entry()["queue_depth"] == rt.view().queue_depth == 2


def test_the_tracker_salt_rejections_show_as_the_source_counter() -> None:
    rt = runtime()
    rt.tracker.salt_rejected = 2
    assert rt.stats_entry()["salt_rejected"] == 2
    assert rt.stats.salt_rejected == 2


def test_readiness_entry_of_an_unwatched_source_before_it_attached() -> None:
    rt = runtime()
    assert rt.readiness_entry() == {
        "backend": BACKEND, "ready": False, "reason": "not_attached", "engine": "vllm",
        "engine_state": "off", "publishers_connected": 0}


async def drain(rt: SourceRuntime) -> None:
    """Run the pump until it has taken and applied everything queued (bounded)."""
    pump = asyncio.create_task(rt._pump())
    try:
        async with asyncio.timeout(5):
            while not rt.queue.empty() or rt.stats.queued_tokens:
                await asyncio.sleep(0)  # yield until the pump took every item
            for _ in range(10):
                await asyncio.sleep(0)  # and applied what it took (one wake-up: it never waits)
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump


async def test_an_engine_down_clear_is_counted_and_applied_even_when_the_queue_is_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine died while the tracker was a whole queue behind: nothing more will come from
    # it, so the clear must be applied once the pump has made room, not lost with the full queue
    # (the dead engine's prefixes would live on).
    monkeypatch.setattr(runtime_module, "SOURCE_QUEUE_SIZE", 1)
    rt = runtime()
    rt.queue.put_nowait(EventBatch(0.0, (stored(1, 4),), 0, 0))
    rt.stats.queued(4, 1)  # as the source's feeder counts what it queues
    rt._on_liveness(LivenessChange.WENT_DOWN, 0.0)
    assert rt.stats.clears == {"engine_down": 1}
    assert rt.readiness() == "engine_down" and rt.queue.qsize() == 1
    await drain(rt)
    assert rt.tracker.blocks_tracked == 0 and rt.tracker.clears == 1
    assert rt.stats.clears == {"engine_down": 1}  # counted once
    rt.hub.close()


async def test_a_batch_dropped_last_clears_the_tracker_once_the_pump_made_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The queue is full when a batch (here the engine's removal of block 1) comes, and the engine
    # then goes quiet: nothing else is ever put. The overflow clear must still reach the
    # tracker, or block 1's prefix stays announced though the engine freed it.
    monkeypatch.setattr(runtime_module, "SOURCE_QUEUE_SIZE", 2)
    rt = runtime()
    assert rt.feeder.put(EventBatch(0.0, (stored(1, 4),), 0, 0))
    assert rt.feeder.put(EventBatch(0.0, (stored(2, 4),), 0, 1))
    assert not rt.feeder.put(EventBatch(0.0, (BlockRemoved(block_hashes=(1,)),), 0, 2))
    assert rt.stats.events_dropped == {"queue_overflow": 1}
    await drain(rt)
    assert rt.tracker.blocks_tracked == 0 and rt.tracker.clears == 1
    assert rt.stats.clears == {"overflow": 1}
    # and the next batch follows the clear, as from a fresh start
    assert rt.feeder.put(EventBatch(0.0, (stored(3, 4),), 0, 3))
    await drain(rt)
    assert rt.tracker.blocks_tracked == 1 and rt.stats.clears == {"overflow": 1}
    rt.hub.close()


async def test_the_pump_gives_back_the_tokens_and_hashes_it_takes_and_counts_engine_clears() -> None:
    rt = runtime()
    feeder = QueueFeeder(rt.queue, rt.stats, BACKEND)
    assert feeder.put(EventBatch(0.0, (stored(1, 4), stored(2, 4)), 0, 0))
    assert feeder.put(EventBatch(0.0, (BlockRemoved(block_hashes=(1, 2, 3)),), 0, 1))
    assert feeder.put(EventBatch(0.0, (AllBlocksCleared(),), 0, 2))
    assert (rt.stats.queued_tokens, rt.stats.queued_hashes) == (8, 5)
    pump = asyncio.create_task(rt._pump())
    try:
        async with asyncio.timeout(5):
            while not rt.queue.empty() or rt.stats.queued_tokens or rt.stats.queued_hashes:
                await asyncio.sleep(0)  # yield until the pump took every batch
    finally:
        pump.cancel()
        rt.hub.close()
    assert (rt.stats.queued_tokens, rt.stats.queued_hashes) == (0, 0)
    assert rt.stats.clears == {"engine_cleared": 1}


def test_settled_heap_is_frozen_and_young_objects_are_collected_less_often() -> None:
    import gc  # noqa: PLC0415

    from kv_listener.app import GC_YOUNG_THRESHOLD, settle_heap  # noqa: PLC0415

    before = gc.get_threshold()
    built_at_start = [{"a": []}]  # a container start-up made: frozen with the rest
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert GC_YOUNG_THRESHOLD > 700  # CPython's default: the collector ran every few batches
        # collected survivors go to the oldest generation; frozen ones are in none of them
        assert not any(o is built_at_start for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


_MALLINFO = """
import ctypes

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def mapped_after_a_larger_freed_block():
    big = bytearray(1 << 20)  # above the 128 KiB default: a mapping of its own
    del big  # freed: glibc raises its threshold to 1 MiB, unless pinned
    mapped = libc.mallinfo2().hblkhd
    column = bytearray(600 << 10)  # a smaller block after a larger one went: a grown column
    return libc.mallinfo2().hblkhd - mapped >= 600 << 10
"""

_MMAP_PROBE = _MALLINFO + """
import sys
from kv_listener.app import pin_mmap_threshold

if sys.argv[1] == "pin":
    assert pin_mmap_threshold()
print(mapped_after_a_larger_freed_block())
"""

#: The daemon's own start: `Listener.run` pins the threshold before its first await.
_RUN_PROBE = _MALLINFO + """
import asyncio, sys
from kv_listener.app import Listener
from kv_listener.config import parse_config

async def main():
    listener = Listener(parse_config({"listen": "127.0.0.1:" + sys.argv[1]}))
    run = asyncio.create_task(listener.run())
    await asyncio.sleep(0)  # one turn of the loop: run() has started, up to its first await
    print("mapped:", mapped_after_a_larger_freed_block(), flush=True)  # the daemon logs too
    listener.request_stop()
    await run

asyncio.run(main())
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc >= 2.33 only")
def test_pinned_mmap_threshold_maps_a_block_that_follows_a_larger_freed_one() -> None:
    """Without the pin, glibc serves a 600 KiB block from its heap once a 1 MiB mapping was
    freed (the hole it leaves when freed stays in RSS); pinned, the block gets its own mapping,
    which free() returns."""
    def probe(mode: str) -> str:
        done = subprocess.run([sys.executable, "-c", _MMAP_PROBE, mode], capture_output=True,
                              text=True, timeout=30, check=True)
        return done.stdout.strip()

    assert probe("default") == "False"  # glibc's own behaviour: what the pin is for
    assert probe("pin") == "True"


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc >= 2.33 only")
def test_the_listener_pins_the_mmap_threshold_as_it_starts() -> None:
    """The daemon's start does pin it, and says so in its start-up line (a listener with no
    source, in a fresh process)."""
    done = subprocess.run([sys.executable, "-c", _RUN_PROBE, str(free_port())],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mapped: True" in done.stdout.splitlines(), done.stdout[-2000:]
    started = [line for line in done.stdout.splitlines() if "listener_started" in line]
    assert len(started) == 1 and "mmap_threshold_pinned=True" in started[0], done.stdout[-2000:]
