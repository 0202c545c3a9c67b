"""Simulated engines: wire payloads exactly as vLLM, SGLang and TRT-LLM releases write them.

`encode` turns model events into engine bytes (tests, benches, the demo's fake engines).
"""

from kv_listener.sim.encode import (
    SGLANG_VERSIONS,
    VLLM_VERSIONS,
    Layout,
    Wire,
    assemble_batch,
    decoded_to_jsonable,
    encode_sglang_batch,
    encode_sglang_event,
    encode_trtllm_events,
    encode_vllm_batch,
    encode_vllm_event,
    event_to_jsonable,
    sglang_layout,
    trtllm_to_jsonable,
    vllm_layout,
)

__all__ = [
    "SGLANG_VERSIONS",
    "VLLM_VERSIONS",
    "Layout",
    "Wire",
    "assemble_batch",
    "decoded_to_jsonable",
    "encode_sglang_batch",
    "encode_sglang_event",
    "encode_trtllm_events",
    "encode_vllm_batch",
    "encode_vllm_event",
    "event_to_jsonable",
    "sglang_layout",
    "trtllm_to_jsonable",
    "vllm_layout",
]
