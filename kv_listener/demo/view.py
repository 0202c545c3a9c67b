"""What the demo shows: its counters, the start-up view, the live view with its legend, and the
lines it prints when stdout is no terminal.

Owns the terminal output. Everything renders to plain lines (no escape codes, each cut to the
width it is given); only `LiveView`, used when `wants_live_view` says stdout is a terminal that
understands cursor movement, adds ANSI escapes to redraw them in place. No I/O but the stream it
is handed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from kv_listener.demo.settings import MAX_OUTSTANDING, PROG

# --- counters and the view ---------------------------------------------------------------------


@dataclass(slots=True)
class BackendCounters:
    requests: int = 0  # served to the end
    kv_aware: int = 0
    fallback: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class Totals:
    kv_aware: int = 0  # routing decisions (counted when made, like the router's metric)
    fallback: int = 0
    requests: int = 0  # requests served to the end
    skipped: int = 0  # arrivals dropped because MAX_OUTSTANDING requests were pending
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def summary_line(totals: Totals) -> str:
    """The line the demo ends with (SPEC §9)."""
    return (f"routing: kv_aware={totals.kv_aware} fallback={totals.fallback} "
            f"hit_rate={totals.hit_rate:.2f}")


@dataclass(frozen=True, slots=True)
class BackendRow:
    name: str
    running: int
    counters: BackendCounters
    cached_blocks: int
    total_blocks: int
    records: int  # prefix records the router applied from this backend's stream
    connected: bool


@dataclass(frozen=True, slots=True)
class PrefixRow:
    label: str  # system prompt name
    prefix_hash: str
    holders: tuple[tuple[str, int], ...]  # (backend, token_count), most tokens first


@dataclass(frozen=True, slots=True)
class ViewState:
    elapsed_s: float
    duration_s: float | None
    backends: tuple[BackendRow, ...]
    prefixes: tuple[PrefixRow, ...]
    other_prefixes: int  # indexed prefixes that are not one of the workload's prompts
    totals: Totals
    listener: str  # e.g. "pid 1234 on 127.0.0.1:40123"
    admin_url: str
    listener_warnings: int = 0
    stopping: bool = False
    done: bool = False
    rate_rps: float = field(default=0.0)


def _bar(fraction: float, width: int = 24) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "#" * filled + "." * (width - filled)


#: What the live view's columns mean, shown under it (packed to the terminal's width).
LEGEND: tuple[tuple[str, str], ...] = (
    ("run", "in flight"),
    ("requests", "served"),
    ("kv_aware", "routed to a holder the index named"),
    ("fallback", "least-loaded (no holder)"),
    ("hit rate", "cached/prompt tokens"),
    ("cached", "engine's cached/total KV blocks"),
    ("records", "prefix records indexed"),
    ("stream", "listener -SSE-> router"),
    ("holders", "engines the index says cache the prompt"),
)


def pack(items: Sequence[str], width: int, sep: str = "  ") -> list[str]:
    """`items` in order on as few lines of `width` columns as fit, never split inside an item
    (one longer than `width` gets a line of its own and is cut by the caller)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + len(sep) + len(item) <= width:
            lines[-1] += sep + item
        else:
            lines.append(item)
    return lines


def render_view(state: ViewState, width: int = 80) -> list[str]:
    """The live view as plain lines (no escapes), each cut to `width` columns; the tables fit
    in 80. The summary line is not part of it: it is printed once, after the last drawing."""
    if state.duration_s is not None:
        frac = min(1.0, state.elapsed_s / state.duration_s) if state.duration_s > 0 else 1.0
        progress = (f"{state.elapsed_s:5.1f}s/{state.duration_s:g}s "
                    f"[{_bar(frac, 16)}] {frac * 100:3.0f}%")
    else:
        progress = f"{state.elapsed_s:5.1f}s"
    status = "done" if state.done else "stopping..." if state.stopping else "Ctrl-C to stop"
    lines = [
        f"{PROG} demo  {progress}  {status}",
        f"engines -ZMQ-> listener ({state.listener}) -SSE-> router",
        f"router admin: {state.admin_url}  traffic {state.rate_rps:.1f} req/s",
        "",
        f"{'backend':<8} {'run':>4} {'requests':>8} {'kv_aware':>8} {'fallback':>8} "
        f"{'hit rate':>8} {'cached':>8} {'records':>7}  stream",
    ]
    for b in state.backends:
        c = b.counters
        lines.append(
            f"{b.name:<8} {b.running:>4} {c.requests:>8} {c.kv_aware:>8} {c.fallback:>8} "
            f"{c.hit_rate:>8.2f} {f'{b.cached_blocks}/{b.total_blocks}':>8} {b.records:>7}  "
            f"{'up' if b.connected else 'down'}")
    t = state.totals
    up = sum(b.connected for b in state.backends)
    cached = f"{sum(b.cached_blocks for b in state.backends)}/" \
             f"{sum(b.total_blocks for b in state.backends)}"
    lines.append(
        f"{'all':<8} {sum(b.running for b in state.backends):>4} {t.requests:>8} "
        f"{t.kv_aware:>8} {t.fallback:>8} {t.hit_rate:>8.2f} {cached:>8} "
        f"{sum(b.records for b in state.backends):>7}  {up}/{len(state.backends)} up")
    lines += ["", f"{'system prompt':<14} {'prefix hash':<14} holders in the router's index "
                  "(tokens)"]
    for p in state.prefixes:
        holders = "  ".join(f"{b}: {n}" for b, n in p.holders) if p.holders else "-"
        lines.append(f"{p.label:<14} {p.prefix_hash[:12] + '..':<14} {holders}")
    if state.other_prefixes:
        lines.append(f"{'(other)':<14} {state.other_prefixes} more prefixes")
    if t.skipped or state.listener_warnings:
        lines += ["", f"skipped arrivals (over {MAX_OUTSTANDING} pending): {t.skipped}  "
                      f"listener warnings: {state.listener_warnings}"]
    # Last, so that a short terminal loses the legend first (see LiveView.draw).
    lines += ["", *pack([f"{k}: {v}" for k, v in LEGEND], min(width, 80))]
    return [line[:width] for line in lines]


# --- the start-up view -------------------------------------------------------------------------


@dataclass(slots=True)
class Stage:
    """One step the demo waits for before its live view means something."""

    name: str  # "engines up", ...
    waiting_for: str  # what it waits for, shown until it is done
    done_s: float | None = None  # seconds from the start when it was done
    detail: str = ""  # what came up, once done
    failed: bool = False


def startup_stages(engines: int) -> list[Stage]:
    return [
        Stage("engines up", f"{engines} simulated vLLM engines: tokenizer, servers"),
        Stage("listener ready", "the listener daemon, subscribed to their ZMQ"),
        Stage("router consuming", "its consumers on the listener's SSE streams"),
        Stage("first prefix records", "traffic's KV events in the router's index"),
    ]


def startup_line(engines: int) -> str:
    """The first line the headless demo prints, before anything starts."""
    names = ", ".join(s.name for s in startup_stages(engines))
    return (f"demo: starting {engines} simulated vLLM engines, the listener and the router on "
            f"127.0.0.1; waiting for: {names}")


def stage_line(stage: Stage) -> str:
    """A headless line for a stage that is done (or failed)."""
    when = f"{stage.done_s:.1f} s" if stage.done_s is not None else "?"
    if stage.failed:
        return f"demo: {stage.name}: failed after {when}"
    return f"demo: {stage.name} ({when}): {stage.detail}"


def render_startup(stages: Sequence[Stage], elapsed_s: float, *, status: str = "Ctrl-C to stop",
                   width: int = 80) -> list[str]:
    """The start-up view: what is starting and what it waits for (plain lines, cut to `width`;
    they fit in 80)."""
    current = next((i for i, s in enumerate(stages) if s.done_s is None), len(stages))
    lines = [f"{PROG} demo  starting {elapsed_s:5.1f}s  {status}",
             "engines -ZMQ-> listener -SSE-> router on 127.0.0.1, waiting for:", ""]
    for i, s in enumerate(stages):
        if s.failed:
            mark, when, text = "fail", f"{s.done_s or 0:4.1f}s", s.waiting_for
        elif s.done_s is not None:
            mark, when, text = " ok ", f"{s.done_s:4.1f}s", s.detail
        else:
            mark, when, text = " .. " if i == current else "    ", "", s.waiting_for
        lines.append(f"[{mark}] {s.name:<20} {when:>5}  {text}")
    lines += ["", "then the live view"]
    return [line[:width] for line in lines]


class LiveView:
    """Redraws the view in place: cursor up over the last drawing, clear to the end, print."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._lines = 0
        self._cursor_hidden = False

    def draw(self, lines: Sequence[str], rows: int | None = None, *, last: bool = False) -> None:
        """Draw `lines`, at most `rows - 1` of them: a drawing taller than the terminal would
        scroll, and the cursor could no longer go back to its first line. The `last` drawing
        shows the cursor again before its final newline, so the line printed after it (the
        summary) starts clean."""
        if rows is not None and len(lines) >= rows:
            lines = lines[:max(1, rows - 1)]
        buf = []
        if self._lines:
            buf.append(f"\x1b[{self._lines}F\x1b[J")
        if not self._cursor_hidden and not last:
            buf.append("\x1b[?25l")  # hidden while drawing
            self._cursor_hidden = True
        buf.append("\n".join(lines))
        if last and self._cursor_hidden:
            buf.append("\x1b[?25h")
            self._cursor_hidden = False
        buf.append("\n")
        self.out.write("".join(buf))
        self.out.flush()
        self._lines = len(lines)

    def close(self) -> None:
        if self._cursor_hidden:
            self.out.write("\x1b[?25h")
            self.out.flush()
            self._cursor_hidden = False


def wants_live_view(headless: bool, out: TextIO, env: Mapping[str, str]) -> bool:
    """Redrawing in place needs a terminal that understands cursor movement: `--headless`, a
    pipe, a file or TERM=dumb get plain lines with no escape codes."""
    return not headless and out.isatty() and env.get("TERM", "") != "dumb"
