"""Resolution of block chains into prefix keys, off the ingestion path (SPEC §2, §4).

Owns `ChainResolver`, one per source: it takes the tracker's `ResolveRequest`s (tokens of a
chain root..head), decodes them (engine `/detokenize` or local tokenizer), parses the chat
prompt and computes the prefix key with the request's model, then hands a `ResolveOutcome` back.

Delivery: outcomes go to the `on_outcome` callback given at construction, always called from a
resolver worker task (never from inside `submit`), so the caller never sees re-entrant calls.
To feed a tracker owned by another task, pass `queue.put_nowait` of an `asyncio.Queue` that the
owning task drains. After `close()` no outcome is delivered.

Bounds: at most `max_concurrency` decodes run at once; at most `max_backlog` requests wait; at
most the first `max_decode_tokens` tokens of a chain are decoded. A head already queued or
running is not queued again (one call per distinct chain head). When
the backlog is full a request is answered at once with `FAILED` / `backlog_full` (the tracker
keeps the chain pending and asks again when it grows): ingestion never waits for us.
"""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import structlog

from kv_listener.config import SourceConfig
from kv_listener.core.model import Engine, ResolveOutcome, ResolveRequest, ResolveStatus
from kv_listener.core.prefix import DEFAULT_MAX_PREFIX_LENGTH, prefix_key
from kv_listener.resolver.detokenize import (
    DetokenizeError,
    Detokenizer,
    HttpDetokenizer,
    LocalDetokenizer,
    fetch_tokenizer_info,
    tokenizer_info_url,
)
from kv_listener.resolver.template import (
    NoKeyReason,
    PromptParser,
    TemplateProbeError,
    build_prompt_parser,
    load_tokenizer,
)
from kv_listener.stats import SourceStats

log = structlog.get_logger(__name__)

OutcomeCallback = Callable[[ResolveOutcome], None]

#: `ResolveOutcome.reason` of a request refused because the backlog is full.
BACKLOG_FULL = "backlog_full"
#: `ResolveOutcome.reason` of an unexpected error inside the resolver (a bug, logged).
INTERNAL_ERROR = "internal_error"
#: `ResolveOutcome.reason` (UNATTRIBUTED) of a chain still pending after `max_decode_tokens`
#: tokens: more tokens are never decoded, so it can never resolve.
BEYOND_DECODE_LIMIT = "beyond_decode_limit"
#: The key depends on the first `max_prefix_length` bytes of the system prompt or first message
#: only. Decoding the first 4096 tokens covers a template's header, a default system prompt and
#: 1024 content bytes many times over (a token decodes to at least one byte), and keeps a vLLM
#: event that stores a whole 16k-token prompt at once from costing a 16k-token decode.
DEFAULT_MAX_DECODE_TOKENS = 4096


class ChainResolver:
    """Bounded, de-duplicated, non-blocking chain resolution for one source."""

    def __init__(
        self,
        *,
        detokenizer: Detokenizer,
        parser: PromptParser,
        on_outcome: OutcomeCallback,
        max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH,
        stats: SourceStats | None = None,
        max_concurrency: int = 4,
        max_backlog: int = 10000,
        max_decode_tokens: int = DEFAULT_MAX_DECODE_TOKENS,
        name: str = "source",
        local_tokenizer: Any = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if max_decode_tokens < 1:
            raise ValueError("max_decode_tokens must be >= 1")
        self.detokenizer = detokenizer
        self.parser = parser
        self.max_prefix_length = max_prefix_length
        self.stats = stats
        self.max_concurrency = max_concurrency
        self.max_backlog = max_backlog
        self.max_decode_tokens = max_decode_tokens
        self.name = name
        self._on_outcome = on_outcome
        #: A local copy of the engine's tokenizer (the source's `tokenizer`), when there is one:
        #: used to find `key_tokens`, the shortest token prefix that already decides the key.
        self._local = local_tokenizer
        self._queue: asyncio.Queue[ResolveRequest] = asyncio.Queue()
        self._heads: set[int] = set()  # queued or running
        self._workers: list[asyncio.Task[None]] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        #: Resolver-level counters (labels from fixed sets): outcomes by status and reason,
        #: `deduplicated`, `backlog_full`, `resolved_trimming_template`, `callback_errors`.
        self.counters: Counter[str] = Counter()

    # --- construction from a source's config --------------------------------------------------

    @classmethod
    async def for_source(
        cls,
        source: SourceConfig,
        *,
        on_outcome: OutcomeCallback,
        max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH,
        stats: SourceStats | None = None,
        session: aiohttp.ClientSession | None = None,
        use_tokenizer_info: bool = True,
        timeout_s: float = 5.0,
        retries: int = 2,
        max_concurrency: int = 4,
        max_backlog: int = 10000,
        max_decode_tokens: int = DEFAULT_MAX_DECODE_TOKENS,
    ) -> ChainResolver:
        """Decoder and template of `source` (SPEC §2 order). Loads the local tokenizer and
        learns the template in a worker thread. Raises `ValueError` when the source has
        neither a `detokenize_endpoint` nor a `tokenizer` (only salts can attribute it)."""
        tokenizer: Any = None
        if source.tokenizer is not None:
            tokenizer = await asyncio.to_thread(load_tokenizer, source.tokenizer)
        detokenizer: Detokenizer
        if source.detokenize_endpoint is not None and source.engine is not Engine.TRTLLM:
            # No "model" in the body: both engines default to the served base model, and the
            # config's `model` is the router-facing name, which may be an alias the engine
            # does not know (vLLM answers 404 for an unknown model name).
            detokenizer = HttpDetokenizer(source.detokenize_endpoint, source.engine,
                                          model=None, session=session,
                                          timeout_s=timeout_s, retries=retries)
        elif tokenizer is not None:
            detokenizer = LocalDetokenizer(tokenizer)
        else:
            raise ValueError(f"{source.backend_name}: no detokenize_endpoint and no tokenizer")
        info = None
        if (use_tokenizer_info and source.chat_template is None and tokenizer is None
                and source.engine is Engine.VLLM and source.detokenize_endpoint is not None):
            own = session is None
            http = session if session is not None else aiohttp.ClientSession()
            try:
                info = await fetch_tokenizer_info(
                    http, tokenizer_info_url(source.detokenize_endpoint), timeout_s)
            finally:
                if own:
                    await http.close()
        try:
            parser = await asyncio.to_thread(
                build_prompt_parser, chat_template=source.chat_template, tokenizer=tokenizer,
                tokenizer_info=info, name=source.backend_name)
        except (TemplateProbeError, OSError) as exc:
            log.error("chat_template_unusable", backend=source.backend_name,
                      error=type(exc).__name__, detail=str(exc))
            parser = PromptParser(None)
        log.info("resolver_ready", backend=source.backend_name, template=parser.source,
                 decoder="http" if isinstance(detokenizer, HttpDetokenizer) else "local")
        return cls(detokenizer=detokenizer, parser=parser, on_outcome=on_outcome,
                   max_prefix_length=max_prefix_length, stats=stats, local_tokenizer=tokenizer,
                   max_concurrency=max_concurrency, max_backlog=max_backlog,
                   max_decode_tokens=max_decode_tokens, name=source.backend_name)

    # --- the API the source task uses ---------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests queued or running."""
        return len(self._heads)

    def submit(self, req: ResolveRequest) -> None:
        """Queue `req` unless its head is already queued or running. Never blocks; must be
        called from the event loop's thread."""
        if self._closed:
            return
        if req.head in self._heads:
            self.counters["deduplicated"] += 1
            return
        if len(self._heads) >= self.max_backlog + self.max_concurrency:
            self.counters[BACKLOG_FULL] += 1
            outcome = ResolveOutcome(req.head, ResolveStatus.FAILED, reason=BACKLOG_FULL)
            asyncio.get_running_loop().call_soon(self._deliver, outcome)
            return
        self._start_workers()
        self._heads.add(req.head)
        self._idle.clear()
        self._queue.put_nowait(req)

    async def wait_idle(self) -> None:
        """Wait until nothing is queued or running (tests, orderly shutdown)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Stop the workers, drop what is queued, close the decoder. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers.clear()
        self._heads.clear()
        self._idle.set()
        await self.detokenizer.close()

    # --- internals ----------------------------------------------------------------------------

    def _start_workers(self) -> None:
        if self._workers:
            return
        for i in range(self.max_concurrency):
            self._workers.append(asyncio.create_task(self._worker(), name=f"resolver-{self.name}-{i}"))

    async def _worker(self) -> None:
        while True:
            req = await self._queue.get()
            try:
                outcome = await self.resolve(req)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not kill the worker
                log.error("resolver_internal_error", backend=self.name, error=type(exc).__name__)
                outcome = ResolveOutcome(req.head, ResolveStatus.FAILED, reason=INTERNAL_ERROR)
            self._heads.discard(req.head)
            if not self._heads:
                self._idle.set()
            self._deliver(outcome)

    async def resolve(self, req: ResolveRequest) -> ResolveOutcome:
        """Decode, parse and key one chain (no de-duplication, no bound: `submit` adds those)."""
        if self.stats is not None:
            self.stats.detokenize_calls += 1
        capped = len(req.tokens) > self.max_decode_tokens
        tokens = req.tokens[: self.max_decode_tokens] if capped else req.tokens
        try:
            text = await self.detokenizer.detokenize(tokens)
        except DetokenizeError as exc:
            reason = exc.reason.value
            if self.stats is not None:
                self.stats.detokenize_errors[reason] += 1
            self.counters[f"failed:{reason}"] += 1
            if self.counters[f"failed:{reason}"] in (1, 10, 100) or \
                    self.counters[f"failed:{reason}"] % 1000 == 0:
                log.warning("detokenize_failed", backend=self.name, reason=reason,
                            count=self.counters[f"failed:{reason}"])
            return ResolveOutcome(req.head, ResolveStatus.FAILED, reason=reason)
        parsed = self.parser.parse_prompt(text, self.max_prefix_length)
        if parsed.status is ResolveStatus.PENDING and capped:
            self.counters[f"unattributed:{BEYOND_DECODE_LIMIT}"] += 1
            return ResolveOutcome(req.head, ResolveStatus.UNATTRIBUTED,
                                  reason=BEYOND_DECODE_LIMIT)
        if parsed.status is not ResolveStatus.RESOLVED:
            self.counters[f"{parsed.status.value}:{parsed.reason}" if parsed.reason
                          else parsed.status.value] += 1
            return ResolveOutcome(req.head, parsed.status, reason=parsed.reason)
        key = prefix_key(req.model, parsed.system_text, parsed.first_text, self.max_prefix_length)
        if key is None:
            self.counters[f"unattributed:{NoKeyReason.NO_TEXT.value}"] += 1
            return ResolveOutcome(req.head, ResolveStatus.UNATTRIBUTED,
                                  reason=NoKeyReason.NO_TEXT.value)
        self.counters["resolved:S" if parsed.system_text else "resolved:M"] += 1
        if self.parser.trims_content(parsed):
            self.counters["resolved_trimming_template"] += 1
        key_tokens = None
        if self._local is not None:
            key_tokens = await asyncio.to_thread(self._deciding_tokens, req.model, tokens, key)
        return ResolveOutcome(req.head, ResolveStatus.RESOLVED, key=key, key_tokens=key_tokens)

    def _deciding_tokens(self, model: str, tokens: array[int], key: bytes) -> int | None:
        """The fewest leading tokens that resolve to `key`, by bisection with the local
        tokenizer (a prefix that resolves keeps resolving to the same key as it grows: the
        content is complete, or `max_prefix_length` bytes of it are there). Costs about
        log2(len) local decodes, no engine call; it saves a request for every later chain
        that shares those tokens (many users behind one system prompt). None on any doubt."""
        ids = tokens.tolist()

        def decides(n: int) -> bool:
            try:
                text = self._local.decode(ids[:n], skip_special_tokens=False)
            except Exception:  # tokenizer backends raise anything: no hint then
                return False
            parsed = self.parser.parse_prompt(text, self.max_prefix_length)
            return parsed.status is ResolveStatus.RESOLVED and prefix_key(
                model, parsed.system_text, parsed.first_text, self.max_prefix_length) == key

        if not decides(len(ids)):
            return None
        lo, hi = 0, len(ids)  # decides(hi) is true; decides(lo) taken as false
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if decides(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def _deliver(self, outcome: ResolveOutcome) -> None:
        if self._closed:
            return
        try:
            self._on_outcome(outcome)
        except Exception as exc:  # the consumer's bug must not kill a worker
            self.counters["callback_errors"] += 1
            log.error("resolver_callback_error", backend=self.name, error=type(exc).__name__)
