"""Async shells around the core that receive engine events (ZMQ SUB, TRT-LLM poller)."""
