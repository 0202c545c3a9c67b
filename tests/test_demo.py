"""`continuum-kv-listener demo` as a user runs it: a real process tree on 127.0.0.1 (simulated
engines, the tokenizer server, the listener daemon as a child, the router in process), headless
for a few seconds; with stdout a pipe, then Ctrl-C delivered to the whole process group as a
terminal does; on a pseudo-terminal, the start-up view, the live view and its legend; plus the
views' rendering.

What an operator sees: output at once (a start-up line or view before the engines are even up,
where setting up takes seconds), the summary line exactly once and last, and no ANSI escape
codes unless stdout is a terminal.

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

import fcntl
import io
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from kv_listener.demo.view import (
    LEGEND,
    BackendCounters,
    BackendRow,
    PrefixRow,
    Stage,
    Totals,
    ViewState,
    render_startup,
    render_view,
    startup_line,
    startup_stages,
    summary_line,
    wants_live_view,
)
from kv_listener.sim.workload import SYSTEM_PROMPTS, ChatWorkload

CMD = [sys.executable, "-m", "kv_listener", "demo"]
SUMMARY = re.compile(r"^routing: kv_aware=(\d+) fallback=(\d+) hit_rate=(\d\.\d\d)$")
ANY_SUMMARY = re.compile(r"routing: kv_aware=")
HIT_RATE_BOUND = 0.6
ESC = "\x1b"
STAGES = [s.name for s in startup_stages(2)]


def _env() -> dict[str, str]:
    # No network is needed: make any attempt to reach the Hub fail instead of downloading.
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _summary(stdout: str) -> tuple[int, int, float]:
    lines = stdout.strip().splitlines()
    assert lines, stdout
    m = SUMMARY.match(lines[-1])
    assert m, lines[-1]
    # Once: not also in a view or a progress line before it.
    assert len(ANY_SUMMARY.findall(stdout)) == 1, stdout
    return int(m.group(1)), int(m.group(2)), float(m.group(3))


def _assert_plain_start(lines: list[str], min_stages: int = len(STAGES)) -> None:
    """Not a TTY: the first line says what is starting, before any part is up; then one line
    per stage done, in order (at least `min_stages` of them)."""
    assert lines[0] == startup_line(2), lines[:2]
    stage_lines = [line for line in lines if re.match(r"demo: [a-z ]+ \(\d+\.\d s\): ", line)]
    names = [re.sub(r" \(.*", "", line.removeprefix("demo: ")) for line in stage_lines]
    assert len(names) >= min_stages and names == STAGES[:len(names)], lines
    assert lines.index(stage_lines[0]) == 1  # nothing before the engines are up but the start


@pytest.mark.timeout(90)
def test_headless_demo_routes_kv_aware_and_hits_the_cache() -> None:
    proc = subprocess.run([*CMD, "--duration", "3", "--headless"], capture_output=True, text=True,
                          timeout=80, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr, proc.stderr
    assert ESC not in proc.stdout and ESC not in proc.stderr
    _assert_plain_start(proc.stdout.splitlines())
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
    # No --headless: stdout is a pipe, which gets the same plain lines.
    proc = subprocess.Popen(CMD, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), start_new_session=True)
    try:
        assert proc.stdout is not None
        seen = []
        while not seen or not seen[-1].startswith("demo: listener ready"):
            line = proc.stdout.readline()
            assert line, "".join(seen) + (proc.stderr.read() if proc.stderr else "")
            seen.append(line)
        m = re.search(r"\bpid (\d+)", seen[-1])
        assert m, seen[-1]
        listener_pid = int(m.group(1))
        # A terminal's Ctrl-C: SIGINT to the foreground process group (demo and listener).
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    out = "".join(seen) + out
    assert ESC not in out and ESC not in err
    _assert_plain_start(out.splitlines(), min_stages=2)  # Ctrl-C came once the listener was up
    _summary(out)
    with pytest.raises(ProcessLookupError):
        os.kill(listener_pid, 0)  # the listener ended (and was reaped) with the demo


def _frames(raw: str) -> list[list[str]]:
    """A live terminal's output as the drawings it made: each redraw starts with the cursor
    moving up over the last one (ESC[<n>F ESC[J); the cursor's show/hide codes are dropped."""
    raw = raw.replace("\x1b[?25l", "").replace("\x1b[?25h", "").replace("\r\n", "\n")
    return [part.splitlines() for part in re.split(r"\x1b\[\d+F\x1b\[J", raw)]


@pytest.mark.timeout(90)
def test_terminal_shows_startup_then_live_view_with_legend_and_one_summary() -> None:
    """On a pseudo-terminal (80 x 40) as in a user's shell: the start-up view comes first, while
    the engines are not up yet; then the live view with its legend; the summary once, last."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    env = dict(_env(), TERM="xterm")
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    proc = subprocess.Popen([*CMD, "--duration", "2"], stdin=slave, stdout=slave,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    try:
        deadline = time.monotonic() + 75
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the demo exited and closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        _, err_bytes = proc.communicate(timeout=30)
        err = err_bytes.decode()
        code = proc.returncode
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 0, err
    raw = b"".join(chunks).decode()
    frames = _frames(raw)
    # The first drawing is the start-up view, with no stage done yet: output came at once.
    first = frames[0]
    assert "starting" in first[0], first
    assert any(line.startswith("[ .. ] engines up") for line in first), first
    assert not any(line.startswith("[ ok ]") for line in first), first
    # The live view followed, with its legend, and fits the terminal.
    live = [f for f in frames if f and "backend" in "".join(f)]
    assert live, frames[-1]
    last = live[-1]
    for term, meaning in LEGEND:
        assert f"{term}: {meaning}" in "\n".join(last), (term, last)
    assert all(len(line) <= 80 for f in frames for line in f)
    # One summary line, after the last drawing.
    assert len(ANY_SUMMARY.findall(raw)) == 1, raw[-2000:]
    assert SUMMARY.match(raw.replace("\r\n", "\n").strip().splitlines()[-1])  # no escape codes


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
    assert re.search(r"^all\s+2\s+10\s+8\s+2\s+0\.85\s+120/256\s+14\s+1/1 up$", text, re.M)
    assert re.search(rf"^support\s+{hashes['support'][:12]}\.\.\s+vllm-1: 576$", text, re.M)
    assert re.search(r"^travel\s+\S+\s+-$", text, re.M)
    # The summary is printed once, after the view: the view does not carry it.
    assert "routing:" not in text and "kv_aware=" not in text
    # A legend of every column, compact and last (a short terminal loses it first).
    legend = lines[lines.index("", len(lines) - 6) + 1:]
    assert 1 <= len(legend) <= 4, legend
    assert " ".join(legend).split("  ")[0] == f"{LEGEND[0][0]}: {LEGEND[0][1]}"
    for term in ("run", "requests", "kv_aware", "fallback", "hit rate", "cached", "records",
                 "stream", "holders"):
        assert re.search(rf"(^|  ){term}: ", "\n".join(legend), re.M), term
    assert max(len(line) for line in render_view(state, width=200)) <= 80  # fits a terminal
    assert all(len(line) <= 40 for line in render_view(state, width=40))
    assert all(ESC not in line for line in lines)
    assert summary_line(Totals()) == "routing: kv_aware=0 fallback=0 hit_rate=0.00"


def test_startup_view_says_what_it_waits_for() -> None:
    stages = startup_stages(2)
    lines = render_startup(stages, 0.0)
    assert [line.split("]")[0] for line in lines if line.startswith("[")] == ["[ .. "] + ["[    "] * 3
    assert [line[7:27].strip() for line in lines if line.startswith("[")] == STAGES
    stages[0].done_s, stages[0].detail = 1.2, "vllm-1 :1, vllm-2 :2"
    stages[1].done_s, stages[1].failed = 3.0, True
    lines = render_startup(stages, 3.1, status="stopped")
    assert "stopped" in lines[0]
    assert any(re.fullmatch(r"\[ ok \] engines up\s+1\.2s  vllm-1 :1, vllm-2 :2", x) for x in lines)
    assert any(x.startswith("[fail] listener ready") for x in lines)
    assert max(len(x) for x in render_startup(startup_stages(8), 999.9)) <= 80
    assert isinstance(stages[0], Stage)


def test_live_view_only_on_a_terminal_that_can_redraw() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wants_live_view(False, Tty(), {"TERM": "xterm"})
    assert not wants_live_view(True, Tty(), {"TERM": "xterm"})  # --headless
    assert not wants_live_view(False, io.StringIO(), {"TERM": "xterm"})  # a pipe or a file
    assert not wants_live_view(False, Tty(), {"TERM": "dumb"})
