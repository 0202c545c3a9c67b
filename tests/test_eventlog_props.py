"""Property: resume by Last-Event-ID never loses, repeats or invents state.

Random transition batches and flushes on an advancing clock feed one EventLog. An uninterrupted
consumer takes every record; an interrupted one is cut at random points (also in the middle of a
replay or a resync), loses what was in flight, and reconnects with the last ID it saw. Checked:
- numbered records arrive with seq +1 each (no gap, no duplicate), a resync being the only jump;
- every resync's snapshot equals the log's live state and the uninterrupted consumer's state;
- with a history that never runs out, the interrupted consumer's numbered records equal the
  uninterrupted stream exactly;
- at the end both consumers, the log's live state, and the transitions applied directly agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kv_listener.core.eventlog import EventLog, Record, RecordEvent, ResyncReason, parse_event_id
from kv_listener.core.model import PrefixTransition, Tier, TransitionKind

EPOCH = "feedc0de"
PREFIXES = [c * 64 for c in "abcd"]

transitions = st.builds(
    PrefixTransition,
    # Mostly transitions that produce records; clears are rare, as in real traffic.
    kind=st.sampled_from([TransitionKind.CREATED] * 3 + [TransitionKind.TOKEN_COUNT] * 4
                         + [TransitionKind.TIER] * 2 + [TransitionKind.EVICTED] * 2
                         + [TransitionKind.CLEARED]),
    prefix_hash=st.sampled_from(PREFIXES),
    token_count=st.integers(0, 64),
    tier=st.sampled_from([Tier.GPU_HOT, Tier.STORAGE_WARM, None]),
).map(
    # The tracker always names the tier of a tier change; the rest may leave it out.
    lambda t: PrefixTransition(t.kind, t.prefix_hash, t.token_count, Tier.GPU_HOT)
    if t.kind is TransitionKind.TIER and t.tier is None else t
)

# Every step applies a batch, maybe a flush later, then the consumer takes `deliver` records of
# what reached it, and is maybe cut off, to come back `away` steps later.
steps = st.lists(
    st.tuples(
        st.floats(0, 0.4),  # time before the batch
        st.lists(transitions, min_size=1, max_size=6),
        st.one_of(st.none(), st.floats(0, 0.4)),  # a flush this much later
        st.integers(0, 8),  # deliver
        st.booleans(),  # cut off afterwards
        st.integers(0, 3),  # away for that many steps
    ),
    min_size=1, max_size=50,
)

State = dict[str, tuple[int, Tier]]


def drop(state: State, prefix_hash: str | None, *, everything: bool) -> None:
    """A clear (`everything`) or the eviction of one prefix: records and transitions alike."""
    if everything:
        state.clear()
    else:
        assert prefix_hash is not None
        state.pop(prefix_hash, None)


def apply(state: State, r: Record) -> None:
    if r.event in (RecordEvent.CACHE_CLEARED, RecordEvent.CACHE_EVICTED):
        drop(state, r.prefix_hash, everything=r.event is RecordEvent.CACHE_CLEARED)
    else:
        assert r.prefix_hash is not None and r.token_count is not None and r.tier is not None
        state[r.prefix_hash] = (r.token_count, r.tier)


def truth_apply(state: State, t: PrefixTransition) -> None:
    """The transitions' meaning, with no coalescing and no log in between."""
    if t.kind in (TransitionKind.CLEARED, TransitionKind.EVICTED):
        drop(state, t.prefix_hash, everything=t.kind is TransitionKind.CLEARED)
    else:
        assert t.prefix_hash is not None
        old = state.get(t.prefix_hash)
        # A token-count update without a tier keeps the prefix's tier; a creation without one
        # is in GPU memory (an engine that names no medium means GPU).
        keep = old[1] if old is not None and t.kind is TransitionKind.TOKEN_COUNT else None
        tier = t.tier or keep or Tier.GPU_HOT
        state[t.prefix_hash] = (t.token_count, tier)


@dataclass
class Consumer:
    log: EventLog
    last_id: str | None = None
    connected: bool = False
    inbox: list[tuple[Record, bool]] = field(default_factory=list)  # (record, part of a resync)
    state: State = field(default_factory=dict)
    numbered: list[Record] = field(default_factory=list)  # numbered records outside resyncs
    resyncs: list[ResyncReason] = field(default_factory=list)
    last_seq: int | None = None
    resumes: int = 0
    resync_seq: int = 0  # seq carried by the last resync delivered in full

    def connect(self, reference: State) -> None:
        replay = self.log.since(self.last_id)
        if replay.resync is not None:
            self.resyncs.append(replay.resync)
            snapshot: State = {}
            for r in replay.records:
                apply(snapshot, r)
            assert snapshot == self.log.live() == reference
            assert [r.id for r in replay.records[:-1]] == [None] * (len(replay.records) - 1)
            assert replay.records[-1].id == self.log.last_id
        else:
            self.resumes += 1
        self.inbox = [(r, replay.resync is not None) for r in replay.records]
        self.connected = True

    def push(self, records: list[Record]) -> None:
        if self.connected:
            self.inbox.extend((r, False) for r in records)

    def deliver(self, k: int) -> None:
        for r, in_resync in self.inbox[:k]:
            apply(self.state, r)
            if r.id is None:
                continue
            parsed = parse_event_id(r.id)
            assert parsed is not None and parsed[0] == EPOCH
            seq = parsed[1]
            if in_resync:
                self.last_seq = seq  # a resync's last record: the one allowed jump
                self.resync_seq = seq
            else:
                assert self.last_seq is not None and seq == self.last_seq + 1, (self.last_seq, seq)
                self.last_seq = seq
                self.numbered.append(r)
            self.last_id = r.id
        del self.inbox[:k]

    def disconnect(self) -> None:
        self.inbox.clear()  # what was in flight is lost
        self.connected = False


@settings(max_examples=300, deadline=None)
@given(
    ops=steps,
    history_size=st.sampled_from([1, 2, 3, 5, 8, 10_000]),
    interval=st.sampled_from([0.0, 0.1, 0.25]),
)
def test_resume_never_loses_repeats_or_invents_state(
    ops: list[tuple[float, list[PrefixTransition], float | None, int, bool, int]],
    history_size: int, interval: float
) -> None:
    log = EventLog("vllm-1", EPOCH, history_size, interval)
    reference = Consumer(log)
    reference.connect({})
    consumer = Consumer(log)
    consumer.connect({})
    truth: State = {}
    now = 1000.0

    def publish(records: list[Record]) -> None:
        reference.push(records)
        reference.deliver(len(reference.inbox))
        consumer.push(records)

    away = 0
    for dt, batch, flush_dt, deliver, cut, away_steps in ops:
        now += dt
        for t in batch:
            truth_apply(truth, t)
        publish(log.record(batch, now))
        if flush_dt is not None:
            now += flush_dt
            publish(log.flush(now))
        if consumer.connected:
            consumer.deliver(deliver)
            if cut:
                consumer.disconnect()
                away = away_steps
        elif away > 0:
            away -= 1
        else:
            consumer.connect(reference.state)
        assert reference.state == log.live()

    # Everything pending goes out; the interrupted consumer comes back and catches up.
    publish(log.flush(now + 10.0))
    assert log.next_flush_at() is None
    if not consumer.connected:
        consumer.connect(reference.state)
    consumer.deliver(len(consumer.inbox))

    for r in consumer.resyncs:  # coverage of the cases (pytest --hypothesis-show-statistics)
        event(r.value)
    event(f"numbered={len(reference.numbered)//10*10}")
    event(f"resumes={consumer.resumes}")
    assert consumer.state == reference.state == log.live() == truth
    assert consumer.last_id == log.last_id
    after = [r for r in reference.numbered if seq_of(r) > consumer.resync_seq]
    assert [r for r in consumer.numbered if seq_of(r) > consumer.resync_seq] == after
    if all(r is ResyncReason.NEW_CONSUMER for r in consumer.resyncs):
        # It never held an ID before its last resync, so nothing came before: the pieces it got
        # across its reconnections are exactly the uninterrupted stream from there on.
        assert consumer.numbered == after
    if history_size == 10_000:
        assert set(consumer.resyncs) == {ResyncReason.NEW_CONSUMER}


def seq_of(r: Record) -> int:
    assert r.id is not None
    parsed = parse_event_id(r.id)
    assert parsed is not None
    return parsed[1]
