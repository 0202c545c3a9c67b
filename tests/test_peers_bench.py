"""A short run of `bench/peers.py` (issue 13) without Dynamo (`--ours-only`: CI installs nothing):
every workload once on small streams through the real daemon, then the in-process floors. The
figures are the benchmark's, not checked here beyond being there, positive and lossless."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.bench import run_bench

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
