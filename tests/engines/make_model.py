"""Build a tiny random-weight Llama next to a copy of a fixture tokenizer (the `engines` tests'
model: no model can be downloaded here). Run with `.venv-engines/bin/python` (it needs torch and
the engine venv's transformers): `python make_model.py TOKENIZER_DIR OUT_DIR`.

Outputs are gibberish; prompts, prefix caching and KV-cache events are real. Deterministic:
`torch.manual_seed(0)`. Standalone on purpose: the project is not installed in that venv.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(tokenizer_dir: Path, out: Path) -> None:
    import torch  # noqa: PLC0415 - only in the engine venv
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    vocab = (len(tok) + 63) // 64 * 64
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, vocab_size=vocab, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
