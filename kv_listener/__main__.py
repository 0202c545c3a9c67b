"""`python -m kv_listener` is the same as the `continuum-kv-listener` command."""

from kv_listener.cli import entrypoint

entrypoint()
