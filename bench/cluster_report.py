"""Figures of one cluster-benchmark run and their output: the stdout table, the JSON file and
the PNG plots (matplotlib, optional: `pip install -e '.[bench]'`)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Served:
    """One request as the client saw it."""

    engine: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # client side: request sent -> first streamed chunk
    engine_ttft_s: float | None  # the engine's own: arrival -> first chunk (None: not told)
    decide_s: float  # time the bench-side router spent choosing (0 for a proxy)
    decision: str


@dataclass(slots=True)
class RunResult:
    workload: str
    strategy: str
    concurrency: int
    pool_fraction: float
    requests: int = 0
    failed: int = 0
    hit_rate: float = 0.0
    prefill_tokens: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    imbalance: float = 0.0  # max / mean requests per engine
    decisions: dict[str, int] = field(default_factory=dict)
    decide_ms: float = 0.0  # mean per request: the bench-side router's decision time
    transit_ms: float = 0.0  # mean client TTFT minus the engine's own TTFT (a proxy's hop, the
    # client's and engines' shared loop); a proxy adds what it shows over round robin's
    router_added_ms: float = 0.0  # decide_ms, or for a proxy transit_ms - round robin's
    wall_s: float = 0.0
    note: str = ""

    def fill(self, served: list[Served], engines: list[str], failed: int, wall_s: float) -> None:
        self.requests, self.failed, self.wall_s = len(served), failed, wall_s
        if not served:
            return
        prompt = sum(s.prompt_tokens for s in served)
        cached = sum(s.cached_tokens for s in served)
        self.hit_rate = cached / prompt if prompt else 0.0
        self.prefill_tokens = prompt - cached
        ttft = sorted(s.ttft_s * 1e3 for s in served)
        self.ttft_p50_ms = _pct(ttft, 0.50)
        self.ttft_p90_ms = _pct(ttft, 0.90)
        self.ttft_p99_ms = _pct(ttft, 0.99)
        per = Counter(s.engine for s in served)
        counts = [per.get(e, 0) for e in engines]
        self.imbalance = max(counts) / statistics.mean(counts) if any(counts) else 0.0
        self.decisions = dict(Counter(s.decision for s in served))
        self.decide_ms = statistics.mean(s.decide_s for s in served) * 1e3
        transit = [s.ttft_s - s.engine_ttft_s for s in served if s.engine_ttft_s is not None]
        self.transit_ms = statistics.mean(transit) * 1e3 if transit else 0.0
        self.router_added_ms = self.decide_ms


def settle_added(results: list[RunResult]) -> None:
    """A proxy's added latency: its transit over round robin's (direct to the engine) in the
    same workload, concurrency and pool."""
    direct = {(r.workload, r.concurrency, r.pool_fraction): r.transit_ms for r in results
              if r.strategy == "round_robin" and r.requests}
    for r in results:
        key = (r.workload, r.concurrency, r.pool_fraction)
        if ":" in r.strategy and key in direct and r.requests:
            r.router_added_ms = max(0.0, r.transit_ms - direct[key])


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


HEADER = (f"{'workload':<10} {'conc':>4} {'pool':>5} {'strategy':<28} {'hit':>6} {'prefill':>9} "
          f"{'ttft p50':>9} {'p90':>8} {'p99':>8} {'imbal':>6} {'added ms':>8}  decisions")


def row(r: RunResult) -> str:
    if r.note and not r.requests:
        return f"{r.workload:<10} {r.concurrency:>4} {r.pool_fraction:>5.2f} {r.strategy:<28} {r.note}"
    dec = " ".join(f"{k}={v}" for k, v in sorted(r.decisions.items()))
    fail = f" failed={r.failed}" if r.failed else ""
    return (f"{r.workload:<10} {r.concurrency:>4} {r.pool_fraction:>5.2f} {r.strategy:<28} "
            f"{r.hit_rate:6.3f} {r.prefill_tokens:9d} {r.ttft_p50_ms:9.1f} {r.ttft_p90_ms:8.1f} "
            f"{r.ttft_p99_ms:8.1f} {r.imbalance:6.2f} {r.router_added_ms:8.2f}  {dec}{fail}")


def write_json(path: Path, meta: dict[str, Any], results: list[RunResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]},
                               indent=1) + "\n")


def read_json(path: Path) -> tuple[dict[str, Any], list[RunResult]]:
    doc = json.loads(path.read_text())
    return doc["meta"], [RunResult(**r) for r in doc["results"]]


def write_plots(directory: Path, results: list[RunResult], main_fraction: float) -> list[Path]:
    """Hit rate and TTFT p90 per strategy across workloads (one bar group per workload and
    concurrency), and both across pool sizes for the sweep. Returns the files written."""
    import matplotlib  # noqa: PLC0415 - optional: only when plots are asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    main = [r for r in results if r.pool_fraction == main_fraction and r.requests]
    groups = sorted({(r.workload, r.concurrency) for r in main})
    strategies = sorted({r.strategy for r in main})
    for metric, label, fname in (("hit_rate", "prefix-cache hit rate", "cluster-hit-rate.png"),
                                 ("ttft_p90_ms", "TTFT p90 (ms)", "cluster-ttft-p90.png")):
        fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.6), 4.5))
        width = 0.8 / max(1, len(strategies))
        for i, s in enumerate(strategies):
            values = [next((getattr(r, metric) for r in main
                            if (r.workload, r.concurrency) == g and r.strategy == s), 0.0)
                      for g in groups]
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=s)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{w}\nc={c}" for w, c in groups])
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        out = directory / fname
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    sweep = [r for r in results if r.requests and r.workload == "chat" and r.concurrency > 1]
    fractions = sorted({r.pool_fraction for r in sweep})
    if len(fractions) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for s in sorted({r.strategy for r in sweep}):
            pts = sorted((r.pool_fraction, r) for r in sweep if r.strategy == s)
            if len(pts) < 2:
                continue
            axes[0].plot([f for f, _ in pts], [r.hit_rate for _, r in pts], marker="o", label=s)
            axes[1].plot([f for f, _ in pts], [r.ttft_p90_ms for _, r in pts], marker="o", label=s)
        axes[0].set_xlabel("KV pool per engine / working set")
        axes[0].set_ylabel("hit rate")
        axes[1].set_xlabel("KV pool per engine / working set")
        axes[1].set_ylabel("TTFT p90 (ms)")
        axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        out = directory / "cluster-pool-sweep.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written
