"""Plain per-source counters: the one source of truth behind `/stats` and `/metrics`.

Edges (sources, resolver, SSE server) bump these ints; `kv_listener.metrics` reads them at scrape
time, so nothing is counted twice and the hot path costs one attribute increment. Dict keys of
the `Counter`s are reasons from fixed Enums (metric label values), never free text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class SourceStats:
    engine: str
    events_received: int = 0  # events seen on the wire (before decoding)
    events_decoded: int = 0  # events decoded into the model
    batches_received: int = 0
    events_dropped: Counter[str] = field(default_factory=Counter)  # reason -> n
    gaps: int = 0
    replays: int = 0  # replays that covered a gap
    replay_failures: int = 0
    clears: Counter[str] = field(default_factory=Counter)  # ClearReason -> n
    refused_publishers: int = 0
    #: ZMQ connections lost (libzmq's EVENT_DISCONNECTED: an engine gone, or a frame over
    #: ZMQ_MAXMSGSIZE refused); a connecting source connects again itself.
    zmq_disconnects: int = 0
    #: ZMQ peers whose handshake succeeded and that are still connected (for a bound SUB the
    #: engine's publishers, one per DP rank; for a connecting SUB, 1 once the engine took it).
    publishers_connected: int = 0
    poll_errors: Counter[str] = field(default_factory=Counter)  # trtllm: reason -> n
    last_event_at: float | None = None  # wall clock of the last decoded batch
    ready: bool = False  # socket bound/connected, or last poll ok
    last_ok_at: float | None = None  # trtllm: monotonic time of the last successful poll
    detokenize_calls: int = 0
    tokenize_calls: int = 0  # engine /tokenize calls (deciding points, HTTP-only resolution)
    detokenize_errors: Counter[str] = field(default_factory=Counter)
    salt_rejected: int = 0
    source_restarts: int = 0
    #: How the start-up replay went: exact (the buffer started at seq 0), partial, empty,
    #: timeout, unavailable; None without a replay endpoint (or before it finished).
    startup_replay: str | None = None
    startup_replay_batches: int = 0
    startup_replay_from_seq: int | None = None
    engine_state: str = "unknown"  # core.liveness.EngineState value ("off": not watched)
    engine_downs: int = 0  # times the engine was declared down (a clear each)
    queue_depth: int = 0
    queued_tokens: int = 0  # token IDs held by the batches in the source's queue
