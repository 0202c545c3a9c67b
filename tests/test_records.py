"""The one prefix-record contract (core/records.py): what the encoder writes the decoder reads back,
and the validator refuses what no index may store."""

from __future__ import annotations

import json

import pytest

from kv_listener.backoff import Backoff
from kv_listener.core.model import Tier
from kv_listener.core.records import (
    ControlEvent,
    InvalidRecord,
    Record,
    RecordEvent,
    RecordFault,
    control_data,
    decode_data,
    encode_data,
    is_prefix_hash,
    is_token_count,
    record_data,
)
from kv_listener.router.consumer_state import reconnect_backoff
from kv_listener.router.index import IndexEvent

H = "ab" * 32


@pytest.mark.parametrize("record", [
    Record("e-1", RecordEvent.CACHE_CREATED, "vllm-1", H, 16, Tier.GPU_HOT, 1.2345),
    Record("e-2", RecordEvent.CACHE_OFFLOADED, "vllm-1", H, 0, Tier.STORAGE_WARM, 2.0),
    Record(None, RecordEvent.CACHE_EVICTED, "vllm-1", H, None, None, 3.5),
    Record("e-4", RecordEvent.CACHE_CLEARED, "vllm-1", None, None, None, 4.0),
])
def test_encoded_data_decodes_back(record: Record) -> None:
    text = encode_data(record)
    assert json.loads(text) == record_data(record)
    want = Record(record.id, record.event, record.backend, record.prefix_hash,
                  record.token_count, record.tier, round(record.ts or 0, 3))
    assert decode_data("vllm-1", text, record_id=record.id) == want


def test_a_record_without_ts_encodes_without_it() -> None:
    r = Record(None, RecordEvent.CACHE_EVICTED, "vllm-1", H, None, None, None)
    assert json.loads(encode_data(r)) == {"event": "cache_evicted", "backend": "vllm-1",
                                          "prefix_hash": H}
    assert r.as_dict() == {"event": "cache_evicted", "backend": "vllm-1", "prefix_hash": H,
                           "id": None}


def test_control_events_decode_to_themselves() -> None:
    assert decode_data("b", control_data(ControlEvent.DRAINING, "b")) is ControlEvent.DRAINING
    assert decode_data("b", "{}", event="buffer_overflow") is ControlEvent.BUFFER_OVERFLOW


@pytest.mark.parametrize(("data", "fault"), [
    ("[", RecordFault.MALFORMED_JSON),
    ("[1]", RecordFault.MALFORMED_JSON),
    ('{"event":"cache_moved"}', RecordFault.UNKNOWN_EVENT),
    ('{"event":"cache_cleared","backend":"other"}', RecordFault.BACKEND_MISMATCH),
    ('{"event":"cache_evicted","prefix_hash":"AB"}', RecordFault.INVALID_FIELD),
    (f'{{"event":"cache_created","prefix_hash":"{H}","token_count":-1}}', RecordFault.INVALID_FIELD),
    (f'{{"event":"cache_created","prefix_hash":"{H}","token_count":1,"tier":"x"}}',
     RecordFault.INVALID_FIELD),
])
def test_decode_faults(data: str, fault: RecordFault) -> None:
    with pytest.raises(InvalidRecord) as info:
        decode_data("b", data)
    assert info.value.fault is fault


def test_validators() -> None:
    assert is_prefix_hash(H) and not is_prefix_hash(H + "\n") and not is_prefix_hash(H.upper())
    assert is_token_count(0) and not is_token_count(True) and not is_token_count(1 << 53)


def test_the_index_api_builds_the_one_record() -> None:
    assert IndexEvent(RecordEvent.CACHE_OFFLOADED, "b", H, 5) == Record(
        None, RecordEvent.CACHE_OFFLOADED, "b", H, 5, Tier.STORAGE_WARM, None)
    assert IndexEvent(RecordEvent.CACHE_EVICTED, "b", H, 0).token_count is None


def test_reconnect_backoff_is_the_shared_policy_without_jitter() -> None:
    b = reconnect_backoff(1.0)
    assert isinstance(b, Backoff) and (b.initial_s, b.max_s, b.jitter) == (1.0, 60.0, 0.0)
