"""Turns unresolved block chains into prompt text: /detokenize client, local tokenizer, chat templates."""
