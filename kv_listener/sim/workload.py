"""A deterministic chat workload for the demo and tests: a few long system prompts, many users.

Owns the requests the demo's router routes: OpenAI chat-completions bodies made of one of
`SYSTEM_PROMPTS` (a few hundred tokens each, so each spans many KV blocks and its blocks are
what requests share) and one user message (short, mostly unique: the part no cache can serve).
Prompts are picked by a skewed popularity, as real fleets see a few hot assistants and a tail.

Each request carries its prefix key computed the router's way (`kv_listener.prefix.
request_prefix_key` on the body, SPEC §2), so the demo can show which prompt a prefix hash is.
Everything comes from one seeded `random.Random`: the same seed gives the same requests.

`ChatSessions` makes the same requests multi-turn (`simulate`): a user comes back to an open
conversation with a follow-up that carries the whole history, so each turn's prompt extends the
previous one's (its KV blocks are a prefix hit, as far as the answer re-tokenizes alike).
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kv_listener.prefix import DEFAULT_MAX_PREFIX_LENGTH, prefix_hash, request_prefix_key

#: The router-facing model name of the demo's engines (the listener's `sources[].model`).
DEMO_MODEL = "demo-chat"


@dataclass(frozen=True, slots=True)
class SystemPrompt:
    name: str  # short label for the live view
    text: str
    weight: float  # relative popularity


SYSTEM_PROMPTS: tuple[SystemPrompt, ...] = (
    SystemPrompt("support", (
        "You are the customer support assistant of Northwind Cloud, a hosting company. Answer "
        "politely and precisely, in short paragraphs. Always ask for the account ID before "
        "discussing billing, never reveal internal ticket notes, and never promise refunds: "
        "say that a billing specialist will review the case within two business days. When a "
        "customer reports an outage, first check the public status page, then collect the "
        "region, the instance IDs and the time the problem started (with the time zone). For "
        "questions about quotas, explain the difference between soft limits, which support can "
        "raise, and hard limits, which need an architecture review. Escalate security reports "
        "to the security team at once and tell the customer a case number will follow by "
        "email. If you do not know an answer, say so and offer to open a ticket."), 0.34),
    SystemPrompt("code-review", (
        "You are a senior software engineer reviewing pull requests for a Python service that "
        "processes payments. Review for correctness first, then security, then readability. "
        "Point out missing tests for every new branch, unchecked inputs, money handled as "
        "floating point, time zones handled implicitly, and errors that are swallowed. Suggest "
        "concrete changes as small diffs, and explain why each matters in one sentence. Do not "
        "comment on formatting that the linter already enforces. Prefer clear names over "
        "comments, and comments that say why over comments that say what. Flag any change to "
        "the database schema that lacks a migration, and any new dependency that lacks a "
        "pinned version. End every review with a one-line verdict: approve, approve with nits, "
        "or request changes."), 0.24),
    SystemPrompt("travel", (
        "You are a travel planning assistant. Build day-by-day itineraries that respect the "
        "traveller's budget, pace and interests. For every day list the morning, afternoon and "
        "evening plans, the neighbourhood, the walking or transit time between places, and one "
        "rainy-day alternative. Mention opening days and typical queues for museums, and "
        "suggest booking ahead where it is usually needed. Recommend local food that fits any "
        "dietary restrictions the traveller gives. Keep transfers realistic: never plan more "
        "than two cities in three days. Quote prices as ranges in the local currency and in "
        "euros, and say that they are estimates. Ask about travel dates first if they are "
        "missing, because seasons change everything."), 0.18),
    SystemPrompt("legal-summary", (
        "You summarize contracts for a small business owner who is not a lawyer. For each "
        "document, list the parties, the term and renewal rules, the payment obligations, the "
        "termination clauses, liability caps, indemnities, governing law and any unusual "
        "clause. Quote the clause numbers you rely on. Explain each point in plain language in "
        "at most two sentences, and mark with a warning anything that renews automatically, "
        "shifts unlimited liability, or restricts the owner from working with competitors. Do "
        "not give legal advice: finish with a reminder that a qualified lawyer should review "
        "the contract before signing, and list three questions worth asking that lawyer."),
        0.14),
    SystemPrompt("korean-tutor", (
        "당신은 한국어를 배우는 외국인 학생을 돕는 친절한 한국어 선생님입니다. 학생이 쓴 문장을 "
        "읽고 틀린 부분을 고쳐 주세요. 고친 문장을 먼저 보여 주고, 왜 고쳤는지 쉬운 한국어로 "
        "짧게 설명한 다음, 같은 문법을 쓰는 예문을 두 개 더 알려 주세요. 존댓말과 반말의 차이, "
        "조사 은/는과 이/가의 차이처럼 학생이 자주 헷갈리는 부분은 특히 자세히 설명해 주세요. "
        "학생이 영어로 질문하면 영어로 간단히 답한 뒤 같은 내용을 한국어로도 말해 주세요. "
        "항상 격려하는 말투를 쓰고, 학생의 수준에 맞는 어휘를 고르세요."), 0.10),
)

_FIRST_NAMES = ("Ana", "Bo", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jun",
                "Kemal", "Lea", "Mina", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sami",
                "Tomas", "Uma", "Viktor", "Wen", "Yara", "Zoe")
_QUESTIONS: dict[str, tuple[str, ...]] = {
    "support": (
        "My instance {n} in eu-west stopped answering about twenty minutes ago.",
        "Why was I billed twice this month for account {n}?",
        "Can you raise my vCPU quota to {n} cores?",
        "How do I rotate the API key of project {n}?",
        "I think someone logged into my account from an unknown address.",
    ),
    "code-review": (
        "Please review this diff: it adds retry logic to the refund handler ({n} lines).",
        "Is it fine to store the amount as a float in the new invoice model?",
        "Review my change that parses dates from the webhook payload, PR #{n}.",
        "I removed a try/except around the ledger write, can you check PR #{n}?",
    ),
    "travel": (
        "Plan {n} days in Lisbon for two people on a mid-range budget.",
        "I have a weekend in Kyoto in autumn, what should I not miss?",
        "Family trip with two kids, {n} days between Rome and Florence, please.",
        "Vegetarian food tour in Seoul for {n} days?",
    ),
    "legal-summary": (
        "Summarize this {n}-page SaaS agreement for me.",
        "What should I watch out for in this office lease renewal?",
        "Here is a freelance contract with a non-compete clause, section {n}.",
    ),
    "korean-tutor": (
        "어제 친구가 만났어요. 맞아요? ({n})",
        "How do I say 'I have been learning Korean for {n} months'?",
        "저는 학생 입니다. 띄어쓰기가 맞나요?",
        "선생님, 은/는 하고 이/가 차이를 다시 설명해 주세요. 예문 {n}개 부탁해요.",
    ),
}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One request of the workload."""

    index: int
    user: str
    system: str  # SystemPrompt.name
    body: dict[str, Any]  # OpenAI chat-completions body
    prefix_hash: str  # request_prefix_key(body), hex
    output_tokens: int  # how many tokens the simulated engine generates

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.body["messages"]
        return messages


class ChatWorkload:
    """`next()` (or iterate) yields `ChatRequest`s; `k` system prompts (4 to 6), `users` users."""

    def __init__(self, *, seed: int = 0, k: int = 5, users: int = 500, model: str = DEMO_MODEL,
                 prompts: Sequence[SystemPrompt] = SYSTEM_PROMPTS,
                 output_tokens: tuple[int, int] = (8, 48),
                 max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH) -> None:
        if not 1 <= k <= len(prompts):
            raise ValueError(f"k must be between 1 and {len(prompts)}")
        if users < 1:
            raise ValueError("users must be at least 1")
        self.model = model
        self.prompts = tuple(prompts[:k])
        self.output_tokens = output_tokens
        self.max_prefix_length = max_prefix_length
        self._rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not secrets
        self._users = [f"{_FIRST_NAMES[i % len(_FIRST_NAMES)]}-{i // len(_FIRST_NAMES) + 1}"
                       for i in range(users)]
        self._weights = [p.weight for p in self.prompts]
        self._count = 0
        self._hashes = {p.name: self._hash(self._body(p, "hello")) for p in self.prompts}

    def prefix_hashes(self) -> dict[str, str]:
        """System prompt name -> the prefix hash its requests carry."""
        return dict(self._hashes)

    def _body(self, prompt: SystemPrompt, user_text: str) -> dict[str, Any]:
        return {"model": self.model, "messages": [
            {"role": "system", "content": prompt.text},
            {"role": "user", "content": user_text},
        ]}

    def _hash(self, body: dict[str, Any]) -> str:
        key = request_prefix_key(body, max_prefix_length=self.max_prefix_length)
        assert key is not None  # every request has a system prompt
        return prefix_hash(key)

    def next(self) -> ChatRequest:
        rng = self._rng
        prompt = rng.choices(self.prompts, weights=self._weights)[0]
        user = rng.choice(self._users)
        question = rng.choice(_QUESTIONS.get(prompt.name, ("Hello, can you help me ({n})?",)))
        text = f"Hi, this is {user}. " + question.format(n=rng.randint(2, 999))
        body = self._body(prompt, text)
        lo, hi = self.output_tokens
        req = ChatRequest(index=self._count, user=user, system=prompt.name, body=body,
                          prefix_hash=self._hash(body), output_tokens=rng.randint(lo, hi))
        self._count += 1
        return req

    def __iter__(self) -> Iterator[ChatRequest]:
        while True:
            yield self.next()


_FOLLOW_UPS = (
    "Thanks! Can you say that again in two sentences?",
    "Could you give me a concrete example?",
    "Why is that? Please explain the reasoning.",
    "What should I do first, and what can wait?",
    "And what changes if there are {n} of them?",
    "Can you check point {n} of your answer once more?",
    "고마워요. 조금 더 쉽게 설명해 줄 수 있어요?",
)


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One turn of a conversation: `turn` 1 opens it; `request.body` holds the whole history."""

    conversation: int
    turn: int
    request: ChatRequest


@dataclass(slots=True)
class _Conversation:
    opening: ChatRequest
    messages: list[dict[str, str]]
    turns: int = 1
    pending: ChatTurn | None = field(default=None)


class ChatSessions:
    """Multi-turn chat over `ChatWorkload`'s prompts and users. `next()` gives the next turn: a
    follow-up of an idle open conversation (probability `follow_up`) or a new conversation;
    the caller reports `answered(turn, text)` (the turn's answer joins the history and the
    conversation is idle again, until its `max_turns`) or `failed(turn)` (it is dropped). At most
    `max_open` conversations stay open: beyond that the one idle the longest is forgotten, as a
    user who left. A conversation never has two turns in flight."""

    def __init__(self, *, seed: int = 0, model: str = DEMO_MODEL,
                 max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH, max_turns: int = 6,
                 follow_up: float = 0.6, max_open: int = 64) -> None:
        if max_turns < 1 or max_open < 1 or not 0.0 <= follow_up <= 1.0:
            raise ValueError("max_turns and max_open must be >= 1, follow_up in [0, 1]")
        self.opening = ChatWorkload(seed=seed, model=model, max_prefix_length=max_prefix_length)
        self.max_turns = max_turns
        self.follow_up = follow_up
        self.max_open = max_open
        self._rng = random.Random(seed + 1)  # noqa: S311 - a reproducible workload
        self._idle: OrderedDict[int, _Conversation] = OrderedDict()  # idle the longest first
        self._busy: dict[int, _Conversation] = {}
        self._ids = itertools.count(1)
        self._index = itertools.count()

    @property
    def open_conversations(self) -> int:
        return len(self._idle) + len(self._busy)

    def next(self) -> ChatTurn:
        rng = self._rng
        if self._idle and rng.random() < self.follow_up:
            conv_id = rng.choice(list(self._idle))
            conv = self._idle.pop(conv_id)
            question = rng.choice(_FOLLOW_UPS).format(n=rng.randint(2, 9))
            conv.messages.append({"role": "user", "content": question})
            conv.turns += 1
            lo, hi = self.opening.output_tokens
            # The key is the system prompt's (SPEC §2): the same on every turn.
            request = replace(conv.opening, index=next(self._index),
                              body={**conv.opening.body, "messages": list(conv.messages)},
                              output_tokens=rng.randint(lo, hi))
        else:
            first = self.opening.next()
            conv_id = next(self._ids)
            conv = _Conversation(first, [dict(m) for m in first.messages])
            request = replace(first, index=next(self._index))
        turn = ChatTurn(conv_id, conv.turns, request)
        conv.pending = turn
        self._busy[conv_id] = conv
        return turn

    def answered(self, turn: ChatTurn, text: str) -> None:
        conv = self._busy.pop(turn.conversation, None)
        if conv is None or conv.pending is not turn:
            return
        conv.pending = None
        conv.messages.append({"role": "assistant", "content": text})
        if conv.turns >= self.max_turns:
            return
        self._idle[turn.conversation] = conv
        while len(self._idle) > self.max_open:
            self._idle.popitem(last=False)

    def failed(self, turn: ChatTurn) -> None:
        self._busy.pop(turn.conversation, None)
