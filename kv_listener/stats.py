"""One source's counters, and the one place each of them is written.

`SourceStats` is the single source of truth behind `/stats` and `/metrics`: the source's runtime
(`kv_listener.runtime.SourceRuntime`) creates one per source, hands it to the parts that see the
facts (the ZMQ or TRT-LLM source, its queue feeder, the liveness watch, the resolver) and reads it
at scrape time, so nothing is counted twice. Each field changes in one method below, named after
the fact it records (`received`, `dropped`, `cleared`...): the parts call these and never assign a
field, so what a counter means is written once; on the hot path a count costs one method call.
Dict keys of the `Counter`s are reasons from fixed Enums (metric label values), never free text.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
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
    queued_tokens: int = 0  # token IDs held by the batches in the source's queue
    queued_hashes: int = 0  # block hashes (stored and removed) held by those batches

    # --- what the source receives -------------------------------------------------------------

    def frame_received(self) -> None:
        """A ZMQ message in the `[topic, seq, payload]` shape arrived (a sign of life too)."""
        self.batches_received += 1

    def received(self, raw: int, decoded: int, drops: Mapping[str, int], at: float | None) -> None:
        """A payload was decoded: `raw` events on the wire, `decoded` of them kept, `drops` by
        reason; `at` is the wall clock of the last decoded batch (None: leave it as it was)."""
        self.events_received += raw
        self.events_decoded += decoded
        if drops:
            self.dropped_by_reason(drops)
        if at is not None:
            self.last_event_at = at

    def dropped(self, reason: str, n: int = 1) -> None:
        """`n` events (or one frame or batch) dropped for `reason`."""
        self.events_dropped[reason] += n

    def dropped_by_reason(self, drops: Mapping[str, int]) -> None:
        for reason, n in drops.items():
            self.events_dropped[str(reason)] += n

    def gap_found(self, n: int = 1) -> None:
        self.gaps += n

    def replay_ended(self, *, covered: bool) -> None:
        """A replay that covered what was lost, or one that could not."""
        if covered:
            self.replays += 1
        else:
            self.replay_failures += 1

    def startup_replayed(self, status: str, batches: int = 0, from_seq: int | None = None) -> None:
        self.startup_replay = status
        if batches:
            self.startup_replay_batches = batches
            self.startup_replay_from_seq = from_seq

    # --- peers and readiness ------------------------------------------------------------------

    def publisher_refused(self) -> None:
        self.refused_publishers += 1

    def publishers_now(self, n: int, *, lost: bool = False) -> None:
        """`n` engine connections are up; `lost`: one more went down to get there."""
        self.publishers_connected = n
        if lost:
            self.zmq_disconnects += 1

    def attached(self, ready: bool) -> None:
        """The ZMQ socket was bound or connected (True), or closed (False)."""
        self.ready = ready

    def poll_failed(self, reason: str) -> None:
        self.poll_errors[reason] += 1
        self.ready = False

    def poll_succeeded(self, now: float) -> None:
        """A TRT-LLM poll was answered; `now` is monotonic."""
        self.ready = True
        self.last_ok_at = now

    def engine_is(self, state: str, *, went_down: bool = False) -> None:
        """The liveness state (`core.liveness.EngineState` value, or "off": not watched)."""
        self.engine_state = state
        if went_down:
            self.engine_downs += 1

    # --- the queue and the pipeline behind it -------------------------------------------------

    def queued(self, tokens: int, hashes: int) -> None:
        """A batch holding `tokens` token IDs and `hashes` block hashes went into the queue
        (negative: the pump took it out)."""
        self.queued_tokens += tokens
        self.queued_hashes += hashes

    def cleared(self, reason: str, n: int = 1) -> None:
        """The source's state was cleared `n` times for `reason` (a `ClearReason` value)."""
        self.clears[reason] += n

    def restarted(self) -> None:
        """The source task crashed and is restarted (not ready until it is attached again)."""
        self.ready = False
        self.source_restarts += 1

    def salt_rejections(self, total: int) -> None:
        """The tracker's own count of discarded salts, shown per source."""
        self.salt_rejected = total

    # --- the resolver -------------------------------------------------------------------------

    def detokenize_called(self) -> None:
        self.detokenize_calls += 1

    def tokenize_called(self) -> None:
        self.tokenize_calls += 1

    def detokenize_failed(self, reason: str) -> None:
        self.detokenize_errors[reason] += 1
