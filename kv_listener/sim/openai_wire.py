"""vLLM's OpenAI wire shapes for the simulated engine, pure: request bodies in, checked values
out (`RequestError` with the HTTP status for anything else), and the answer bodies out.

Owns what `sim/server.py` must say exactly as vLLM 0.11 says it (`vllm/entrypoints/openai/
protocol.py`, `serving_chat.py`, `serving_completion.py`): the fields a request may carry and the
400 it gets otherwise, the error shape of vLLM >= 0.10.2, the `usage` block with
`prompt_tokens_details.cached_tokens`, the choice of a chat or completion answer (whole or a
streamed delta), one server-sent event, and a Prometheus label value. No sockets, no clock, no
engine: `sim/service.py` and the routes call these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from aiohttp import web

Kind = Literal["chat", "completion"]


class RequestError(Exception):
    """A request the server refuses, with its HTTP status (400 or 404)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> web.Response:
    """vLLM >= 0.10.2 `ErrorResponse`: OpenAI's nested shape, `code` the HTTP status."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status=status)


# --- request parsing (pure: bodies in, values out, RequestError for anything else) -------------


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON's `true` is not a token ID)."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError covers UnicodeDecodeError
        raise RequestError(400, "request body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


def parse_sampling(body: Mapping[str, Any], default_max_tokens: int) -> tuple[int, bool]:
    """`(max_tokens, stream)` of a request; other sampling fields are accepted and ignored
    (the simulation samples random tokens), except `n`, which must be 1."""
    # Chat accepts OpenAI's newer `max_completion_tokens` as well (vLLM does).
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not is_int(max_tokens) or max_tokens < 1:
        # vLLM's SamplingParams: "max_tokens must be at least 1".
        raise RequestError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be a boolean")
    n = body.get("n", 1)
    if n != 1 or not is_int(n):
        raise RequestError(400, "the simulated engine serves n=1 only")
    return int(max_tokens), stream


def parse_cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's `cache_salt` request field (>= 0.9, both routes): absent, or a non-empty string
    that the engine hashes into the prompt's first block and echoes in its KV events."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise RequestError(400, "Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def parse_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    """Chat messages with string contents; text parts are joined with "\\n" as vLLM's "string"
    content format does."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list")
    out: list[dict[str, str]] = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise RequestError(400, "every message must be an object with a string role")
        content = msg.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError(400, "the simulated engine accepts text content parts only")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(400, "message content must be a string or a list of text parts")
        out.append({"role": msg["role"], "content": content})
    return out


def parse_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """A completions `prompt`: a string, a list of token IDs, or a batch of exactly one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # OpenAI's batch form, one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(400, "prompt cannot be empty")
        return prompt
    if isinstance(prompt, list) and all(is_int(t) for t in prompt):
        if not prompt:
            raise RequestError(400, "prompt cannot be empty")
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        raise RequestError(400, "the simulated engine does not serve batched prompts")
    raise RequestError(400, "prompt must be a string or a list of token IDs")


def check_token_ids(tokens: Sequence[Any], vocab: int) -> list[int]:
    if not all(is_int(t) for t in tokens):
        raise RequestError(400, "tokens must be a list of integers")
    if any(t < 0 or t >= vocab for t in tokens):
        raise RequestError(400, "token id out of vocabulary")
    return list(tokens)


# --- response bodies --------------------------------------------------------------------------


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(kind: Kind, text: str, finish_reason: str | None, *, delta: bool) -> dict[str, Any]:
    """One element of `choices`: a completion's `text`, a chat answer's `message`, or (`delta`)
    a streamed chat chunk's `delta` (empty on a finish chunk with no text, as vLLM sends it)."""
    out: dict[str, Any] = {"index": 0}
    if kind == "completion":
        out["text"] = text
    elif delta:
        out["delta"] = {"content": text} if text or finish_reason is None else {}
    else:
        out["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    out.update(logprobs=None, finish_reason=finish_reason, stop_reason=None)
    return out


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event of a streamed answer, compact JSON as vLLM writes it."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def prom_label(value: str) -> str:
    """A Prometheus label value, escaped as the text exposition format requires."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
