"""The push-mode state tables (core/push_session.py): bytes and events in, actions out; every
pair the tables do not list raises."""

from __future__ import annotations

import pytest

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import Forbidden, Subscribe, Unsubscribe, Welcome
from kv_listener.core.push_session import (
    LISTENER_TABLE,
    SESSION_TABLE,
    STREAM_TABLE,
    BusFailure,
    LineRefused,
    ListenerInput,
    ListenerSession,
    ListenerState,
    PushStateError,
    SessionFailed,
    StartPush,
    StopPush,
    StreamInput,
    StreamState,
    Welcomed,
    step,
)


def welcomed(sources: tuple[str, ...] = ("vllm-1",)) -> ListenerSession:
    s = ListenerSession()
    s.connect()
    s.sources = sources
    assert s.receive_data(bp.encode_message(Welcome("s-1"))) == [Welcomed("s-1")]
    return s


def test_lines_fed_byte_by_byte_give_the_same_actions() -> None:
    body = (bp.encode_message(Welcome("s-1")) + bp.encode_message(Subscribe("st", "vllm-1", None))
            + bp.encode_message(Unsubscribe("st")))
    s = ListenerSession()
    s.connect()
    s.sources = ("vllm-1",)
    actions = [a for i in range(len(body)) for a in s.receive_data(body[i:i + 1])]
    assert actions == [Welcomed("s-1"), StartPush(Subscribe("st", "vllm-1", None)), StopPush("st")]
    assert s.state is ListenerState.WELCOMED


def test_odd_lines_are_counted_and_skipped() -> None:
    s = welcomed()
    sub = bp.encode_message(Subscribe("st", "vllm-1", None))
    assert s.receive_data(b'{"type":"gossip"}\nnot json\n') == [
        LineRefused("unknown_type", bp.BusProtocolErrorReason.UNKNOWN_TYPE),
        LineRefused("not_json", bp.BusProtocolErrorReason.NOT_JSON)]
    assert s.receive_data(bp.encode_message(Welcome("again"))) == [LineRefused("second_welcome")]
    assert s.receive_data(sub) == [StartPush(Subscribe("st", "vllm-1", None))]
    assert s.receive_data(sub) == [LineRefused("duplicate_stream")]
    assert s.receive_data(bp.encode_message(Subscribe("x", "vllm-9", None))) == [
        LineRefused("unannounced_source", backend="vllm-9")]
    assert s.receive_data(bp.encode_message(Unsubscribe("nope"))) == []
    s.push_ended("st")
    assert s.receive_data(bp.encode_message(Unsubscribe("st"))) == []


def test_the_first_line_must_be_welcome() -> None:
    for first, failure in [(bp.encode_message(Forbidden("no")), BusFailure.FORBIDDEN),
                           (bp.encode_message(Subscribe("s", "vllm-1", None)), BusFailure.PROTOCOL)]:
        s = ListenerSession()
        s.connect()
        [action] = s.receive_data(first)
        assert isinstance(action, SessionFailed) and action.failure is failure
    s = ListenerSession()
    s.connect()
    assert s.router_ended() == SessionFailed(BusFailure.SESSION_ENDED, "ended before welcome")
    too_long = s.receive_data(b"x" * (bp.MAX_LINE_BYTES + 1))
    assert [type(a) for a in too_long] == [SessionFailed]  # not counted before the welcome
    assert len(welcomed().receive_data(b"x" * (bp.MAX_LINE_BYTES + 1))) == 2  # counted after


def test_forbidden_fails_and_the_attempt_reason_follows_reload_and_drain() -> None:
    s = welcomed()
    assert s.receive_data(bp.encode_message(Forbidden("shrunk"))) == [
        SessionFailed(BusFailure.FORBIDDEN, "shrunk")]
    assert s.attempt_over(BusFailure.FORBIDDEN) is BusFailure.FORBIDDEN
    assert s.state is ListenerState.IDLE
    s = welcomed()
    s.reload()
    assert s.attempt_over(BusFailure.CONNECTION_LOST) is BusFailure.RELOAD  # reconnect at once
    s = welcomed()
    s.reload()
    s.drain()  # draining outranks reloading
    assert s.draining and s.attempt_over(None) is BusFailure.DRAINED and s.closed
    s = welcomed()
    assert s.attempt_over(None, crashed=True) is BusFailure.PROTOCOL
    s = ListenerSession()
    s.drain()  # drained before run(): nothing to connect
    assert s.closed
    with pytest.raises(PushStateError):
        s.connect()


def test_every_listener_pair_not_in_the_table_raises() -> None:
    for state in ListenerState:
        for event in ListenerInput:
            if (state, event) in LISTENER_TABLE:
                assert isinstance(step(LISTENER_TABLE, state, event), ListenerState)
            else:
                with pytest.raises(PushStateError):
                    step(LISTENER_TABLE, state, event)
    # Reload and drain may come at any time; lines only while an attempt runs.
    assert all((s, ListenerInput.DRAIN) in LISTENER_TABLE for s in ListenerState)
    assert (ListenerState.IDLE, ListenerInput.SUBSCRIBE) not in LISTENER_TABLE


def test_router_tables() -> None:
    assert step(STREAM_TABLE, StreamState.REQUESTED, StreamInput.END) is StreamState.ENDED_UNATTACHED
    with pytest.raises(PushStateError):
        step(STREAM_TABLE, StreamState.ATTACHED, StreamInput.ATTACH)  # attached once
    with pytest.raises(PushStateError):
        step(STREAM_TABLE, StreamState.ENDED, StreamInput.ATTACH)
    assert len(SESSION_TABLE) == 5
