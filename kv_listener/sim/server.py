"""A simulated vLLM engine served over HTTP: the OpenAI routes, the probes routers send, and a
service-time model, in front of one `SimEngine` (whose ZMQ PUB and replay ROUTER keep
publishing its KV events exactly as before).

Owns what a cluster routing benchmark needs from an engine that routers (round robin,
consistent hashing, ours, smg 1.13, vllm-router 0.1.17) proxy HTTP to, in vLLM 0.11's shapes
(`vllm/entrypoints/openai/api_server.py`, `serving_chat.py`, `serving_completion.py`):

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

Service time (`ServiceTiming`): at most `engine.max_num_seqs` requests run at once, admitted in
arrival order (arrival at the engine core, once the prompt is tokenized: vLLM's frontend also
tokenizes before its scheduler sees a request); a request holds its blocks through its prefill
(time grows with the prompt tokens not served from the prefix cache), then one decode step per
further output token. TTFT follows from cache hits and queueing; `ServerStats` holds the
counters and one `RequestRecord` per request for the benchmark. The engine's own `Timing` and
`generate()` are not used: a served engine must not also be driven by `generate()` (the two
would not share their sequence slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from array import array
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
from aiohttp import web

from kv_listener.sim.engine import NoFreeBlocksError, RunningRequest, SimEngine, render_chat
from kv_listener.sim.workload import DEMO_MODEL

log = structlog.get_logger(__name__)

#: What `/version` answers: a vLLM release whose routes and shapes these are.
VLLM_VERSION = "0.11.0"
#: Chat bodies with long histories are large; vLLM itself has no small limit.
MAX_BODY_BYTES = 16 << 20
#: `max_tokens` when a request gives none (vLLM defaults to the rest of the context, which
#: would make a simulated request decode for minutes; OpenAI's legacy completions default is 16).
DEFAULT_MAX_TOKENS = 16
#: Chat renders memoized per server (recent bodies' messages -> prompt token IDs).
_RENDER_CACHE = 2048
#: Prometheus' text exposition format, as prometheus_client serves it.
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Kind = Literal["chat", "completion"]
#: Called with the tokens of one chunk and, on the last one, the finish reason.
Emit = Callable[[Sequence[int], str | None], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ServiceTiming:
    """How long a simulated request takes, in simulated seconds, then multiplied by `time_scale`.

    Defaults mimic a small GPU serving a ~7B model:

    - `overhead_s = 0.005`: the fixed cost of the step that runs a request's prefill;
    - `prefill_s_per_token = 0.00005` (0.05 ms, 20k tokens/s) per prompt token NOT served from
      the prefix cache: a cache hit is what shortens TTFT;
    - `decode_s_per_token = 0.010` (10 ms): one decode step per output token after the first
      (the first is sampled from the prefill's logits, as in vLLM). Each running request steps
      on its own: a step's time does not grow with the batch (decode on a GPU is memory-bound
      for small batches), and prefills do not stall other requests' decoding;
    - `time_scale = 0.1`: real seconds per simulated second, so a benchmark runs 10x faster
      than the GPU it mimics (TTFTs the server records are real, i.e. scaled, seconds);
    - `min_tick_s = 0.005`: REAL seconds (not scaled) between two wake-ups of a decoding
      request; tokens that fell due meanwhile go out in one chunk (vLLM's `stream_interval`
      does the same), so a fleet of simulated engines stays cheap on a shared CPU.
    """

    overhead_s: float = 0.005
    prefill_s_per_token: float = 0.00005
    decode_s_per_token: float = 0.010
    time_scale: float = 0.1
    min_tick_s: float = 0.005

    def __post_init__(self) -> None:
        for name in ("overhead_s", "prefill_s_per_token", "decode_s_per_token", "time_scale",
                     "min_tick_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def prefill_s(self, uncached_tokens: int) -> float:
        """Real seconds of the prefill of a prompt with `uncached_tokens` to compute."""
        return (self.overhead_s + uncached_tokens * self.prefill_s_per_token) * self.time_scale

    def decode_step_s(self) -> float:
        """Real seconds of one decode step (one output token)."""
        return self.decode_s_per_token * self.time_scale


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the server saw it; times are the event loop's monotonic clock (real
    seconds: divide by `ServiceTiming.time_scale` for simulated ones)."""

    request_id: str
    kind: Kind
    stream: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # "length", or "abort" (client gone, or server closed)
    arrived_at: float  # the request reached the handler
    admitted_at: float | None  # it got a sequence slot and its blocks (None: aborted waiting)
    first_token_at: float | None  # prefill done, first token sampled (its chunk follows)
    finished_at: float

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived_at

    @property
    def queued_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.arrived_at


@dataclass(slots=True)
class ServerStats:
    """Counters the benchmark reads in process. `requests` and the token counts cover requests
    that finished (not aborted); `records` has every admitted-or-queued request, in finish order."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    aborted: int = 0
    rejected: int = 0  # 4xx answers
    records: list[RequestRecord] = field(default_factory=list)


class RequestError(Exception):
    """A request the server refuses, with its HTTP status (400 or 404)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> web.Response:
    """vLLM >= 0.10.2 `ErrorResponse`: OpenAI's nested shape, `code` the HTTP status."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status=status)


# --- request parsing (pure: bodies in, values out, RequestError for anything else) -------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError covers UnicodeDecodeError
        raise RequestError(400, "request body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


def parse_sampling(body: Mapping[str, Any], default_max_tokens: int) -> tuple[int, bool]:
    """`(max_tokens, stream)` of a request; other sampling fields are accepted and ignored
    (the simulation samples random tokens), except `n`, which must be 1."""
    # Chat accepts OpenAI's newer `max_completion_tokens` as well (vLLM does).
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens) or max_tokens < 1:
        # vLLM's SamplingParams: "max_tokens must be at least 1".
        raise RequestError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be a boolean")
    n = body.get("n", 1)
    if n != 1 or not _is_int(n):
        raise RequestError(400, "the simulated engine serves n=1 only")
    return int(max_tokens), stream


def parse_cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's `cache_salt` request field (>= 0.9, both routes): absent, or a non-empty string
    that the engine hashes into the prompt's first block and echoes in its KV events."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise RequestError(400, "Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def parse_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    """Chat messages with string contents; text parts are joined with "\\n" as vLLM's "string"
    content format does."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list")
    out: list[dict[str, str]] = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise RequestError(400, "every message must be an object with a string role")
        content = msg.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError(400, "the simulated engine accepts text content parts only")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(400, "message content must be a string or a list of text parts")
        out.append({"role": msg["role"], "content": content})
    return out


def parse_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """A completions `prompt`: a string, a list of token IDs, or a batch of exactly one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # OpenAI's batch form, one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(400, "prompt cannot be empty")
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        if not prompt:
            raise RequestError(400, "prompt cannot be empty")
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        raise RequestError(400, "the simulated engine does not serve batched prompts")
    raise RequestError(400, "prompt must be a string or a list of token IDs")


def check_token_ids(tokens: Sequence[Any], vocab: int) -> list[int]:
    if not all(_is_int(t) for t in tokens):
        raise RequestError(400, "tokens must be a list of integers")
    if any(t < 0 or t >= vocab for t in tokens):
        raise RequestError(400, "token id out of vocabulary")
    return list(tokens)


# --- response bodies --------------------------------------------------------------------------


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _choice(kind: Kind, text: str, finish_reason: str | None, *, delta: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if kind == "completion":
        choice["text"] = text
    elif delta:
        choice["delta"] = {"content": text} if text or finish_reason is None else {}
    else:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=None)
    return choice


def _sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _prom_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# --- the server -----------------------------------------------------------------------------


class _Waiter:
    __slots__ = ("cache_salt", "future", "prompt")

    def __init__(self, prompt: array[int], future: asyncio.Future[RunningRequest],
                 cache_salt: str | None) -> None:
        self.prompt = prompt
        self.future = future
        self.cache_salt = cache_salt


class EngineServer:
    """One simulated engine behind aiohttp on `host` (port 0: read `port` back after
    `start()`). Use as `async with EngineServer(engine, ...) as server:`; the server owns the
    engine's lifecycle (`start()` starts it, `close()` closes it).

    `engine` an unstarted `SimEngine` (its `max_num_seqs` is the concurrency limit, its
    tokenizer tokenizes); `model` the one served model name; `timing` the service-time model;
    `tokenizer_info` the `/tokenizer_info` body (None: 404, as vLLM without the flag);
    `max_model_len` the context limit (default and maximum: the pool's tokens, so an admissible
    request always fits once the pool is idle); `default_max_tokens` when a request gives none.
    `serve_http=False` runs the engine for in-process requests only (`chat()`), with no socket;
    `health_path` serves the health probe at another path as well.
    """

    def __init__(self, engine: SimEngine, *, model: str = DEMO_MODEL,
                 timing: ServiceTiming | None = None,
                 tokenizer_info: Mapping[str, Any] | None = None,
                 max_model_len: int | None = None, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 host: str = "127.0.0.1", port: int = 0, serve_http: bool = True,
                 health_path: str = "/health") -> None:
        pool_tokens = engine.core.pool.num_blocks * engine.core.block_size
        if max_model_len is not None and not 1 <= max_model_len <= pool_tokens:
            raise ValueError(f"max_model_len must be in 1..{pool_tokens} (the pool's tokens)")
        if default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        self.engine = engine
        self.model = model
        self.timing = timing or ServiceTiming()
        self.tokenizer_info = dict(tokenizer_info) if tokenizer_info is not None else None
        self.max_model_len = max_model_len or pool_tokens
        self.default_max_tokens = default_max_tokens
        self.host = host
        self.port = port
        self.serve_http = serve_http
        self.health_path = health_path
        self.stats = ServerStats()
        self.num_running = 0
        self.generated_tokens = 0  # output tokens of every step, aborted requests' included
        self._vocab = len(engine.tokenizer)
        self._waiting: deque[_Waiter] = deque()
        self._watchers: list[asyncio.Future[None]] = []
        self._inflight: set[asyncio.Task[Any]] = set()
        self._rendered: OrderedDict[str, array[int]] = OrderedDict()
        self._runner: web.AppRunner | None = None
        self._started = False

    @property
    def url(self) -> str:
        """The server's base URL (what a router is given as a backend)."""
        return f"http://{self.host}:{self.port}"

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: 1 - free/total, where cached blocks no running request
        references are free (evictable). So idle cache is not usage, and 1.0 means full."""
        pool = self.engine.core.pool
        return 1.0 - pool.num_free / pool.num_blocks

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> EngineServer:
        await self.engine.start()
        self._started = True
        if self.serve_http:
            await self._start_http()
        return self

    async def _start_http(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/chat/completions/render", self._chat_render)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/loads", self._loads)
        app.router.add_get("/get_load", self._get_load)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/tokenizer_info", self._tokenizer_info)
        if self.health_path != "/health":
            app.router.add_get(self.health_path, self._health)
        # vLLM aborts a request whose client disconnected (`with_cancellation`): aiohttp cancels
        # the handler, which frees the request's blocks and its sequence slot.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                               shutdown_timeout=1.0)
        try:
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            await self.engine.close()
            self._started = False
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info("engine_server_listening", engine=self.engine.name, model=self.model,
                 host=self.host, port=self.port, zmq_endpoint=self.engine.endpoint)

    async def close(self) -> None:
        """Abort what still runs (its records say "abort"), stop serving, close the engine."""
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._started:
            self._started = False
            await self.engine.close()

    async def __aenter__(self) -> EngineServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
        """Wait until `predicate()` holds; it is checked again whenever a request arrives in the
        queue, is admitted, sends its first token or ends (tests and benchmarks await states)."""
        async with asyncio.timeout(timeout_s):
            while not predicate():
                watcher = asyncio.get_running_loop().create_future()
                self._watchers.append(watcher)
                await watcher

    def _changed(self) -> None:
        watchers, self._watchers = self._watchers, []
        for w in watchers:
            if not w.done():
                w.set_result(None)

    # --- scheduling: vLLM V1's `Scheduler.schedule()`, reduced -------------------------------

    def _schedule(self) -> None:
        """Admit waiting requests in arrival order while a sequence slot is free. A head that
        cannot get its blocks stops the queue, as vLLM 0.11's scheduler breaks out of its waiting
        loop when `allocate_slots` fails (no request overtakes it)."""
        admitted = False
        while self._waiting and self.num_running < self.engine.max_num_seqs:
            head = self._waiting[0]
            if head.future.done():  # cancelled while waiting, its task not yet run to clean up
                self._waiting.popleft()
                continue
            try:
                req = self.engine.core.admit(head.prompt, head.cache_salt)
            except NoFreeBlocksError:
                break
            self._waiting.popleft()
            self.num_running += 1
            self.engine.running += 1
            self.engine.publish_step()  # the hit blocks touched, evictions and new blocks stored
            head.future.set_result(req)
            admitted = True
        if admitted:
            self._changed()

    async def _admit(self, prompt: array[int], cache_salt: str | None) -> RunningRequest:
        waiter = _Waiter(prompt, asyncio.get_running_loop().create_future(), cache_salt)
        self._waiting.append(waiter)
        self._schedule()
        self._changed()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(waiter.future.result())  # admitted, then aborted at once
            else:
                waiter.future.cancel()
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                self._schedule()  # the head may have gone: the next one may fit
            raise

    def _release(self, req: RunningRequest) -> None:
        self.engine.core.release(req)
        self.num_running -= 1
        self.engine.running -= 1
        self._schedule()
        self._changed()

    def _append(self, req: RunningRequest, tokens: Sequence[int]) -> int:
        """One step of sampled tokens; the blocks they fill are announced as that step's batch."""
        done = self.engine.core.append(req, tokens)
        self.engine.publish_step()
        self.generated_tokens += done
        return done

    # --- one request ------------------------------------------------------------------------

    async def _run(self, request_id: str, kind: Kind, stream: bool, prompt: array[int],
                   max_tokens: int, arrived_at: float, emit: Emit,
                   cache_salt: str | None = None) -> RequestRecord:
        """Queue, prefill, decode; `emit` gets the first token when prefill is done, then the
        tokens of each decode wake-up. Always leaves a record, and frees what it held."""
        loop = asyncio.get_running_loop()
        req: RunningRequest | None = None
        admitted_at = first_token_at = None
        emitted = 0
        finish_reason = "abort"
        try:
            req = await self._admit(prompt, cache_salt)
            admitted_at = loop.time()
            await asyncio.sleep(self.timing.prefill_s(req.prompt_len - req.hit_tokens))
            output = self.engine.sample_output(max_tokens)
            # vLLM: the prefill step samples the first token (it has no KV yet).
            emitted = self._append(req, output[:1])
            first_token_at = loop.time()
            self._changed()
            last = emitted < 1 or max_tokens == 1
            await emit(output[:emitted], "length" if last else None)
            if not last:
                emitted = await self._decode(req, output, first_token_at, emit, stream=stream)
            finish_reason = "length"  # the simulation never samples EOS: it decodes max_tokens
        finally:
            if req is not None:
                self._release(req)
            record = RequestRecord(
                request_id=request_id, kind=kind, stream=stream, prompt_tokens=len(prompt),
                cached_tokens=req.hit_tokens if req is not None else 0,
                completion_tokens=emitted, finish_reason=finish_reason, arrived_at=arrived_at,
                admitted_at=admitted_at, first_token_at=first_token_at, finished_at=loop.time())
            self._count(record)
            self._changed()
        return record

    async def _decode(self, req: RunningRequest, output: Sequence[int], first_token_at: float,
                      emit: Emit, *, stream: bool) -> int:
        """Token i (from 0) falls due at `first_token_at + i * step`; deadlines are absolute, so
        a late wake-up emits everything due instead of drifting. Returns the tokens emitted."""
        loop = asyncio.get_running_loop()
        step_s = self.timing.decode_step_s()
        bs = self.engine.core.block_size
        n = len(output)
        emitted, woke = 1, first_token_at
        while emitted < n:
            target = emitted + 1
            if not stream:
                # Nobody watches the tokens: wake only for the token that opens a new block
                # (that step allocates it and announces the one just filled), or the last one.
                target = min(n, emitted + ((1 - len(req.tokens)) % bs or bs))
            wake_at = max(first_token_at + (target - 1) * step_s,
                          woke + self.timing.min_tick_s)
            await asyncio.sleep(max(0.0, wake_at - loop.time()))
            woke = loop.time()
            due = n if step_s <= 0 else min(n, 1 + int((woke - first_token_at) / step_s + 1e-9))
            chunk = output[emitted:max(due, emitted + 1)]
            done = self._append(req, chunk)
            emitted += done
            if done < len(chunk):
                # The pool has no block left for this request: vLLM would preempt it and
                # recompute later; the simulation ends it here, as `EngineCore.append` does.
                await emit(chunk[:done], "length")
                break
            await emit(chunk, "length" if emitted == n else None)
        return emitted

    def _count(self, record: RequestRecord) -> None:
        stats = self.stats
        stats.records.append(record)
        if record.finish_reason == "abort":
            stats.aborted += 1
        else:
            stats.requests += 1
            stats.prompt_tokens += record.prompt_tokens
            stats.cached_tokens += record.cached_tokens
            stats.completion_tokens += record.completion_tokens

    def _check_length(self, prompt: array[int], max_tokens: int) -> None:
        if len(prompt) + max_tokens > self.max_model_len:
            raise RequestError(400, (
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                f"{max_tokens} in the completion)."))

    @contextlib.contextmanager
    def _tracked(self) -> Iterator[None]:
        """The calling task runs a request: `close()` aborts it."""
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            yield
        finally:
            self._inflight.discard(task)

    async def _complete(self, request_id: str, kind: Kind, prompt: array[int], max_tokens: int,
                        arrived_at: float, cache_salt: str | None
                        ) -> tuple[RequestRecord, list[int]]:
        """A request run to its end, nobody watching its tokens: its record and output."""
        tokens: list[int] = []

        async def collect(chunk: Sequence[int], _: str | None) -> None:
            tokens.extend(chunk)

        rec = await self._run(request_id, kind, False, prompt, max_tokens, arrived_at, collect,
                              cache_salt)
        return rec, tokens

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int,
                   cache_salt: str | None = None) -> tuple[RequestRecord, str]:
        """One chat request in process, queued, prefilled and decoded exactly as a
        non-streamed `POST /v1/chat/completions` (a driver without HTTP: `simulate`). Returns
        its record and the answer's text; raises `RequestError` for what the route answers
        400."""
        arrived_at = asyncio.get_running_loop().time()
        prompt = await self._render(parse_messages({"messages": list(messages)}))
        self._check_length(prompt, max_tokens)
        with self._tracked():
            rec, tokens = await self._complete("chatcmpl-" + uuid.uuid4().hex, "chat", prompt,
                                               max_tokens, arrived_at, cache_salt)
        return rec, self._text(tokens)

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
                "choices": [_choice(kind, self._text(tokens), rec.finish_reason, delta=False)],
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
        role = _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                           "logprobs": None, "finish_reason": None}]})
        pending = role if kind == "chat" else b""

        async def emit(tokens: Sequence[int], finish_reason: str | None) -> None:
            nonlocal pending
            text = self._text(tokens)
            out = pending + _sse({**head, "choices": [_choice(kind, text, finish_reason,
                                                               delta=True)]})
            pending = b""
            await resp.write(out)

        try:
            rec = await self._run(request_id, kind, True, prompt, max_tokens, arrived_at, emit,
                                  cache_salt)
            # The usage chunk OpenAI sends for `stream_options.include_usage`: always here.
            await resp.write(_sse({**head, "choices": [], "usage": usage(
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

    def _text(self, tokens: Sequence[int]) -> str:
        return str(self.engine.tokenizer.decode(list(tokens), skip_special_tokens=True))

    async def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        try:
            ids = await asyncio.to_thread(self.engine.tokenizer, text,
                                          add_special_tokens=add_special_tokens)
        except Exception as exc:  # e.g. a lone surrogate, which JSON allows and Rust refuses
            raise RequestError(400, f"prompt cannot be tokenized: {type(exc).__name__}") from None
        return list(ids["input_ids"])

    async def _render(self, messages: list[dict[str, str]]) -> array[int]:
        # Memoized: a router that renders every request on every engine before it forwards
        # (vllm-router's cache_aware and kv_aware, `/v1/chat/completions/render`) would
        # otherwise spend the simulated fleet's shared CPU on the same templating N times.
        key = json.dumps(messages, sort_keys=True)
        cached = self._rendered.get(key)
        if cached is not None:
            self._rendered.move_to_end(key)
            return cached
        try:
            ids = await asyncio.to_thread(render_chat, self.engine.tokenizer, messages)
        except Exception as exc:  # the template or the tokenizer raised (jinja's TemplateError..)
            raise RequestError(400, f"chat template failed: {type(exc).__name__}") from None
        self._rendered[key] = ids
        if len(self._rendered) > _RENDER_CACHE:
            self._rendered.popitem(last=False)
        return ids

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
        labels = f'{{engine="0",model_name="{_prom_label(self.model)}"}}'
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
