"""Sequence tracking, replay merge and frame parsing (core/sequence.py): pure, no sockets."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kv_listener.core.decode import DropReason, TrtllmRecord
from kv_listener.core.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheCreated,
    ClearReason,
    EventBatch,
    KvEvent,
    SourceCleared,
)
from kv_listener.core.sequence import (
    END_SEQ,
    FrameError,
    GapOutcome,
    ReplayStatus,
    SeqAction,
    SequenceTracker,
    SourceDropReason,
    TrtllmEventStream,
    parse_event_frames,
    parse_replay_frames,
    plan_gap_fill,
    replay_request,
)

# --- live sequence decisions ---------------------------------------------------------------


def observed(*seqs: int) -> SequenceTracker:
    """A tracker that has seen `seqs`."""
    t = SequenceTracker()
    for seq in seqs:
        t.observe(seq)
    return t


def decide(t: SequenceTracker, seq: int) -> tuple[SeqAction, int | None, int]:
    """`t` observes `seq`: its action, the seq it expected, the seq it got."""
    d = t.observe(seq)
    return d.action, d.expected, d.got


def test_first_batch_is_applied_as_is_then_in_order() -> None:
    t = SequenceTracker()
    assert t.expected is None
    assert decide(t, 7) == (SeqAction.APPLY, None, 7)
    assert t.observe(8).action is SeqAction.APPLY
    assert t.expected == 9


def test_a_seq_that_does_not_continue_the_stream_is_never_a_duplicate() -> None:
    # PUB/SUB neither duplicates nor reorders: `expected - 1` again is a restarted publisher
    # that has sent as many batches as before minus one, e.g. a real vLLM that sent exactly one
    # batch (seq 0), restarted and sent seq 0 again (issue #10).
    t = observed(0)
    assert decide(t, 0) == (SeqAction.RESTART, 1, 0)
    assert t.expected == 1
    t.observe(1)
    t.observe(2)
    assert decide(t, 2) == (SeqAction.RESTART, 3, 2)
    assert t.observe(3).action is SeqAction.APPLY


def test_sequence_going_backwards_is_a_restart_and_restarts_tracking() -> None:
    t = observed(*range(6))
    assert decide(t, 0) == (SeqAction.RESTART, 6, 0)
    assert t.expected == 1
    assert t.observe(1).action is SeqAction.APPLY


def test_gap_does_not_advance_until_filled() -> None:
    t = observed(0)
    d = t.observe(4)
    assert (d.action, d.expected, d.got) == (SeqAction.GAP, 1, 4)
    assert t.expected == 1
    plan = t.fill_gap(d, "P4", [(1, "P1"), (2, "P2"), (3, "P3")], ReplayStatus.COMPLETE)
    assert plan.outcome is GapOutcome.FILLED
    assert not plan.clear
    assert plan.batches == ((1, "P1"), (2, "P2"), (3, "P3"), (4, "P4"))
    assert t.expected == 5


def test_fill_gap_refuses_a_non_gap_or_stale_decision() -> None:
    t = SequenceTracker()
    d0 = t.observe(0)
    with pytest.raises(ValueError, match="not a gap"):
        t.fill_gap(d0, "x", [], ReplayStatus.COMPLETE)
    gap = t.observe(3)
    t.fill_gap(gap, "x", [], ReplayStatus.UNAVAILABLE)
    with pytest.raises(ValueError, match="stale"):
        t.fill_gap(gap, "x", [], ReplayStatus.UNAVAILABLE)


def test_reset_forgets_history() -> None:
    t = SequenceTracker()
    t.observe(10)
    t.reset()
    assert t.observe(3).action is SeqAction.APPLY


# --- gap fill plans ------------------------------------------------------------------------


def test_replay_beyond_the_revealing_batch_and_below_expected_is_ignored() -> None:
    # The engine published 6 and 7 after 5 revealed the gap; they come live right after 5.
    replay = [(2, "P2"), (3, "P3"), (4, "P4"), (5, "R5"), (6, "R6"), (7, "R7")]
    plan = plan_gap_fill(3, 5, "L5", replay, ReplayStatus.COMPLETE)
    assert plan.batches == ((3, "P3"), (4, "P4"), (5, "L5"))
    assert not plan.clear


def test_replay_starting_above_requested_seq_clears_then_applies_the_revealing_batch() -> None:
    plan = plan_gap_fill(3, 6, "L6", [(4, "P4"), (5, "P5")], ReplayStatus.COMPLETE)
    assert plan.outcome is GapOutcome.MISSING_HISTORY
    assert plan.clear
    assert plan.batches == ((6, "L6"),)


@pytest.mark.parametrize(
    ("replay", "status", "outcome"),
    [
        ([], ReplayStatus.COMPLETE, GapOutcome.INCOMPLETE),  # empty buffer: only the end marker
        ([(3, "a"), (5, "c")], ReplayStatus.COMPLETE, GapOutcome.INCOMPLETE),  # hole at 4
        ([(3, "a")], ReplayStatus.TIMEOUT, GapOutcome.TIMEOUT),
        ([], ReplayStatus.UNAVAILABLE, GapOutcome.NO_REPLAY),
    ],
)
def test_replay_that_does_not_cover_the_gap_clears(
    replay: list[tuple[int, str]], status: ReplayStatus, outcome: GapOutcome
) -> None:
    plan = plan_gap_fill(3, 6, "L6", replay, status)
    assert (plan.outcome, plan.clear, plan.batches) == (outcome, True, ((6, "L6"),))


def test_a_covering_replay_whose_end_marker_timed_out_is_still_used() -> None:
    plan = plan_gap_fill(3, 5, "L5", [(3, "a"), (4, "b")], ReplayStatus.TIMEOUT)
    assert plan.outcome is GapOutcome.FILLED
    assert plan.batches == ((3, "a"), (4, "b"), (5, "L5"))


def test_plan_gap_fill_rejects_a_non_gap() -> None:
    with pytest.raises(ValueError, match="not a gap"):
        plan_gap_fill(5, 5, "x", [], ReplayStatus.COMPLETE)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 60),
    lost=st.sets(st.integers(0, 59)),
    buffer_steps=st.integers(1, 80),
    restart_at=st.one_of(st.none(), st.integers(1, 59)),
)
def test_stream_with_losses_and_replay_reconstructs_the_engine_state(
    n: int, lost: set[int], buffer_steps: int, restart_at: int | None
) -> None:
    """Model: an engine publishes batches (optionally restarting once: seq back to 0, replay
    buffer lost); the subscriber misses some; it replays from a bounded buffer. Whatever happens,
    the batches applied since the last clear are exactly the engine instance's batches from some
    point on, in order, each once; and with no restart and a large enough buffer nothing is
    cleared and everything from the first batch received on is applied."""
    published: list[tuple[int, int, str]] = []  # (instance, seq, payload)
    instance, seq = 0, 0
    for i in range(n):
        if restart_at is not None and i == restart_at:
            instance, seq = 1, 0
        published.append((instance, seq, f"i{instance}s{seq}"))
        seq += 1
    last_instance = published[-1][0]
    lost = {i for i in lost if i < n - 1}  # the last batch always arrives
    if restart_at is not None:
        # Only a sequence going back below the last applied one reveals a restart (vLLM
        # publishes no epoch): the first new batch arrives and the old instance got past seq 0.
        received_old = [i for i in range(restart_at) if i not in lost]
        assume(restart_at not in lost and bool(received_old) and received_old[-1] >= 1)

    t = SequenceTracker()
    applied: list[str] = []
    clears = 0
    for idx, (inst, s, payload) in enumerate(published):
        if idx in lost:
            continue
        d = t.observe(s)
        if d.action is SeqAction.APPLY:
            applied.append(payload)
        elif d.action is SeqAction.RESTART:
            clears += 1
            applied = [payload]
        elif d.action is SeqAction.GAP:
            history = [(ps, pp) for (pi, ps, pp) in published[: idx + 1] if pi == inst]
            replayed = [(ps, pp) for ps, pp in history[-buffer_steps:] if ps >= (d.expected or 0)]
            plan = t.fill_gap(d, payload, replayed, ReplayStatus.COMPLETE)
            if plan.clear:
                clears += 1
                applied = []
            applied.extend(p for _, p in plan.batches)
        else:
            pytest.fail(f"unexpected {d}")

    current = [p for (pi, _, p) in published if pi == last_instance]
    # A suffix of the current instance's batches, in order, without duplicates.
    assert applied == current[len(current) - len(applied):]
    if restart_at is None and buffer_steps >= n:
        first_received = min(i for i in range(n) if i not in lost)
        assert clears == 0
        assert applied == current[first_received:]


# --- frames --------------------------------------------------------------------------------


def test_event_frames_wire_vector() -> None:
    # wire-formats §7.1: topic "kv-events", seq 1
    topic, seq, payload = parse_event_frames(
        [bytes.fromhex("6b762d6576656e7473"), bytes.fromhex("0000000000000001"), b"\x93"]
    )
    assert (topic, seq, payload) == (b"kv-events", 1, b"\x93")
    assert parse_event_frames([b"", b"\xff" * 8, b""])[1] == (1 << 64) - 1


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"t", b"\x00" * 8], DropReason.BAD_FRAME_COUNT),
        ([b"t", b"\x00" * 8, b"p", b"extra"], DropReason.BAD_FRAME_COUNT),
        ([b"t", b"\x00" * 4, b"p"], DropReason.BAD_SEQ),
        ([b"t", b"", b"p"], DropReason.BAD_SEQ),
    ],
)
def test_malformed_event_frames_raise_with_a_reason(
    frames: list[bytes], reason: DropReason
) -> None:
    with pytest.raises(FrameError) as info:
        parse_event_frames(frames)
    assert info.value.reason is reason


def test_replay_request_wire_vector() -> None:
    assert replay_request(5) == [b"", bytes.fromhex("0000000000000005")]


def test_replay_frames_both_layouts_and_end_markers() -> None:
    # wire-formats §7.5, as a DEALER receives them
    s1 = (1).to_bytes(8, "big")
    assert parse_replay_frames([b"", s1, b"P1"]) == (1, b"P1")
    assert parse_replay_frames([b"", b"kv-events", s1, b"P1"]) == (1, b"P1")
    assert bytes.fromhex("ffffffffffffffff") == END_SEQ
    assert parse_replay_frames([b"", END_SEQ, b""]) is None
    assert parse_replay_frames([b"", b"", END_SEQ, b""]) is None


@pytest.mark.parametrize(
    "frames",
    [
        [b"", (1).to_bytes(8, "big")],
        [b"", b"t", (1).to_bytes(8, "big"), b"p", b"x"],
        [b"x", (1).to_bytes(8, "big"), b"p"],
        [b"", b"\x01", b"p"],
        [b"", END_SEQ, b"not-empty"],
    ],
)
def test_malformed_replay_frames_raise(frames: list[bytes]) -> None:
    with pytest.raises(FrameError) as info:
        parse_replay_frames(frames)
    assert info.value.reason is SourceDropReason.BAD_REPLAY_FRAME


# --- TRT-LLM event stream ------------------------------------------------------------------


def Rec(
    event_id: int, events: tuple[KvEvent, ...], window_size: int | None = None,
    dp_rank: int | None = None,
) -> TrtllmRecord:
    # The decoder's own record type: proves it satisfies TrtllmRecordLike.
    return TrtllmRecord(event_id, window_size, dp_rank, events)


def stored(h: int) -> BlockStored:
    return BlockStored(block_hashes=(h,), parent_hash=None, token_ids=array("I", [1, 2]), block_size=2)


def test_trtllm_first_poll_applied_then_duplicates_skipped() -> None:
    s = TrtllmEventStream()
    out = s.accept([Rec(5, (stored(1),)), Rec(6, (stored(2),))], ts=1.0)
    assert out.items == (EventBatch(ts=1.0, events=(stored(1), stored(2))),)
    out = s.accept([Rec(6, (stored(2),)), Rec(7, (BlockRemoved((1,)),))], ts=2.0)
    assert out.items == (EventBatch(ts=2.0, events=(BlockRemoved((1,)),)),)
    assert out.drops == {"duplicate_event_id": 1}
    assert s.last_event_id() == 7


def test_trtllm_event_id_gap_clears_then_applies() -> None:
    s = TrtllmEventStream()
    s.accept([Rec(0, (stored(1),))], ts=1.0)
    out = s.accept([Rec(1, (stored(2),)), Rec(4, (stored(3),))], ts=2.0)
    assert out.gaps == 1
    assert out.items == (
        EventBatch(ts=2.0, events=(stored(2),)),
        SourceCleared(ClearReason.GAP),
        EventBatch(ts=2.0, events=(stored(3),)),
    )


def test_trtllm_created_clears_and_restarts_id_tracking() -> None:
    s = TrtllmEventStream()
    s.accept([Rec(40, (stored(1),))], ts=1.0)
    # The server restarted: ids start again at 0 with a `created`.
    out = s.accept([Rec(0, (CacheCreated((10, 0)),)), Rec(1, (stored(2),))], ts=2.0)
    assert out.items == (
        SourceCleared(ClearReason.ENGINE_CLEARED),
        EventBatch(ts=2.0, events=(CacheCreated((10, 0)), stored(2))),
    )
    assert out.gaps == 0 and out.drops == {}


def test_trtllm_keeps_only_the_largest_window() -> None:
    s = TrtllmEventStream()
    out = s.accept(
        [
            Rec(0, (CacheCreated((8,)),), window_size=512),
            Rec(1, (CacheCreated((8,)),), window_size=4096),
            Rec(2, (stored(1),), window_size=512),
            Rec(3, (stored(2),), window_size=4096),
        ],
        ts=1.0,
    )
    assert s.max_window == 4096
    # consecutive clears collapse into one
    assert out.items == (
        SourceCleared(ClearReason.ENGINE_CLEARED),
        EventBatch(ts=1.0, events=(CacheCreated((8,)), stored(2))),
    )
    assert out.drops == {"window_not_max": 2}
    assert out.gaps == 0


def test_trtllm_larger_window_learned_late_clears_the_smaller_windows_state() -> None:
    s = TrtllmEventStream()
    s.accept([Rec(0, (stored(1),), window_size=512)], ts=1.0)
    out = s.accept([Rec(1, (stored(2),), window_size=4096)], ts=2.0)
    assert out.items == (SourceCleared(ClearReason.WINDOW_CHANGED), EventBatch(ts=2.0, events=(stored(2),)))
    out = s.accept([Rec(2, (stored(3),), window_size=512)], ts=3.0)
    assert out.items == ()
    assert out.drops == {"window_not_max": 1}


def test_trtllm_ids_are_tracked_per_dp_rank_and_batches_split_by_rank() -> None:
    s = TrtllmEventStream()
    out = s.accept(
        [
            Rec(0, (stored(1),), dp_rank=0),
            Rec(0, (stored(2),), dp_rank=1),
            Rec(1, (stored(3),), dp_rank=1),
            Rec(1, (AllBlocksCleared(),), dp_rank=0),
        ],
        ts=1.0,
    )
    assert out.gaps == 0 and out.drops == {}
    assert out.items == (
        EventBatch(ts=1.0, events=(stored(1),), dp_rank=0),
        EventBatch(ts=1.0, events=(stored(2), stored(3)), dp_rank=1),
        EventBatch(ts=1.0, events=(AllBlocksCleared(),), dp_rank=0),
    )
