"""Prefix keys (SPEC §2): the one definition both sides of the wire hash with.

Owns: UTF-8 truncation, the `S`/`M` key rule, `prefix_hash`, and the request-side extraction of
the system / first-message text from OpenAI chat and Anthropic messages bodies. The listener side
(`kv_listener.resolver.template`) extracts the same two texts from a chat-templated prompt and
calls `prefix_key` too, so a router and a listener agree byte for byte.

Pure: no I/O. Bodies are already-parsed JSON (`Mapping`); malformed shapes give `None` texts,
never an exception, because a router must not fail a request over a prefix key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

DEFAULT_MAX_PREFIX_LENGTH = 1024

#: Roles that make the first message a system prompt (OpenAI `developer` replaced `system` for
#: o1-style models; vLLM passes both to the chat template).
SYSTEM_ROLES = frozenset({"system", "developer"})

Api = Literal["openai", "anthropic"]


def truncate_utf8(text: str, max_bytes: int) -> bytes:
    """UTF-8 bytes of `text` cut to `max_bytes`, then shortened to the last whole character.

    Lone surrogates (possible in JSON `\\ud800` escapes) are encoded with `surrogatepass` so a
    hostile body cannot raise here; no engine tokenizer accepts them, so such a key never matches
    a listener key, which is the right outcome.
    """
    if max_bytes <= 0:
        return b""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return data
    cut = max_bytes
    # Step back over continuation bytes (10xxxxxx) to the lead byte of the character that was
    # cut, and drop that character unless it ends exactly at the cut.
    lead = cut
    while lead > 0 and (data[lead] & 0xC0) == 0x80:
        lead -= 1
    return data[:lead]


def prefix_key(
    model: str,
    system_text: str | None,
    first_message_text: str | None,
    max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH,
) -> bytes | None:
    """Raw 32-byte SHA-256 prefix key (SPEC §2), or None when both texts are empty."""
    if system_text:
        rule, text = b"S", system_text
    elif first_message_text:
        rule, text = b"M", first_message_text
    else:
        return None
    h = hashlib.sha256()
    h.update(model.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(rule)
    h.update(truncate_utf8(text, max_prefix_length))
    return h.digest()


def prefix_hash(key: bytes) -> str:
    """Lowercase hex of a raw key: the `prefix_hash` of events and the KV index."""
    return key.hex()


def content_text(content: Any) -> str | None:
    """Text of a message `content`: a string as is; a list of parts -> the `text` of its text
    parts joined with "\\n" (vLLM's "string" content format); anything else -> None.

    A part counts as text when its `type` is `"text"` (OpenAI, Anthropic) or when it has no
    `type` but a string `text` (vLLM accepts that shorthand). Image/audio/tool parts are skipped:
    templates of multimodal models render placeholders for them, which is a documented limit.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type")
            text = part.get("text")
            if isinstance(text, str) and (kind == "text" or kind is None):
                texts.append(text)
        return "\n".join(texts) if texts else None
    return None


def _messages(body: Mapping[str, Any]) -> Sequence[Any]:
    messages = body.get("messages")
    if isinstance(messages, Sequence) and not isinstance(messages, (str, bytes, bytearray)):
        return messages
    return ()


def openai_chat_texts(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(system_text, first_message_text) of an OpenAI chat-completions body.

    System text: the first message's content when its role is `system` or `developer` (a system
    message that is not first is ignored). First-message text: the content of the first message
    whose role is neither `system` nor `developer`.
    """
    messages = _messages(body)
    system: str | None = None
    first: str | None = None
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            continue
        role = msg.get("role")
        if role in SYSTEM_ROLES:
            if i == 0:
                system = content_text(msg.get("content"))
            continue
        first = content_text(msg.get("content"))
        break
    return system, first


def anthropic_messages_texts(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(system_text, first_message_text) of an Anthropic messages body: top-level `system`
    (a string, or text blocks joined with "\\n"); the first message that is not system-like."""
    system = content_text(body.get("system"))
    first: str | None = None
    for msg in _messages(body):
        if not isinstance(msg, Mapping) or msg.get("role") in SYSTEM_ROLES:
            continue
        first = content_text(msg.get("content"))
        break
    return system, first


def request_prefix_key(
    body: Mapping[str, Any],
    *,
    model: str | None = None,
    api: Api = "openai",
    max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH,
) -> bytes | None:
    """Prefix key of a request body (router side). `model` defaults to the body's `"model"`
    (the router-facing name, which for a LoRA adapter is the adapter's name). None when the body
    has no model or no text."""
    if model is None:
        raw_model = body.get("model")
        if not isinstance(raw_model, str):
            return None
        model = raw_model
    if api == "openai":
        system, first = openai_chat_texts(body)
    elif api == "anthropic":
        system, first = anthropic_messages_texts(body)
    else:
        raise ValueError(f"unknown api {api!r}: expected 'openai' or 'anthropic'")
    return prefix_key(model, system, first, max_prefix_length)
