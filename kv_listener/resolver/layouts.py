"""The shape of a chat template (`ChatLayout`, `SystemForm`) and the built-in layouts of the
common families, recognized on decoded text when no template of the source is known.

Owns: the two layout types, shared by the probe (`resolver.probe`, which learns a layout by
rendering a template) and the parser (`resolver.parser`, which reads a prompt with one), the one
way their patterns are compiled, and `BUILTIN_LAYOUTS`, written from the families' public chat
templates. Imports neither transformers nor the parser: a layout is data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import regex


@dataclass(frozen=True, slots=True)
class SystemForm:
    """How one system-like role (system, developer) is laid out.

    `opener` matches from the start of the prompt to the first character of the system content;
    `close` is searched for from there (its first match ends the content); `after` matches at
    the close's start and ends at the first character of the following user content.
    """

    opener: Any  # regex.Pattern[str]
    close: Any
    after: Any


@dataclass(frozen=True, slots=True)
class ChatLayout:
    """The shape of one chat template, learned or built in."""

    name: str
    system_forms: tuple[SystemForm, ...]
    user_opener: Any  # regex.Pattern[str]: start of prompt -> first user content
    user_close: Any | None  # regex.Pattern[str]: ends a user content (None: unknown)
    default_system: Any | None = None  # regex.Pattern[str]; fullmatch => "no system"
    merged_system: bool = False  # system content shares the first user turn (Mistral v0.3)
    trims_content: bool = False  # the template strips content (Llama 3 `| trim`)


def compile_pattern(pattern: str) -> Any:
    """A layout pattern: `regex` (V0), whose `partial=True` matching the parser relies on."""
    return regex.compile(pattern, regex.V0)


# --- built-in recognizers -------------------------------------------------------------------


def _builtin(name: str, *, systems: Sequence[tuple[str, str, str]], user_opener: str,
             user_close: str, default_system: str | None = None,
             trims: bool = False) -> ChatLayout:
    return ChatLayout(
        name=name,
        system_forms=tuple(SystemForm(compile_pattern(o), compile_pattern(c), compile_pattern(a))
                           for o, c, a in systems),
        user_opener=compile_pattern(user_opener), user_close=compile_pattern(user_close),
        default_system=compile_pattern(default_system) if default_system is not None else None,
        trims_content=trims,
    )


_LLAMA3_BOS = r"(?:<\|begin_of_text\|>)?"
_LLAMA3_SYSTEM_PREAMBLE = (r"(?:Environment: ipython\n)?"
                           r"(?:Cutting Knowledge Date: [^\n]*\nToday Date: [^\n]*\n\n)?")
_MISTRAL_BOS = r"(?:<s>)?"

#: Families recognized on the decoded text when no template is available. Rules are written from
#: the families' public chat templates (Qwen 2.5 / Qwen 3 / Phi-4 ChatML, Llama 3.0-3.3,
#: Mistral v0.1-v0.3 and v7 "tekken", Gemma 1-3, Phi-3/3.5, DeepSeek V2.5/V3/R1).
BUILTIN_LAYOUTS: tuple[ChatLayout, ...] = (
    _builtin(
        "chatml",
        systems=[(r"<\|im_start\|>(?:system|developer)(?:\n|<\|im_sep\|>)", r"<\|im_end\|>",
                  r"<\|im_end\|>\n?<\|im_start\|>user(?:\n|<\|im_sep\|>)")],
        user_opener=r"<\|im_start\|>user(?:\n|<\|im_sep\|>)", user_close=r"<\|im_end\|>",
        # Qwen 2.5's injected default (Qwen 2's "You are a helpful assistant." is left out: it
        # is too common as a real system prompt to be read as "no system").
        default_system=regex.escape(
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    ),
    _builtin(
        "llama3",
        systems=[(_LLAMA3_BOS + r"<\|start_header_id\|>(?:system|developer)<\|end_header_id\|>\n\n"
                  + _LLAMA3_SYSTEM_PREAMBLE, r"<\|eot_id\|>",
                  r"<\|eot_id\|><\|start_header_id\|>user<\|end_header_id\|>\n\n")],
        user_opener=_LLAMA3_BOS + r"<\|start_header_id\|>user<\|end_header_id\|>\n\n",
        user_close=r"<\|eot_id\|>", default_system="", trims=True,
    ),
    _builtin(
        "mistral",
        systems=[(_MISTRAL_BOS + r"\[SYSTEM_PROMPT\]", r"\[/SYSTEM_PROMPT\]",
                  r"\[/SYSTEM_PROMPT\]\[INST\] ?")],
        user_opener=_MISTRAL_BOS + r" ?\[INST\] ?", user_close=r" ?\[/INST\]",
    ),
    _builtin(
        "gemma",
        systems=[],
        user_opener=r"(?:<bos>)?<start_of_turn>user\n", user_close=r"<end_of_turn>", trims=True,
    ),
    _builtin(
        "phi3",
        systems=[(r"(?:<s>)?<\|system\|>\n?", r"<\|end\|>", r"<\|end\|>\n?<\|user\|>\n?")],
        user_opener=r"(?:<s>)?<\|user\|>\n?", user_close=r"<\|end\|>",
    ),
    _builtin(
        "deepseek",
        systems=[("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜User｜>")],
        user_opener="<｜begin▁of▁sentence｜><｜User｜>",
        user_close="<｜Assistant｜>|<｜end▁of▁sentence｜>", default_system="",
    ),
)
