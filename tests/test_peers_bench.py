"""A short run of `bench/peers.py` (issue 13) without Dynamo (`--ours-only`: CI installs nothing):
every workload once on small streams through the real daemon, then the in-process floors. The
figures are the benchmark's, not checked here beyond being there, positive and lossless."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kv_listener.core.model import AllBlocksCleared
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.support.bench import run_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"

pytestmark = pytest.mark.timeout(90)


def test_peers_bench_ours_only_quick(tmp_path: Path) -> None:
    text, doc = run_bench("peers.py", ["--quick", "--ours-only", "--reps", "1"],
                          tmp_path / "peers.json", timeout_s=80)
    for workload in ("salted", "chat", "resolver"):
        figs = doc[workload]["figures"]["ours"]
        for name in ("blocks_per_s", "cpu_ms_per_1k", "rss_mib"):
            assert figs[name]["median"] > 0, (workload, name)
        assert "dynamo" not in doc[workload]["figures"]
        checks = doc[workload]["runs"]["ours"][0]["checks"]
        assert checks["gaps"] == 0 and not checks["events_dropped"] and not checks["buffer_overflow"]
    assert doc["resolver"]["runs"]["ours"][0]["checks"]["detokenize_calls"] > 0
    assert set(doc["memory"]) == {"1", "16"}  # blocks per chain
    for run in doc["memory"].values():
        memory = run["figures"]["ours"]
        assert memory["idle_rss_mib"]["median"] > 0
        assert all(memory[f"bytes_per_block_{n}"]["median"] > 0 for n in run["sizes"])
    floors = doc["floors"]
    assert floors["msgpack.unpackb"] > 0 and floors["decode + Tracker.apply"] > 0
    # the printed tables carry the same figures
    for label in ("blocks/s", "CPU ms per 1,000 blocks", "RSS MiB at the end",
                  "bytes per tracked block @", "decode_zmq_payload", "decode + Tracker.apply"):
        assert label in text, label
    assert re.search(r"rep 1 ours +[\d,]+ blocks/s", text)
    assert "!!" not in text


@pytest.fixture
def bench_on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


async def test_our_consumer_stops_waiting_as_soon_as_the_marker_cannot_come(
        tmp_path: Path, bench_on_path: None) -> None:
    # A burst larger than the daemon's source queue made it drop and clear: the phase's last
    # block never came, and the bench waited its whole 300 s for it before saying nothing useful.
    import peers_consumers as pc  # noqa: PLC0415 - bench/ is on the path only in this test
    from peers_workloads import salted_chains  # noqa: PLC0415

    stream = salted_chains(2, 2, 1)
    assert stream.warmup.marker is not None and stream.timed.marker is not None
    async with SimPublisher("tcp://127.0.0.1:0", mode="bind") as pub, \
            pc.Ours(pub.endpoint, tmp_path) as ours:
        await pub.wait_for_subscriber(timeout_s=30)
        ours.expect(stream.warmup.marker)
        for frame in stream.warmup.frames:
            pub.publish(frame)
        assert await ours.applied(timeout_s=30) > 0  # what it waits for, when it comes
        ours.expect(stream.timed.marker)  # never published: the daemon clears instead
        pub.publish(encode_vllm_batch([AllBlocksCleared()], ts=1.0, version="0.33"))
        with pytest.raises(pc.StreamEnded, match="cleared the backend"):
            await ours.applied(timeout_s=30)
        ours.expect(stream.timed.marker)
        assert ours.daemon.proc is not None
        ours.daemon.proc.kill()
        with pytest.raises(pc.StreamEnded, match="exited"):
            await ours.applied(timeout_s=30)
