"""A simulated vLLM engine served over HTTP: the OpenAI routes and the probes routers send, in
front of one `EngineService` (`sim/service.py`: the service-time model and the scheduling) and
its `SimEngine` (whose ZMQ PUB and replay ROUTER keep publishing its KV events exactly as before).

Owns the HTTP side of what a cluster routing benchmark needs from an engine that routers (round
robin, consistent hashing, ours, smg 1.13, vllm-router 0.1.17) proxy HTTP to, in vLLM 0.11's
shapes (`vllm/entrypoints/openai/api_server.py`, `serving_chat.py`, `serving_completion.py`; the
bodies themselves are `sim/openai_wire.py`'s):

- `POST /v1/chat/completions` (prompt: the tokenizer's chat template with the generation
  prompt, `engine.render_chat`) and `POST /v1/completions` (`prompt` a string or token IDs).
  The rule that makes both forms of one request cache alike: a text prompt is tokenized with
  `add_special_tokens=False` unless the body says otherwise (vLLM's completions default is
  True), which is exactly how `render_chat` tokenizes the rendered template, so the rendered
  chat text sent as a completion gives the chat request's token IDs; token IDs are used as
  they are (vllm-router's kv_aware policy sends them). With the demo tokenizer (no BOS) the two
  defaults give the same IDs anyway.
- Answers: OpenAI JSON with `usage.prompt_tokens_details.cached_tokens` (vLLM needs
  `--enable-prompt-tokens-details` for it; here it is always on), or with `"stream": true`
  server-sent events: the first chunk when prefill is done, chunks during decode, the finish
  reason on the last token's chunk, a usage chunk (`choices: []`) always, then `data: [DONE]`.
- Probes: `/health`, `/v1/models`, `/version`, `/metrics` (vLLM's names), SGLang's `/v1/loads`,
  `/loads` and `/get_load`, and the tokenizer routes of `detokenize_server.py` (`/tokenize`,
  `/detokenize`, `/tokenizer_info`) that the listener resolves prefixes with.
- Errors in vLLM >= 0.10.2's OpenAI shape `{"error": {message, type, param, code}}`: 400 for a
  bad body, 404 for a model it does not serve; a bad request never reaches the engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Self

import structlog
from aiohttp import web

from kv_listener.sim.engine import SimEngine
from kv_listener.sim.lifecycle import start_site
from kv_listener.sim.openai_wire import (
    Kind,
    RequestError,
    check_token_ids,
    choice,
    error_response,
    parse_cache_salt,
    parse_json,
    parse_messages,
    parse_prompt,
    parse_sampling,
    prom_label,
    sse_event,
    usage,
)
from kv_listener.sim.service import DEFAULT_MAX_TOKENS, EngineService, RequestRecord, ServiceTiming
from kv_listener.sim.workload import DEMO_MODEL

log = structlog.get_logger(__name__)

#: What `/version` answers: a vLLM release whose routes and shapes these are.
VLLM_VERSION = "0.11.0"
#: Chat bodies with long histories are large; vLLM itself has no small limit.
MAX_BODY_BYTES = 16 << 20
#: Prometheus' text exposition format, as prometheus_client serves it.
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class EngineServer(EngineService):
    """One simulated engine behind aiohttp on `host` (port 0: read `port` back after
    `start()`). Use as `async with EngineServer(engine, ...) as server:`; the server owns the
    engine's lifecycle (`start()` starts it, `close()` closes it).

    `engine`, `timing`, `max_model_len` and `default_max_tokens` as `EngineService`'s; `model`
    the one served model name; `tokenizer_info` the `/tokenizer_info` body (None: 404, as vLLM
    without the flag). `serve_http=False` runs the engine for in-process requests only
    (`chat()`), with no socket; `health_path` serves the health probe at another path as well.
    """

    def __init__(self, engine: SimEngine, *, model: str = DEMO_MODEL,
                 timing: ServiceTiming | None = None,
                 tokenizer_info: Mapping[str, Any] | None = None,
                 max_model_len: int | None = None, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 host: str = "127.0.0.1", port: int = 0, serve_http: bool = True,
                 health_path: str = "/health") -> None:
        super().__init__(engine, timing=timing, max_model_len=max_model_len,
                         default_max_tokens=default_max_tokens)
        self.model = model
        self.tokenizer_info = dict(tokenizer_info) if tokenizer_info is not None else None
        self.host = host
        self.port = port
        self.serve_http = serve_http
        self.health_path = health_path
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The server's base URL (what a router is given as a backend)."""
        return f"http://{self.host}:{self.port}"

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> Self:
        await super().start()
        if self.serve_http:
            await self._start_http()
        return self

    async def _start_http(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        posts: dict[str, Handler] = {
            "/v1/chat/completions": self._chat, "/v1/chat/completions/render": self._chat_render,
            "/v1/completions": self._completion, "/tokenize": self._tokenize,
            "/detokenize": self._detokenize}
        gets: dict[str, Handler] = {
            "/health": self._health, "/v1/models": self._models, "/version": self._version,
            "/v1/loads": self._loads, "/loads": self._loads, "/get_load": self._get_load,
            "/metrics": self._metrics, "/tokenizer_info": self._tokenizer_info}
        for path, handler in posts.items():
            app.router.add_post(path, handler)
        for path, handler in gets.items():
            app.router.add_get(path, handler)
        if self.health_path != "/health":
            app.router.add_get(self.health_path, self._health)
        # vLLM aborts a request whose client disconnected (`with_cancellation`): aiohttp cancels
        # the handler, which frees the request's blocks and its sequence slot.
        try:
            runner = await start_site(app, self.host, self.port, access_log=None,
                                      handler_cancellation=True, shutdown_timeout=1.0)
        except BaseException:
            await self._close_engine()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info("engine_server_listening", engine=self.engine.name, model=self.model,
                 host=self.host, port=self.port, zmq_endpoint=self.engine.endpoint)

    async def close(self) -> None:
        """Abort what still runs (its records say "abort"), stop serving, close the engine."""
        await self._abort_running()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self._close_engine()

    # --- answers ----------------------------------------------------------------------------

    async def _serve(self, request: web.Request, kind: Kind, body: Mapping[str, Any],
                     prompt: array[int], arrived_at: float) -> web.StreamResponse:
        max_tokens, stream = parse_sampling(body, self.default_max_tokens)
        cache_salt = parse_cache_salt(body)
        self._check_length(prompt, max_tokens)
        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        with self._tracked():
            if stream:
                return await self._stream(request, request_id, kind, prompt, max_tokens,
                                          arrived_at, cache_salt)
            rec, tokens = await self._complete(request_id, kind, prompt, max_tokens, arrived_at,
                                               cache_salt)
            return web.json_response({
                "id": request_id, "object": "chat.completion" if kind == "chat"
                else "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [choice(kind, self._text(tokens), rec.finish_reason, delta=False)],
                "usage": usage(rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens),
                "x_sim": self._sim_fields(rec)}, headers=self._headers())

    async def _stream(self, request: web.Request, request_id: str, kind: Kind,
                      prompt: array[int], max_tokens: int, arrived_at: float,
                      cache_salt: str | None) -> web.StreamResponse:
        # Headers go out at once (vLLM's StreamingResponse); the first data chunk at prefill end.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **self._headers()})
        await resp.prepare(request)
        head = {"id": request_id,
                "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model}
        # vLLM's serving_chat sends the role first, with empty content, then the text.
        role = sse_event({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                           "logprobs": None, "finish_reason": None}]})
        pending = role if kind == "chat" else b""

        async def emit(tokens: Sequence[int], finish_reason: str | None) -> None:
            nonlocal pending
            text = self._text(tokens)
            out = pending + sse_event({**head, "choices": [choice(kind, text, finish_reason,
                                                               delta=True)]})
            pending = b""
            await resp.write(out)

        try:
            rec = await self._run(request_id, kind, True, prompt, max_tokens, arrived_at, emit,
                                  cache_salt)
            # The usage chunk OpenAI sends for `stream_options.include_usage`: always here.
            await resp.write(sse_event({**head, "choices": [], "usage": usage(
                rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens),
                "x_sim": self._sim_fields(rec)}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; `_run` recorded the abort and freed the request
        return resp

    def _headers(self) -> dict[str, str]:
        """Which engine answered, for a benchmark behind a proxy (the peers pass it through)."""
        return {"x-engine-name": self.engine.name}

    def _sim_fields(self, rec: RequestRecord) -> dict[str, Any]:
        """Not in vLLM's answer: the engine's name and its own TTFT (arrival -> first token, real
        seconds), so a client behind a router can tell the router's added latency."""
        return {"engine": self.engine.name, "ttft_s": rec.ttft_s}

    async def _chat_render(self, request: web.Request) -> web.StreamResponse:
        """vLLM >= 0.20's `POST /v1/chat/completions/render`: the chat body's prompt token IDs,
        without running it (vllm-router asks every worker before it forwards a chat request)."""
        try:
            body = await self._body(request)
            self._check_model(body)
            prompt = await self._render(parse_messages(body))
        except RequestError as err:
            return self._refuse(err)
        return web.json_response({"token_ids": list(prompt)})

    # --- routes -----------------------------------------------------------------------------

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(400, "model must be a string")
        if model is not None and model != self.model:
            raise RequestError(404, f"The model `{model}` does not exist.")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = parse_json(await request.read())
        self._check_model(body)
        return body

    def _refuse(self, err: RequestError) -> web.Response:
        self.stats.rejected += 1
        return error_response(err.status, err.message)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        arrived_at = asyncio.get_running_loop().time()
        try:
            body = await self._body(request)
            prompt = await self._render(parse_messages(body))
            return await self._serve(request, "chat", body, prompt, arrived_at)
        except RequestError as err:
            return self._refuse(err)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        arrived_at = asyncio.get_running_loop().time()
        try:
            body = await self._body(request)
            prompt = parse_prompt(body)
            add_special = body.get("add_special_tokens", False)  # see the module docstring
            if not isinstance(add_special, bool):
                raise RequestError(400, "add_special_tokens must be a boolean")
            if isinstance(prompt, str):
                tokens = array("I", await self._encode(prompt, add_special_tokens=add_special))
            else:
                tokens = array("I", check_token_ids(prompt, self._vocab))
            if not tokens:
                raise RequestError(400, "prompt cannot be empty")
            return await self._serve(request, "completion", body, tokens, arrived_at)
        except RequestError as err:
            return self._refuse(err)

    async def _health(self, _: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _models(self, _: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.max_model_len,
            "permission": []}]})

    async def _version(self, _: web.Request) -> web.StreamResponse:
        return web.json_response({"version": VLLM_VERSION})

    async def _loads(self, _: web.Request) -> web.StreamResponse:
        # SGLang's `/v1/loads` (one data-parallel rank); token usage as in `/metrics`.
        pool = self.engine.core.pool
        return web.json_response({"dp_rank_count": 1, "loads": [{
            "dp_rank": 0, "num_running_reqs": self.num_running,
            "num_waiting_reqs": self.num_waiting,
            "max_total_num_tokens": pool.num_blocks * pool.block_size,
            "token_usage": self.kv_cache_usage}]})

    async def _get_load(self, _: web.Request) -> web.StreamResponse:
        # sgl-router's load probe reads `load` (requests running and queued).
        return web.json_response({"load": self.num_running + self.num_waiting})

    async def _metrics(self, _: web.Request) -> web.StreamResponse:
        core = self.engine.core
        labels = f'{{engine="0",model_name="{prom_label(self.model)}"}}'
        # vLLM 0.11 `v1/metrics/loggers.py` names; prefix-cache counters are in tokens.
        series = (
            ("num_requests_running", "gauge", "Number of requests in model execution batches.",
             self.num_running),
            ("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             self.num_waiting),
            ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             self.kv_cache_usage),
            ("prefix_cache_queries", "counter",
             "Prefix cache queries, in terms of number of queried tokens.", core.prompt_tokens),
            ("prefix_cache_hits", "counter",
             "Prefix cache hits, in terms of number of cached tokens.", core.hit_tokens),
            ("prompt_tokens", "counter", "Number of prefill tokens processed.",
             core.prompt_tokens),
            ("generation_tokens", "counter", "Number of generation tokens processed.",
             self.generated_tokens),
        )
        lines: list[str] = []
        for name, kind, help_text, value in series:
            sample = f"vllm:{name}_total" if kind == "counter" else f"vllm:{name}"
            lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} {kind}",
                      f"{sample}{labels} {float(value)!r}"]
        return web.Response(body=("\n".join(lines) + "\n").encode(),
                            headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        # vLLM's TokenizeCompletionRequest (`prompt`, add_special_tokens default true) or
        # TokenizeChatRequest (`messages`, the chat template, no special tokens added again).
        try:
            body = await self._body(request)
            if "messages" in body:
                ids = list(await self._render(parse_messages(body)))
            else:
                prompt = body.get("prompt")
                add_special = body.get("add_special_tokens", True)
                if not isinstance(prompt, str) or not isinstance(add_special, bool):
                    raise RequestError(400, "prompt must be a string")
                ids = await self._encode(prompt, add_special_tokens=add_special)
        except RequestError as err:
            return self._refuse(err)
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len,
                                  "tokens": list(ids), "token_strs": None})

    async def _detokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise RequestError(400, "tokens must be a list of integers")
            ids = check_token_ids(tokens, self._vocab)
        except RequestError as err:
            return self._refuse(err)
        # As vLLM's `tokenizer.decode(ids)`: special tokens kept, so template markers survive.
        text = await asyncio.to_thread(self.engine.tokenizer.decode, ids,
                                       skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def _tokenizer_info(self, _: web.Request) -> web.StreamResponse:
        if self.tokenizer_info is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response(self.tokenizer_info)
