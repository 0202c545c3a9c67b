"""Per-source ZMQ sequence tracking and the merge of replayed batches (pure: no I/O, no clock).

Owns the decision, for each batch received on a SUB socket, whether to apply it, skip it, treat
it as a gap to fill, or as an engine restart; and how a replay reply is merged with the batch
that revealed the gap (SPEC §4 and §5, wire-formats §1 rule 5 and §2.2).

Wire facts this relies on (vLLM 0.9.0 .. 0.33.0 `ZmqEventPublisher`, SGLang's copy of it):

- the sequence starts at 0 per publisher instance and grows by one per non-empty batch;
- it goes back to 0 when the engine restarts (the replay buffer is lost with it);
- PUB/SUB never duplicates nor reorders, but silently drops at the high-water mark, which a
  subscriber sees as a jump in the sequence;
- a replay answers every buffered batch with `seq >= start_seq`, oldest first, then an end marker;
  if its first batch is above `start_seq`, the history was evicted.

Rules:

- The first batch after start (or after `reset`) is applied as it is: there is no history.
- `seq == expected` applies. Any older `seq` (even `expected - 1`) means the sequence went
  backwards, i.e. the engine restarted: the edge clears the source and the batch is applied
  after the clear. PUB/SUB never duplicates a message, so there is no "duplicate" case: a real
  vLLM that sent exactly one batch (seq 0), restarted and sent seq 0 again showed that treating
  `expected - 1` as a duplicate loses the new engine's first batch and keeps the old state.
- `seq > expected` is a gap. The edge fetches `expected .. seq-1` by replay when it can and hands
  the answer to `SequenceTracker.fill_gap`, which returns the batches to apply in order (the
  replayed ones, then the batch that revealed the gap), or says "clear first" when the replay
  does not cover the gap exactly (unavailable, timed out before covering it, started above the
  requested seq, or has a hole). The revealing batch is applied after the clear either way.
- Replayed batches above the revealing one are ignored: the live stream delivers them in order
  right after it, so applying them from the replay would make their live copies look like an
  engine restart. Live batches buffered during the replay go through `observe` as usual.

Known limit: a restart whose new sequence happens to jump *above* the expected one (the engine
restarted and published many batches while the subscriber was disconnected) is seen as a gap, and
a replay from the new engine may then appear to cover it. vLLM publishes no epoch to tell the two
apart.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import msgspec

from kv_listener.core.decode import DropReason
from kv_listener.core.model import (
    CacheCreated,
    ClearReason,
    EventBatch,
    KvEvent,
    SourceCleared,
    SourceItem,
)

T = TypeVar("T")

#: Replay end marker: `(-1).to_bytes(8, "big", signed=True)` (vLLM `ZmqEventPublisher.END_SEQ`).
END_SEQ = b"\xff" * 8


class SourceDropReason(enum.StrEnum):
    """Drop reasons of the sources that the decoder's `DropReason` does not define (frame count,
    seq frame, stale seq and duplicate TRT-LLM event ids are `DropReason` members). Values are
    metric labels (`events_dropped{reason}`)."""

    BAD_REPLAY_FRAME = "bad_replay_frame"  # replay reply in neither layout
    WINDOW_NOT_MAX = "window_not_max"  # TRT-LLM VSWA: event of a smaller attention window
    QUEUE_OVERFLOW = "queue_overflow"  # our bounded queue was full (a clear follows)
    MESSAGE_TOO_LARGE = "message_too_large"  # payload above limits.max_message_bytes
    REPLAY_BACKLOG_OVERFLOW = "replay_backlog_overflow"  # live batches beyond the bound during a replay


class FrameError(ValueError):
    """A multipart message that is not in the engine's frame layout."""

    def __init__(self, reason: DropReason | SourceDropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def parse_event_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """Live PUB message `[topic, seq (8 bytes big-endian), payload]` -> (topic, seq, payload).

    vLLM 0.9.0 .. 0.33.0 and SGLang send exactly 3 frames (wire-formats §1 rule 1)."""
    if len(frames) != 3:
        raise FrameError(DropReason.BAD_FRAME_COUNT, f"{len(frames)} frames, expected 3")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise FrameError(DropReason.BAD_SEQ, f"seq frame of {len(seq)} bytes, expected 8")
    return bytes(topic), int.from_bytes(seq, "big"), bytes(payload)


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask a replay from `start_seq`: `[b"", start_seq (8 bytes BE)]`."""
    return [b"", start_seq.to_bytes(8, "big")]


def parse_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One replay reply as a DEALER receives it -> (seq, payload), or None for the end marker.

    Both layouts (wire-formats §2.2, §7.5): `[b"", seq, payload]` (vLLM <= 0.25, SGLang <= 0.5.21)
    and `[b"", topic, seq, payload]` (vLLM >= 0.26, SGLang >= 0.5.22, TRT-LLM streaming). The end
    marker is seq `ff`x8 with an empty payload (and an empty topic in the new layout)."""
    if len(frames) == 3:
        delim, seq, payload = frames
    elif len(frames) == 4:
        delim, _topic, seq, payload = frames
    else:
        raise FrameError(SourceDropReason.BAD_REPLAY_FRAME, f"{len(frames)} frames, expected 3 or 4")
    if len(delim) != 0:
        raise FrameError(SourceDropReason.BAD_REPLAY_FRAME, "first frame is not the empty delimiter")
    if len(seq) != 8:
        raise FrameError(SourceDropReason.BAD_REPLAY_FRAME, f"seq frame of {len(seq)} bytes, expected 8")
    if seq == END_SEQ:
        if len(payload) != 0:
            raise FrameError(SourceDropReason.BAD_REPLAY_FRAME, "end marker with a payload")
        return None
    return int.from_bytes(seq, "big"), bytes(payload)


class SeqAction(enum.StrEnum):
    APPLY = "apply"  # in order (or the first batch): apply it
    GAP = "gap"  # batches are missing before it: fill (replay) or clear, then apply it
    RESTART = "restart"  # the sequence went backwards: clear, then apply it


class SeqDecision(msgspec.Struct, frozen=True, gc=False):
    action: SeqAction
    got: int
    expected: int | None  # the seq that was expected (None before the first batch)


class ReplayStatus(enum.StrEnum):
    """How a replay ended, as the edge observed it. Values are metric/log labels."""

    COMPLETE = "complete"  # the end marker arrived
    TIMEOUT = "timeout"  # no end marker within the timeout
    UNAVAILABLE = "unavailable"  # no replay endpoint, or the request could not be sent
    TRUNCATED = "truncated"  # cut before the end marker: the edge's byte budget, or a stall


class GapOutcome(enum.StrEnum):
    """Why a gap was (not) filled. Values are metric/log labels."""

    FILLED = "filled"
    NO_REPLAY = "no_replay"  # ReplayStatus.UNAVAILABLE
    TIMEOUT = "timeout"  # timed out before the gap was covered
    MISSING_HISTORY = "missing_history"  # replay started above the requested seq
    INCOMPLETE = "incomplete"  # empty replay, or a hole inside the requested range


@dataclass(frozen=True, slots=True)
class GapFill(Generic[T]):
    """What to do about a gap: when `clear` is set, clear the source first; then apply
    `batches` (seq, item) in order. The last one is always the batch that revealed the gap."""

    outcome: GapOutcome
    clear: bool
    batches: tuple[tuple[int, T], ...]


def plan_gap_fill(
    expected: int,
    got: int,
    revealing: T,
    replayed: Iterable[tuple[int, T]],
    status: ReplayStatus,
) -> GapFill[T]:
    """Merge a replay answer for the gap `expected .. got-1` with the revealing batch `got`.

    `replayed` is what the replay delivered, in arrival order. Only `expected .. got-1` is used;
    anything else is ignored (see the module docstring). A replay that covered the whole range
    is used even if its end marker did not arrive in time.
    """
    if got <= expected:
        raise ValueError(f"not a gap: expected {expected}, got {got}")
    if status is ReplayStatus.UNAVAILABLE:
        return GapFill(GapOutcome.NO_REPLAY, True, ((got, revealing),))
    wanted: dict[int, T] = {}
    first_seq: int | None = None
    for seq, item in replayed:
        if first_seq is None:
            first_seq = seq
        if expected <= seq < got and seq not in wanted:
            wanted[seq] = item
    if len(wanted) == got - expected:
        ordered = tuple((seq, wanted[seq]) for seq in range(expected, got))
        return GapFill(GapOutcome.FILLED, False, (*ordered, (got, revealing)))
    if status is ReplayStatus.TIMEOUT:
        outcome = GapOutcome.TIMEOUT
    elif first_seq is not None and first_seq > expected:
        outcome = GapOutcome.MISSING_HISTORY
    else:
        outcome = GapOutcome.INCOMPLETE
    return GapFill(outcome, True, ((got, revealing),))


class SequenceTracker:
    """The sequence state of one source (one publisher instance, one seq space)."""

    __slots__ = ("_expected",)

    def __init__(self) -> None:
        self._expected: int | None = None

    @property
    def expected(self) -> int | None:
        """The next seq in order, or None before the first batch (or after `reset`)."""
        return self._expected

    def reset(self) -> None:
        """Forget the history: the next batch is applied as it is."""
        self._expected = None

    def expect(self, seq: int) -> None:
        """The next batch in order is `seq` (a later one is a gap to fill by replay)."""
        self._expected = seq

    def observe(self, seq: int) -> SeqDecision:
        """Classify one live batch. APPLY and RESTART advance the state (the batch is to be
        applied, after a clear for RESTART); GAP does not: call `fill_gap` with the replay
        answer (or `ReplayStatus.UNAVAILABLE`)."""
        expected = self._expected
        if expected is None or seq == expected:
            self._expected = seq + 1
            return SeqDecision(SeqAction.APPLY, seq, expected)
        if seq > expected:
            return SeqDecision(SeqAction.GAP, seq, expected)
        self._expected = seq + 1
        return SeqDecision(SeqAction.RESTART, seq, expected)

    def fill_gap(
        self,
        decision: SeqDecision,
        revealing: T,
        replayed: Iterable[tuple[int, T]],
        status: ReplayStatus,
    ) -> GapFill[T]:
        """Resolve the gap of a GAP `decision` (see `plan_gap_fill`) and advance past it."""
        if decision.action is not SeqAction.GAP or decision.expected is None:
            raise ValueError(f"not a gap decision: {decision}")
        if self._expected != decision.expected:
            raise ValueError(
                f"stale gap decision: expected {decision.expected}, tracker at {self._expected}"
            )
        plan = plan_gap_fill(decision.expected, decision.got, revealing, replayed, status)
        self._expected = decision.got + 1
        return plan


# --- TRT-LLM: event_id tracking and attention-window selection --------------------------------


class TrtllmRecordLike(Protocol):
    """One decoded TRT-LLM event (what `core.decode` yields per JSON element)."""

    @property
    def event_id(self) -> int: ...

    @property
    def window_size(self) -> int | None: ...

    @property
    def dp_rank(self) -> int | None: ...

    @property
    def events(self) -> Sequence[KvEvent]: ...


class TrtllmPoll(msgspec.Struct, frozen=True, gc=False):
    """What one poll's records become: queue items in order, plus counted drops (reason label ->
    number of TRT-LLM events) and the number of event_id gaps seen."""

    items: tuple[SourceItem, ...]
    drops: dict[str, int]
    gaps: int


class TrtllmEventStream:
    """Dedupe, gap detection and window selection for one TRT-LLM source.

    - `event_id` increases by one per event and per attention-DP rank (each rank's
      `KVCacheEventManager` counts on its own; TRT-LLM `_utils.KVCacheEventSerializer`), so it is
      tracked per `dp_rank`. An id at or below the last one applied is a duplicate (skipped); an
      id above last+1 means events were lost: clear, then apply. The first id seen is applied as
      it is.
    - `created` (the KV cache manager was (re)built, e.g. a server restart) clears the source and
      restarts the id tracking of its rank at its id, whatever that id is.
    - VSWA models emit one stream per attention window (wire-formats §4.2). Only the largest
      window is kept, learned from `created` events and from every window seen (as Dynamo does);
      events of smaller windows are dropped and counted. Records without `window_size` (older
      TRT-LLM) are kept. If a larger window shows up after events of a smaller one were applied,
      the source is cleared: its state holds the wrong window's blocks.
    """

    __slots__ = ("_applied_windows", "_last", "_max_window")

    def __init__(self) -> None:
        self._last: dict[int | None, int] = {}
        self._max_window: int | None = None
        self._applied_windows: set[int] = set()

    @property
    def max_window(self) -> int | None:
        return self._max_window

    def last_event_id(self, dp_rank: int | None = None) -> int | None:
        return self._last.get(dp_rank)

    def accept(self, records: Sequence[TrtllmRecordLike], ts: float) -> TrtllmPoll:
        """Turn one poll's records (in the order received) into queue items; `ts` stamps the
        batches (the caller's clock)."""
        items: list[SourceItem] = []
        drops: dict[str, int] = {}
        gaps = 0
        pending: list[KvEvent] = []
        pending_rank: int | None = None

        def flush() -> None:
            if pending:
                items.append(EventBatch(ts=ts, events=tuple(pending), dp_rank=pending_rank))
                pending.clear()

        def clear(reason: ClearReason) -> None:
            flush()
            # Nothing was applied since the previous clear: one is enough.
            if not items or not isinstance(items[-1], SourceCleared):
                items.append(SourceCleared(reason))
            self._applied_windows.clear()

        def drop(reason: DropReason | SourceDropReason) -> None:
            drops[reason.value] = drops.get(reason.value, 0) + 1

        windows = [r.window_size for r in records if r.window_size is not None]
        if windows and (self._max_window is None or max(windows) > self._max_window):
            self._max_window = max(windows)
            if any(w < self._max_window for w in self._applied_windows):
                # What was applied belongs to a smaller window: the state is incomplete for the
                # window we keep from now on.
                clear(ClearReason.WINDOW_CHANGED)

        for record in records:
            rank = record.dp_rank
            last = self._last.get(rank)
            if any(isinstance(e, CacheCreated) for e in record.events):
                clear(ClearReason.ENGINE_CLEARED)
            elif last is not None and record.event_id <= last:
                drop(DropReason.DUPLICATE_EVENT_ID)
                continue
            elif last is not None and record.event_id > last + 1:
                gaps += 1
                clear(ClearReason.GAP)
            self._last[rank] = record.event_id
            window = record.window_size
            if window is not None and self._max_window is not None and window < self._max_window:
                drop(SourceDropReason.WINDOW_NOT_MAX)
                continue
            if rank != pending_rank:
                flush()
                pending_rank = rank
            pending.extend(record.events)
            if window is not None:
                self._applied_windows.add(window)
        flush()
        return TrtllmPoll(items=tuple(items), drops=drops, gaps=gaps)
