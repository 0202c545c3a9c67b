"""Resolution of block chains into prefix keys, off the ingestion path (SPEC §2, §4).

Owns `ChainResolver`, one per source: it takes the tracker's `ResolveRequest`s (tokens of a
chain root..head), decodes them (engine `/detokenize` or local tokenizer), parses the chat
prompt and computes the prefix key with the request's model, then hands a `ResolveOutcome` back.

Delivery: outcomes go to the `on_outcome` callback given at construction, always called from a
resolver worker task (never from inside `submit`), so the caller never sees re-entrant calls.
To feed a tracker owned by another task, pass `queue.put_nowait` of an `asyncio.Queue` that the
owning task drains. After `close()` no outcome is delivered.

Bounds: at most `max_concurrency` decodes run at once; at most `max_backlog` requests, holding
at most `max_backlog_tokens` tokens, wait or run; at most the first `max_decode_tokens` tokens
of a chain are decoded (and kept in a queued request). A head already queued or
running is not queued again (one call per distinct chain head). When
the backlog is full a request is answered at once with `FAILED` / `backlog_full` (the tracker
keeps the chain pending and asks again when it grows): ingestion never waits for us.

Late template: a sidecar usually starts before its engine has loaded its model, so the engine's
`GET /tokenizer_info` (SPEC §2, third template source) is often unreachable at start. The resolver
then works with the built-in recognizers and asks again from `resolve()`, at most once every
`template_retry_s`, until it learns the template (swapped in for later resolutions) or gets a
final answer (disabled endpoint, not a vLLM). The resolution that starts a retry waits for it at
most the per-call timeout (so it already uses the template when the engine answers); the others
go on meanwhile. Known limit: chains resolved by the built-ins before that keep their key (a
template with a default system prompt makes them `S` keys of that default) until evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import structlog

from kv_listener.config import SourceConfig
from kv_listener.core.model import Engine, ResolveOutcome, ResolveRequest, ResolveStatus
from kv_listener.core.prefix import DEFAULT_MAX_PREFIX_LENGTH, prefix_key
from kv_listener.core.tracker import common_prefix_len
from kv_listener.resolver.detokenize import (
    DetokenizeError,
    DetokenizeErrorReason,
    Detokenizer,
    HttpDetokenizer,
    LocalDetokenizer,
    TokenizerInfoAnswer,
    TokenizerInfoStatus,
    endpoint_label,
    probe_tokenizer_info,
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
#: Tokens that queued and running requests may hold together (4 bytes each: 16 MiB). Beyond it
#: a request is answered `backlog_full` at once: a flood of chains whose `/detokenize` never
#: answers grew the listener by 246 MiB before this bound (issue #11).
DEFAULT_MAX_BACKLOG_TOKENS = 1 << 22
#: At most one `/tokenizer_info` request per this many seconds while the engine is unreachable:
#: an engine loading a large model takes minutes; asking more often only adds log lines.
DEFAULT_TEMPLATE_RETRY_S = 30.0
#: `counters` key: `/tokenizer_info` requests made after the one at start.
TEMPLATE_RETRIES = "template_retries"
#: `/detokenize` calls at most to find the deciding point when the engine's tokenization of the
#: deciding text is not a prefix of the chain's tokens (a merge across the cut spans a token or
#: two: more means the text did not come from these tokens).
_DECIDING_PROBES = 3
#: How long a request waits for an open circuit's trial before it is answered FAILED (the
#: tracker then asks again when its chain grows), and how often a waiting worker looks again.
DEFAULT_CIRCUIT_WAIT_S = 30.0
_CIRCUIT_POLL_S = 0.05


def _require_at_least_one(**counts: int) -> None:
    """`ValueError` naming the first of `counts` below 1."""
    for name, count in counts.items():
        if count < 1:
            raise ValueError(f"{name} must be >= 1")


class TemplateRetry:
    """The engine's `/tokenizer_info`, to be asked again: it was unreachable when last asked.

    `clock` gives monotonic seconds (injectable for tests). With a shared `session` the
    requests go through it; without one (or once its owner closed it) each attempt opens and
    closes its own, so nothing stays open between attempts that are `retry_s` apart.
    """

    __slots__ = ("_clock", "_session", "last_attempt_at", "retry_s", "timeout_s", "url")

    def __init__(self, url: str, *, retry_s: float = DEFAULT_TEMPLATE_RETRY_S,
                 timeout_s: float = 5.0, session: aiohttp.ClientSession | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 last_attempt_at: float | None = None) -> None:
        if retry_s <= 0:
            raise ValueError("retry_s must be > 0")
        self.url = url
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self._session = session
        self._clock = clock
        self.last_attempt_at = clock() if last_attempt_at is None else last_attempt_at

    def due(self) -> bool:
        return self._clock() - self.last_attempt_at >= self.retry_s

    async def fetch(self) -> TokenizerInfoAnswer:
        self.last_attempt_at = self._clock()
        if self._session is not None and not self._session.closed:
            return await probe_tokenizer_info(self._session, self.url, self.timeout_s)
        async with aiohttp.ClientSession() as http:
            return await probe_tokenizer_info(http, self.url, self.timeout_s)


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
        max_backlog_tokens: int = DEFAULT_MAX_BACKLOG_TOKENS,
        name: str = "source",
        local_tokenizer: Any = None,
        template_retry: TemplateRetry | None = None,
        circuit_wait_s: float = DEFAULT_CIRCUIT_WAIT_S,
    ) -> None:
        _require_at_least_one(max_concurrency=max_concurrency, max_decode_tokens=max_decode_tokens)
        self.detokenizer = detokenizer
        self.parser = parser
        self.max_prefix_length = max_prefix_length
        self.stats = stats
        self.max_concurrency = max_concurrency
        self.max_backlog = max_backlog
        self.max_decode_tokens = max_decode_tokens
        self.max_backlog_tokens = max_backlog_tokens
        self.circuit_wait_s = circuit_wait_s
        self.name = name
        self._on_outcome = on_outcome
        #: A local copy of the engine's tokenizer (the source's `tokenizer`), when there is one:
        #: used to find `key_tokens`, the shortest token prefix that already decides the key.
        self._local = local_tokenizer
        self._queue: asyncio.Queue[ResolveRequest] = asyncio.Queue()
        self._heads: dict[int, int] = {}  # queued or running -> its tokens
        self._held_tokens = 0  # tokens of the requests queued or running
        self._workers: list[asyncio.Task[None]] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        #: Set while the engine's template is still to be learned (see the module docstring).
        self._template_retry = template_retry
        self._template_task: asyncio.Task[None] | None = None
        #: The engine refused `/tokenize` (4xx): deciding points are not asked for any more.
        self._tokenize_refused = False
        #: Resolver-level counters (labels from fixed sets): outcomes by status and reason,
        #: `deduplicated`, `backlog_full`, `resolved_trimming_template`, `callback_errors`,
        #: `template_retries`.
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
        template_retry_s: float | None = DEFAULT_TEMPLATE_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> ChainResolver:
        """Decoder and template of `source` (SPEC §2 order). Loads the local tokenizer and
        learns the template in a worker thread. Raises `ValueError` when the source has
        neither a `detokenize_endpoint` nor a `tokenizer` (only salts can attribute it).

        When the engine's `/tokenizer_info` is the template's source and the engine is
        unreachable, the built-ins are used meanwhile and the request is made again at most
        every `template_retry_s` seconds of `clock` (None: never, the built-ins stay)."""
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
        info_status: TokenizerInfoStatus | None = None
        template_retry = None
        if (use_tokenizer_info and source.chat_template is None and tokenizer is None
                and source.engine is Engine.VLLM and source.detokenize_endpoint is not None):
            url = tokenizer_info_url(source.detokenize_endpoint)
            if session is not None:
                answer = await probe_tokenizer_info(session, url, timeout_s)
            else:
                async with aiohttp.ClientSession() as http:
                    answer = await probe_tokenizer_info(http, url, timeout_s)
            info, info_status = answer.info, answer.status
            if answer.status is TokenizerInfoStatus.UNREACHABLE and template_retry_s is not None:
                template_retry = TemplateRetry(url, retry_s=template_retry_s,
                                               timeout_s=timeout_s, session=session, clock=clock)
                log.warning("chat_template_fetch_deferred", backend=source.backend_name,
                            endpoint=endpoint_label(url), detail=answer.detail,
                            retry_s=template_retry_s)
        try:
            parser = await asyncio.to_thread(
                build_prompt_parser, chat_template=source.chat_template, tokenizer=tokenizer,
                tokenizer_info=info, name=source.backend_name)
        except (TemplateProbeError, OSError) as exc:
            log.error("chat_template_unusable", backend=source.backend_name,
                      error=type(exc).__name__, detail=str(exc))
            parser = PromptParser(None)
        log.info("resolver_ready", backend=source.backend_name, template=parser.source,
                 decoder="http" if isinstance(detokenizer, HttpDetokenizer) else "local",
                 tokenizer_info=info_status.value if info_status is not None else None)
        return cls(detokenizer=detokenizer, parser=parser, on_outcome=on_outcome,
                   max_prefix_length=max_prefix_length, stats=stats, local_tokenizer=tokenizer,
                   max_concurrency=max_concurrency, max_backlog=max_backlog,
                   max_decode_tokens=max_decode_tokens, name=source.backend_name,
                   template_retry=template_retry)

    # --- the API the source task uses ---------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests queued or running."""
        return len(self._heads)

    @property
    def held_tokens(self) -> int:
        """Tokens held by the requests queued or running (at most `max_backlog_tokens`)."""
        return self._held_tokens

    @property
    def template_pending(self) -> bool:
        """Is the engine's template still to be learned (retries continue)?"""
        return self._template_retry is not None

    def submit(self, req: ResolveRequest) -> None:
        """Queue `req` unless its head is already queued or running. Never blocks; must be
        called from the event loop's thread."""
        if self._closed:
            return
        if req.head in self._heads:
            self.counters["deduplicated"] += 1
            return
        if len(req.tokens) > self.max_decode_tokens + 1:
            # Only the first max_decode_tokens are ever decoded (one more keeps it "capped"): a
            # queued request holds no more than that (a 16k-token chain would hold 64 KiB).
            req = msgspec.structs.replace(req, tokens=req.tokens[: self.max_decode_tokens + 1])
        n = len(req.tokens)
        if len(self._heads) >= self.max_backlog + self.max_concurrency or \
                (self._heads and self._held_tokens + n > self.max_backlog_tokens):
            self.counters[BACKLOG_FULL] += 1
            outcome = ResolveOutcome(req.head, ResolveStatus.FAILED, reason=BACKLOG_FULL)
            asyncio.get_running_loop().call_soon(self._deliver, outcome)
            return
        self._start_workers()
        self._heads[req.head] = n
        self._held_tokens += n
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
        self._template_retry = None
        tasks = [*self._workers, *([self._template_task] if self._template_task else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers.clear()
        self._template_task = None
        self._heads.clear()
        self._held_tokens = 0
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
            self._held_tokens -= self._heads.pop(req.head, 0)
            if not self._heads:
                self._idle.set()
            self._deliver(outcome)
            # The callback may have queued more work that fails without any I/O (an open
            # circuit): never run back to back without letting the loop serve others.
            await asyncio.sleep(0)

    async def resolve(self, req: ResolveRequest) -> ResolveOutcome:
        """Decode, parse and key one chain (no de-duplication, no bound: `submit` adds those)."""
        if self._template_retry is not None and self._template_task is None \
                and self._template_retry.due():
            await self._retry_template(self._template_retry)
        if self.stats is not None:
            self.stats.detokenize_calls += 1
        capped = len(req.tokens) > self.max_decode_tokens
        tokens = req.tokens[: self.max_decode_tokens] if capped else req.tokens
        try:
            text = await self._detokenize(tokens)
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
        elif parsed.decided_at is not None and parsed.decided_at < len(text) and \
                isinstance(self.detokenizer, HttpDetokenizer):
            key_tokens = await self._deciding_tokens_remote(
                self.detokenizer, req.model, tokens, text[: parsed.decided_at], key)
        return ResolveOutcome(req.head, ResolveStatus.RESOLVED, key=key, key_tokens=key_tokens)

    async def _deciding_tokens_remote(self, http: HttpDetokenizer, model: str,
                                      tokens: array[int], deciding_text: str,
                                      key: bytes) -> int | None:
        """The fewest leading tokens that resolve to `key`, with the engine's tokenizer only
        (no local copy): the engine's `/tokenize` of the text the key depends on. When that is
        a prefix of the chain's tokens, its length is the deciding point (the text cut one
        token earlier lacks the end delimiter or the last content character the key needs).
        When the engine's tokenization of the cut text differs from the chain's at token c
        (BPE merges across the cut), tokens root..c do not decide, so the first of c+1, c+2,
        ... that does is the answer: at most `_DECIDING_PROBES` `/detokenize` calls. None on
        any doubt (the tracker then uses the whole request, as before: exact, coarser).

        Without it a chain is attributed only from the length it was resolved at, so an engine
        that frees tails first (vLLM under memory pressure) makes the key look evicted while the
        blocks that decide it are still cached (issue #10)."""
        if self._tokenize_refused:
            return None
        if self.stats is not None:
            self.stats.tokenize_calls += 1
        try:
            ids = await http.tokenize(deciding_text)
        except DetokenizeError as exc:
            self.counters[f"key_tokens_failed:{exc.reason.value}"] += 1
            if exc.reason is DetokenizeErrorReason.HTTP_4XX:
                # An engine without /tokenize (SGLang < 0.5.4, a proxy): do not ask again.
                self._tokenize_refused = True
                log.warning("tokenize_unavailable", backend=self.name, detail=exc.detail,
                            effect="chains are attributed from the length they were resolved "
                                   "at; a tail eviction can evict a key whose deciding blocks "
                                   "are still cached")
            return None
        got = array("I", ids)
        n = len(got)
        common = common_prefix_len(tokens, got)
        if 0 < n == common:
            self.counters["key_tokens:tokenized"] += 1
            return n
        for m in range(common + 1, min(common + 1 + _DECIDING_PROBES, len(tokens) + 1)):
            if self.stats is not None:
                self.stats.detokenize_calls += 1
            try:
                text = await http.detokenize(tokens[:m])
            except DetokenizeError:
                break
            parsed = self.parser.parse_prompt(text, self.max_prefix_length)
            if parsed.status is ResolveStatus.RESOLVED and prefix_key(
                    model, parsed.system_text, parsed.first_text, self.max_prefix_length) == key:
                self.counters["key_tokens:probed"] += 1
                return m
        self.counters["key_tokens:unknown"] += 1
        return None

    async def _detokenize(self, tokens: array[int]) -> str:
        """Decode; while the endpoint's circuit is open, wait for its trial (at most
        `circuit_wait_s`) instead of failing at once: an engine restart or a `/detokenize`
        outage then costs one trial per cooldown, not a stream of instant failures, and the
        waiting chains resolve as soon as the endpoint is back."""
        http = self.detokenizer if isinstance(self.detokenizer, HttpDetokenizer) else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.circuit_wait_s
        while True:
            try:
                return await self.detokenizer.detokenize(tokens)
            except DetokenizeError as exc:
                left = deadline - loop.time()
                if http is None or exc.reason is not DetokenizeErrorReason.CIRCUIT_OPEN or left <= 0:
                    raise
                self.counters["circuit_waits"] += 1
                # A designed wait for the breaker's cooldown (no event marks its end); polled at
                # most every 50 ms while another worker's trial is out.
                await asyncio.sleep(min(max(http.breaker.retry_in_s(), _CIRCUIT_POLL_S), left))

    async def _retry_template(self, retry: TemplateRetry) -> None:
        """Ask `/tokenizer_info` again in a task of its own; wait for it at most the per-call
        timeout (a slow template learning then finishes in the background)."""
        self.counters[TEMPLATE_RETRIES] += 1
        task = asyncio.create_task(self._learn_late(retry), name=f"template-{self.name}")
        self._template_task = task
        await asyncio.wait({task}, timeout=retry.timeout_s)

    async def _learn_late(self, retry: TemplateRetry) -> None:
        try:
            answer = await retry.fetch()
            if answer.status is TokenizerInfoStatus.UNREACHABLE:
                log.debug("chat_template_retry_failed", backend=self.name,
                          detail=answer.detail, retries=self.counters[TEMPLATE_RETRIES])
                return
            self._template_retry = None  # any other answer is final
            if answer.status is TokenizerInfoStatus.ABSENT:
                log.warning("chat_template_fetch_final", backend=self.name,
                            endpoint=endpoint_label(retry.url), detail=answer.detail)
                return
            try:
                parser = await asyncio.to_thread(build_prompt_parser,
                                                 tokenizer_info=answer.info, name=self.name)
            except TemplateProbeError as exc:
                log.error("chat_template_unusable", backend=self.name,
                          error=type(exc).__name__, detail=str(exc))
                return
            if parser.layout is None:  # the engine answered, with no chat template in it
                log.warning("chat_template_fetch_final", backend=self.name,
                            endpoint=endpoint_label(retry.url), detail="no chat_template")
                return
            if not self._closed:
                self.parser = parser
                log.info("chat_template_learned_late", backend=self.name,
                         template=parser.source, retries=self.counters[TEMPLATE_RETRIES])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: log it, and let the next resolution try again
            log.error("chat_template_retry_error", backend=self.name, error=type(exc).__name__)
        finally:
            self._template_task = None

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
