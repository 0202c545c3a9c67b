"""continuum-kv-listener: KV-cache events from LLM engines -> router prefix keys."""

__version__ = "0.1.0"
