"""Per-backend prefix event log: tracker transitions in, numbered SSE records out (SPEC §6).

Owns, for one backend:
- the turn of `PrefixTransition`s into records (`cache_created`, `cache_offloaded`,
  `cache_evicted`, `cache_cleared`), with token-count updates coalesced to at most one record per
  prefix per `update_interval_s` (creations, tier changes, evictions and clears go out at once);
- record IDs `<epoch>-<seq>` (seq from 1, +1 per record);
- the live state the emitted records describe (prefix -> token_count, tier), which is what a
  resync's snapshot shows;
- the bounded history that serves `Last-Event-ID` resume without gap or duplicate, and the resync
  rule for everything it cannot serve.

The records are `core.records.Record`s, the one type the SSE encoder, the push path and the
router read. Pure: no clock, no I/O. Callers pass `now` (wall-clock seconds, also used as the
records' `ts`).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any, Final

from msgspec.structs import astuple

from kv_listener.core.model import PrefixTransition, Tier, TransitionKind
from kv_listener.core.records import Record, RecordEvent, upsert_event
from kv_listener.core.structs import FrozenStruct, UntrackedStruct, fields_in_order

# Record and RecordEvent are re-exported: the log's callers name them from here too.
__all__ = ["EventLog", "Record", "RecordEvent", "Replay", "ResyncReason", "parse_event_id"]


class ResyncReason(enum.StrEnum):
    """Why `since()` answered with a resync instead of a replay. Values are metric labels."""

    NEW_CONSUMER = "new_consumer"  # no Last-Event-ID
    MALFORMED_ID = "malformed_id"
    UNKNOWN_EPOCH = "unknown_epoch"  # another listener run (or a re-added backend)
    TOO_OLD = "too_old"  # older than the history
    AHEAD = "ahead"  # newer than anything this log produced


class Replay(FrozenStruct, frozen=True, gc=False):
    """Answer to `EventLog.since()`: the records to send before live ones.

    `resync` is None for a plain replay (possibly empty: the consumer is up to date), else why a
    resync (`cache_cleared` + snapshot) was needed.
    """

    records: tuple[Record, ...]
    resync: ResyncReason | None


class _Live(UntrackedStruct, gc=False):
    """A live prefix as its last record described it (what a resync's snapshot shows), and
    that record's ts, which coalescing measures the update interval from. Updated in place.

    One per live prefix, so small: 40 bytes, untracked by the cyclic GC, its int and float
    the very objects its record holds (`EventLog.record` boxes each once). A tuple of the
    three with its own int and float took 120 (tests/test_eventlog.py measures the whole
    entry)."""

    count: int
    tier: Tier
    ts: float


class _Pending(UntrackedStruct, gc=False):
    token_count: int
    tier: Tier
    due: float


def parse_event_id(event_id: str) -> tuple[str, int] | None:
    """`"<epoch>-<seq>"` -> (epoch, seq), or None when it is not of that shape."""
    epoch, sep, seq = event_id.rpartition("-")
    if not sep or not epoch or not seq.isdigit() or not seq.isascii() or len(seq) > 19:
        return None
    return epoch, int(seq)


class EventLog:
    """The numbered record stream of one backend. Not thread-safe (one owner, the event loop)."""

    def __init__(
        self, backend: str, epoch: str, history_size: int, update_interval_s: float
    ) -> None:
        if history_size < 1:
            raise ValueError("history_size must be at least 1")
        if update_interval_s < 0:
            raise ValueError("update_interval_s must not be negative")
        if not epoch or "-" in epoch:
            # The ID's seq is what follows the last "-"; an epoch must not contain one so that
            # parsing never depends on that detail.
            raise ValueError("epoch must be a non-empty string without '-'")
        self.backend = backend
        self.epoch = epoch
        self.history_size = history_size
        self.update_interval_s = update_interval_s
        self._seq = 0
        self._history: deque[Record] = deque(maxlen=history_size)
        # prefix -> its state as emitted
        self._live: dict[str, _Live] = {}
        self._pending: dict[str, _Pending] = {}
        # (due, tiebreak, prefix) with lazy deletion: an entry is valid while `_pending` still
        # holds that prefix with that due time.
        self._due_heap: list[tuple[float, int, str]] = []
        self._tiebreak = itertools.count()
        # Numbered records written, by event (`records_written`): the bulk kinds as native
        # counters (compiled, an increment of a few instructions where the record is made;
        # counting them afterwards by label cost about 65 ns a record), the rest by label.
        self._n_created = 0
        self._n_offloaded = 0
        self._n_evicted = 0
        self._n_other: dict[str, int] = {}

    # --- reading ---------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def last_id(self) -> str:
        """ID of the newest record (`<epoch>-0` when there is none yet)."""
        return f"{self.epoch}-{self._seq}"

    def records_written(self) -> dict[str, int]:
        """Numbered records written so far (those `record` and `flush` returned, not replays),
        by event label (`RecordEvent` value); events with none are left out."""
        out = {label: n for label, n in (
            (RecordEvent.CACHE_CREATED.value, self._n_created),
            (RecordEvent.CACHE_OFFLOADED.value, self._n_offloaded),
            (RecordEvent.CACHE_EVICTED.value, self._n_evicted)) if n}
        out.update(self._n_other)
        return out

    @property
    def history_len(self) -> int:
        return len(self._history)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def live(self) -> dict[str, tuple[int, Tier]]:
        """Copy of the live state as the emitted records describe it: prefix -> (count, tier)."""
        return {p: (lv.count, lv.tier) for p, lv in self._live.items()}

    @property
    def live_count(self) -> int:
        return len(self._live)

    def next_flush_at(self) -> float | None:
        """When the earliest coalesced update falls due (same clock as `now`), None if none."""
        heap = self._due_heap
        while heap:
            due, _, prefix = heap[0]
            pending = self._pending.get(prefix)
            if pending is not None and pending.due == due:
                return due
            heapq.heappop(heap)
        return None

    def since(self, last_event_id: str | None, now: float | None = None) -> Replay:
        """Records a consumer that last saw `last_event_id` needs before the live ones.

        A replay when the history holds every record after that ID; otherwise a resync:
        `cache_cleared` then one upsert per live prefix, unnumbered except the last one, which
        carries the newest ID so that the consumer resumes from there. `now` stamps the resync's
        `cache_cleared` (default: the newest record's ts).
        """
        if last_event_id is None:
            return self._resync(ResyncReason.NEW_CONSUMER, now)
        parsed = parse_event_id(last_event_id)
        if parsed is None:
            return self._resync(ResyncReason.MALFORMED_ID, now)
        epoch, seq = parsed
        if epoch != self.epoch:
            return self._resync(ResyncReason.UNKNOWN_EPOCH, now)
        if seq > self._seq:
            return self._resync(ResyncReason.AHEAD, now)
        first_seq = self._seq - len(self._history) + 1
        if seq < first_seq - 1:
            return self._resync(ResyncReason.TOO_OLD, now)
        start = seq + 1 - first_seq
        if start >= len(self._history):
            return Replay((), None)
        return Replay(tuple(itertools.islice(self._history, start, None)), None)

    # --- writing ---------------------------------------------------------------------------

    def record(self, transitions: Iterable[PrefixTransition], now: float) -> list[Record]:
        """Apply tracker transitions at time `now`; return the records to send, in order.

        Coalesced updates that fell due by `now` go first (they are older). Raises ValueError,
        before changing anything, when a transition is malformed.
        """
        batch = transitions if type(transitions) is list else list(transitions)
        # each transition's fields as one tuple (compiled, each attribute of a msgspec Struct
        # is a generic lookup, ~160 instructions; `_TRANSITION_FIELDS` pins their order)
        rows: list[tuple[Any, ...]] = []
        for t in batch:
            row: tuple[Any, ...] = _astuple(t)
            # _validate raises for none of these (two records per block: no call for them)
            if row[1] is None or not (row[0] is _EVICTED or (row[2] >= 0 and row[3] is not None)):
                _validate(t)
            rows.append(row)
        out = self.flush(now) if self._due_heap else []
        # Boxed once (compiled, a float or int local is a machine value, boxed anew for each
        # call that takes an object): the records of this call and their live entries share
        # one ts object, and a record and its live entry the transition's token-count object.
        stamp: Any = now
        count: Any
        # CREATED and EVICTED, the bulk of a busy engine's records, inline (what _upsert and
        # _evict do); the rest through the methods
        live, pending = self._live, self._pending
        # bound once: compiled, `deque.append` by name is a method lookup per call
        remember = self._history.append
        head, backend = f"{self.epoch}-", self.backend
        for i in range(len(rows)):
            # untyped, as the attributes were read (compiled, a typed local is a cast)
            kind, prefix, count, tier = rows[i]
            if kind is _CREATED:
                tier = tier or _GPU_HOT
                if pending:
                    pending.pop(prefix, None)
                # one lookup whether the prefix is new (the common case) or known
                new = _Live(count, tier, stamp)
                old = live.setdefault(prefix, new)
                if old is not new:
                    if old.count == count and old.tier is tier:
                        continue
                    old.count, old.tier, old.ts = count, tier, stamp
                self._seq = seq = self._seq + 1
                if tier is _GPU_HOT:  # upsert_event
                    event = _CACHE_CREATED
                    self._n_created += 1
                else:
                    event = _CACHE_OFFLOADED
                    self._n_offloaded += 1
                rec = Record(f"{head}{seq}", event, backend, prefix, count, tier, stamp)
                remember(rec)
                out.append(rec)
                continue
            if kind is _EVICTED:
                if pending:
                    pending.pop(prefix, None)
                if live.pop(prefix, None) is None:
                    continue  # consumers never heard of it: nothing to take back
                self._seq = seq = self._seq + 1
                self._n_evicted += 1
                rec = Record(f"{head}{seq}", _CACHE_EVICTED, backend, prefix, None, None, stamp)
                remember(rec)
                out.append(rec)
                continue
            if kind is TransitionKind.CLEARED:
                self._clear(now, out)
                continue
            assert prefix is not None  # checked by _validate
            if kind is TransitionKind.TOKEN_COUNT:
                self._update_count(prefix, batch[i], now, out)
            else:  # TIER: at once
                self._upsert(prefix, count, tier or Tier.GPU_HOT, now, out)
        return out

    def flush(self, now: float) -> list[Record]:
        """Emit the coalesced updates due by `now`, earliest first."""
        out: list[Record] = []
        heap = self._due_heap
        while heap:
            due, _, prefix = heap[0]
            pending = self._pending.get(prefix)
            if pending is None or pending.due != due:
                heapq.heappop(heap)
                continue
            # A due time more than one interval ahead means the wall clock stepped back since
            # it was set: send it rather than hold the update for that long.
            if due > now and due - now <= self.update_interval_s:
                break
            heapq.heappop(heap)
            del self._pending[prefix]
            self._emit_upsert(prefix, pending.token_count, pending.tier, now, out)
        return out

    # --- internals -------------------------------------------------------------------------

    def _update_count(
        self, prefix: str, t: PrefixTransition, now: float, out: list[Record]
    ) -> None:
        live = self._live.get(prefix)
        if live is None or (t.tier is not None and t.tier is not live.tier):
            # Not what a token-count update means (unknown prefix, or another tier): it changes
            # presence or tier, which must not wait.
            self._upsert(prefix, t.token_count, t.tier or Tier.GPU_HOT, now, out)
            return
        tier = live.tier
        pending = self._pending.get(prefix)
        if t.token_count == live.count:
            # Back to what consumers already have: nothing to send.
            if pending is not None:
                del self._pending[prefix]
            return
        if pending is not None:
            pending.token_count = t.token_count  # latest value wins, due time unchanged
            return
        due = live.ts + self.update_interval_s
        if due <= now:
            self._emit_upsert(prefix, t.token_count, tier, now, out)
            return
        self._pending[prefix] = _Pending(t.token_count, tier, due)
        heapq.heappush(self._due_heap, (due, next(self._tiebreak), prefix))

    def _upsert(
        self, prefix: str, token_count: int, tier: Tier, now: float, out: list[Record]
    ) -> None:
        # The new record carries the current state, so an older pending update is superseded.
        self._pending.pop(prefix, None)
        live = self._live.get(prefix)
        if live is not None and live.count == token_count and live.tier is tier:
            return
        self._emit_upsert(prefix, token_count, tier, now, out)

    def _emit_upsert(
        self, prefix: str, token_count: int, tier: Tier, now: float, out: list[Record]
    ) -> None:
        rec = self._append(upsert_event(tier), prefix, token_count, tier, now)
        live = self._live.get(prefix)
        if live is None:
            self._live[prefix] = _Live(rec.token_count, tier, rec.ts)  # type: ignore[arg-type]
        else:  # the record's own int and float, as `record` shares them
            live.count, live.tier, live.ts = rec.token_count, tier, rec.ts  # type: ignore[assignment]
        out.append(rec)

    def _evict(self, prefix: str, now: float, out: list[Record]) -> None:
        self._pending.pop(prefix, None)
        if self._live.pop(prefix, None) is None:
            return  # consumers never heard of it: nothing to take back
        out.append(self._append(RecordEvent.CACHE_EVICTED, prefix, None, None, now))

    def _clear(self, now: float, out: list[Record]) -> None:
        self._live.clear()
        self._pending.clear()
        self._due_heap.clear()
        out.append(self._append(RecordEvent.CACHE_CLEARED, None, None, None, now))

    def _append(
        self, event: RecordEvent, prefix: str | None, token_count: int | None,
        tier: Tier | None, now: float,
    ) -> Record:
        self._seq += 1
        if event is _CACHE_CREATED:
            self._n_created += 1
        elif event is _CACHE_OFFLOADED:
            self._n_offloaded += 1
        elif event is _CACHE_EVICTED:
            self._n_evicted += 1
        else:
            label = event.value
            self._n_other[label] = self._n_other.get(label, 0) + 1
        rec = Record(f"{self.epoch}-{self._seq}", event, self.backend, prefix, token_count, tier,
                     now)
        self._history.append(rec)
        return rec

    def _resync(self, reason: ResyncReason, now: float | None) -> Replay:
        if now is None:
            now = self._history[-1].ts if self._history else 0.0
        records = [Record(None, RecordEvent.CACHE_CLEARED, self.backend, None, None, None, now)]
        records.extend(
            Record(None, upsert_event(lv.tier), self.backend, prefix, lv.count, lv.tier, lv.ts)
            for prefix, lv in self._live.items()
        )
        last = records[-1]
        records[-1] = Record(self.last_id, last.event, last.backend, last.prefix_hash,
                             last.token_count, last.tier, last.ts)
        return Replay(tuple(records), reason)


# Final: compiled (setup.py), a Final module constant is a C static, another global a dict lookup
# (and `Tier.GPU_HOT` a class attribute lookup) each time `record` reads it.
_CREATED: Final = TransitionKind.CREATED
_EVICTED: Final = TransitionKind.EVICTED
_CACHE_EVICTED: Final = RecordEvent.CACHE_EVICTED
_CACHE_CREATED: Final = RecordEvent.CACHE_CREATED
_CACHE_OFFLOADED: Final = RecordEvent.CACHE_OFFLOADED
_GPU_HOT: Final = Tier.GPU_HOT
_astuple: Final[Any] = astuple  # compiled: a C static, not a module attribute lookup per call
_TRANSITION_FIELDS: Final = fields_in_order(PrefixTransition,
                                             ("kind", "prefix_hash", "token_count", "tier"))


def _validate(t: PrefixTransition) -> None:
    if t.kind is TransitionKind.CLEARED:
        return
    if t.prefix_hash is None:
        raise ValueError(f"{t.kind} transition without prefix_hash")
    if t.kind is TransitionKind.EVICTED:
        return
    if t.token_count < 0:
        raise ValueError(f"{t.kind} transition with negative token_count")
    if t.kind is TransitionKind.TIER and t.tier is None:
        raise ValueError("tier transition without tier")
