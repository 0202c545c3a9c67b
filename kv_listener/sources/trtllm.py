"""TRT-LLM source: polls `trtllm-serve`'s `POST /kv_cache_events` (SPEC §5, wire-formats §4).

**The endpoint is drain-on-read**: each call removes the events it returns from the server's
queue (`tensorrt_llm/serve/openai_server.py`, `get_kv_cache_events`). The listener must therefore
be the *only* poller of a given `trtllm-serve`; a second poller (another listener, a debugging
`curl`) silently takes events away, which this source then sees as `event_id` gaps and answers
by clearing the backend's state.

Owns the HTTP polling (aiohttp), peer checks, backoff, and turning each poll's records into queue
items (`core.sequence.TrtllmEventStream` does the pure part):

- `EventBatch` (`seq=None`, `dp_rank` from `attention_dp_rank`) per run of records of one rank;
- `SourceCleared(engine_cleared)` before a `created` event (the KV cache was rebuilt, e.g. a
  server restart), `SourceCleared(gap)` before the first event after an `event_id` gap;
- duplicates (`event_id` at or below the last applied, per rank) and events of attention windows
  smaller than the largest (VSWA models) are dropped and counted.

Safety: redirects are refused (a 3xx is an error), the URL host must be in `allowed_publishers`
(checked at construction) and so must every address a host name resolves to when a connection
is opened (`AllowListResolver`; the list's own names are re-resolved when stale). Non-200
answers, timeouts, connection errors, oversized and invalid bodies are counted in
`poll_errors{reason}` and back off exponentially (from `poll_interval` doubling up to
`max_backoff_s`); a successful poll resets the delay, sets `stats.ready` and `stats.last_ok_at`
(monotonic). `is_ready()` is the readiness rule: the last poll succeeded and
polling is on schedule (a success within the last three intervals, or a request in flight that
started within them).
"""

from __future__ import annotations

import asyncio
import enum
import os
import socket
import time
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import structlog
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from kv_listener.backoff import Backoff
from kv_listener.config import SourceConfig, host_allowed
from kv_listener.core.decode import DecodeError, decode_trtllm_events
from kv_listener.core.model import Engine, SourceItem
from kv_listener.core.sequence import TrtllmEventStream
from kv_listener.sources.common import PublisherAllowList, QueueFeeder
from kv_listener.stats import SourceStats

log = structlog.get_logger(__name__)


class PollErrorReason(enum.StrEnum):
    """Why a poll failed. Values are metric labels (`poll_errors{reason}`)."""

    HTTP_STATUS = "http_status"  # any status other than 200 and 3xx
    REDIRECT = "redirect"  # 3xx: redirects are refused
    TIMEOUT = "timeout"
    CONNECTION = "connection"  # refused, reset, DNS failure, broken response
    INVALID_BODY = "invalid_body"  # not JSON, or not a JSON list
    BODY_TOO_LARGE = "body_too_large"
    PEER_NOT_ALLOWED = "peer_not_allowed"  # the answering address is not in allowed_publishers


def poll_backoff(interval_s: float, max_s: float) -> Backoff:
    """The delays after 1, 2, 3... consecutive failed polls: twice the poll interval, doubling
    up to `max_s` (the interval itself once a poll succeeds); no jitter: one poller per server."""
    return Backoff(min(2 * interval_s, max_s), max_s)


def backoff_delay(interval_s: float, failures: int, max_s: float) -> float:
    """Delay before the next poll after `failures` consecutive failures (0: the interval)."""
    if failures <= 0:
        return interval_s
    backoff = poll_backoff(interval_s, max_s)
    # Past 62 doublings every delay is the cap: no need to step further.
    for _ in range(min(failures, 62) - 1):
        backoff.next_delay()
    return backoff.next_delay()


class _PollError(Exception):
    def __init__(self, reason: PollErrorReason, detail: str, errno: int | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.errno = errno


def _connection_error(exc: aiohttp.ClientError) -> _PollError:
    """What an operator needs of a failed connection: the error and the OS's reason (errno)."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, OSError) and os_error.errno is not None:
        # asyncio's own strerror is "Connect call failed (host, port)"; the errno's is the why
        detail = f"{type(exc).__name__}: {os.strerror(os_error.errno)}"
        return _PollError(PollErrorReason.CONNECTION, detail, os_error.errno)
    text = str(exc)
    return _PollError(PollErrorReason.CONNECTION,
                      f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


class TrtllmSource:
    """One `trtllm-serve` instance as a stream of items (see the module docstring).

    `queue` is bounded and created by the caller; `stats` is this source's counters. `run()`
    polls until cancelled and closes its HTTP session on the way out. Optional knobs:
    `request_timeout_s` (whole request; older trtllm-serve holds an empty poll up to 2 s),
    `max_backoff_s`, `max_body_bytes`.
    """

    def __init__(self, config: SourceConfig, queue: asyncio.Queue[SourceItem], stats: SourceStats,
                 *, request_timeout_s: float = 10.0, max_backoff_s: float = 30.0,
                 max_body_bytes: int = 64 * 1024 * 1024, feeder: QueueFeeder | None = None) -> None:
        if config.engine is not Engine.TRTLLM:
            raise ValueError(f"{config.backend_name}: TrtllmSource is for trtllm, not {config.engine}")
        if config.trtllm_endpoint is None:
            raise ValueError(f"{config.backend_name}: trtllm_endpoint is required")
        parts = urlsplit(config.trtllm_endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{config.backend_name}: trtllm_endpoint must be an http(s) URL")
        if not host_allowed(parts.hostname, config.allowed_publishers):
            raise ValueError(
                f"{config.backend_name}: trtllm_endpoint host {parts.hostname!r} is not in "
                "allowed_publishers"
            )
        self.config = config
        self.stats = stats
        self._url = config.trtllm_endpoint
        # user:password@ never goes to a log line
        self._logged_url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self._feeder = feeder if feeder is not None else QueueFeeder(queue, stats, config.backend_name)
        self._stream = TrtllmEventStream()
        self._allow = PublisherAllowList(config.allowed_publishers)
        self._request_timeout_s = request_timeout_s
        down_after = config.engine_down_after_s
        # The poller must look a few times within the liveness window: with a longer pause a
        # brief run of failed polls (the endpoint flapping) would be declared engine_down and
        # clear a cache the engine still holds, which drain-on-read events cannot rebuild.
        max_backoff_s = (max_backoff_s if down_after is None else
                         min(max_backoff_s, max(config.poll_interval_s, down_after / 4)))
        self._backoff = poll_backoff(config.poll_interval_s, max_backoff_s)
        #: The pause before the next poll: the interval, or the backoff after failed polls.
        self.next_delay_s = config.poll_interval_s
        self._max_body = max_body_bytes
        self._inflight_since: float | None = None
        self._log = log.bind(backend=config.backend_name)
        self._cond = asyncio.Condition()
        #: Polls completed, successful or not.
        self.polls = 0

    @property
    def failures(self) -> int:
        """Consecutive failed polls (0 after a success)."""
        return self._backoff.failures

    def is_ready(self, now: float | None = None) -> bool:
        """The last poll succeeded and one succeeded (or started) within three intervals."""
        last_ok = self.stats.last_ok_at
        if not self.stats.ready or last_ok is None:
            return False
        window = 3 * self.config.poll_interval_s
        now = time.monotonic() if now is None else now
        if now - last_ok <= window:
            return True
        return self._inflight_since is not None and self._inflight_since - last_ok <= window

    async def wait_polls(self, n: int, timeout_s: float = 5.0) -> None:
        """Wait until `n` polls in total have completed (supervision and tests)."""
        async with asyncio.timeout(timeout_s), self._cond:
            await self._cond.wait_for(lambda: self.polls >= n)

    # --- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        await self._allow.refresh()
        timeout = aiohttp.ClientTimeout(total=self._request_timeout_s)
        # One connection is enough (polls are sequential); cookies are never wanted here.
        connector = aiohttp.TCPConnector(
            limit=1, use_dns_cache=False, resolver=AllowListResolver(self._allow, self.stats)
        )
        try:
            async with aiohttp.ClientSession(
                timeout=timeout, connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=True,
            ) as session:
                while True:
                    await self._poll(session)
                    await asyncio.sleep(self.next_delay_s)
        finally:
            self.stats.attached(False)

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        self._inflight_since = time.monotonic()
        try:
            body = await self._fetch(session)
            decoded = decode_trtllm_events(body)
        except _PollError as exc:
            self._failed(exc.reason, str(exc), exc.errno)
        except DecodeError as exc:
            self._failed(PollErrorReason.INVALID_BODY, exc.reason.value)
        else:
            self._succeeded()
            if not decoded.records:
                self.stats.received(decoded.raw_events, 0, decoded.drops, None)
            else:
                now = time.time()
                self.stats.received(decoded.raw_events,
                                    sum(len(r.events) for r in decoded.records), decoded.drops, now)
                out = self._stream.accept(decoded.records, ts=now)
                if out.gaps:
                    self.stats.gap_found(out.gaps)
                    self._log.warning("trtllm_event_gap", gaps=out.gaps)
                self.stats.dropped_by_reason(out.drops)
                for item in out.items:
                    self._feeder.put(item)
        finally:
            self._inflight_since = None
            async with self._cond:
                self.polls += 1
                self._cond.notify_all()

    async def _fetch(self, session: aiohttp.ClientSession) -> bytes:
        try:
            async with session.post(self._url, allow_redirects=False) as resp:
                if 300 <= resp.status < 400:
                    raise _PollError(PollErrorReason.REDIRECT, f"status {resp.status}")
                if resp.status != 200:
                    raise _PollError(PollErrorReason.HTTP_STATUS, f"status {resp.status}")
                too_large = _PollError(PollErrorReason.BODY_TOO_LARGE, f"over {self._max_body} bytes")
                if (resp.content_length or 0) > self._max_body:
                    raise too_large
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > self._max_body:
                        raise too_large
                    chunks.append(chunk)
                return b"".join(chunks)
        except TimeoutError:
            raise _PollError(PollErrorReason.TIMEOUT, f"no answer in {self._request_timeout_s}s") from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, PeerNotAllowed):
                raise _PollError(PollErrorReason.PEER_NOT_ALLOWED, str(exc.os_error)) from None
            raise _connection_error(exc) from None
        except aiohttp.ClientError as exc:
            raise _connection_error(exc) from None

    def _failed(self, reason: PollErrorReason, detail: str, errno: int | None = None) -> None:
        self.stats.poll_failed(reason.value)
        self.next_delay_s = self._backoff.next_delay()
        self._log.warning("trtllm_poll_failed", url=self._logged_url, reason=reason.value,
                          detail=detail, errno=errno, failures=self._backoff.failures,
                          retry_in_s=round(self.next_delay_s, 3))

    def _succeeded(self) -> None:
        if self._backoff.failures:
            self._log.info("trtllm_poll_recovered", after_failures=self._backoff.failures)
        self._backoff.reset()
        self.next_delay_s = self.config.poll_interval_s
        self.stats.poll_succeeded(time.monotonic())


class PeerNotAllowed(OSError):
    """Every address a host name resolved to is outside `allowed_publishers`."""


class AllowListResolver(AbstractResolver):
    """aiohttp resolver that only returns addresses in `allowed_publishers`, so a connection
    (hence a request, which drains the server's events) only ever goes to an allowed peer, even
    if the name's DNS answer changes. aiohttp does not resolve IP-literal hosts: those are
    checked once against the list at construction."""

    def __init__(self, allow: PublisherAllowList, stats: SourceStats) -> None:
        self._inner = ThreadedResolver()
        self._allow = allow
        self._stats = stats

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        kept = [r for r in results if await self._allow.check(r["host"])]
        if not kept:
            self._stats.publisher_refused()
            raise PeerNotAllowed(f"{host} resolved to no allowed address")
        return kept

    async def close(self) -> None:
        await self._inner.close()
