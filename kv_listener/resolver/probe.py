"""The probe: learn a `ChatLayout` from a chat template by rendering it through transformers
(SPEC §2, listener side), and load the local tokenizers it renders with.

Owns: `learn_layout` (from any render function), `learn_from_tokenizer` (a tokenizer's own or a
given template, through `apply_chat_template`), `learn_from_template` (a Jinja source, with a
vocabulary-less stand-in tokenizer when there is no model tokenizer), the special-token texts of
a vLLM `/tokenizer_info` answer, `TemplateProbeError`, `load_tokenizer` and the demo tokenizer.

How a template is learned: render [system S, user U], [developer S, user U], [user U] (with and
without the generation prompt) and [user U, assistant A] with sentinel strings, then read off
the text before the system content, the text between the system content and the user content,
the text before a first user message, and what ends a user message. When the user-only render
already holds a system block (`<system opener> D <between>`), the template injects a default
system prompt D (Qwen 2.5; Llama 3.1/3.2 inject an empty one after their date lines); a prompt
whose system content is D counts as "no system" (the `M` rule), like the request side, which only
sees the messages. A template that raises on a system role (Gemma, old Mistral) still yields the
user layout, which is all the `M` rule needs. `strftime_now(...)` dates in a template (Llama 3.2)
become wildcards, so a layout learned today still matches tomorrow's prompts. A template that
strips content (`| trim`) is detected (`ChatLayout.trims_content`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import regex
import structlog

from kv_listener.logging import adopt_transformers_logging
from kv_listener.resolver.layouts import ChatLayout, SystemForm, compile_pattern

log = structlog.get_logger(__name__)

# _lazy_transformers: `transformers` is imported inside the functions that need it. It takes about
# a second to import, and most runs (`config validate`, salt-only or router processes) never
# render a template or load a tokenizer.

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


class TemplateProbeError(Exception):
    """A chat template could not be learned (does not render a user message, ...)."""


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
    return compile_pattern("|".join(f"(?:{a})" for a in alternatives))


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
            default_system = compile_pattern(_pattern_of(injected))
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
        forms.append(SystemForm(opener=compile_pattern(_pattern_of(before)),
                                close=_close_pattern(*cores),
                                after=compile_pattern(_pattern_of(between))))

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
        name=name, system_forms=tuple(forms), user_opener=compile_pattern(_pattern_of(user_prefix)),
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


#: The tiny ChatML tokenizer shipped for `continuum-kv-listener demo` (a copy of
#: fixtures/tokenizers/chatml, built by fixtures/make_tokenizers.py).
DEMO_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "data" / "demo-tokenizer"


def load_tokenizer(path: str | Path) -> Any:
    """A local tokenizer directory through `AutoTokenizer` (files only: never the Hub)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - see _lazy_transformers

    adopt_transformers_logging()

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
