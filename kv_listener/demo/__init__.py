"""`continuum-kv-listener demo`: the whole pipeline on 127.0.0.1, with simulated engines.

The package owns the demo's process tree and its live view, in three rooms: `run.py` the
scenario and its main loop, `view.py` the terminal output, `process.py` the child processes
(`settings.py` holds the numbers they share). Nothing leaves the machine and nothing is
downloaded (no GPU, no model: a tiny ChatML tokenizer ships in the package):

    chat workload --route, POST /v1/chat/completions--> simulated vLLM engines (OpenAI servers,
    `sim/server.py`) --ZMQ (vLLM 0.33 wire)--> listener (child process: `python -m kv_listener
    --config <temp file>`, the real daemon) --/detokenize--> the engines; listener --SSE
    GET /events/{backend}--> router (in process: consumers -> in-memory KV index -> overlap
    scorer) --> routing decisions for the next requests.

Each request of a seeded chat workload (a few long system prompts, many users) gets its prefix
key the router's way; the scorer picks the backend that holds the prefix (`kv_aware`) or, when no
backend scores above the pool threshold, the demo's default strategy picks the least-loaded
engine (`fallback`, round-robin among equals). The chosen engine serves it from its block pool
and answers with `usage.prompt_tokens_details.cached_tokens`: the ground truth behind the hit
rate (cached prompt tokens / prompt tokens, the engines' own measure, like vLLM's prefix cache
hit rate). Its KV events flow back through the listener into the router's index.

Setting up takes seconds (the tokenizer, then the listener's own start; 10 s and more on a busy
machine), so the first output comes at once: on a terminal (stdout a TTY, not `--headless`,
TERM not `dumb`) a start-up view lists what the demo waits for (engines up, listener ready,
router consuming, first prefix records) and gives way to the live view, redrawn twice a second
with plain ANSI escapes, a legend of its columns under it. Otherwise every line is plain text
with no escape codes: one line when the demo starts, one per stage, the per-backend figures at
the end. The demo ends after `--duration` seconds of traffic, or on Ctrl-C / SIGTERM / SIGHUP:
traffic stops, running requests finish, the listener gets SIGTERM (and must exit 0), the router
and engines stop, and the last stdout line is the summary
`routing: kv_aware=<n> fallback=<m> hit_rate=<x>`, printed once (the live view does not carry
it). Exit 0, or 1 when something failed.
"""

from kv_listener.demo.process import (
    DemoError,
    ListenerProcess,
    free_ports,
    listener_config,
    wait_for_subscriptions,
    write_listener_config,
)
from kv_listener.demo.run import Demo, run_demo, run_unless_stopped
from kv_listener.demo.settings import (
    CONNECT_TIMEOUT_S,
    ENGINE_BLOCKS,
    FINISH_TIMEOUT_S,
    FIRST_RECORDS_PATIENCE_S,
    LISTENER_START_TIMEOUT_S,
    LISTENER_STOP_TIMEOUT_S,
    MAX_OUTSTANDING,
    PROG,
    REDRAW_INTERVAL_S,
    REQUEST_RATE,
    SEED,
    SIGINT_GRACE_S,
    STARTUP_REDRAW_INTERVAL_S,
)
from kv_listener.demo.view import Totals, summary_line

# What callers of the one-module `kv_listener.demo` import from it (the CLI, `bench/soak.py`),
# with the settings beside them; the view's other names are imported from `demo.view`.
__all__ = [
    "CONNECT_TIMEOUT_S", "ENGINE_BLOCKS", "FINISH_TIMEOUT_S", "FIRST_RECORDS_PATIENCE_S",
    "LISTENER_START_TIMEOUT_S", "LISTENER_STOP_TIMEOUT_S", "MAX_OUTSTANDING", "PROG",
    "REDRAW_INTERVAL_S", "REQUEST_RATE", "SEED", "SIGINT_GRACE_S", "STARTUP_REDRAW_INTERVAL_S",
    "Demo", "DemoError", "ListenerProcess", "Totals", "free_ports", "listener_config", "run_demo",
    "run_unless_stopped", "summary_line", "wait_for_subscriptions", "write_listener_config",
]
