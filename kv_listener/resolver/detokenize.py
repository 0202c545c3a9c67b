"""Token IDs -> text: the engine's `/detokenize` over HTTP, or a local tokenizer.

Owns: the two wire shapes (vLLM 0.9-0.33 `POST /detokenize` `{"model", "tokens"}` ->
`{"prompt"}`; SGLang >= 0.5.4 `POST /detokenize` `{"model", "tokens", "skip_special_tokens"}` ->
`{"text"}`, asked with `skip_special_tokens: false` because its default drops the role markers
the template parser needs; see wire-formats §2.7 and §3.4), per-call timeouts, retries with
exponential backoff (the shared `kv_listener.backoff.Backoff`), a circuit breaker per endpoint,
and typed errors whose reason is a metric label. The local path decodes with
`skip_special_tokens=False` in a worker thread, so the event loop never blocks on a tokenizer.
Also vLLM's `GET /tokenizer_info`, with its answer classified as found, absent (final) or
unreachable (transient: ask again later).

Never logs token IDs or decoded text: only the endpoint (scheme, host, port), reasons and counts.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import structlog

from kv_listener.backoff import Backoff
from kv_listener.core.model import Engine
from kv_listener.resolver.probe import load_tokenizer

log = structlog.get_logger(__name__)

#: A 16384-token chain decodes to well under 1 MiB of text; anything much larger is not an
#: answer to our request.
MAX_RESPONSE_BYTES = 8 * 1024 * 1024


class DetokenizeErrorReason(enum.StrEnum):
    """Why a detokenize call failed. Values are metric labels (`detokenize_errors{reason}`)."""

    TIMEOUT = "timeout"
    CONNECT = "connect_error"
    HTTP_4XX = "http_4xx"  # our request was refused (unknown model, token out of range ...)
    HTTP_5XX = "http_5xx"  # includes 429: the engine is overloaded
    BAD_RESPONSE = "bad_response"  # not JSON, wrong shape, too large, redirect
    CIRCUIT_OPEN = "circuit_open"  # not called: the endpoint failed too often recently
    BAD_TOKENS = "bad_tokens"  # local tokenizer: a token ID outside its vocabulary
    LOCAL_ERROR = "local_error"  # local tokenizer raised


class DetokenizeError(Exception):
    def __init__(self, reason: DetokenizeErrorReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


#: Failures that say "the endpoint is unhealthy" (retried, and counted by the breaker). A 4xx
#: says "this request is wrong": retrying it or opening the circuit would not help.
_RETRIABLE = frozenset({DetokenizeErrorReason.TIMEOUT, DetokenizeErrorReason.CONNECT,
                        DetokenizeErrorReason.HTTP_5XX, DetokenizeErrorReason.BAD_RESPONSE})


class Detokenizer(Protocol):
    async def detokenize(self, tokens: array[int]) -> str: ...

    async def close(self) -> None: ...


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker: after `failure_threshold` failures in a row it opens for
    `cooldown_s`; then one trial call is let through (half-open): success closes it, failure
    opens it again. `clock` is injectable (monotonic seconds)."""

    def __init__(self, failure_threshold: int = 5, cooldown_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False
        self.opened_count = 0

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def retry_in_s(self) -> float:
        """Seconds until an open circuit lets a trial through (0 when closed or half-open)."""
        if self._opened_at is None:
            return 0.0
        return max(0.0, self.cooldown_s - (self._clock() - self._opened_at))

    def allow(self) -> bool:
        """May a call go out now? In half-open state only one trial at a time."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._trial_in_flight = False

    def record_failure(self) -> bool:
        """Count a failure; True when this failure opened (or re-opened) the circuit."""
        self._failures += 1
        was_trial = self._trial_in_flight
        self._trial_in_flight = False
        if was_trial or (self._opened_at is None and self._failures >= self.failure_threshold):
            self._opened_at = self._clock()
            self.opened_count += 1
            return True
        return False

    def release(self) -> None:
        """A trial ended without a verdict on the endpoint (e.g. a 4xx): let another try."""
        self._trial_in_flight = False


def detokenize_payload(engine: Engine, model: str | None, tokens: array[int]) -> dict[str, Any]:
    body: dict[str, Any] = {"tokens": tokens.tolist()}
    if model is not None:
        body["model"] = model
    if engine is Engine.SGLANG:
        # SGLang's DetokenizeRequest defaults to skip_special_tokens=true (0.5.23).
        body["skip_special_tokens"] = False
    return body


def parse_detokenize_response(engine: Engine, body: Any) -> str:
    """`{"prompt": str}` (vLLM) or `{"text": str | [str]}` (SGLang) -> text. Either key is
    accepted from either engine (proxies in front of engines mix them); raises
    `DetokenizeError(BAD_RESPONSE)` otherwise."""
    if isinstance(body, Mapping):
        keys = ("text", "prompt") if engine is Engine.SGLANG else ("prompt", "text")
        for key in keys:
            value = body.get(key)
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            if isinstance(value, str):
                return value
    raise DetokenizeError(DetokenizeErrorReason.BAD_RESPONSE, "no prompt/text string in answer")


def endpoint_label(url: str) -> str:
    """scheme://host:port of a URL, without credentials, path or query: safe to log."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, "", "", ""))


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of `resp`, or `DetokenizeError(BAD_RESPONSE)` beyond `limit` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        raise DetokenizeError(DetokenizeErrorReason.BAD_RESPONSE, "answer too large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(65536):
        size += len(chunk)
        if size > limit:
            raise DetokenizeError(DetokenizeErrorReason.BAD_RESPONSE, "answer too large")
        chunks.append(chunk)
    return b"".join(chunks)


class HttpDetokenizer:
    """`POST` to an engine's `/detokenize` with timeouts, retries and a circuit breaker.

    `url` is the full endpoint (e.g. `http://127.0.0.1:8000/detokenize`). A `session` may be
    shared (it is then not closed here); otherwise one is created on first use.
    """

    def __init__(
        self,
        url: str,
        engine: Engine,
        model: str | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 5.0,
        retries: int = 2,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 2.0,
        breaker: CircuitBreaker | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        if engine is Engine.TRTLLM:
            raise ValueError("trtllm-serve has no /detokenize endpoint")
        self.url = url
        self.engine = engine
        self.model = model
        self.timeout_s = timeout_s
        self.retries = max(0, retries)
        Backoff(backoff_initial_s, backoff_max_s)  # bad delays fail here, not at a first retry
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.max_response_bytes = max_response_bytes
        self._session = session
        self._own_session = session is None
        self.attempts = 0  # HTTP requests sent, retries included
        self.tokenize_url = sibling_url(url, "tokenize")
        self._label = endpoint_label(url)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._own_session = True
        return self._session

    async def detokenize(self, tokens: array[int]) -> str:
        body = await self._call(self.url, detokenize_payload(self.engine, self.model, tokens))
        return parse_detokenize_response(self.engine, body)

    async def tokenize(self, text: str) -> list[int]:
        """The engine's own token IDs for `text` (`POST /tokenize` beside `/detokenize`, vLLM
        0.9+ and SGLang 0.5.4+ `{"prompt", "add_special_tokens"}` -> `{"tokens"}`). Special
        tokens written in the text (a template's BOS and role markers) are parsed as such;
        none is added. Same timeouts, retries and breaker as `detokenize`."""
        payload: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        if self.model is not None:
            payload["model"] = self.model
        body = await self._call(self.tokenize_url, payload)
        tokens = body.get("tokens") if isinstance(body, Mapping) else None
        if isinstance(tokens, list) and len(tokens) == 1 and isinstance(tokens[0], list):
            tokens = tokens[0]  # SGLang answers a batch shape for a list prompt
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise DetokenizeError(DetokenizeErrorReason.BAD_RESPONSE, "no token list in answer")
        return tokens

    async def _call(self, url: str, payload: dict[str, Any]) -> Any:
        """POST `payload` to `url` with retries (retriable failures only) behind the breaker;
        the parsed JSON answer."""
        backoff: Backoff | None = None  # made at the first retry: most calls never need one
        while True:
            if not self.breaker.allow():
                raise DetokenizeError(DetokenizeErrorReason.CIRCUIT_OPEN)
            try:
                body = await self._attempt(url, payload)
            except DetokenizeError as exc:
                if exc.reason not in _RETRIABLE:
                    self.breaker.release()
                    raise
                if self.breaker.record_failure():
                    log.warning("detokenize_circuit_open", endpoint=self._label,
                                reason=exc.reason.value, cooldown_s=self.breaker.cooldown_s)
                if backoff is None:
                    backoff = Backoff(self.backoff_initial_s, self.backoff_max_s)
                if backoff.failures >= self.retries or \
                        self.breaker.state is not BreakerState.CLOSED:
                    raise
                # A designed pause between attempts (nothing to await instead).
                await asyncio.sleep(backoff.next_delay())
                continue
            if self.breaker.state is not BreakerState.CLOSED:
                log.info("detokenize_circuit_closed", endpoint=self._label)
            self.breaker.record_success()
            return body

    async def _attempt(self, url: str, payload: dict[str, Any]) -> Any:
        self.attempts += 1
        session = self._get_session()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.post(url, json=payload, timeout=timeout,
                                    allow_redirects=False) as resp:
                status = resp.status
                if status >= 500 or status == 429:
                    raise DetokenizeError(DetokenizeErrorReason.HTTP_5XX, f"status {status}")
                if status >= 400:
                    raise DetokenizeError(DetokenizeErrorReason.HTTP_4XX, f"status {status}")
                if status != 200:
                    raise DetokenizeError(DetokenizeErrorReason.BAD_RESPONSE, f"status {status}")
                raw = await read_capped(resp, self.max_response_bytes)
        except DetokenizeError:
            raise
        except TimeoutError:
            raise DetokenizeError(DetokenizeErrorReason.TIMEOUT) from None
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise DetokenizeError(DetokenizeErrorReason.CONNECT, type(exc).__name__) from None
        except aiohttp.ClientError as exc:
            raise DetokenizeError(DetokenizeErrorReason.BAD_RESPONSE,
                                  type(exc).__name__) from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise DetokenizeError(DetokenizeErrorReason.BAD_RESPONSE, "not JSON") from None

    async def close(self) -> None:
        if self._own_session and self._session is not None and not self._session.closed:
            await self._session.close()


class LocalDetokenizer:
    """Decode with a local `transformers` tokenizer (a directory, or an already loaded one),
    keeping special tokens, in a worker thread."""

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self._vocab_size = len(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if ids and max(ids) >= self._vocab_size:
            raise DetokenizeError(DetokenizeErrorReason.BAD_TOKENS, "token id out of vocabulary")
        try:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        except Exception as exc:  # tokenizer backends raise anything
            raise DetokenizeError(DetokenizeErrorReason.LOCAL_ERROR,
                                  type(exc).__name__) from None
        if not isinstance(text, str):
            raise DetokenizeError(DetokenizeErrorReason.LOCAL_ERROR, "decode returned no text")
        return text

    async def detokenize(self, tokens: array[int]) -> str:
        return await asyncio.to_thread(self._decode, tokens.tolist())

    async def close(self) -> None:
        return None


def sibling_url(detokenize_url: str, name: str) -> str:
    """The engine route `name` next to its `/detokenize` (`/tokenize`, `/tokenizer_info`,
    `/health`): vLLM and SGLang serve them all at the same level."""
    parts = urlsplit(detokenize_url)
    path = parts.path
    path = path[: -len("/detokenize")] if path.endswith("/detokenize") else path.rstrip("/")
    return urlunsplit((parts.scheme, parts.netloc, f"{path}/{name}", "", ""))


def tokenizer_info_url(detokenize_url: str) -> str:
    """vLLM serves `/tokenizer_info` next to `/detokenize` (only with
    `--enable-tokenizer-info-endpoint`)."""
    return sibling_url(detokenize_url, "tokenizer_info")


class TokenizerInfoStatus(enum.StrEnum):
    """What a `/tokenizer_info` request said. Values are log and metric labels."""

    FOUND = "found"  # a JSON object (with or without a chat_template)
    #: Final: the endpoint is disabled (404, vLLM without `--enable-tokenizer-info-endpoint`),
    #: refused (another 4xx), or the server is not a vLLM (not JSON, not an object, a redirect,
    #: too large). Asking again would get the same answer.
    ABSENT = "absent"
    #: Transient: connection refused or reset, timeout, 5xx or 429. An engine that is still
    #: loading its model (a sidecar usually starts first) or restarting answers like this.
    UNREACHABLE = "unreachable"


@dataclass(frozen=True, slots=True)
class TokenizerInfoAnswer:
    status: TokenizerInfoStatus
    info: dict[str, Any] | None = None  # set when FOUND
    detail: str = ""  # a status code or an exception class name: safe to log


async def probe_tokenizer_info(session: aiohttp.ClientSession, url: str,
                               timeout_s: float = 5.0) -> TokenizerInfoAnswer:
    """GET vLLM's `/tokenizer_info` (tokenizer config: `chat_template`, special tokens) and
    classify the answer: FOUND with the JSON object, ABSENT (final) or UNREACHABLE (worth
    asking again later). Never raises for a network or protocol failure."""
    absent, unreachable = TokenizerInfoStatus.ABSENT, TokenizerInfoStatus.UNREACHABLE
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                               allow_redirects=False) as resp:
            status = resp.status
            if status >= 500 or status == 429:
                return TokenizerInfoAnswer(unreachable, detail=f"status {status}")
            if status != 200:
                return TokenizerInfoAnswer(absent, detail=f"status {status}")
            raw = await read_capped(resp, MAX_RESPONSE_BYTES)
    except DetokenizeError:
        return TokenizerInfoAnswer(absent, detail="answer too large")
    except TimeoutError:
        return TokenizerInfoAnswer(unreachable, detail="timeout")
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
        # Includes a server that closed the connection mid-answer (a restarting engine).
        return TokenizerInfoAnswer(unreachable, detail=type(exc).__name__)
    except aiohttp.ClientError as exc:  # invalid URL and the like: asking again will not help
        return TokenizerInfoAnswer(absent, detail=type(exc).__name__)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return TokenizerInfoAnswer(absent, detail="not JSON")
    if not isinstance(body, dict):
        return TokenizerInfoAnswer(absent, detail="not a JSON object")
    return TokenizerInfoAnswer(TokenizerInfoStatus.FOUND, info=body)


async def fetch_tokenizer_info(session: aiohttp.ClientSession, url: str,
                               timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The `/tokenizer_info` JSON object, or None whatever the reason (see
    `probe_tokenizer_info` to tell a disabled endpoint from an unreachable engine)."""
    return (await probe_tokenizer_info(session, url, timeout_s)).info
