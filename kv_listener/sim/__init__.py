"""Engine stand-ins for tests, benches and the demo; none of it is used by the daemon itself.

- `encode`: model events -> wire payloads exactly as vLLM, SGLang and TRT-LLM releases write them;
- `publisher`: a ZMQ publisher with replay that behaves like vLLM's;
- `trtllm_server`: `trtllm-serve`'s drain-on-read `/kv_cache_events`;
- `engine`, `workload`, `detokenize_server`: the demo's block pool, chat workload and
  `/detokenize` endpoint;
- `service`: one `SimEngine`'s requests, queued, prefilled and decoded by a service-time model
  (`DEMO_TIMING`: the pace of the demo and `simulate`), no socket;
- `server`: that service behind vLLM's OpenAI HTTP routes and probes; `openai_wire`: their
  bodies, pure;
- `lifecycle`: `async with` as start/close, and an aiohttp app served, for every stand-in;
- `plan`: a listener file read from the engines' side, for `simulate`.
"""
