"""Companion router module: consumers, event-bus server, KV index, scorer, admin.

Imports the core (`core.records` is the prefix record it consumes and indexes), the config
toolkit (`configkit`) and the small shared edges (`backoff`, `httpserver`, `logging`, `errors`,
`metrics`, `reloading`); never the listener's `config`, sources, outputs or resolver.

What an embedding Python router needs first is exported here: the request-side prefix key
(SPEC §2) and the cache salt it may send with each request (SPEC §3).
"""

from kv_listener.core.prefix import prefix_hash, prefix_key, request_prefix_key
from kv_listener.core.salt import issue_cache_salt, verify_cache_salt

__all__ = ["issue_cache_salt", "prefix_hash", "prefix_key", "request_prefix_key", "verify_cache_salt"]
