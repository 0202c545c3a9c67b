"""`kv_listener.prefix`: the one function family that computes prefix keys for both sides
(SPEC §2). Routers import from here; the implementation lives in `kv_listener.core.prefix`."""

from kv_listener.core.prefix import (
    DEFAULT_MAX_PREFIX_LENGTH,
    SYSTEM_ROLES,
    anthropic_messages_texts,
    content_text,
    openai_chat_texts,
    prefix_hash,
    prefix_key,
    request_prefix_key,
    truncate_utf8,
)

__all__ = [
    "DEFAULT_MAX_PREFIX_LENGTH",
    "SYSTEM_ROLES",
    "anthropic_messages_texts",
    "content_text",
    "openai_chat_texts",
    "prefix_hash",
    "prefix_key",
    "request_prefix_key",
    "truncate_utf8",
]
