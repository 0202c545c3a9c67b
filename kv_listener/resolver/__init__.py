"""Turns unresolved block chains into prefix keys, off the ingestion path.

Rooms: `resolver` (the per-source `ChainResolver`: bounds, de-duplication, late templates),
`detokenize` (token IDs -> text: the engines' `/detokenize`, or a local tokenizer), `template`
(a source's `PromptParser`, from its chat template), built from `probe` (learns a `ChatLayout` by
rendering a template with transformers), `parser` (reads the system prompt and first message
out of decoded text) and `layouts` (the layout types and the built-in families).
"""
