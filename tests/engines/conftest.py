"""Fixtures of the real-engine tests (marker `engines`): the engines' own virtual environment
(.venv-engines, made by .ci/install-engines) and the tiny random-weight model they serve.

Every test under tests/engines/ gets the `engines` marker here. Without .venv-engines the tests
are skipped on a developer's machine (run `bash .ci/install-engines`) and fail on CI, where
.ci/install has made it: a missing install step must not pass as green.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.engines.paths import ENGINES_PYTHON, ENGINES_VENV, LLAMA3_TOKENIZER, MAKE_MODEL, VLLM_MARKER

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.engines)


def require_engines_venv(marker: Path = VLLM_MARKER) -> None:
    if ENGINES_PYTHON.exists() and marker.exists():
        return
    message = f"{marker.name} missing under {ENGINES_VENV}: run `bash .ci/install-engines`"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama (seed 0) next to a copy of fixtures/tokenizers/llama3
    (byte-level BPE, chat template with a BOS token), built once per session with the engine
    venv's transformers."""
    require_engines_venv()
    out = tmp_path_factory.mktemp("tiny-llama")
    proc = subprocess.run([str(ENGINES_PYTHON), str(MAKE_MODEL), str(LLAMA3_TOKENIZER), str(out)],
                          capture_output=True, text=True, timeout=180, check=False,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    assert proc.returncode == 0, f"building the tiny model failed:\n{proc.stderr[-3000:]}"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    return out
