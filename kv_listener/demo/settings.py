"""The demo's numbers, written once: its pace, its sizes and how long it waits for its parts.

Owns the constants the view, the child processes and the run share (`bench/soak.py` reuses some
through the package). The simulated requests' pace is `sim.service.DEMO_TIMING`, which
`simulate` shares.
"""

from __future__ import annotations

PROG = "continuum-kv-listener"
#: KV blocks per simulated engine (16 tokens each). The workload's five system prompts take
#: about 140 blocks together: one engine can hold them all, but not with much room for the rest.
ENGINE_BLOCKS = 256
#: Requests per second the workload sends (Poisson arrivals), over all engines.
REQUEST_RATE = 30.0
#: Requests that may wait or run at once; beyond that arrivals are skipped (never queued forever).
MAX_OUTSTANDING = 256
SEED = 7
LISTENER_START_TIMEOUT_S = 60.0
LISTENER_STOP_TIMEOUT_S = 20.0
CONNECT_TIMEOUT_S = 15.0
#: Running requests get this long to finish once traffic stops; the rest are cancelled.
FINISH_TIMEOUT_S = 5.0
REDRAW_INTERVAL_S = 0.5
#: The start-up view is redrawn this often (its clock shows that something is happening).
STARTUP_REDRAW_INTERVAL_S = 0.2
#: How long the start-up view waits for the first prefix records once traffic runs.
FIRST_RECORDS_PATIENCE_S = 10.0
#: After a SIGINT, how long to look for the listener stopping on its own (a terminal's Ctrl-C
#: reached it too) before it gets SIGTERM.
SIGINT_GRACE_S = 2.0
