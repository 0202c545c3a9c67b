"""`continuum-kv-listener demo` as a user runs it: a real process tree on 127.0.0.1 (simulated
engines, the tokenizer server, the listener daemon as a child, the router in process), headless
for a few seconds, then Ctrl-C delivered to the whole process group as a terminal does; plus the
live view's rendering.

The hit-rate bound: every workload prompt is a system prompt of 384 to 500 tokens plus a user
turn of 20 to 60 tokens, so a request served by an engine that holds its system prompt hits at
least 368 / 560 = 0.66 of its prompt and typically 0.85. Misses are bounded: the first request of
each of the 5 prompts on each of the 2 engines, plus the requests that arrive before the index has
learned a prefix (engine -> listener -> /detokenize -> SSE -> index: tens of milliseconds); each
engine's 256 blocks hold all 5 prompts (about 140 blocks) with room for the per-user blocks, which
the LRU order evicts first. Over ~180 requests that leaves the token hit rate well above 0.6
(0.84-0.86 measured), while an engine without prefix caching, or a pipeline whose index never
fills (every request a fallback), would fail the kv_aware checks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from kv_listener.demo import (
    BackendCounters,
    BackendRow,
    PrefixRow,
    Totals,
    ViewState,
    render_view,
    summary_line,
)
from kv_listener.sim.workload import SYSTEM_PROMPTS, ChatWorkload

CMD = [sys.executable, "-m", "kv_listener", "demo"]
SUMMARY = re.compile(r"^routing: kv_aware=(\d+) fallback=(\d+) hit_rate=(\d\.\d\d)$")
HIT_RATE_BOUND = 0.6


def _env() -> dict[str, str]:
    # No network is needed: make any attempt to reach the Hub fail instead of downloading.
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _summary(stdout: str) -> tuple[int, int, float]:
    lines = stdout.strip().splitlines()
    assert lines, stdout
    m = SUMMARY.match(lines[-1])
    assert m, lines[-1]
    return int(m.group(1)), int(m.group(2)), float(m.group(3))


@pytest.mark.timeout(90)
def test_headless_demo_routes_kv_aware_and_hits_the_cache() -> None:
    proc = subprocess.run([*CMD, "--duration", "6", "--headless"], capture_output=True, text=True,
                          timeout=80, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr, proc.stderr
    kv_aware, fallback, hit_rate = _summary(proc.stdout)
    assert kv_aware > 0
    assert kv_aware > fallback  # fallbacks are the warm-up only (see the module docstring)
    assert hit_rate >= HIT_RATE_BOUND
    # The router's index learned every system prompt (the Korean one included) from the
    # listener's streams: each has a holder among the engines.
    holders = dict(re.findall(r"^prefix (\S+) [0-9a-f]{12} holders (.+)$", proc.stdout, re.M))
    assert set(holders) == {p.name for p in SYSTEM_PROMPTS}
    for name, text in holders.items():
        assert re.fullmatch(r"(vllm-[12]:\d+ ?)+", text), (name, text)
    # Per backend: both engines served, and their counts add up to the summary.
    rows = re.findall(r"^(vllm-\d): requests=(\d+) kv_aware=(\d+) fallback=(\d+)", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["vllm-1", "vllm-2"]
    assert all(int(r[1]) > 0 for r in rows)
    assert sum(int(r[2]) for r in rows) == kv_aware and sum(int(r[3]) for r in rows) == fallback


@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_whole_tree_cleanly() -> None:
    proc = subprocess.Popen([*CMD, "--headless"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), start_new_session=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed once traffic starts
        m = re.search(r"listener pid (\d+)", first)
        assert m, first + (proc.stderr.read() if proc.stderr else "")
        listener_pid = int(m.group(1))
        # A terminal's Ctrl-C: SIGINT to the foreground process group (demo and listener).
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    _summary(out)
    with pytest.raises(ProcessLookupError):
        os.kill(listener_pid, 0)  # the listener ended (and was reaped) with the demo


def test_view_renders_backends_prefixes_and_the_summary() -> None:
    hashes = ChatWorkload().prefix_hashes()
    counters = BackendCounters(requests=10, kv_aware=8, fallback=2, prompt_tokens=1000,
                               hit_tokens=850)
    totals = Totals(kv_aware=8, fallback=2, requests=10, prompt_tokens=1000, hit_tokens=850)
    state = ViewState(
        elapsed_s=3.0, duration_s=6.0,
        backends=(BackendRow("vllm-1", 2, counters, 120, 256, 14, True),),
        prefixes=(PrefixRow("support", hashes["support"], (("vllm-1", 576),)),
                  PrefixRow("travel", hashes["travel"], ())),
        other_prefixes=0, totals=totals, listener="pid 1, 127.0.0.1:1", admin_url="http://x")
    lines = render_view(state, width=200)
    text = "\n".join(lines)
    assert "50%" in lines[0] and "Ctrl-C to stop" in lines[0]
    assert re.search(r"^vllm-1\s+2\s+10\s+8\s+2\s+0\.85\s+120/256\s+14\s+up$", text, re.M)
    assert re.search(rf"^support\s+{hashes['support'][:12]}\.\.\s+vllm-1: 576$", text, re.M)
    assert re.search(r"^travel\s+\S+\s+-$", text, re.M)
    assert lines[-1].startswith("routing: kv_aware=8 fallback=2 hit_rate=0.85")
    assert max(len(line) for line in render_view(state, width=200)) <= 80  # fits a terminal
    assert all(len(line) <= 40 for line in render_view(state, width=40))
    assert summary_line(Totals()) == "routing: kv_aware=0 fallback=0 hit_rate=0.00"
