"""The test tokenizers of `fixtures/tokenizers` (built by fixtures/make_tokenizers.py), each loaded
once per test process, and the prompt parsers learned from their own chat templates.

Loading a tokenizer and learning its template take tens of milliseconds; hundreds of tests use the
same few. Neither a tokenizer nor a `PromptParser` is changed by the tests that share them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kv_listener.resolver.parser import PromptParser
from kv_listener.resolver.probe import learn_from_tokenizer, load_tokenizer

TOKENIZERS = Path(__file__).resolve().parent.parent.parent / "fixtures" / "tokenizers"

_tokenizers: dict[str, Any] = {}
_parsers: dict[str, PromptParser] = {}


def tokenizer(name: str) -> Any:
    """The tokenizer `fixtures/tokenizers/<name>`."""
    if name not in _tokenizers:
        _tokenizers[name] = load_tokenizer(TOKENIZERS / name)
    return _tokenizers[name]


def parser(name: str) -> PromptParser:
    """A parser of the layout learned from the chat template of `tokenizer(name)`."""
    if name not in _parsers:
        _parsers[name] = PromptParser(learn_from_tokenizer(tokenizer(name), name=name))
    return _parsers[name]
