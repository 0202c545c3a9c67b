"""Engine stand-ins for tests, benches and the demo; none of it is used by the daemon itself.

- `encode`: model events -> wire payloads exactly as vLLM, SGLang and TRT-LLM releases write them;
- `publisher`: a ZMQ publisher with replay that behaves like vLLM's;
- `trtllm_server`: `trtllm-serve`'s drain-on-read `/kv_cache_events`;
- `engine`, `workload`, `detokenize_server`: the demo's block pool, chat workload and
  `/detokenize` endpoint;
- `server`: one `SimEngine` behind vLLM's OpenAI HTTP routes and probes, with a service-time model.
- `plan`: a listener file read from the engines' side, for `simulate`.
"""
