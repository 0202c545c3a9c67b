"""The service side of a simulated vLLM engine, without a socket: the service-time model, the
order in which requests run, and one request from its queueing to its last token.

Owns, for one `SimEngine` (`sim/server.py` puts vLLM's HTTP routes in front of it; `simulate`
drives it in process through `chat()`):

- `ServiceTiming`: how long a request takes. At most `engine.max_num_seqs` requests run at once,
  admitted in arrival order (arrival at the engine core, once the prompt is tokenized: vLLM's
  frontend also tokenizes before its scheduler sees a request); a request holds its blocks
  through its prefill (time grows with the prompt tokens not served from the prefix cache), then
  one decode step per further output token. TTFT follows from cache hits and queueing.
- `ServerStats`: the counters, and one `RequestRecord` per request for the benchmark.
- The chat template's renders, memoized (a router may ask every engine to render each request).

The engine's own `Timing` and `generate()` are not used: a served engine must not also be driven
by `generate()` (the two would not share their sequence slots). `DEMO_TIMING` is the pace the
demo and `simulate` share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from array import array
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from kv_listener.sim.engine import NoFreeBlocksError, RunningRequest, SimEngine, render_chat
from kv_listener.sim.lifecycle import AsyncLifecycle
from kv_listener.sim.openai_wire import Kind, RequestError, parse_messages

#: `max_tokens` when a request gives none (vLLM defaults to the rest of the context, which
#: would make a simulated request decode for minutes; OpenAI's legacy completions default is 16).
DEFAULT_MAX_TOKENS = 16
#: Chat renders memoized per server (recent bodies' messages -> prompt token IDs).
_RENDER_CACHE = 2048

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


#: The pace of the demo and of `simulate` (what the demo had with the engines' own Timing):
#: 5 ms per prefill step, 0.3 ms per uncached prompt token, 3 ms per output token, real time.
DEMO_TIMING = ServiceTiming(overhead_s=0.005, prefill_s_per_token=0.0003,
                            decode_s_per_token=0.003, time_scale=1.0)


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


class _Waiter:
    __slots__ = ("cache_salt", "future", "prompt")

    def __init__(self, prompt: array[int], future: asyncio.Future[RunningRequest],
                 cache_salt: str | None) -> None:
        self.prompt = prompt
        self.future = future
        self.cache_salt = cache_salt


class EngineService(AsyncLifecycle):
    """Requests of one simulated engine, queued, prefilled and decoded on the event loop's
    clock; no socket (`EngineServer` is this with vLLM's HTTP routes). `start()` starts the
    engine, `close()` aborts what still runs (its records say "abort") and closes the engine.

    `engine` an unstarted `SimEngine` (its `max_num_seqs` is the concurrency limit, its
    tokenizer tokenizes); `timing` the service-time model; `max_model_len` the context limit
    (default and maximum: the pool's tokens, so an admissible request always fits once the pool
    is idle); `default_max_tokens` when a request gives none.
    """

    def __init__(self, engine: SimEngine, *, timing: ServiceTiming | None = None,
                 max_model_len: int | None = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        pool_tokens = engine.core.pool.num_blocks * engine.core.block_size
        if max_model_len is not None and not 1 <= max_model_len <= pool_tokens:
            raise ValueError(f"max_model_len must be in 1..{pool_tokens} (the pool's tokens)")
        if default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        self.engine = engine
        self.timing = timing or ServiceTiming()
        self.max_model_len = max_model_len or pool_tokens
        self.default_max_tokens = default_max_tokens
        self.stats = ServerStats()
        self.num_running = 0
        self.generated_tokens = 0  # output tokens of every step, aborted requests' included
        self._vocab = len(engine.tokenizer)
        self._waiting: deque[_Waiter] = deque()
        self._watchers: list[asyncio.Future[None]] = []
        self._inflight: set[asyncio.Task[Any]] = set()
        self._rendered: OrderedDict[str, array[int]] = OrderedDict()
        self._started = False

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

    async def start(self) -> Self:
        await self.engine.start()
        self._started = True
        return self

    async def close(self) -> None:
        """Abort what still runs (its records say "abort"), close the engine."""
        await self._abort_running()
        await self._close_engine()

    async def _abort_running(self) -> None:
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    async def _close_engine(self) -> None:
        if self._started:
            self._started = False
            await self.engine.close()

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

    # --- tokenizer -------------------------------------------------------------------------

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
