"""ZMQ source: receives one vLLM / SGLang engine's KV-cache event batches (SPEC §5).

Owns the SUB socket (bind or connect, topic prefix filter), the replay DEALER, the ZAP
authenticator that enforces `allowed_publishers`, and turning frames into queue items:

- `EventBatch` (with `seq`) for every batch to apply, in sequence order;
- `SourceCleared(reason)` before the batch that revealed an engine restart (`engine_restart`), a
  gap that replay could not cover (`gap`), or our own queue overflowing (`overflow`).

Wire rules (wire-formats §1, §2.1, §2.2, §7.1, §7.5; vLLM 0.9.0 .. 0.33.0, SGLang 0.4.7 .. 0.5.23):
frames are `[topic, seq (8 bytes BE), payload]`; a message in any other shape is counted under
its reason and skipped. The sequence logic is `core.sequence.SequenceTracker`. On a gap, with a
`replay_endpoint`, a DEALER sends `[b"", start_seq]` and reads replies in either layout until the
end marker; live batches arriving meanwhile are kept (bounded) and processed after the replay.
A replay that times out is abandoned with its DEALER (late replies must not be mistaken for the
next replay's). A batch lost right before the engine goes quiet shows no gap, so after
`TAIL_PROBE_S` without a batch the replay buffer is asked once for what follows the last one.
Peers (who may publish, whether one is connected) are `sources.zmq_peers`'.

Receiving live batches never waits for downstream work: they go on the bounded queue with
`put_nowait` (`QueueFeeder`): a full queue drops and counts, then queues `SourceCleared(overflow)`.
Batches already in hand (a replay's answer, bounded by the receive budget, and the live batches
kept meanwhile, `sources.zmq_backlog`) wait for room instead: the engine's whole replay buffer is
more than the queue holds, and overflowing would clear what the replay was rebuilding.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
import zmq
import zmq.asyncio

from kv_listener.backoff import Backoff
from kv_listener.config import SourceConfig
from kv_listener.core.decode import DecodeError, decode_zmq_payload
from kv_listener.core.model import ClearReason, Engine, SourceCleared, SourceItem
from kv_listener.core.sequence import (
    FrameError,
    GapOutcome,
    ReplayStatus,
    SeqAction,
    SeqDecision,
    SequenceTracker,
    SourceDropReason,
    parse_event_frames,
    parse_replay_frames,
    replay_request,
)
from kv_listener.sources.common import PublisherAllowList, QueueFeeder
from kv_listener.sources.zmq_backlog import LiveBacklog, recv_future, recv_now, send_future
from kv_listener.sources.zmq_peers import (
    MONITORED,
    ZAP_DOMAIN,
    AllowListAuthenticator,
    wants_ipv6,
    watch_connection,
)
from kv_listener.stats import SourceStats

log = structlog.get_logger(__name__)

#: Retries of a bind/connect that failed: from the first delay, doubling up to the second.
_BIND_RETRY_S = 0.5
_BIND_RETRY_MAX_S = 30.0
#: Payloads above this are decoded in a worker thread (about 2-5 ms of decoding in the loop).
_THREAD_DECODE_BYTES = 64 << 10
#: libzmq refuses (drops the connection on) any frame over this many times max_message_bytes
#: (ZMQ_MAXMSGSIZE): frames between the two are dropped and counted, frames above it are never
#: read whole into memory, so one message costs at most this much while it is received.
SOCKET_CAP_FACTOR = 2
#: Bytes that frames received but not handled yet may take, three times per source: libzmq's
#: receive queue, which counts messages, not bytes (the SUB's high-water mark is as many frames
#: of the socket cap as fit, at least `_MIN_RCVHWM`: at most this or 4 x the cap; a longer burst
#: waits in the kernel's socket buffer and the engine's PUB queue, and is lost, as a gap, only
#: there), the live batches kept while a replay is in flight and a replay's answer (each plus
#: one frame, `_replay`).
RECEIVE_BUDGET_BYTES = 16 << 20
#: Fewer costs CPU on bursts (docs/reliability.md, "Memory bound").
_MIN_RCVHWM = 4
_MAX_RCVHWM = 100_000
#: `_replay`'s upper bound when the whole buffer is wanted (start-up).
_ALL_SEQS = 1 << 63
_CUT_OR_DONE = (ReplayStatus.TRUNCATED, ReplayStatus.COMPLETE)  # a gap fill asks on after these
#: Silence that ends a replay's answer once replies began (`ZmqSource._replay`).
REPLAY_STALL_S = 0.5
#: Silence after which a source with a replay endpoint asks the engine once for what follows its
#: last batch (`ZmqSource._probe_tail`).
TAIL_PROBE_S = 2.0


class ZmqSource:
    """One vLLM / SGLang engine instance (one DP rank: one seq space) as a stream of items.

    `queue` is bounded and created by the caller; `stats` is this source's counters. `run()`
    runs until cancelled and closes every socket on the way out.

    Optional knobs: `replay_timeout_s` bounds a whole replay (request to end marker);
    `max_replay_backlog` bounds the live batches kept while a replay is in flight (in count;
    in bytes, the receive budget does);
    `receive_budget_bytes` bounds the frames received and not handled yet
    (`RECEIVE_BUDGET_BYTES`); `feeder` the queue's feeder when its owner
    (the source runtime) shares one (else one of its own on `queue`); `tail_probe_s` the silence
    after which the replay buffer is asked for batches lost right before it (`_probe_tail`).
    """

    def __init__(self, config: SourceConfig, queue: asyncio.Queue[SourceItem], stats: SourceStats,
                 *, replay_timeout_s: float = 5.0, max_replay_backlog: int = 4096,
                 receive_budget_bytes: int = RECEIVE_BUDGET_BYTES,
                 feeder: QueueFeeder | None = None,
                 tail_probe_s: float = TAIL_PROBE_S) -> None:
        if config.engine not in (Engine.VLLM, Engine.SGLANG):
            raise ValueError(f"{config.backend_name}: ZmqSource is for vllm/sglang, not {config.engine}")
        if config.zmq_endpoint is None:
            raise ValueError(f"{config.backend_name}: zmq_endpoint is required")
        if config.zmq_mode not in ("bind", "connect"):
            raise ValueError(f"{config.backend_name}: zmq_mode must be bind or connect")
        self.config = config
        self.stats = stats
        self._queue = queue
        self._feeder = feeder if feeder is not None else QueueFeeder(queue, stats, config.backend_name)
        self._seq = SequenceTracker()
        self._new_stream = False  # set by expect_new_stream, applied at the next live batch
        self._replay_timeout_s = replay_timeout_s
        self._budget = receive_budget_bytes
        self._backlog = LiveBacklog(max_replay_backlog, receive_budget_bytes)
        self._tail_probe_s = tail_probe_s
        self._tail_probed = False  # since the last live batch
        self._live_fut: asyncio.Future[list[bytes]] | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._log = log.bind(backend=config.backend_name)
        #: Set once the SUB socket is bound/connected (also `stats.ready`).
        self.ready = asyncio.Event()
        #: Set once the first bind/connect attempt is over, failed or not; `attach_error` then
        #: says why it failed (the daemon's start-up fails on a busy port rather than waiting).
        self.first_attach = asyncio.Event()
        self.attach_error: str | None = None
        #: Set each time a peer is refused by `allowed_publishers`.
        self.peer_refused = asyncio.Event()
        #: The endpoint actually bound (port 0 resolved) or connected to.
        self.endpoint: str | None = None
        #: The SUB socket while running.
        self.socket: zmq.asyncio.Socket | None = None

    @property
    def _uses_zap(self) -> bool:
        return (self.config.zmq_endpoint or "").startswith("tcp://")

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self) -> None:
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        auth: AllowListAuthenticator | None = None
        sub: zmq.asyncio.Socket | None = None
        monitor: asyncio.Task[None] | None = None
        try:
            if self._uses_zap:
                allow = PublisherAllowList(self.config.allowed_publishers)
                await allow.refresh()
                auth = AllowListAuthenticator(ctx, allow, self.stats, self.config.backend_name,
                                               self.peer_refused)
                auth.start()
            sub = self.socket = ctx.socket(zmq.SUB)
            sub.linger = 0
            sub.rcvhwm = self.rcvhwm
            sub.ipv6 = wants_ipv6(self.config.zmq_endpoint or "")
            if auth is not None:
                sub.zap_domain = ZAP_DOMAIN
            sub.maxmsgsize = self._socket_cap
            sub.setsockopt(zmq.SUBSCRIBE, self.config.zmq_topic.encode("utf-8"))
            # Monitored before it attaches, so that no handshake is missed.
            mon = sub.get_monitor_socket(MONITORED)
            monitor = asyncio.create_task(watch_connection(
                sub, mon, stats=self.stats, log=self._log, mode=self.config.zmq_mode,
                endpoint=lambda: self.endpoint, max_frame_bytes=self._socket_cap))
            await self._attach(sub)
            if self.config.replay_endpoint is not None:
                self._dealer = self._new_dealer()
            self.stats.attached(True)
            self.ready.set()
            self._log.info("zmq_source_ready", endpoint=self.endpoint, mode=self.config.zmq_mode)
            if self._dealer is not None:
                await self._startup_replay(sub)
            now: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
            while True:
                if self._backlog:  # kept during a replay: in hand, so it waits for room
                    await self._handle(sub, self._backlog.popleft(), in_hand=True)
                    continue
                got = await self._next_live(sub, now)
                if got is None:
                    await self._probe_tail(sub)
                    continue
                await self._handle(sub, got)
        finally:
            self.stats.attached(False)
            self.ready.clear()
            if monitor is not None:
                monitor.cancel()
                await asyncio.gather(monitor, return_exceptions=True)
            if self._live_fut is not None:
                self._live_fut.cancel()
                self._live_fut = None
            self._close_dealer()
            if sub is not None:
                sub.close(linger=0)
                self.socket = None
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)
            self._ctx = None

    async def _attach(self, sub: zmq.asyncio.Socket) -> None:
        endpoint = self.config.zmq_endpoint
        assert endpoint is not None
        backoff = Backoff(_BIND_RETRY_S, _BIND_RETRY_MAX_S)
        while True:
            try:
                if self.config.zmq_mode == "bind":
                    sub.bind(endpoint)
                    self.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    sub.connect(endpoint)
                    self.endpoint = endpoint
                self.attach_error = None
                self.first_attach.set()
                return
            except zmq.ZMQError as exc:
                # e.g. the port still held by a previous process. At start-up the daemon gives
                # up (exit 1, its supervisor retries); later the source retries, not ready, logged.
                self.attach_error = (f"cannot {self.config.zmq_mode} {endpoint}: "
                                     f"{zmq.strerror(exc.errno or 0)}")
                self.first_attach.set()
                delay = backoff.next_delay()
                self._log.error("zmq_attach_failed", endpoint=endpoint, mode=self.config.zmq_mode,
                                error=exc.strerror, errno=exc.errno, retry_in_s=delay)
                await asyncio.sleep(delay)

    @property
    def _socket_cap(self) -> int:
        return self.config.limits.max_message_bytes * SOCKET_CAP_FACTOR

    @property
    def rcvhwm(self) -> int:
        """The SUB's high-water mark: as many frames of the socket cap as the receive budget
        holds, at least `_MIN_RCVHWM` (4 with the default 8 MiB messages)."""
        return self._frames_in_budget(at_least=_MIN_RCVHWM)

    def _frames_in_budget(self, *, at_least: int) -> int:
        return max(at_least, min(_MAX_RCVHWM, self._budget // self._socket_cap))

    def expect_new_stream(self) -> None:
        """The engine was declared down and the source cleared: whatever comes next starts
        afresh. With a replay endpoint the next batch is expected at seq 0, so a stream that goes
        on above it (the same engine, back from a network cut) is rebuilt from the engine's
        replay buffer; without one the next batch is applied as it is.

        Called from outside the source's task: taken into account at the next live batch, so a
        gap being filled meanwhile finishes against the sequence state it started from."""
        self._new_stream = True

    def _new_dealer(self) -> zmq.asyncio.Socket:
        assert self._ctx is not None and self.config.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.maxmsgsize = self._socket_cap
        # Replies received ahead of `_replay`: the budget or one frame (libzmq's 1,000 frames of
        # up to the cap were unbounded); what the engine's ROUTER drops is asked for again.
        dealer.rcvhwm = self._frames_in_budget(at_least=1)
        dealer.ipv6 = wants_ipv6(self.config.replay_endpoint)
        dealer.connect(self.config.replay_endpoint)
        return dealer

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    async def _recv_live(self, sub: zmq.asyncio.Socket) -> list[bytes]:
        # One pending receive, shared with the replay loop: none is lost to a cancelled future.
        if self._live_fut is None:
            self._live_fut = recv_future(sub)
        frames = await self._live_fut
        self._live_fut = None
        return frames

    async def _next_live(self, sub: zmq.asyncio.Socket, now: zmq.Socket[bytes]
                         ) -> list[bytes] | None:
        """The next live message, or None after `tail_probe_s` of silence when a tail probe is
        due. One already queued is taken at once through `now`, the SUB's sync shadow, without
        a Future or a timer (the hot path), unless a receive is pending: that one takes the next
        message, none may overtake it."""
        if self._live_fut is None and (frames := recv_now(now)) is not None:
            return frames
        if self._live_fut is None:
            self._live_fut = recv_future(sub)
        if not (self._tail_probed or self.config.replay_endpoint is None
                or self._seq.expected is None or self._live_fut.done()):
            done, _ = await asyncio.wait((self._live_fut,), timeout=self._tail_probe_s)
            if not done:
                return None  # the pending receive is kept: no message is lost to a cancel
        return await self._recv_live(sub)

    async def _probe_tail(self, sub: zmq.asyncio.Socket) -> None:
        """After `tail_probe_s` without a batch, ask the engine's replay buffer once for what
        follows the last one. A batch lost at the high-water mark or during a reconnect right
        before the engine went quiet shows no gap until a later batch comes, which an idle
        engine does not send: its stores and removals would stay unknown for as long as it is
        idle. The run that continues the stream is applied; a buffer that no longer starts where
        the stream stopped clears, as a gap does. Live batches received meanwhile follow (those
        the run already covered are skipped). A source told to expect a new stream (engine
        down, cleared) waits for its next batch instead."""
        self._tail_probed = True
        expected = self._seq.expected
        if expected is None or self._new_stream:
            return
        gap = SourceCleared(ClearReason.GAP)  # queued first when the buffer has moved on
        first, last, _status = await self._replay_run(
            sub, expected, lambda seq: None if seq == expected else self._feeder.put(gap))
        if first is None or last is None:
            return  # nothing was lost (or the engine does not answer: nothing is known)
        self.stats.gap_found()
        covered = first == expected
        self._log.warning("zmq_tail_lost", expected=expected, first=first, last=last,
                          replayed="exact" if covered else "partial")
        self.stats.replay_ended(covered=covered)
        self._seq.expect(last + 1)
        self._backlog.drop_covered(last)

    # --- live batches -------------------------------------------------------------------

    async def _handle(self, sub: zmq.asyncio.Socket, frames: list[bytes], *,
                      in_hand: bool = False) -> None:
        try:
            _topic, seq, payload = parse_event_frames(frames)
        except FrameError as exc:
            self.stats.dropped(exc.reason.value)
            self._log.warning("zmq_bad_message", reason=exc.reason.value, detail=str(exc))
            return
        self.stats.frame_received()
        self._tail_probed = False
        if self._new_stream:
            self._new_stream = False
            self._seq.reset()
            if self.config.replay_endpoint is not None:
                self._seq.expect(0)
        decision = self._seq.observe(seq)
        if decision.action is SeqAction.APPLY:
            await self._apply(seq, payload, in_hand=in_hand)
        elif decision.action is SeqAction.RESTART:
            self._log.warning("zmq_engine_restart", expected=decision.expected, got=seq)
            self._feeder.put(SourceCleared(ClearReason.ENGINE_RESTART))
            if seq > 0 and self.config.replay_endpoint is not None:
                await self._replay_restart(sub, seq)
            await self._apply(seq, payload, in_hand=in_hand)
        else:
            await self._fill_gap(sub, decision, payload)

    async def _apply(self, seq: int, payload: bytes, *, in_hand: bool = True) -> None:
        """Decode and queue one batch. A live one (`in_hand` False) that finds the queue full is
        dropped behind an overflow clear; one already held (a replay's answer, the live batches
        kept during it) waits for room: the engine's whole buffer would overflow the queue."""
        limits = self.config.limits
        if len(payload) > limits.max_message_bytes:
            # Dropped on receipt and counted, like an undecodable batch; a frame over the socket
            # cap (ZMQ_MAXMSGSIZE) never gets here: libzmq drops the connection instead.
            self.stats.dropped(SourceDropReason.MESSAGE_TOO_LARGE.value)
            self._log.warning("zmq_batch_too_large", seq=seq, bytes=len(payload),
                              max_message_bytes=limits.max_message_bytes)
            return
        engine = self.config.engine
        decode = partial(decode_zmq_payload, engine, payload, seq,
                         max_event_tokens=limits.max_event_tokens,
                         max_event_hashes=limits.max_event_hashes)
        try:
            # A large one in a worker thread, so the loop (other sources, the HTTP server) keeps
            # running meanwhile; this source waits for it, keeping its order.
            decoded = (await asyncio.to_thread(decode) if len(payload) > _THREAD_DECODE_BYTES
                       else decode())
        except DecodeError as exc:
            self.stats.dropped(exc.reason.value)
            self._log.warning("zmq_batch_undecodable", reason=exc.reason.value, seq=seq)
            return
        self.stats.received(decoded.raw_events, len(decoded.batch.events), decoded.drops,
                            time.time())
        if decoded.batch.events:
            if in_hand:
                await self._feeder.put_waiting(decoded.batch)
            else:
                self._feeder.put(decoded.batch)

    # --- gaps and replay ----------------------------------------------------------------

    async def _startup_replay(self, sub: zmq.asyncio.Socket) -> None:
        """Rebuild what the engine holds from its whole replay buffer (a listener restarted
        next to a running engine would otherwise know nothing stored before its start; vLLM
        keeps up to 10,000 batches). Exact when the buffer still starts at seq 0; otherwise the
        state is what it holds, said in the log and in `/stats`. Live batches received meanwhile
        that the replay already covered are skipped; the rest follow in order. An engine that
        does not answer (not up yet) leaves seq 0 expected, so its first batch above 0 is
        fetched by replay like any gap."""
        first, last, status = await self._replay_run(sub, 0, None)
        if first is None or last is None:
            self._seq.expect(0)
            outcome = "empty" if status is ReplayStatus.COMPLETE else status.value
            self.stats.startup_replayed(outcome)
            self._log.info("zmq_startup_replay", status=outcome, batches=0)
            return
        batches = last - first + 1
        self._seq.expect(last + 1)
        self.stats.startup_replayed("exact" if first == 0 else "partial", batches, first)
        self._backlog.drop_covered(last)
        if first == 0:
            self._log.info("zmq_startup_replay", status="exact", batches=batches, last_seq=last)
        else:
            self._log.warning("zmq_startup_replay", status="partial", batches=batches,
                              from_seq=first, last_seq=last,
                              effect="blocks stored before the engine's replay buffer starts "
                                     "are unknown until stored again")

    async def _replay_run(self, sub: zmq.asyncio.Socket, start: int,
                          before_first: Callable[[int], object] | None,
                          ) -> tuple[int | None, int | None, ReplayStatus]:
        """Replay `start..` and apply the run of consecutive batches it delivers from its first
        one: (first, last) of the run (None, None when it delivered nothing) and how the last
        request ended. `before_first(seq)` runs before the first batch is applied. What one
        request holds is bounded by the receive budget: a request cut there (`TRUNCATED`) is
        applied and followed by one from where it stopped, so the engine's whole buffer (vLLM:
        10,000 batches of up to `max_message_bytes`) never sits in memory at once; so is one
        cut at a hole or a stall (`_replay`: vLLM 0.32's ROUTER drops what the queue toward
        this DEALER cannot take), and one that ended complete, until one brings nothing or the
        live batches kept meanwhile continue the run (that ROUTER can drop a tail and still
        deliver its end marker). A request whose first batch does not continue the run ends it."""
        first: int | None = None
        last: int | None = None
        while True:
            if self._dealer is None:
                self._dealer = self._new_dealer()
            replayed, status = await self._replay(sub, self._dealer, start, _ALL_SEQS)
            before = last
            for seq, payload in replayed:  # consecutive: `_replay` stops at a hole
                if last is not None and seq != last + 1:
                    return first, last, status  # the buffer does not continue the run
                if first is None:
                    first = seq
                    if before_first is not None:
                        before_first(seq)
                await self._apply(seq, payload)
                last = seq
            more = status is ReplayStatus.TRUNCATED or (
                status is ReplayStatus.COMPLETE and not self._backlog.continues(last))
            if not more or last is None or last == before:
                return first, last, status
            start = last + 1

    async def _replay_restart(self, sub: zmq.asyncio.Socket, seq: int) -> None:
        """The restarted engine's first batch seen is `seq` > 0: its batches 0..seq-1 were lost
        on the way (published before this SUB was connected again, or a high-water mark). They
        are in its replay buffer: apply the run of them that ends right before `seq`."""
        if self._dealer is None:
            self._dealer = self._new_dealer()
        replayed, status = await self._replay(sub, self._dealer, 0, seq, holes_end=False)
        run: list[tuple[int, bytes]] = []
        for item in reversed(replayed):
            if item[0] != (run[-1][0] if run else seq) - 1:
                break
            run.append(item)
        run.reverse()
        for batch_seq, payload in run:
            await self._apply(batch_seq, payload)
        covered = bool(run) and run[0][0] == 0
        self.stats.replay_ended(covered=covered)
        if covered:
            self._log.info("zmq_restart_replayed", got=seq, batches=len(run), status="exact")
        else:
            # What the buffer no longer holds stays unknown until stored again, as after a gap.
            self._log.warning("zmq_restart_replayed", got=seq, batches=len(run),
                              status="partial" if run else status.value)

    async def _fill_gap(self, sub: zmq.asyncio.Socket, decision: SeqDecision, payload: bytes) -> None:
        expected = decision.expected
        assert expected is not None
        self.stats.gap_found()
        self._log.warning("zmq_gap", expected=expected, got=decision.got,
                          replay=self.config.replay_endpoint is not None)
        if self._dealer is None and self.config.replay_endpoint is not None:
            self._dealer = self._new_dealer()
        if self._dealer is None:
            replayed: list[tuple[int, bytes]] = []
            status = ReplayStatus.UNAVAILABLE
        else:
            replayed, status = await self._replay(sub, self._dealer, expected, decision.got)
            # Cut at the budget, a hole or a dropped tail: the run so far applied, the rest asked.
            while (status in _CUT_OR_DONE and replayed and replayed[0][0] == expected
                   and (nxt := replayed[-1][0] + 1) < decision.got):
                for seq, item in replayed:
                    await self._apply(seq, item)
                expected = nxt
                decision = SeqDecision(decision.action, decision.got, expected)
                self._seq.expect(expected)
                dealer = self._dealer = self._dealer or self._new_dealer()
                replayed, status = await self._replay(sub, dealer, expected, decision.got)
        plan = self._seq.fill_gap(decision, payload, replayed, status)
        if plan.clear:
            if plan.outcome is not GapOutcome.NO_REPLAY:
                self.stats.replay_ended(covered=False)
            self._log.warning("zmq_gap_cleared", expected=expected, got=decision.got,
                              outcome=plan.outcome.value)
            self._feeder.put(SourceCleared(ClearReason.GAP))
        else:
            self.stats.replay_ended(covered=True)
            self._log.info("zmq_gap_replayed", expected=expected, got=decision.got)
        for seq, item in plan.batches:
            await self._apply(seq, item)

    async def _replay(
        self, sub: zmq.asyncio.Socket, dealer: zmq.asyncio.Socket, start: int, got: int,
        *, holes_end: bool = True,
    ) -> tuple[list[tuple[int, bytes]], ReplayStatus]:
        """Ask the engine for `start..` and read replies until the end marker, the deadline, the
        receive budget, a hole, or `REPLAY_STALL_S` without a reply once they began
        (`TRUNCATED`: the engine sends its answer in one loop, so a hole or a pause is what was
        dropped on the way, the end marker included), or an error, while live batches keep
        being received into the backlog. Without `holes_end`, replies after a hole are kept
        (`_replay_restart` wants the run that ends right before `got`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replay_timeout_s
        stalled_at: float | None = None  # once replies began: when the answer counts as cut
        replayed: list[tuple[int, bytes]] = []
        replayed_bytes = 0
        status = ReplayStatus.TIMEOUT
        send_fut: asyncio.Future[Any] | None = send_future(dealer, replay_request(start))
        reply_fut: asyncio.Future[list[bytes]] | None = None
        try:
            while True:
                now = loop.time()
                if now >= deadline:
                    break
                if stalled_at is not None and now >= stalled_at:
                    status = ReplayStatus.TRUNCATED
                    break
                remaining = min(deadline, stalled_at or deadline) - now
                if self._live_fut is None:
                    self._live_fut = recv_future(sub)
                if send_fut is None and reply_fut is None:
                    reply_fut = recv_future(dealer)
                other = send_fut if send_fut is not None else reply_fut
                assert other is not None
                waiting: set[asyncio.Future[Any]] = {self._live_fut, other}
                done, _ = await asyncio.wait(waiting, timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                if self._live_fut in done:
                    frames = self._live_fut.result()
                    self._live_fut = None
                    if not self._backlog.keep(frames):  # the newest kept, the one before lost
                        self.stats.dropped(SourceDropReason.REPLAY_BACKLOG_OVERFLOW.value)
                if send_fut is not None and send_fut in done:
                    send_fut.result()
                    send_fut = None
                if reply_fut is not None and reply_fut in done:
                    frames = reply_fut.result()
                    reply_fut = None
                    stalled_at = loop.time() + REPLAY_STALL_S
                    try:
                        reply = parse_replay_frames(frames)
                    except FrameError as exc:
                        self.stats.dropped(exc.reason.value)
                        continue
                    if reply is None:
                        status = ReplayStatus.COMPLETE
                        break
                    # Keep only what can be used (start..got-1), and at most the receive
                    # budget (and one reply): bounded memory whatever the engine's buffer holds.
                    if start <= reply[0] < got:
                        if replayed and (replayed_bytes + len(reply[1]) > self._budget or (
                                holes_end and reply[0] != replayed[-1][0] + 1)):
                            status = ReplayStatus.TRUNCATED
                            break
                        replayed.append(reply)
                        replayed_bytes += len(reply[1])
        except zmq.ZMQError as exc:
            self._log.warning("zmq_replay_error", error=exc.strerror)
            status = ReplayStatus.UNAVAILABLE
        finally:
            for fut in (send_fut, reply_fut):
                if fut is not None:
                    fut.cancel()
        if status is not ReplayStatus.COMPLETE:
            # Late replies of this request would be read as the next replay's.
            self._close_dealer()
        if status is ReplayStatus.TIMEOUT:
            self._log.warning("zmq_replay_timeout", start=start, received=len(replayed))
        return replayed, status

