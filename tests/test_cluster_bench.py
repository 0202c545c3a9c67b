"""A short run of `bench/cluster.py` (issue #12): two engines, the `chat` workload, this
project's strategy next to round robin, no peers. The pipeline (simulated engines -> the real
listener process -> the router module -> the routing decision) must route by the KV index and
every request must be served; the figures it prints are the benchmark's, not checked here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench import run_bench

pytestmark = pytest.mark.timeout(180)


def test_cluster_bench_smoke_run(tmp_path: Path) -> None:
    stdout, doc = run_bench(
        "cluster.py", ["--engines", "2", "--requests", "48", "--workloads", "chat",
                       "--strategies", "round_robin,kv_listener", "--no-peers", "--no-sweep"],
        tmp_path / "cluster.json", timeout_s=170)
    runs = {(r["strategy"], r["concurrency"]): r for r in doc["results"]}
    assert set(runs) == {("round_robin", 1), ("round_robin", 16), ("kv_listener", 1),
                         ("kv_listener", 16)}
    for r in runs.values():
        assert r["failed"] == 0 and r["requests"] == (48 if r["concurrency"] == 16 else 20)
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["ttft_p50_ms"] > 0
    # the listener's streams reached the index: requests were routed on what engines cache
    assert runs[("kv_listener", 16)]["decisions"].get("kv_aware", 0) > 0
    assert sum(runs[("round_robin", 16)]["decisions"].values()) == 48
    assert "kv_listener" in stdout and "round_robin" in stdout
