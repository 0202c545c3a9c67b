"""Prefix keys (SPEC §2): the SPEC test vectors, UTF-8 truncation, request-side extraction."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_listener import prefix as public
from kv_listener.core.prefix import (
    anthropic_messages_texts,
    content_text,
    openai_chat_texts,
    prefix_hash,
    prefix_key,
    request_prefix_key,
    truncate_utf8,
)
from tests.support.vectors import PREFIX_VECTORS

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


# --- SPEC test vectors ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PREFIX_VECTORS))
def test_spec_vector(name: str) -> None:
    v = PREFIX_VECTORS[name]
    key = prefix_key(v.model, v.system, v.first_message)
    assert key is not None and len(key) == 32
    assert prefix_hash(key) == v.prefix_hash


def test_vector_truncation_to_whole_character() -> None:
    system = PREFIX_VECTORS["truncation_to_whole_character"].system
    assert system == "가" * 400 and len(system.encode()) == 1200
    assert truncate_utf8(system, 1024) == ("가" * 341).encode()


def test_vectors_through_request_bodies() -> None:
    v = PREFIX_VECTORS["system_rule"]
    body = {"model": v.model, "messages": [
        {"role": "system", "content": v.system}, {"role": "user", "content": "hi"}]}
    assert prefix_hash(request_prefix_key(body) or b"") == v.prefix_hash
    v = PREFIX_VECTORS["first_message_rule_korean"]
    body = {"model": v.model, "messages": [{"role": "user", "content": v.first_message}]}
    assert prefix_hash(request_prefix_key(body) or b"") == v.prefix_hash


def test_public_module_is_the_same_function() -> None:
    assert public.prefix_key is prefix_key
    assert public.request_prefix_key is request_prefix_key
    assert public.prefix_hash is prefix_hash


# --- the rule itself --------------------------------------------------------------------------


def test_key_is_sha256_of_model_nul_rule_text() -> None:
    assert prefix_key("m", "sys", "first") == hashlib.sha256(b"m\x00Ssys").digest()
    assert prefix_key("m", "", "first") == hashlib.sha256(b"m\x00Mfirst").digest()
    assert prefix_key("m", None, "first") == hashlib.sha256(b"m\x00Mfirst").digest()
    assert prefix_key("m", "", "") is None
    assert prefix_key("m", None, None) is None


def test_model_changes_the_key() -> None:
    assert prefix_key("base", "s", None) != prefix_key("my-lora", "s", None)


def test_system_and_message_rules_differ_for_same_text() -> None:
    assert prefix_key("m", "same", None) != prefix_key("m", None, "same")


def test_max_prefix_length_is_honoured() -> None:
    long = "a" * 2000
    assert prefix_key("m", long, None) == prefix_key("m", long[:1024] + "tail", None)
    assert prefix_key("m", long, None, 100) == prefix_key("m", "a" * 100, None, 100)
    assert prefix_key("m", long, None, 100) != prefix_key("m", long, None)


@pytest.mark.parametrize(("text", "limit", "expected"), [
    ("abc", 10, b"abc"),
    ("abc", 3, b"abc"),
    ("abc", 2, b"ab"),
    ("a가", 2, b"a"),  # 가 is 3 bytes: cut inside it
    ("a가", 4, "a가".encode()),
    ("😀x", 3, b""),  # 4-byte emoji cut
    ("😀x", 4, "😀".encode()),
    ("é", 1, b""),
    ("", 5, b""),
    ("abc", 0, b""),
])
def test_truncate_utf8(text: str, limit: int, expected: bytes) -> None:
    assert truncate_utf8(text, limit) == expected


@given(st.text(), st.integers(min_value=0, max_value=64))
def test_truncate_utf8_is_the_longest_valid_prefix(text: str, limit: int) -> None:
    out = truncate_utf8(text, limit)
    data = text.encode("utf-8", "surrogatepass")
    assert len(out) <= limit
    assert data.startswith(out)
    decoded = out.decode("utf-8", "surrogatepass")  # never a partial character
    # Maximal: the next character would not have fit.
    rest = text[len(decoded):]
    if rest:
        assert len(out) + len(rest[0].encode("utf-8", "surrogatepass")) > limit


def test_lone_surrogate_does_not_raise() -> None:
    assert prefix_key("m", "\ud800abc", None) is not None


# --- OpenAI extraction ------------------------------------------------------------------------


def test_openai_system_first() -> None:
    body = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert openai_chat_texts(body) == ("S", "U")


def test_openai_developer_role_counts_as_system() -> None:
    body = {"messages": [{"role": "developer", "content": "D"}, {"role": "user", "content": "U"}]}
    assert openai_chat_texts(body) == ("D", "U")
    assert request_prefix_key({"model": "m", **body}) == prefix_key("m", "D", None)


def test_openai_system_not_first_is_ignored() -> None:
    body = {"model": "m", "messages": [
        {"role": "user", "content": "U"}, {"role": "system", "content": "late"}]}
    assert openai_chat_texts(body) == (None, "U")
    assert request_prefix_key(body) == prefix_key("m", None, "U")


def test_openai_first_message_skips_system_like_roles() -> None:
    body = {"messages": [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                         {"role": "assistant", "content": "A"}, {"role": "user", "content": "U"}]}
    assert openai_chat_texts(body) == ("S", "A")


def test_openai_empty_system_falls_back_to_first_message() -> None:
    body = {"model": "m", "messages": [
        {"role": "system", "content": ""}, {"role": "user", "content": "U"}]}
    assert request_prefix_key(body) == prefix_key("m", None, "U")


def test_openai_list_content_joins_text_parts_with_newline() -> None:
    body = {"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "line one"},
                                       {"type": "image_url", "image_url": {"url": "x"}},
                                       {"type": "text", "text": "line two"}]},
        {"role": "user", "content": [{"type": "text", "text": "안녕"}]}]}
    assert openai_chat_texts(body) == ("line one\nline two", "안녕")
    assert request_prefix_key(body) == prefix_key("m", "line one\nline two", None)


def test_content_text_shapes() -> None:
    assert content_text("x") == "x"
    assert content_text([{"text": "no type"}]) == "no type"
    assert content_text([{"type": "image_url"}]) is None
    assert content_text([]) is None
    assert content_text(None) is None
    assert content_text(42) is None
    assert content_text(["bare string", {"type": "text", "text": 5}]) is None


@pytest.mark.parametrize("body", [
    {},
    {"messages": None},
    {"messages": "not a list"},
    {"messages": [None, 3, "x"]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": None}]},
])
def test_openai_malformed_bodies_give_no_text(body: dict[str, object]) -> None:
    assert openai_chat_texts(body) == (None, None)
    assert request_prefix_key({"model": "m", **body}) is None


def test_request_key_needs_a_model() -> None:
    body = {"messages": [{"role": "user", "content": "U"}]}
    assert request_prefix_key(body) is None
    assert request_prefix_key({"model": 3, **body}) is None
    assert request_prefix_key(body, model="given") == prefix_key("given", None, "U")


def test_request_key_model_argument_overrides_body() -> None:
    body = {"model": "alias", "messages": [{"role": "user", "content": "U"}]}
    assert request_prefix_key(body, model="lora-a") == prefix_key("lora-a", None, "U")


def test_request_key_max_prefix_length() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 300}]}
    assert request_prefix_key(body, max_prefix_length=16) == prefix_key("m", None, "x" * 16, 16)


def test_request_key_unknown_api() -> None:
    with pytest.raises(ValueError, match="unknown api"):
        request_prefix_key({"model": "m"}, api="gemini")  # type: ignore[arg-type]


# --- Anthropic extraction ---------------------------------------------------------------------


def test_anthropic_system_string() -> None:
    body = {"model": "claude", "system": "S", "messages": [{"role": "user", "content": "U"}]}
    assert anthropic_messages_texts(body) == ("S", "U")
    assert request_prefix_key(body, api="anthropic") == prefix_key("claude", "S", None)


def test_anthropic_system_blocks_joined() -> None:
    body = {"model": "claude",
            "system": [{"type": "text", "text": "one"}, {"type": "text", "text": "two",
                                                         "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert anthropic_messages_texts(body) == ("one\ntwo", "U")
    assert request_prefix_key(body, api="anthropic") == prefix_key("claude", "one\ntwo", None)


def test_anthropic_without_system_uses_first_message() -> None:
    body = {"model": "claude", "messages": [{"role": "user", "content": "U"},
                                            {"role": "assistant", "content": "A"}]}
    assert request_prefix_key(body, api="anthropic") == prefix_key("claude", None, "U")


def test_anthropic_and_openai_agree_on_the_same_conversation() -> None:
    anthropic = {"model": "m", "system": "S", "messages": [{"role": "user", "content": "U"}]}
    openai = {"model": "m", "messages": [{"role": "system", "content": "S"},
                                         {"role": "user", "content": "U"}]}
    assert request_prefix_key(anthropic, api="anthropic") == request_prefix_key(openai)
