"""Chat-template learning and prompt parsing (SPEC §2, listener side), on the tiny real
tokenizers of fixtures/tokenizers (built offline by fixtures/make_tokenizers.py)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kv_listener.core.model import ResolveStatus
from kv_listener.core.prefix import prefix_key
from kv_listener.resolver.layouts import BUILTIN_LAYOUTS
from kv_listener.resolver.parser import ParsedPrompt, PromptParser
from kv_listener.resolver.probe import (
    TemplateProbeError,
    learn_from_template,
    special_tokens_from_info,
)
from kv_listener.resolver.template import build_prompt_parser
from tests.support.tokenizers import TOKENIZERS, parser, tokenizer

NAMES = ["chatml", "default-system", "llama3", "llama3-dated", "no-system"]
SYSTEM_OK = ["chatml", "default-system", "llama3", "llama3-dated"]


def render(name: str, messages: list[dict[str, str]], gen: bool = True) -> str:
    out = tokenizer(name).apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert isinstance(out, str)
    return out


def key_of(parsed: ParsedPrompt, model: str = "m", limit: int = 1024) -> bytes | None:
    assert parsed.status is ResolveStatus.RESOLVED, parsed
    return prefix_key(model, parsed.system_text, parsed.first_text, limit)


SYS = "You are a careful assistant. 답은 한국어로."
USR = "안녕하세요, 도와주세요"


# --- learned layouts of the fixture templates ---------------------------------------------------


def test_learned_flags() -> None:
    chatml = parser("chatml").layout
    assert chatml is not None
    assert len(chatml.system_forms) == 2  # system and developer
    assert chatml.default_system is None and not chatml.trims_content
    assert not chatml.merged_system

    default = parser("default-system").layout
    assert default is not None and default.default_system is not None
    assert default.default_system.fullmatch(
        "You are Tiny, a small model trained for tests. You are a helpful assistant.")

    llama3 = parser("llama3").layout
    assert llama3 is not None and llama3.trims_content and llama3.default_system is None

    dated = parser("llama3-dated").layout
    assert dated is not None and dated.trims_content
    assert dated.default_system is not None and dated.default_system.fullmatch("")

    no_system = parser("no-system").layout
    assert no_system is not None and no_system.system_forms == ()
    assert no_system.trims_content


@pytest.mark.parametrize("name", SYSTEM_OK)
def test_system_rule(name: str) -> None:
    text = render(name, [{"role": "system", "content": SYS}, {"role": "user", "content": USR}])
    parsed = parser(name).parse_prompt(text)
    assert parsed.status is ResolveStatus.RESOLVED
    assert parsed.system_text == SYS and parsed.first_text is None
    assert parsed.layout == name


@pytest.mark.parametrize("name", SYSTEM_OK)
def test_developer_role_is_a_system_prompt(name: str) -> None:
    text = render(name, [{"role": "developer", "content": SYS}, {"role": "user", "content": USR}])
    assert parser(name).parse_prompt(text).system_text == SYS


@pytest.mark.parametrize("name", NAMES)
def test_first_message_rule(name: str) -> None:
    text = render(name, [{"role": "user", "content": USR}, {"role": "assistant", "content": "네"},
                         {"role": "user", "content": "more"}])
    parsed = parser(name).parse_prompt(text)
    assert parsed.status is ResolveStatus.RESOLVED
    assert parsed.system_text is None and parsed.first_text == USR


@pytest.mark.parametrize("name", SYSTEM_OK)
def test_empty_system_uses_first_message(name: str) -> None:
    text = render(name, [{"role": "system", "content": ""}, {"role": "user", "content": USR}])
    parsed = parser(name).parse_prompt(text)
    assert (parsed.system_text, parsed.first_text) == (None, USR)


def test_default_system_prompt_counts_as_no_system() -> None:
    text = render("default-system", [{"role": "user", "content": USR}])
    assert "You are Tiny" in text  # the template really injected it
    parsed = parser("default-system").parse_prompt(text)
    assert (parsed.system_text, parsed.first_text) == (None, USR)


def test_dated_template_matches_prompts_of_another_day() -> None:
    text = render("llama3-dated", [{"role": "system", "content": SYS},
                                   {"role": "user", "content": USR}])
    today = dt.datetime.now().strftime("%d %b %Y")
    assert today in text
    other_day = text.replace(today, "01 Jan 2031")
    assert parser("llama3-dated").parse_prompt(other_day).system_text == SYS
    no_system = render("llama3-dated", [{"role": "user", "content": USR}]).replace(
        today, "31 Dec 2029")
    assert parser("llama3-dated").parse_prompt(no_system).first_text == USR


def test_no_system_template_rejects_system_but_parses_users() -> None:
    with pytest.raises(Exception, match="System role not supported"):
        render("no-system", [{"role": "system", "content": SYS}, {"role": "user", "content": USR}])
    text = render("no-system", [{"role": "user", "content": "  padded  "}])
    # Gemma-style `| trim`: the template strips the content (a documented limit).
    assert parser("no-system").parse_prompt(text).first_text == "padded"


def test_trim_limit_is_visible() -> None:
    text = render("llama3", [{"role": "system", "content": "  spaced \n"},
                             {"role": "user", "content": USR}])
    parsed = parser("llama3").parse_prompt(text)
    assert parsed.system_text == "spaced"
    assert parser("llama3").trims_content(parsed)
    assert not parser("chatml").trims_content(
        parser("chatml").parse_prompt(render("chatml", [{"role": "user", "content": "x"}])))


@pytest.mark.parametrize("name", NAMES)
def test_empty_first_message_has_no_text(name: str) -> None:
    text = render(name, [{"role": "user", "content": ""}])
    parsed = parser(name).parse_prompt(text)
    assert parsed.status is ResolveStatus.UNATTRIBUTED and parsed.reason == "no_text"


# --- growing chains: every prefix of the prompt is PENDING or the right key ---------------------


def _walk(name: str, messages: list[dict[str, str]], limit: int) -> list[ResolveStatus]:
    full = render(name, messages)
    expected = key_of(parser(name).parse_prompt(full, limit), limit=limit)
    statuses: list[ResolveStatus] = []
    for i in range(len(full) + 1):
        parsed = parser(name).parse_prompt(full[:i], limit)
        assert parsed.status in (ResolveStatus.PENDING, ResolveStatus.RESOLVED), (i, parsed)
        if parsed.status is ResolveStatus.RESOLVED:
            assert key_of(parsed, limit=limit) == expected, (i, parsed)
        statuses.append(parsed.status)
    # Once resolved, a longer chain stays resolved (to the same key, checked above).
    first = statuses.index(ResolveStatus.RESOLVED)
    assert all(s is ResolveStatus.RESOLVED for s in statuses[first:])
    return statuses


@pytest.mark.parametrize("name", SYSTEM_OK)
@pytest.mark.parametrize("limit", [16, 1024])
def test_every_prefix_with_system(name: str, limit: int) -> None:
    statuses = _walk(name, [{"role": "system", "content": SYS * 3},
                            {"role": "user", "content": USR}], limit)
    assert statuses[0] is ResolveStatus.PENDING


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("limit", [16, 1024])
def test_every_prefix_without_system(name: str, limit: int) -> None:
    _walk(name, [{"role": "user", "content": USR * 3}], limit)


def test_resolution_by_length_before_the_end_delimiter() -> None:
    system = "가" * 400  # 1200 bytes
    full = render("chatml", [{"role": "system", "content": system},
                             {"role": "user", "content": USR}])
    head = full[: full.index(system) + 342]  # 342 characters = 1026 bytes, no end yet
    parsed = parser("chatml").parse_prompt(head)
    assert parsed.status is ResolveStatus.RESOLVED
    assert key_of(parsed) == prefix_key("m", system, None)
    shorter = full[: full.index(system) + 300]
    assert parser("chatml").parse_prompt(shorter).status is ResolveStatus.PENDING


def test_trailing_partial_character_is_dropped_and_counted() -> None:
    system = "가" * 400
    full = render("chatml", [{"role": "system", "content": system},
                             {"role": "user", "content": USR}])
    start = full.index(system)
    # 341 whole characters (1023 bytes) and a cut one: the first 1024 bytes are known.
    cut = full[: start + 341] + "\ufffd"
    parsed = parser("chatml").parse_prompt(cut)
    assert parsed.status is ResolveStatus.RESOLVED and parsed.system_text == "가" * 341
    assert key_of(parsed) == prefix_key("m", system, None)
    # 340 whole characters and a cut one: only 1021+ bytes known, not enough.
    assert parser("chatml").parse_prompt(full[: start + 340] + "\ufffd").status is (
        ResolveStatus.PENDING)


def test_cut_character_inside_short_content_is_pending() -> None:
    full = render("chatml", [{"role": "user", "content": "짧은 질문"}])
    cut = full[: full.index("질문")] + "\ufffd"
    assert parser("chatml").parse_prompt(cut).status is ResolveStatus.PENDING


# --- unattributed ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_plain_completion_is_not_chat(name: str) -> None:
    parsed = parser(name).parse_prompt("Once upon a time there was a tiny tokenizer.")
    assert parsed.status is ResolveStatus.UNATTRIBUTED and parsed.reason == "not_chat"


def test_builtins_tell_unknown_templates_from_plain_text() -> None:
    builtin = PromptParser(None)
    assert builtin.parse_prompt("<|weird_start|>system\nS").reason == "template_unknown"
    assert builtin.parse_prompt("[ROLE_X] hello").reason == "template_unknown"
    assert builtin.parse_prompt("Plain completion text").reason == "not_chat"
    # Nothing decoded yet cannot be judged.
    assert builtin.parse_prompt("").status is ResolveStatus.PENDING


def test_system_followed_by_assistant_is_not_chat_for_m_rule() -> None:
    text = render("chatml", [{"role": "system", "content": ""},
                             {"role": "assistant", "content": "A"},
                             {"role": "user", "content": "U"}])
    parsed = parser("chatml").parse_prompt(text)
    assert parsed.status is ResolveStatus.UNATTRIBUTED and parsed.reason == "not_chat"


# --- built-in recognizers (no template available) --------------------------------------------------

QWEN_DEFAULT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.mark.parametrize(("text", "system", "first", "family"), [
    ("<|im_start|>system\nS1<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n", "S1", None, "chatml"),
    ("<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\n", None, "U1", "chatml"),
    (f"<|im_start|>system\n{QWEN_DEFAULT}<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n",
     None, "U1", "chatml"),
    ("<|im_start|>system<|im_sep|>S4<|im_end|><|im_start|>user<|im_sep|>U4<|im_end|>",
     "S4", None, "chatml"),  # Phi-4
    ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
     "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nS2<|eot_id|>"
     "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>", "S2", None, "llama3"),
    ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
     "Cutting Knowledge Date: December 2023\nToday Date: 02 Mar 2026\n\n<|eot_id|>"
     "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>", None, "U2", "llama3"),
    ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nU3<|eot_id|>",
     None, "U3", "llama3"),
    ("<s>[SYSTEM_PROMPT]S5[/SYSTEM_PROMPT][INST]U5[/INST]", "S5", None, "mistral"),
    ("<s>[INST] U6 [/INST]", None, "U6", "mistral"),
    ("<s>[INST]U6[/INST]", None, "U6", "mistral"),
    ("<bos><start_of_turn>user\nU7<end_of_turn>\n<start_of_turn>model\n", None, "U7", "gemma"),
    ("<|system|>\nS8<|end|>\n<|user|>\nU8<|end|>\n<|assistant|>\n", "S8", None, "phi3"),
    ("<|user|>\nU8<|end|>\n<|assistant|>\n", None, "U8", "phi3"),
    ("<｜begin▁of▁sentence｜>S9<｜User｜>U9<｜Assistant｜>", "S9", None, "deepseek"),
    ("<｜begin▁of▁sentence｜><｜User｜>U9<｜Assistant｜>", None, "U9", "deepseek"),
])
def test_builtin_recognizers(text: str, system: str | None, first: str | None,
                             family: str) -> None:
    parsed = PromptParser(None).parse_prompt(text)
    assert parsed.status is ResolveStatus.RESOLVED, parsed
    assert (parsed.system_text, parsed.first_text, parsed.layout) == (system, first, family)


def test_builtin_families_are_all_listed() -> None:
    assert [layout.name for layout in BUILTIN_LAYOUTS] == [
        "chatml", "llama3", "mistral", "gemma", "phi3", "deepseek"]


@pytest.mark.parametrize("name", ["chatml", "llama3", "no-system"])
def test_builtins_agree_with_learned_on_fixture_prompts(name: str) -> None:
    for messages in ([{"role": "user", "content": USR}],
                     [{"role": "system", "content": SYS}, {"role": "user", "content": USR}]):
        try:
            text = render(name, messages)
        except Exception:  # no-system rejects the system role
            continue
        learned = parser(name).parse_prompt(text)
        builtin = PromptParser(None).parse_prompt(text)
        assert (builtin.status, builtin.system_text, builtin.first_text) == (
            learned.status, learned.system_text, learned.first_text)


# --- templates given as Jinja source ----------------------------------------------------------------

MISTRAL_V03_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] + '\\n\\n' %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if m['role'] == 'user' %}"
    "{% if loop.first %}{{ '[INST] ' + sys + m['content'] + '[/INST]' }}"
    "{% else %}{{ '[INST] ' + m['content'] + '[/INST]' }}{% endif %}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)

DEEPSEEK_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% set msgs = messages[1:] %}{% else %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% else %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def test_template_source_with_unknown_bos_uses_a_wildcard() -> None:
    source = (TOKENIZERS / "llama3" / "chat_template.jinja").read_text()
    layout = learn_from_template(source)  # no tokenizer, no special tokens
    text = render("llama3", [{"role": "system", "content": SYS}, {"role": "user", "content": USR}])
    assert PromptParser(layout).parse_prompt(text).system_text == SYS


def test_template_source_with_special_tokens_from_tokenizer_info() -> None:
    specials = special_tokens_from_info({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"content": "<｜begin▁of▁sentence｜>", "lstrip": False},
        "eos_token": "<｜end▁of▁sentence｜>", "pad_token": None})
    assert specials == {"bos_token": "<｜begin▁of▁sentence｜>",
                        "eos_token": "<｜end▁of▁sentence｜>"}
    layout = learn_from_template(DEEPSEEK_STYLE, special_tokens=specials)
    assert layout.default_system is not None and layout.default_system.fullmatch("")
    p = PromptParser(layout)
    with_sys = p.parse_prompt("<｜begin▁of▁sentence｜>S<｜User｜>U<｜Assistant｜>")
    assert (with_sys.system_text, with_sys.first_text) == ("S", None)
    without = p.parse_prompt("<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜>")
    assert (without.system_text, without.first_text) == (None, "U")


def word_level_tokenizer() -> Any:
    """A real tokenizer whose vocabulary lacks most of the probe's text: decoding its encoding
    of a rendered prompt gives `[UNK]`s back, an inexact round trip."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "user": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")  # type: ignore[no-untyped-call]


def round_trip_warnings(learn: Any) -> int:
    with capture_logs() as logs:
        learn()
    return sum(1 for e in logs if e["event"] == "chat_template_round_trip_inexact")


def test_round_trip_is_checked_only_with_the_models_tokenizer() -> None:
    source = (TOKENIZERS / "default-system" / "chat_template.jinja").read_text()
    # Without a tokenizer (a template file, or vLLM's /tokenizer_info) there is nothing to
    # round-trip through: no warning, and the layout is still learned.
    assert round_trip_warnings(lambda: learn_from_template(source)) == 0
    assert round_trip_warnings(lambda: build_prompt_parser(
        tokenizer_info={"chat_template": source, "eos_token": "<|im_end|>"})) == 0
    # With a tokenizer the check runs: silent when exact, a warning when not.
    assert round_trip_warnings(
        lambda: learn_from_template(source, tokenizer=tokenizer("default-system"))) == 0
    assert round_trip_warnings(
        lambda: learn_from_template(source, tokenizer=word_level_tokenizer())) == 1


def test_merged_system_template() -> None:
    layout = learn_from_template(MISTRAL_V03_STYLE, special_tokens={"bos_token": "<s>",
                                                                    "eos_token": "</s>"})
    assert layout.merged_system
    p = PromptParser(layout)
    assert p.parse_prompt("<s>[INST] S\n\nU[/INST]").system_text == "S"
    plain = p.parse_prompt("<s>[INST] just a question[/INST]")
    assert (plain.system_text, plain.first_text) == (None, "just a question")
    assert p.parse_prompt("<s>[INST] still typing").status is ResolveStatus.PENDING


def test_template_without_user_rendering_is_refused() -> None:
    with pytest.raises(TemplateProbeError):
        learn_from_template("{{ 'constant' }}")
    with pytest.raises(TemplateProbeError):
        learn_from_template("{{ raise_exception('nope') }}")


def test_build_prompt_parser_source_order(tmp_path: Path) -> None:
    template_file = tmp_path / "t.jinja"
    template_file.write_text(MISTRAL_V03_STYLE)
    tok = tokenizer("chatml")
    # 1. the chat_template file wins over the tokenizer's own template
    p = build_prompt_parser(chat_template=template_file, tokenizer=tok, name="s")
    assert p.source == "s:chat_template" and p.layout is not None and p.layout.merged_system
    # 2. the tokenizer's template
    p = build_prompt_parser(tokenizer=tok, name="s")
    assert p.source == "s:tokenizer"
    text = render("chatml", [{"role": "user", "content": USR}])
    assert p.parse_prompt(text).first_text == USR
    # 3. vLLM /tokenizer_info
    info = {"chat_template": DEEPSEEK_STYLE, "bos_token": "<｜begin▁of▁sentence｜>"}
    p = build_prompt_parser(tokenizer_info=info, name="s")
    assert p.source == "s:tokenizer_info"
    # 4. built-ins
    p = build_prompt_parser(tokenizer_info={"tokenizer_class": "X"}, name="s")
    assert p.source == "builtin" and p.layout is None


def test_build_prompt_parser_missing_file(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        build_prompt_parser(chat_template=tmp_path / "missing.jinja")


@pytest.mark.parametrize("name", SYSTEM_OK)
def test_system_followed_by_assistant_turn(name: str) -> None:
    text = render(name, [{"role": "system", "content": SYS}, {"role": "assistant", "content": "A"},
                         {"role": "user", "content": USR}])
    assert parser(name).parse_prompt(text).system_text == SYS


# --- where the key is decided (decided_at) ------------------------------------------------------

LONG_SYS = "가" * 400  # 1200 bytes: cut to 341 characters (1023 bytes) by the key


def _deciding_cases() -> list[tuple[str, list[dict[str, str]], int]]:
    cases: list[tuple[str, list[dict[str, str]], int]] = []
    for name in SYSTEM_OK:
        cases.append((name, [{"role": "system", "content": SYS}, {"role": "user", "content": USR}],
                      1024))
        cases.append((name, [{"role": "system", "content": LONG_SYS},
                             {"role": "user", "content": USR}], 1024))
        cases.append((name, [{"role": "system", "content": SYS}, {"role": "user", "content": USR}],
                      16))
    for name in NAMES:
        cases.append((name, [{"role": "user", "content": USR},
                             {"role": "assistant", "content": "네"},
                             {"role": "user", "content": "또"}], 1024))
    return cases


@pytest.mark.parametrize(("name", "messages", "limit"), _deciding_cases())
def test_decided_at_is_the_shortest_text_that_gives_the_key(
        name: str, messages: list[dict[str, str]], limit: int) -> None:
    # The HTTP-only resolver asks the engine to tokenize exactly this much text to learn which
    # blocks of a chain belong to the key (issue #10: tail eviction must not evict the key).
    text = render(name, messages)
    p = parser(name)
    full = p.parse_prompt(text, limit)
    at = full.decided_at
    assert at is not None and 0 < at < len(text)
    cut = p.parse_prompt(text[:at], limit)
    assert cut.status is ResolveStatus.RESOLVED
    assert key_of(cut, limit=limit) == key_of(full, limit=limit)
    assert cut.decided_at == at
    shorter = p.parse_prompt(text[: at - 1], limit)
    assert shorter.status is not ResolveStatus.RESOLVED or \
        key_of(shorter, limit=limit) != key_of(full, limit=limit)


# --- the module split: probe, parser, built-in layouts ------------------------------------------


def test_template_module_still_exports_what_callers_import() -> None:
    # Callers outside the resolver (demo, sim, bench, engine tests) import these from
    # `resolver.template`; they must be the very objects of the rooms that own them now.
    from kv_listener.resolver import layouts, probe, template  # noqa: PLC0415
    from kv_listener.resolver import parser as parser_module  # noqa: PLC0415

    homes = {"BUILTIN_LAYOUTS": layouts, "ChatLayout": layouts, "SystemForm": layouts,
             "NoKeyReason": parser_module, "ParsedPrompt": parser_module,
             "PromptParser": parser_module, "REPLACEMENT_CHAR": parser_module,
             "DEMO_TOKENIZER_DIR": probe, "TemplateProbeError": probe,
             "learn_from_template": probe, "learn_from_tokenizer": probe, "learn_layout": probe,
             "load_tokenizer": probe, "special_tokens_from_info": probe}
    assert set(template.__all__) == {*homes, "build_prompt_parser"}
    for name, home in homes.items():
        assert getattr(template, name) is getattr(home, name), name
    assert (template.DEMO_TOKENIZER_DIR / "tokenizer.json").is_file()


def test_parser_does_not_import_the_probe() -> None:
    # The parser runs for every unsalted chain; the probe (and transformers behind it) is needed
    # only where a template is learned. Checked in a fresh interpreter.
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import sys, kv_listener.resolver.parser, kv_listener.resolver.layouts; "
            "print(sorted(m for m in sys.modules if m == 'transformers' "
            "or m.startswith('kv_listener.resolver.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    assert out == "['kv_listener.resolver.layouts', 'kv_listener.resolver.parser']"
