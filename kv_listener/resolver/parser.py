"""The parser: read the system prompt and the first message out of the decoded text of a block
chain, with one learned layout or the built-in ones (SPEC §2, listener side).

Owns: `PromptParser.parse_prompt`, which turns the decoded text of a chain into a `ParsedPrompt`
(status, system text for the `S` rule or first-message text for the `M` rule, and the point in
the text that decides the key), and `NoKeyReason`, why a chain never gets a key. A decoded chain
may end inside a multi-byte character (the engine's decoder then writes U+FFFD) or inside an end
delimiter; a content is usable once it is complete or its first `max_prefix_length` bytes are
known, since the key depends on nothing after them. Pure: regex matching only.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_listener.core.model import ResolveStatus
from kv_listener.core.prefix import DEFAULT_MAX_PREFIX_LENGTH
from kv_listener.resolver.layouts import BUILTIN_LAYOUTS, ChatLayout, SystemForm

#: The character an engine's decoder puts where a token ends inside a multi-byte character.
REPLACEMENT_CHAR = "\ufffd"


class NoKeyReason(enum.StrEnum):
    """Why a decoded chain never gets a key. Values are metric labels."""

    NOT_CHAT = "not_chat"  # no chat layout (plain completions, or a layout we cannot read)
    TEMPLATE_UNKNOWN = "template_unknown"  # looks templated, but no known family matched
    NO_TEXT = "no_text"  # chat prompt with an empty system prompt and an empty first message


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
