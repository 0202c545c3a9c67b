"""Chat templates: learn where a system prompt and a first message sit in a templated prompt,
and extract them from a decoded chain (SPEC §2, listener side).

Owns: `ChatLayout` (the learned or built-in shape of one template), the probe that learns a
layout by rendering sentinel conversations through transformers' `apply_chat_template`, the
built-in recognizers for the common families, and `PromptParser.parse_prompt`, which turns the
decoded text of a chain into (status, system text, first-message text).

How a template is learned: render [system S, user U], [developer S, user U], [user U] (with and
without the generation prompt) and [user U, assistant A] with sentinel strings, then read off
the text before the system content, the text between the system content and the user content,
the text before a first user message, and what ends a user message. When the user-only render
already holds a system block (`<system opener> D <between>`), the template injects a default
system prompt D (Qwen 2.5; Llama 3.1/3.2 inject an empty one after their date lines); a prompt
whose system content is D counts as "no system" (the `M` rule), like the request side, which only
sees the messages. A template that raises on a system role (Gemma, old Mistral) still yields the
user layout, which is all the `M` rule needs. `strftime_now(...)` dates in a template (Llama 3.2)
become wildcards, so a layout learned today still matches tomorrow's prompts.

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

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import regex
import structlog

from kv_listener.core.model import ResolveStatus
from kv_listener.core.prefix import DEFAULT_MAX_PREFIX_LENGTH
from kv_listener.logging import adopt_transformers_logging

log = structlog.get_logger(__name__)

# _lazy_transformers: `transformers` is imported inside the functions that need it. It takes about
# a second to import, and most runs (`config validate`, salt-only or router processes) never
# render a template or load a tokenizer.

#: The character an engine's decoder puts where a token ends inside a multi-byte character.
REPLACEMENT_CHAR = "\ufffd"

# Sentinels: ASCII, no whitespace at the edges (so `| trim` keeps them), unlikely in templates.
_SYS = "KvlSysProbe7Q"
_USR = "KvlUsrProbe3Z"
_AST = "KvlAstProbe5W"
# Placeholders put into rendered text before it becomes a pattern: a date from strftime_now, and
# a special token whose text is unknown (template file rendered without a tokenizer).
_DATE = "\x00"
_UNKNOWN_TOKEN = "\x01"
_DATE_RE = r"[^\n]{1,64}?"
_UNKNOWN_TOKEN_RE = r"[^\n]{0,64}?"
_STRFTIME_RE = re.compile(r"""strftime_now\(\s*(['"])(.*?)\1\s*\)""")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")


class NoKeyReason(enum.StrEnum):
    """Why a decoded chain never gets a key. Values are metric labels."""

    NOT_CHAT = "not_chat"  # no chat layout (plain completions, or a layout we cannot read)
    TEMPLATE_UNKNOWN = "template_unknown"  # looks templated, but no known family matched
    NO_TEXT = "no_text"  # chat prompt with an empty system prompt and an empty first message


class TemplateProbeError(Exception):
    """A chat template could not be learned (does not render a user message, ...)."""


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """Result of `PromptParser.parse_prompt`. `system_text` is set for the `S` rule,
    `first_text` for the `M` rule (possibly only the first `max_prefix_length` bytes of it)."""

    status: ResolveStatus
    system_text: str | None = None
    first_text: str | None = None
    reason: str | None = None
    layout: str | None = None  # name of the layout that parsed it
    #: RESOLVED: how many leading characters of the text decide the key (the content's end
    #: delimiter included, or the characters that reach `max_prefix_length` bytes): the text cut
    #: there parses to the same key, one character less does not. None: only the whole text
    #: (its last character is a cut multi-byte character).
    decided_at: int | None = None


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


def _compile(pattern: str) -> Any:
    return regex.compile(pattern, regex.V0)


def _pattern_of(rendered: str) -> str:
    """Rendered text (with placeholders) -> a regex matching it literally, placeholders wild."""
    out: list[str] = []
    for ch_run in re.split(f"([{_DATE}{_UNKNOWN_TOKEN}])", rendered):
        if ch_run == _DATE:
            out.append(_DATE_RE)
        elif ch_run == _UNKNOWN_TOKEN:
            out.append(_UNKNOWN_TOKEN_RE)
        elif ch_run:
            out.append(regex.escape(ch_run))
    return "".join(out)


def _common_prefix(strings: Sequence[str]) -> str:
    if not strings:
        return ""
    first, last = min(strings), max(strings)
    n = 0
    while n < len(first) and first[n] == last[n]:
        n += 1
    return first[:n]


def _close_core(text: str) -> str:
    """What ends a content, from the rendered text after it: up to its trailing whitespace
    ("<|im_end|>\\n" -> "<|im_end|>") so that a chain cut right after the end token resolves;
    whitespace-only separators ("\\n\\n") are kept whole. "" when nothing follows."""
    text = text.split(_DATE, 1)[0]
    core = text.rstrip()
    return core if core else text


def _close_pattern(*cores: str) -> Any | None:
    """A pattern matching the earliest of the given (non-empty) close texts."""
    alternatives = [_pattern_of(c) for c in dict.fromkeys(cores) if c]
    if not alternatives:
        return None
    return _compile("|".join(f"(?:{a})" for a in alternatives))


# --- learning a layout by rendering -------------------------------------------------------------

Render = Callable[[list[dict[str, str]], bool], str]


def _date_formats(template_source: str | None) -> list[str]:
    if not template_source:
        return []
    return [m.group(2) for m in _STRFTIME_RE.finditer(template_source)]


def _mask_dates(text: str, formats: Sequence[str]) -> str:
    if not formats:
        return text
    now = datetime.now()
    # Today and yesterday: a probe running across midnight still masks what it rendered.
    for day in (now, now - timedelta(days=1)):
        for fmt in formats:
            try:
                stamp = day.strftime(fmt)
            except ValueError:
                continue
            if stamp and stamp not in (_SYS, _USR, _AST):
                text = text.replace(stamp, _DATE)
    return text


def learn_layout(
    render: Render, *, name: str = "learned", template_source: str | None = None
) -> ChatLayout:
    """Learn a `ChatLayout` from a render function (messages, add_generation_prompt) -> text.

    Raises `TemplateProbeError` when the template cannot render a single user message.
    """
    formats = _date_formats(template_source)

    def try_render(messages: list[dict[str, str]], gen: bool) -> str | None:
        try:
            return _mask_dates(render(messages, gen), formats)
        except Exception:  # templates raise anything (TemplateError, TypeError ...)
            return None

    user_only = try_render([{"role": "user", "content": _USR}], False)
    if user_only is None or user_only.count(_USR) != 1:
        raise TemplateProbeError(f"{name}: the template does not render a single user message")
    i_user = user_only.index(_USR)
    user_prefix = user_only[:i_user]
    after_user = [user_only[i_user + len(_USR):]]
    user_gen = try_render([{"role": "user", "content": _USR}], True)
    if user_gen is not None and user_gen.count(_USR) == 1:
        after_user.append(user_gen[user_gen.index(_USR) + len(_USR):])
    dialog = try_render(
        [{"role": "user", "content": _USR}, {"role": "assistant", "content": _AST}], False)
    if dialog is not None and dialog.count(_USR) == 1 and dialog.count(_AST) == 1:
        i_u, i_a = dialog.index(_USR), dialog.index(_AST)
        if i_a > i_u:
            after_user.append(dialog[i_u + len(_USR):i_a])
    user_core = _close_core(_common_prefix([a for a in after_user if a]))
    user_close = _close_pattern(user_core)

    parts: list[tuple[str, str]] = []  # (before, between) per system-like role, system first
    for role in ("system", "developer"):
        text = try_render([{"role": role, "content": _SYS}, {"role": "user", "content": _USR}],
                          False)
        if text is None or text.count(_SYS) != 1 or text.count(_USR) != 1:
            continue
        i_s, i_u = text.index(_SYS), text.index(_USR)
        if i_u < i_s or not _close_core(text[i_s + len(_SYS):i_u]):
            continue
        part = (text[:i_s], text[i_s + len(_SYS):i_u])
        if part not in parts:
            parts.append(part)

    default_system = None
    merged = False
    if parts:
        before, between = parts[0]
        if (between and user_prefix.startswith(before) and user_prefix.endswith(between)
                and len(user_prefix) >= len(before) + len(between)):
            injected = user_prefix[len(before):len(user_prefix) - len(between)]
            default_system = _compile(_pattern_of(injected))
        elif user_prefix.startswith(before):
            merged = True

    forms: list[SystemForm] = []
    for before, between in parts:
        cores = [_close_core(between)]
        # Whatever ends a user message usually ends any message (<|im_end|>, <|eot_id|>): a
        # system prompt followed by an assistant turn then still ends at the right place. Not
        # for merged layouts, where the user close ends the shared turn, nor for a whitespace
        # close ("\n"), which system prompts contain.
        if not merged and user_core.strip():
            cores.append(user_core)
        forms.append(SystemForm(opener=_compile(_pattern_of(before)),
                                close=_close_pattern(*cores),
                                after=_compile(_pattern_of(between))))

    trims = False
    padded_user = " \n" + _USR + "\n "
    padded_sys = " \n" + _SYS + "\n "
    probe = (try_render([{"role": "system", "content": padded_sys},
                         {"role": "user", "content": padded_user}], False) if forms else None)
    if probe is None:
        probe = try_render([{"role": "user", "content": padded_user}], False)
        trims = probe is not None and padded_user not in probe
    else:
        trims = padded_user not in probe or padded_sys not in probe

    layout = ChatLayout(
        name=name, system_forms=tuple(forms), user_opener=_compile(_pattern_of(user_prefix)),
        user_close=user_close, default_system=default_system, merged_system=merged,
        trims_content=trims,
    )
    log.info("chat_template_learned", layout=name, system_roles=len(forms),
             default_system=default_system is not None, merged_system=merged,
             trims_content=trims, user_close_known=user_close is not None)
    return layout


def learn_from_tokenizer(
    tokenizer: Any, *, chat_template: str | None = None, name: str = "learned",
    check_round_trip: bool = True,
) -> ChatLayout:
    """Learn the layout of `chat_template` (default: the tokenizer's own) rendered with the
    tokenizer's special tokens through `apply_chat_template(..., tokenize=False)`. With
    `check_round_trip`, warn when the tokenizer does not decode its own encoding of a rendered
    prompt back to the same text."""
    source = chat_template if chat_template is not None else getattr(tokenizer, "chat_template",
                                                                     None)
    if isinstance(source, Mapping):  # named templates: transformers renders "default"
        source = source.get("default")
    if not source:
        raise TemplateProbeError(f"{name}: the tokenizer has no chat template")

    def render(messages: list[dict[str, str]], gen: bool) -> str:
        out = tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                            tokenize=False, add_generation_prompt=gen)
        if not isinstance(out, str):
            raise TypeError("apply_chat_template did not return text")
        return out

    layout = learn_layout(render, name=name, template_source=str(source))
    if check_round_trip:
        _check_round_trip(tokenizer, render, name)
    return layout


def _check_round_trip(tokenizer: Any, render: Render, name: str) -> None:
    """Warn when decode(encode(rendered)) != rendered: keys would then differ on the two sides."""
    try:
        text = render([{"role": "user", "content": "Round trip 안녕 " + _USR}], False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=False)
    except Exception:  # a probe: any failure just means "unknown"
        return
    if back != text:
        log.warning("chat_template_round_trip_inexact", layout=name)


def _bare_tokenizer(special_tokens: Mapping[str, str] | None) -> Any:
    """A vocabulary-less fast tokenizer that only carries special-token texts, to render a
    template file through transformers' own `apply_chat_template` without a model tokenizer.
    Unknown special tokens render as a placeholder that matches any short text."""
    from tokenizers import Tokenizer, models  # noqa: PLC0415 - see _lazy_transformers
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - see _lazy_transformers

    adopt_transformers_logging()

    unk = "[UNK]"
    tok = Tokenizer(models.WordLevel({unk: 0}, unk_token=unk))
    specials: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = (special_tokens or {}).get(key)
        specials[key] = value if isinstance(value, str) and value else _UNKNOWN_TOKEN
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)  # type: ignore[no-untyped-call]


def learn_from_template(
    chat_template: str,
    *,
    special_tokens: Mapping[str, str] | None = None,
    tokenizer: Any = None,
    name: str = "chat_template",
) -> ChatLayout:
    """Learn a template given as Jinja source: rendered with `tokenizer` when there is one,
    else with `special_tokens` (e.g. from vLLM's `/tokenizer_info`), else with placeholders.
    The round-trip check needs the model's tokenizer: the stand-in used without one has no
    vocabulary, so its inexact round trip would say nothing about the engine's decoding."""
    if tokenizer is not None:
        return learn_from_tokenizer(tokenizer, chat_template=chat_template, name=name)
    return learn_from_tokenizer(_bare_tokenizer(special_tokens), chat_template=chat_template,
                                name=name, check_round_trip=False)


def special_tokens_from_info(info: Mapping[str, Any]) -> dict[str, str]:
    """Special-token texts of a vLLM `/tokenizer_info` answer (or a tokenizer_config.json):
    values are strings or `{"content": str, ...}` (serialized AddedToken)."""
    out: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = info.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str) and value:
            out[key] = value
    return out


# --- built-in recognizers -------------------------------------------------------------------


def _builtin(name: str, *, systems: Sequence[tuple[str, str, str]], user_opener: str,
             user_close: str, default_system: str | None = None,
             trims: bool = False) -> ChatLayout:
    return ChatLayout(
        name=name,
        system_forms=tuple(SystemForm(_compile(o), _compile(c), _compile(a))
                           for o, c, a in systems),
        user_opener=_compile(user_opener), user_close=_compile(user_close),
        default_system=_compile(default_system) if default_system is not None else None,
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

# A prompt starting like a special token or an [INST]-style marker is "templated but unknown"
# rather than "not a chat prompt".
_TEMPLATED_HEAD = re.compile(r"^\s*(?:<[^<>\s]{1,48}>|<｜[^｜]{1,48}｜>|\[[A-Z_]{2,32}\])")


# --- parsing ----------------------------------------------------------------------------------


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


class _Cut:
    """The decoded text and whether a partial character was dropped from its end."""

    __slots__ = ("cut_char", "text")

    def __init__(self, text: str) -> None:
        stripped = text.rstrip(REPLACEMENT_CHAR)
        self.cut_char = len(stripped) != len(text)
        self.text = stripped


def _cut_at(text: str, start: int, end: int, max_prefix_length: int) -> int | None:
    """The offset after the first characters of `text[start:end]` whose UTF-8 bytes reach
    `max_prefix_length` (the truncated key depends on nothing after it), or None."""
    total = 0
    for i in range(start, end):
        total += _utf8_len(text[i])
        if total >= max_prefix_length:
            return i + 1
    return None


def _close_end(close: Any, text: str, start: int, m: Any) -> int:
    """The shortest text end at which `close` already matches completely where `m` starts (a
    learned close is an alternation: `<|im_end|>\n<|im_start|>user` or `<|im_end|>`; the
    search takes the first alternative, but the second already ends the content)."""
    for end in range(m.start() + 1, m.end()):
        early = close.search(text, start, end, partial=True)
        if early is not None and not early.partial and early.start() == m.start():
            return end
    return int(m.end())


def _content(cut: _Cut, start: int, close: Any | None, max_prefix_length: int
             ) -> tuple[str, bool, int, int | None] | None:
    """(content, complete, end, decided_at) from `start` to `close`, or None when too little is
    known.

    Complete: the close matched fully (it starts at `end`). Otherwise the known content
    excludes a partial close at the end; it is usable once its bytes (plus one for a cut
    character right at the end) reach `max_prefix_length`, because the truncated key then no
    longer depends on the rest. `decided_at`: the first characters whose bytes reach
    `max_prefix_length` end the text the key depends on, else the shortest complete close does
    (None: only a cut character at the very end makes up the count).
    """
    text = cut.text
    end = len(text)
    if close is not None:
        m = close.search(text, start, partial=True)
        if m is not None and not m.partial:
            at = _cut_at(text, start, m.start(), max_prefix_length)
            return (text[start:m.start()], True, m.start(),
                    at if at is not None else _close_end(close, text, start, m))
        if m is not None:
            end = m.start()
    known = text[start:end]
    known_bytes = _utf8_len(known) + (1 if cut.cut_char and end == len(text) else 0)
    if known_bytes < max_prefix_length:
        return None
    return known, False, end, _cut_at(text, start, end, max_prefix_length)


def _parse_layout(layout: ChatLayout, cut: _Cut, max_prefix_length: int) -> ParsedPrompt | None:
    """Parse with one layout; None when the prompt does not start like this layout."""
    text = cut.text
    partial_seen = False
    best: tuple[int, SystemForm] | None = None
    for form in layout.system_forms:
        m = form.opener.match(text, partial=True)
        if m is None:
            continue
        if m.partial:
            partial_seen = True
            continue
        # The longest opener wins: a template with a default system prompt renders a developer
        # message after its default system block, so the system opener also matches there.
        if best is None or m.end() > best[0]:
            best = (m.end(), form)
    if best is not None:
        return _parse_system(layout, best[1], cut, best[0], max_prefix_length)
    m = layout.user_opener.match(text, partial=True)
    if m is not None and not m.partial:
        return _parse_user(layout, cut, m.end(), max_prefix_length)
    if m is not None or partial_seen:
        return ParsedPrompt(ResolveStatus.PENDING, layout=layout.name)
    return None


def _parse_system(layout: ChatLayout, form: SystemForm, cut: _Cut, start: int,
                  max_prefix_length: int) -> ParsedPrompt:
    text = cut.text
    pending = ParsedPrompt(ResolveStatus.PENDING, layout=layout.name)
    if layout.merged_system and layout.user_close is not None:
        # The system content shares the user turn: a user close before the system close means
        # there was no system prompt at all.
        s = form.close.search(text, start)
        u = layout.user_close.search(text, start)
        if u is not None and (s is None or u.start() < s.start()):
            m = layout.user_opener.match(text)
            return _parse_user(layout, cut, m.end() if m is not None else start,
                               max_prefix_length)
    got = _content(cut, start, form.close, max_prefix_length)
    if got is None:
        return pending
    content, complete, end, decided_at = got
    if not complete:
        if layout.default_system is not None:
            d = layout.default_system.fullmatch(content, partial=True)
            if d is not None:  # could still turn out to be the default system prompt
                return pending
        if layout.merged_system:  # cannot tell system from user yet: read it as the message
            return ParsedPrompt(ResolveStatus.RESOLVED, first_text=content, layout=layout.name,
                                decided_at=decided_at)
        return ParsedPrompt(ResolveStatus.RESOLVED, system_text=content, layout=layout.name,
                            decided_at=decided_at)
    if layout.default_system is not None and layout.default_system.fullmatch(content):
        content = ""
    if content:
        if layout.default_system is not None and decided_at is not None and \
                layout.default_system.fullmatch(text[start:decided_at], partial=True) is not None:
            # Cut there, the content could still be the default system prompt.
            decided_at = _close_end(form.close, text, start, form.close.search(text, start))
        return ParsedPrompt(ResolveStatus.RESOLVED, system_text=content, layout=layout.name,
                            decided_at=decided_at)
    # Empty or default system prompt: the key comes from the first user message (M rule).
    m = form.after.match(text, end, partial=True)
    if m is None:
        return ParsedPrompt(ResolveStatus.UNATTRIBUTED, reason=NoKeyReason.NOT_CHAT.value,
                            layout=layout.name)
    if m.partial:
        return pending
    return _parse_user(layout, cut, m.end(), max_prefix_length)


def _parse_user(layout: ChatLayout, cut: _Cut, start: int, max_prefix_length: int
                ) -> ParsedPrompt:
    got = _content(cut, start, layout.user_close, max_prefix_length)
    if got is None:
        return ParsedPrompt(ResolveStatus.PENDING, layout=layout.name)
    content, _complete, _end, decided_at = got
    if not content:
        return ParsedPrompt(ResolveStatus.UNATTRIBUTED, reason=NoKeyReason.NO_TEXT.value,
                            layout=layout.name)
    return ParsedPrompt(ResolveStatus.RESOLVED, first_text=content, layout=layout.name,
                        decided_at=decided_at)


class PromptParser:
    """Extracts (system text, first-message text) from decoded chains of one source.

    With a `layout` (learned from the source's template) only that layout is used; without one,
    the built-in recognizers are tried in order.
    """

    def __init__(self, layout: ChatLayout | None = None,
                 builtins: Sequence[ChatLayout] = BUILTIN_LAYOUTS) -> None:
        self.layout = layout
        self._layouts: tuple[ChatLayout, ...] = (layout,) if layout is not None else tuple(
            builtins)

    @property
    def source(self) -> str:
        return self.layout.name if self.layout is not None else "builtin"

    def parse_prompt(self, text: str,
                     max_prefix_length: int = DEFAULT_MAX_PREFIX_LENGTH) -> ParsedPrompt:
        """RESOLVED (with `system_text` or `first_text`), PENDING (the content is not complete
        and shorter than `max_prefix_length` bytes so far) or UNATTRIBUTED (with a reason)."""
        cut = _Cut(text)
        for layout in self._layouts:
            parsed = _parse_layout(layout, cut, max_prefix_length)
            if parsed is not None:
                return parsed
        if self.layout is None and _TEMPLATED_HEAD.match(cut.text):
            reason = NoKeyReason.TEMPLATE_UNKNOWN
        else:
            reason = NoKeyReason.NOT_CHAT
        return ParsedPrompt(ResolveStatus.UNATTRIBUTED, reason=reason.value)

    def trims_content(self, parsed: ParsedPrompt) -> bool:
        """Did a content-altering template (`| trim`) produce this result?"""
        for layout in self._layouts:
            if layout.name == parsed.layout:
                return layout.trims_content
        return False


#: The tiny ChatML tokenizer shipped for `continuum-kv-listener demo` (a copy of
#: fixtures/tokenizers/chatml, built by fixtures/make_tokenizers.py).
DEMO_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "data" / "demo-tokenizer"


def load_tokenizer(path: str | Path) -> Any:
    """A local tokenizer directory through `AutoTokenizer` (files only: never the Hub)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - see _lazy_transformers

    adopt_transformers_logging()

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


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
