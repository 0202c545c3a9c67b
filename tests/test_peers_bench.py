"""A short run of `bench/peers.py` (issue 13) without Dynamo (`--ours-only`: CI installs nothing):
every workload once on small streams through the real daemon, then the in-process floors. The
figures are the benchmark's, not checked here beyond being there, positive and lossless."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(90)


def test_peers_bench_ours_only_quick(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peers.py"), "--quick", "--ours-only", "--reps", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=80, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = proc.stdout
    doc = json.loads(out.read_text())
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
