"""Chat templates: learn where a system prompt and a first message sit in a templated prompt,
and extract them from a decoded chain (SPEC §2, listener side).

Owns: `build_prompt_parser`, which picks a source's template in SPEC §2 order and gives the
source its `PromptParser`, and the one place callers import the template API from. The work is
done in three rooms: `resolver.probe` learns a `ChatLayout` by rendering sentinel conversations
through transformers' `apply_chat_template` (and loads tokenizers), `resolver.parser` turns the
decoded text of a chain into (status, system text, first-message text), and `resolver.layouts`
holds the layout types and the built-in recognizers of the common families.

Known limits (documented in the README too):
- A template that alters content (Llama 3's `| trim`, Gemma's `| trim`) makes a system prompt or
  first message with leading/trailing whitespace hash differently on the two sides; the probe
  detects such templates (`ChatLayout.trims_content`) and the resolver counts chains resolved
  under them. The cache-salt path has no such limit.
- Templates that merge the system prompt into the first user turn (Mistral v0.3, Gemma 3:
  `S\\n\\nU`) cannot be split exactly: the first `\\n\\n` is taken as the end of the system prompt.
- A request whose explicit system prompt equals the template's default system prompt is hashed
  with `S` by the router but counts as "no system" here.
- Tools rendered into the system block (Qwen 2.5) change the system text unless the system
  prompt alone is at least `max_prefix_length` bytes.
- The decoded text must reproduce the rendered text (true for byte-level BPE tokenizers: GPT-2,
  Llama 3, Qwen; SentencePiece tokenizers may differ around spaces), and `/detokenize` must keep
  special tokens (SGLang is asked for that; vLLM's decode keeps them).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kv_listener.resolver.layouts import BUILTIN_LAYOUTS, ChatLayout, SystemForm
from kv_listener.resolver.parser import (
    REPLACEMENT_CHAR,
    NoKeyReason,
    ParsedPrompt,
    PromptParser,
)
from kv_listener.resolver.probe import (
    DEMO_TOKENIZER_DIR,
    TemplateProbeError,
    learn_from_template,
    learn_from_tokenizer,
    learn_layout,
    load_tokenizer,
    special_tokens_from_info,
)

__all__ = [
    "BUILTIN_LAYOUTS",
    "DEMO_TOKENIZER_DIR",
    "REPLACEMENT_CHAR",
    "ChatLayout",
    "NoKeyReason",
    "ParsedPrompt",
    "PromptParser",
    "SystemForm",
    "TemplateProbeError",
    "build_prompt_parser",
    "learn_from_template",
    "learn_from_tokenizer",
    "learn_layout",
    "load_tokenizer",
    "special_tokens_from_info",
]


def build_prompt_parser(
    *,
    chat_template: str | Path | None = None,
    tokenizer: Any = None,
    tokenizer_info: Mapping[str, Any] | None = None,
    name: str = "source",
) -> PromptParser:
    """The parser of a source, from its template sources in SPEC §2 order: the `chat_template`
    file, the local tokenizer (an object from `load_tokenizer`), the engine's `/tokenizer_info`
    answer, else the built-in recognizers. Blocking (file reads, template rendering): call it
    from a thread in async code. Raises `TemplateProbeError` for a template that cannot be
    learned, `OSError` for an unreadable file."""
    if chat_template is not None:
        source = Path(chat_template).read_text(encoding="utf-8")
        specials = special_tokens_from_info(tokenizer_info) if tokenizer_info else None
        return PromptParser(learn_from_template(source, tokenizer=tokenizer,
                                                special_tokens=specials,
                                                name=f"{name}:chat_template"))
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return PromptParser(learn_from_tokenizer(tokenizer, name=f"{name}:tokenizer"))
    if tokenizer_info is not None:
        info_template = tokenizer_info.get("chat_template")
        if isinstance(info_template, str) and info_template:
            return PromptParser(learn_from_template(
                info_template, tokenizer=tokenizer,
                special_tokens=special_tokens_from_info(tokenizer_info),
                name=f"{name}:tokenizer_info"))
    return PromptParser(None)
