"""The real listener daemon against SGLang 0.5.23's REAL KV-event publisher code (issue #10).

SGLang's own radix tree, event recorder and ZMQ publisher run in `.venv-engines/bin/python`
(`tests.engines.sglang_real`), fed chat-templated token IDs as SGLang's chat server makes them
from the fixture tokenizers. Its PUB connects (SGLang's rule for `tcp://127.0.0.1:P`) to a tap
that records every message for the oracle and forwards it to the listener, whose source binds
(`zmq_mode: bind`), as it would for SGLang itself. The listener is the real daemon process with
one `engine: sglang` source: `replay_endpoint` is SGLang's replay ROUTER, `detokenize_endpoint`
an SGLang-shaped `/detokenize` (`{"text"}`, plus `/tokenize` and `/health`) backed by the same
tokenizer; the salted variant verifies `cache_salt`s issued with `kv_listener.router`.

Every scenario ends with a convergence check: the listener's SSE stream (resync snapshot plus
live records) must equal the oracle's `expected()` exactly, and every `cache_created` prefix
hash must be the request-side key (`kv_listener.router`) of a conversation that was fed.
Page sizes 1 (SGLang's usual default) and 16.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kv_listener.core.decode import decode_zmq_payload
from kv_listener.core.model import BlockRemoved, BlockStored, Engine
from kv_listener.core.sequence import END_SEQ, replay_request
from kv_listener.resolver.template import build_prompt_parser, load_tokenizer
from kv_listener.router import issue_cache_salt, prefix_hash, request_prefix_key
from tests.conftest import FIXTURES
from tests.engines.conftest import require_engines_venv
from tests.engines.oracle import EngineTruth
from tests.engines.sglang_real import (
    SGLANG_MARKER,
    SglangDriver,
    SglangEngine,
    connect_engine,
    sglang_binds,
)
from tests.engines.tap import ZmqTap
from tests.engines.view import Backend, StreamView, converge
from tests.support.daemon import Daemon
from tests.support.detokenize_server import DetokenizeServer
from tests.support.ports import free_port

pytestmark = [pytest.mark.engines, pytest.mark.timeout(60)]

MODEL = "sglang-tiny-chat"
BACKEND = "sglang-1"
SECRET = b"sglang-real-secret"

SYSTEM_A = "You are the fleet's routing assistant. Answer in one short sentence."
SYSTEM_B = "You translate between English and Korean, and nothing else."
SYSTEM_C = "You summarise incident reports for the on-call engineer."
SYSTEM_D = "You write commit messages in the imperative mood."
USER_1 = "Which backend holds the longest cached prefix for this conversation right now?"
USER_2 = "And which one should take the next long request from the batch queue?"
USER_3 = "안녕하세요, 오늘 캐시 상태를 알려 주세요"
REPLY_1 = "Backend sglang-1 holds it; its cache is warm."
REPLY_2 = "Send it to the one with the shortest queue."
REPLY_3 = "네, 지금 캐시는 따뜻합니다."

#: (page size, fixture tokenizer): SGLang's per-token pages, and 16-token pages.
CASES = [pytest.param(1, "llama3", id="page1-llama3"),
         pytest.param(16, "chatml", id="page16-chatml")]

_TOKENIZERS: dict[str, Any] = {}


def tokenizer(name: str) -> Any:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = load_tokenizer(FIXTURES / "tokenizers" / name)
    return _TOKENIZERS[name]


def convo(system: str | None, user: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": user}]


def request_key(messages: list[dict[str, str]]) -> bytes:
    """The router's key of a chat request (SPEC §2), from the request body alone."""
    key = request_prefix_key({"model": MODEL, "messages": messages})
    assert key is not None
    return key


def request_hash(messages: list[dict[str, str]]) -> str:
    return prefix_hash(request_key(messages))


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangDriver]:
    """One driver process per module (importing SGLang and torch takes seconds); each test opens
    its own engine instances in it."""
    require_engines_venv(SGLANG_MARKER)
    drv = SglangDriver(tmp_path_factory.mktemp("sglang") / "driver.log").start()
    try:
        yield drv
    finally:
        drv.close()


@dataclass
class Rig:
    """One SGLang engine, its tap and oracle, the detokenize stand-in and the listener."""

    engine: SglangEngine
    tap: ZmqTap
    truth: EngineTruth
    backend: Backend
    daemon: Daemon
    session: aiohttp.ClientSession
    detok: DetokenizeServer
    page_size: int
    fed: set[str] = field(default_factory=set)  # request-side keys of the conversations fed
    rejected: set[str] = field(default_factory=set)  # keys whose salts must be refused
    view: StreamView | None = None

    async def start_listener(self) -> None:
        await self.daemon.start()
        await self.daemon.wait_log("zmq_source_ready", backend=BACKEND)
        assert await _thread(self.tap.wait_subscriptions, 1), "listener never subscribed"
        view = StreamView(self.daemon.base, BACKEND)
        view.start(self.session)
        try:
            async with asyncio.timeout(15):
                await view.connected.wait()
        except TimeoutError:
            raise AssertionError(f"GET /events/{BACKEND} did not answer within 15 s") from None
        view.check()
        self.view = view
        self.backend.views.append(view)

    async def chat(self, messages: list[dict[str, str]], reply: str, *,
                   cache_salt: str | None = None, expect_key: bool = True) -> dict[str, Any]:
        answer = await self.engine.chat(messages, reply, cache_salt=cache_salt)
        (self.fed if expect_key else self.rejected).add(request_hash(messages))
        await self._tapped(answer)
        return answer

    async def _tapped(self, answer: dict[str, Any]) -> None:
        seqs = set(answer["seqs"])
        assert await _thread(self.tap.wait_for, lambda: seqs <= {m.seq for m in self.tap.messages},
                             10.0), "SGLang's batches did not reach the tap"

    async def evict(self, num_tokens: int) -> int:
        """SGLang's LRU eviction; it frees whole leaves until `num_tokens` are free (one leaf
        for 1). Returns the tokens evicted."""
        answer = await self.engine.evict(num_tokens)
        await self._tapped(answer)
        return int(answer["evicted_tokens"])

    async def flush(self) -> None:
        """SGLang's `flush_cache`: the tree resets (one `[AllBlocksCleared]` batch)."""
        await self._tapped({"seqs": await self.engine.flush()})

    async def restart_engine(self, driver: SglangDriver, tokenizer_name: str) -> None:
        """SGLang restarted: a new tree and publisher on the same endpoints (its sequence starts
        at 0 again, its replay buffer is gone)."""
        old = self.engine
        await old.close(wait=True)
        since = self.tap.count()
        self.engine = await SglangEngine.open(
            driver, endpoint=self.tap.endpoint, page_size=self.page_size,
            tokenizer=FIXTURES / "tokenizers" / tokenizer_name,
            replay_endpoint=old.replay_endpoint)
        assert self.engine.replay_endpoint == old.replay_endpoint
        await connect_engine(self.engine, self.tap, since=since)

    async def converge(self) -> dict[str, tuple[int, str]]:
        """The listener's view == the oracle's; created keys are request-side keys."""
        assert self.view is not None
        await converge([(self.backend, self.view)], timeout_s=15.0)
        created = {r.data["prefix_hash"] for r in self.view.since(0, "cache_created")}
        assert created <= self.fed, f"created keys no conversation has: {sorted(created - self.fed)}"
        assert not (set(self.view.state) | created) & self.rejected, \
            "a chain with a refused salt was attributed"
        return dict(self.view.state)

    async def stats(self) -> dict[str, Any]:
        async with self.session.get(f"{self.daemon.base}/stats") as resp:
            assert resp.status == 200
            body: dict[str, Any] = (await resp.json())["sources"][BACKEND]
            return body

    def wire(self) -> list[Any]:
        """SGLang's events as the tap recorded them, decoded (for scenario assertions)."""
        out: list[Any] = []
        for m in self.tap.messages:
            out.extend(decode_zmq_payload(Engine.SGLANG, m.frames[2], m.seq).batch.events)
        return out


async def _thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


@contextlib.asynccontextmanager
async def rig(driver: SglangDriver, tmp_path: Path, *, page_size: int, tokenizer_name: str,
              salted: bool = False, start_listener: bool = True) -> AsyncIterator[Rig]:
    tok = tokenizer(tokenizer_name)
    listener_zmq = f"tcp://127.0.0.1:{free_port()}"
    tap = ZmqTap(f"tcp://127.0.0.1:{free_port()}")
    detok: DetokenizeServer | None = None
    engine: SglangEngine | None = None
    daemon: Daemon | None = None
    r: Rig | None = None
    try:
        tap.forward_to(listener_zmq)  # SGLang's place: a PUB connecting to the listener
        engine = await SglangEngine.open(driver, endpoint=tap.endpoint, page_size=page_size,
                                         tokenizer=FIXTURES / "tokenizers" / tokenizer_name)
        # SGLang connects for tcp://host:port, so the listener binds.
        assert not sglang_binds(tap.endpoint)
        assert engine.replay_endpoint is not None and \
            engine.replay_endpoint.startswith("tcp://127.0.0.1:")
        detok = await DetokenizeServer(tok, engine="sglang").start()
        source: dict[str, Any] = {
            "backend_name": BACKEND, "engine": "sglang", "model": MODEL,
            "zmq_endpoint": listener_zmq, "zmq_mode": "bind",
            "replay_endpoint": engine.replay_endpoint, "detokenize_endpoint": detok.url}
        config: dict[str, Any] = {"listen": f"127.0.0.1:{free_port()}", "update_interval": "50ms",
                                  "sources": [source]}
        if salted:
            secret_file = tmp_path / "salt.secret"
            secret_file.write_bytes(SECRET + b"\n")
            config["cache_salt"] = {"secret_file": str(secret_file)}
        truth = EngineTruth(engine=Engine.SGLANG, model=MODEL, tokenizer=tok,
                            parser=build_prompt_parser(tokenizer=tok),
                            salt_secret=SECRET if salted else None,
                            backend=BACKEND if salted else None)
        daemon = Daemon(config, tmp_path)
        async with aiohttp.ClientSession() as session:
            r = Rig(engine, tap, truth, Backend(BACKEND, tap, truth, []), daemon, session, detok,
                    page_size)
            try:
                if start_listener:
                    await r.start_listener()
                    await connect_engine(engine, tap)
                yield r
            finally:
                if r.view is not None:
                    await r.view.close()
    finally:
        if daemon is not None:
            await daemon.stop()
        if r is not None:
            engine = r.engine  # a restarted engine replaced the first one
        if engine is not None:
            await engine.close()
        if detok is not None:
            await detok.close()
        tap.close()


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_store(driver: SglangDriver, tmp_path: Path, page_size: int, tok: str) -> None:
    """A system-prompt chat (S rule), then one without a system prompt (M rule)."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok) as r:
        a1 = await r.chat(convo(SYSTEM_A, USER_1), REPLY_1)
        state = await r.converge()
        assert state == {request_hash(convo(SYSTEM_A, USER_1)): (a1["cached_tokens"], "gpu_hot")}
        m3 = await r.chat(convo(None, USER_3), REPLY_3)
        state = await r.converge()
        assert state[request_hash(convo(None, USER_3))] == (m3["cached_tokens"], "gpu_hot")
        # Sizes only in the assertions: a failing one must not print events (token IDs).
        sizes = [(e.block_size, len(e.token_ids), len(e.block_hashes))
                 for e in r.wire() if isinstance(e, BlockStored)]
        assert sizes
        assert all(bs == page_size and n == bs * hashes for bs, n, hashes in sizes), sizes


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_second_user_under_split_node(driver: SglangDriver, tmp_path: Path,
                                            page_size: int, tok: str) -> None:
    """A second user with the same system prompt splits the first chain's node where the
    prompts part (SGLang stores the new leaf with a parent in the middle of the first chain);
    another system prompt splits it right after the shared template head."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok) as r:
        a1 = await r.chat(convo(SYSTEM_A, USER_1), REPLY_1)
        await r.converge()
        first = [h for e in r.wire() if isinstance(e, BlockStored) for h in e.block_hashes]
        mark = len(r.tap.messages)
        a2 = await r.chat(convo(SYSTEM_A, USER_2), REPLY_2)
        state = await r.converge()
        key_a = request_hash(convo(SYSTEM_A, USER_2))
        assert key_a == request_hash(convo(SYSTEM_A, USER_1))
        assert state[key_a] == (max(a1["cached_tokens"], a2["cached_tokens"]), "gpu_hot")
        second = [decode_zmq_payload(Engine.SGLANG, m.frames[2], m.seq).batch.events
                  for m in r.tap.messages[mark:]]
        parent = next(e for batch in second for e in batch if isinstance(e, BlockStored)).parent_hash
        assert parent in first[:-1], "the second user's chain does not hang under a split"
        await r.chat(convo(SYSTEM_B, USER_1), REPLY_1)
        state = await r.converge()
        assert set(state) == {key_a, request_hash(convo(SYSTEM_B, USER_1))}


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_remove(driver: SglangDriver, tmp_path: Path, page_size: int, tok: str) -> None:
    """SGLang evicts LRU leaves first (tails: a chain loses its last blocks and keeps the ones
    where its key is decided), then whole chains; at the end nothing is held."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok) as r:
        await r.chat(convo(SYSTEM_A, USER_1), REPLY_1)
        await r.chat(convo(SYSTEM_A, USER_2), REPLY_2)
        await r.chat(convo(None, USER_3), REPLY_3)
        await r.converge()
        for _ in range(3):
            assert await r.evict(1) > 0
            await r.converge()
        assert any(isinstance(e, BlockRemoved) for e in r.wire())
        assert r.view is not None
        key_a = request_hash(convo(SYSTEM_A, USER_1))
        counts = [rec.data["token_count"] for rec in r.view.since(0, "cache_created")
                  if rec.data["prefix_hash"] == key_a]
        assert any(b < a for a, b in itertools.pairwise(counts)), \
            "no tail eviction lowered the live key's token_count"
        await r.evict(1 << 20)
        assert await r.converge() == {}
        assert r.truth.held == 0


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_clear(driver: SglangDriver, tmp_path: Path, page_size: int, tok: str) -> None:
    """`flush_cache` (tree reset: AllBlocksCleared), then a chat after it."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok) as r:
        await r.chat(convo(SYSTEM_A, USER_1), REPLY_1)
        await r.chat(convo(None, USER_3), REPLY_3)
        assert len(await r.converge()) == 2
        await r.flush()
        assert await r.converge() == {}
        a2 = await r.chat(convo(SYSTEM_A, USER_2), REPLY_2)
        state = await r.converge()
        assert state == {request_hash(convo(SYSTEM_A, USER_2)): (a2["cached_tokens"], "gpu_hot")}


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_salt(driver: SglangDriver, tmp_path: Path, page_size: int, tok: str) -> None:
    """Salted requests (SGLang echoes `cache_salt` on every event of the salted subtree, and
    seeds its hash chain with it): valid salts give the key without detokenizing; a salt made
    with another secret (forged) or for another backend discards the chain; an unsalted chat
    still resolves through /detokenize; a second salted user under the first one's split node
    (a continuation block carrying the salt too) keeps the key."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok, salted=True) as r:
        def salt(messages: list[dict[str, str]], *, secret: bytes = SECRET,
                 backend: str = BACKEND) -> str:
            return issue_cache_salt(secret, backend, request_key(messages))

        await r.chat(convo(SYSTEM_A, USER_1), REPLY_1, cache_salt=salt(convo(SYSTEM_A, USER_1)))
        await r.chat(convo(None, USER_3), REPLY_3, cache_salt=salt(convo(None, USER_3)))
        await r.chat(convo(SYSTEM_B, USER_1), REPLY_1)
        await r.chat(convo(SYSTEM_C, USER_1), REPLY_1, expect_key=False,
                     cache_salt=salt(convo(SYSTEM_C, USER_1), secret=b"not-the-secret"))
        await r.chat(convo(SYSTEM_D, USER_1), REPLY_1, expect_key=False,
                     cache_salt=salt(convo(SYSTEM_D, USER_1), backend="sglang-2"))
        state = await r.converge()
        assert set(state) == {request_hash(convo(SYSTEM_A, USER_1)),
                              request_hash(convo(None, USER_3)),
                              request_hash(convo(SYSTEM_B, USER_1))}
        await r.chat(convo(SYSTEM_A, USER_2), REPLY_2, cache_salt=salt(convo(SYSTEM_A, USER_2)))
        await r.converge()
        salted = [e for e in r.wire() if isinstance(e, BlockStored) and e.cache_salt]
        assert any(e.parent_hash is not None for e in salted), "no salted continuation was sent"
        st = await r.stats()
        assert st["salt_rejected"] >= 2
        # Salted chains (valid or refused) are never detokenized; the unsalted one is.
        tok_ = tokenizer(tok)
        texts = [tok_.decode(q["tokens"], skip_special_tokens=False) for q in r.detok.requests
                 if isinstance(q.get("tokens"), list)]
        assert any(SYSTEM_B in t for t in texts), "the unsalted chat was never detokenized"
        for name, text in (("A", SYSTEM_A), ("C", SYSTEM_C), ("D", SYSTEM_D), ("M", USER_3)):
            assert not any(text in t for t in texts), f"salted conversation {name} was detokenized"


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_replay_fills_a_gap(driver: SglangDriver, tmp_path: Path, page_size: int,
                                  tok: str) -> None:
    """The tap withholds SGLang's next batches from the listener; the next batch that reaches
    it reveals the gap, which SGLang's real replay ROUTER fills (topic layout, 0.5.22+)."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok) as r:
        await r.chat(convo(SYSTEM_A, USER_1), REPLY_1)
        await r.converge()
        r.tap.drop_next(2)
        await r.chat(convo(SYSTEM_B, USER_2), REPLY_2)
        await r.chat(convo(None, USER_3), REPLY_3)
        assert sum(not m.forwarded for m in r.tap.messages) == 2
        await r.chat(convo(SYSTEM_A, USER_2), REPLY_2)
        state = await r.converge()
        assert request_hash(convo(SYSTEM_B, USER_2)) in state
        st = await r.stats()
        assert st["gaps"] >= 1 and st["replays"] >= 1 and st["replay_failures"] == 0, st


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_engine_restart(driver: SglangDriver, tmp_path: Path, page_size: int,
                              tok: str) -> None:
    """SGLang restarted on the same ports: its sequence starts at 0 again, so the listener drops
    what the old engine held and shows what the new one caches."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok) as r:
        await r.chat(convo(SYSTEM_A, USER_1), REPLY_1)
        await r.chat(convo(SYSTEM_A, USER_2), REPLY_2)
        await r.chat(convo(None, USER_3), REPLY_3)
        assert len(await r.converge()) == 2
        old = len(r.tap.messages)
        await r.restart_engine(driver, tok)
        # The new engine's first batch that got through (seq 0, or the first of the flushes
        # that connected it) is below the old engine's last: a sequence going back.
        seqs = [m.seq for m in r.tap.messages]
        assert seqs[old] < seqs[old - 1], seqs
        await r.chat(convo(SYSTEM_B, USER_2), REPLY_2)
        state = await r.converge()
        assert set(state) == {request_hash(convo(SYSTEM_B, USER_2))}
        st = await r.stats()
        assert st["clears_by_reason"].get("engine_restart", 0) >= 1, st["clears_by_reason"]


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_replay_router_answers_in_the_topic_layout(driver: SglangDriver, tmp_path: Path,
                                                         page_size: int, tok: str) -> None:
    """SGLang 0.5.23's replay ROUTER, asked by a DEALER (`[b"", start_seq]`): every buffered
    batch from `start_seq` as `[b"", topic, seq, payload]`, byte for byte what went out live,
    then the end marker `[b"", b"", ff x 8, b""]`."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok,
                   start_listener=False) as r:
        await connect_engine(r.engine, r.tap)
        await r.chat(convo(SYSTEM_A, USER_1), REPLY_1)
        live = {m.seq: m.frames for m in r.tap.messages}
        start = min(live)
        assert r.engine.replay_endpoint is not None
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        try:
            dealer.connect(r.engine.replay_endpoint)
            await dealer.send_multipart(replay_request(start))
            replies: list[list[bytes]] = []
            async with asyncio.timeout(10):
                while len(replies) <= len(live) + 16:
                    replies.append(list(await dealer.recv_multipart()))
                    if replies[-1][2:3] == [END_SEQ]:
                        break
        finally:
            dealer.close(linger=0)
            ctx.term()
        # Booleans first: a failed comparison must not print payloads (they hold token IDs).
        ends = replies[-1] == [b"", b"", END_SEQ, b""]
        assert ends, f"no end marker after {len(replies)} replies"
        body = replies[:-1]
        layout = [len(f) == 4 and f[0] == b"" and f[1] == live[start][0] for f in body]
        assert all(layout), "a reply is not [b'', topic, seq, payload]"
        replayed = {int.from_bytes(f[2], "big"): (f[1], f[2], f[3]) for f in body}
        assert sorted(replayed) == list(range(start, max(replayed) + 1))
        same = all(replayed.get(seq) == tuple(frames) for seq, frames in live.items())
        assert same, "replayed batches differ from what went out live"


@pytest.mark.parametrize(("page_size", "tok"), CASES)
async def test_replay_rebuilds_a_listener_started_late(driver: SglangDriver, tmp_path: Path,
                                                       page_size: int, tok: str) -> None:
    """SGLang published batches before the listener existed; on start, a source with a
    `replay_endpoint` asks SGLang's replay ROUTER for its whole buffer (SPEC §5), so the
    prefixes cached before the listener came are shown too."""
    async with rig(driver, tmp_path, page_size=page_size, tokenizer_name=tok,
                   start_listener=False) as r:
        await connect_engine(r.engine, r.tap)
        await r.chat(convo(SYSTEM_A, USER_1), REPLY_1)
        await r.chat(convo(None, USER_3), REPLY_3)
        before = len(r.tap.messages)
        await r.start_listener()
        await r.chat(convo(SYSTEM_B, USER_2), REPLY_2)
        try:
            state = await r.converge()
        except AssertionError as exc:
            seen = [{k: v for k, v in rec.items() if k in ("event", "status", "batches", "from_seq",
                                                           "last_seq", "expected", "got", "outcome",
                                                           "received", "start", "reason")}
                    for rec in r.daemon.read_logs() if "zmq" in str(rec.get("event"))]
            raise AssertionError(
                f"SGLang sent {before} batches before the listener started; its replay buffer "
                f"holds them all, but the listener did not rebuild from it: {exc}; "
                f"the listener's ZMQ log: {seen}") from None
        assert request_hash(convo(SYSTEM_A, USER_1)) in state
