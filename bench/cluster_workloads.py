"""The cluster benchmark's workloads: seeded, identical for every strategy (issue #12).

Each workload is a list of `Req`s (OpenAI chat bodies plus what the bench needs to know about
them). Texts are built from a small word list so the shipped tiny tokenizer gives about three
tokens per word; a "long" system prompt is 250-450 words (750-1,350 tokens, 47-85 blocks of 16).

- `chat`: multi-tenant chat. 24 long system prompts with Zipf(1.1) popularity, one short user
  turn each (mostly unique: the part no cache serves).
- `multiturn`: 32 conversations over 8 system prompts; each request is the next turn of one of
  them (picked at random), its history growing by a user turn and a fixed assistant reply per
  turn. The system prompt is the prefix key, so the router's key cannot tell two conversations
  of one assistant apart, while the engine caches each conversation's history.
- `docqa`: no system prompt; the first user message is one of 12 long shared documents
  followed by a question (the key is the document's first 1,024 bytes).
- `hotspot`: `chat`, but from the second third on, 80% of requests use one prompt (a launch, a
  viral assistant): keeping that prefix in one place and spreading load pull apart.

`send` is the bench's client: one streamed request to a `Target` (an engine or a peer router),
timed at the client and read back for the engine's own figures.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kv_listener.core.prefix import prefix_hash
from kv_listener.router import request_prefix_key

MODEL = "demo"

_TEXT = (
    "the router sends each request to a backend that already holds the prompt in its cache so "
    "prefill work falls and time to first token drops when many users share one assistant "
    "answer questions about accounts invoices outages deployments regions quotas keys logs "
    "policies contracts refunds upgrades latency throughput errors retries limits tokens blocks "
    "always cite the document section never invent numbers keep a friendly tone use short "
    "paragraphs list steps in order ask for the account id before any change escalate security "
    "issues explain trade offs summarize the context first then give the answer"
)
_WORDS = _TEXT.split(" ")


@dataclass(frozen=True, slots=True)
class Req:
    """One request of a workload."""

    index: int
    body: dict[str, Any]  # OpenAI chat-completions body (model, messages, max_tokens)
    prefix_hash: str | None  # the router's key (request_prefix_key), hex
    prefix_key: bytes | None
    group: str  # what the key names (system prompt / document), for the report
    output_tokens: int
    session: str  # conversation id (multiturn), else the group

    @property
    def messages(self) -> list[dict[str, str]]:
        msgs: list[dict[str, str]] = self.body["messages"]
        return msgs


def _text(rng: random.Random, n_words: int, head: str) -> str:
    return head + " " + " ".join(rng.choice(_WORDS) for _ in range(n_words))


def _zipf_weights(n: int, s: float = 1.1) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def _req(i: int, messages: list[dict[str, str]], group: str, out: int,
         session: str | None = None) -> Req:
    body = {"model": MODEL, "messages": messages, "max_tokens": out}
    key = request_prefix_key(body)
    return Req(i, body, None if key is None else prefix_hash(key), key, group, out,
               session or group)


def _systems(rng: random.Random, n: int) -> list[str]:
    return [_text(rng, rng.randint(250, 450), f"You are assistant {k} of the fleet.")
            for k in range(n)]


def chat(seed: int, n: int) -> list[Req]:
    rng = random.Random(seed)
    systems = _systems(rng, 24)
    weights = _zipf_weights(len(systems))
    out = []
    for i in range(n):
        k = rng.choices(range(len(systems)), weights=weights)[0]
        user = f"User {rng.randint(1, 10_000)} asks: " + _text(rng, rng.randint(8, 20), "")
        out.append(_req(i, [{"role": "system", "content": systems[k]},
                            {"role": "user", "content": user}],
                        f"system-{k}", rng.randint(16, 48)))
    return out


def multiturn(seed: int, n: int) -> list[Req]:
    rng = random.Random(seed)
    systems = _systems(rng, 8)
    convs: list[list[dict[str, str]]] = []
    sys_of: list[int] = []
    for c in range(32):
        k = c % len(systems)
        sys_of.append(k)
        convs.append([{"role": "system", "content": systems[k]}])
    out = []
    for i in range(n):
        c = rng.randrange(len(convs))
        history = convs[c]
        user = f"Turn {len(history) // 2 + 1} of conversation {c}: " + _text(rng, 12, "")
        messages = [*history, {"role": "user", "content": user}]
        out.append(_req(i, messages, f"system-{sys_of[c]}", rng.randint(16, 32), f"conv-{c}"))
        # the assistant's reply enters the history (a fixed text: the engine's own sampled
        # tokens are not known to the client, as with a real chat client that resends text)
        history.extend([{"role": "user", "content": user},
                        {"role": "assistant", "content": _text(rng, 20, "Answer:")}])
        if len(history) > 13:  # a conversation ends after six turns; a new one starts
            convs[c] = [history[0]]
    return out


def docqa(seed: int, n: int) -> list[Req]:
    rng = random.Random(seed)
    docs = [_text(rng, rng.randint(300, 500), f"Document {d}: operations handbook part {d}.")
            for d in range(12)]
    weights = _zipf_weights(len(docs), 0.8)
    out = []
    for i in range(n):
        d = rng.choices(range(len(docs)), weights=weights)[0]
        question = "Question: " + _text(rng, rng.randint(8, 16), "") + "?"
        out.append(_req(i, [{"role": "user", "content": docs[d] + "\n\n" + question}],
                        f"doc-{d}", rng.randint(16, 48)))
    return out


def hotspot(seed: int, n: int) -> list[Req]:
    rng = random.Random(seed)
    base = chat(seed, n)
    hot = base[0]
    out = []
    for r in base:
        if r.index >= n // 3 and rng.random() < 0.8:
            user = f"User {rng.randint(1, 10_000)} asks: " + _text(rng, 12, "")
            out.append(_req(r.index, [hot.messages[0], {"role": "user", "content": user}],
                            hot.group, r.output_tokens))
        else:
            out.append(r)
    return out


WORKLOADS: dict[str, Callable[[int, int], list[Req]]] = {
    "chat": chat, "multiturn": multiturn, "docqa": docqa, "hotspot": hotspot,
}


REQUEST_TIMEOUT_S = 120.0


# --- the client ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Target:
    """Where a request goes and in which form."""

    url: str  # base URL (an engine, or a peer router)
    form: str = "chat"  # "chat" (/v1/chat/completions) or "tokens" (/v1/completions, token IDs)
    headers: dict[str, str] = field(default_factory=dict)


async def send(http: aiohttp.ClientSession, target: Target, req: Req,
               tokens: Callable[[Req], list[int]]) -> tuple[str, int, int, float, float | None]:
    """One streamed request: (engine, prompt tokens, cached tokens, client TTFT, engine TTFT)."""
    if target.form == "tokens":
        path = "/v1/completions"
        body: dict[str, Any] = {"model": MODEL, "prompt": tokens(req),
                                "max_tokens": req.output_tokens}
    else:
        path = "/v1/chat/completions"
        body = dict(req.body)
    body.update(stream=True, stream_options={"include_usage": True})
    started = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    engine = ""
    engine_ttft: float | None = None
    async with http.post(target.url + path, json=body, headers=target.headers,
                         timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {(await resp.text())[:200]}")
        engine = resp.headers.get("x-engine-name", "")
        buf = b""
        async for chunk in resp.content.iter_any():
            if first is None:
                first = time.perf_counter()
            buf += chunk
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                for line in block.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    obj = json.loads(data)
                    if obj.get("usage"):
                        usage = obj["usage"]
                    sim = obj.get("x_sim") or {}
                    engine = sim.get("engine", engine)
                    if "ttft_s" in sim:
                        engine_ttft = float(sim["ttft_s"])
    assert first is not None
    details = usage.get("prompt_tokens_details") or {}
    return (engine, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens", 0)),
            first - started, engine_ttft)
