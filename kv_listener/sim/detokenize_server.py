"""A stand-in for a vLLM engine's tokenizer endpoints, backed by a local tokenizer (the demo's).

Owns four routes in vLLM's shapes (vLLM 0.10 .. 0.33, `vllm/entrypoints/openai/api_server.py`):

- `POST /detokenize` `{"tokens": [int, ...], "model"?: str}` -> `{"prompt": str}`: decoded with
  `skip_special_tokens=False`, as vLLM's `tokenizer.decode(ids)` does, so the chat-template
  markers survive; a malformed body or an ID outside the vocabulary is a 400 in vLLM's error
  shape, an unknown `model` a 404.
- `POST /tokenize` `{"prompt": str, "add_special_tokens"?: bool, "model"?: str}` ->
  `{"count", "max_model_len", "tokens", "token_strs": null}`: special tokens written in the
  text are parsed as such (HF tokenizers do), `add_special_tokens` (default true) adds a BOS.
- `GET /health` -> 200 with an empty body while the engine is up (`healthy`), else 503, as
  vLLM answers once its engine core died.
- `GET /tokenizer_info` -> the tokenizer's configuration with its `chat_template` (what vLLM
  serves with `--enable-tokenizer-info-endpoint`), so a listener learns the template from the
  engine, as SPEC §2 orders.

The demo runs one per engine-like process tree on 127.0.0.1 (port 0, read back `port`); it is not
a test double: everything it answers comes from the real tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Self

import structlog
from aiohttp import web

from kv_listener.sim.lifecycle import AsyncLifecycle, start_site

log = structlog.get_logger(__name__)

#: vLLM answers bodies up to its own limits; a detokenize request of a 16k-token chain is ~100 KB.
MAX_BODY_BYTES = 4 << 20


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status=status)


def tokenizer_info(tokenizer_dir: str | Path) -> dict[str, Any]:
    """What vLLM's `/tokenizer_info` answers for a tokenizer directory: its
    `tokenizer_config.json` plus the chat template (from `chat_template.jinja` when the config has
    none inline)."""
    directory = Path(tokenizer_dir)
    info: dict[str, Any] = {}
    config = directory / "tokenizer_config.json"
    if config.is_file():
        loaded = json.loads(config.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            info.update(loaded)
    template = directory / "chat_template.jinja"
    if "chat_template" not in info and template.is_file():
        info["chat_template"] = template.read_text(encoding="utf-8")
    return info


class DetokenizeServer(AsyncLifecycle):
    """`await start()` (or `async with`), then `url` is the `/detokenize` URL; `close()` stops.

    `tokenizer` is a loaded tokenizer (`resolver.template.load_tokenizer`); `info` the
    `/tokenizer_info` body (None: that route answers 404, as vLLM without the flag does);
    `served_model` the model name a request may give (vLLM answers 404 for another).
    """

    def __init__(self, tokenizer: Any, *, info: dict[str, Any] | None = None,
                 served_model: str | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.served_model = served_model
        self.host = host
        self.port = port
        self.answered = 0  # /detokenize requests answered 200
        self.refused = 0  # /detokenize requests refused
        self.tokenized = 0  # /tokenize requests answered 200
        self.health_checks = 0
        self.health_checked = asyncio.Event()  # set at every /health request
        self.healthy = True
        self._vocab = len(tokenizer)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/detokenize"

    async def _detokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            self.refused += 1
            return _error(400, "request body is not JSON", "BadRequestError")
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            self.refused += 1
            return _error(400, "tokens must be a list of integers", "BadRequestError")
        model = body.get("model")
        if model is not None and self.served_model is not None and model != self.served_model:
            self.refused += 1
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        if any(t < 0 or t >= self._vocab for t in tokens):
            self.refused += 1
            return _error(400, "token id out of vocabulary", "BadRequestError")
        # Decoding a few thousand IDs takes a millisecond; off the loop all the same, since the
        # demo's engines and router share it.
        text = await asyncio.to_thread(self.tokenizer.decode, tokens, skip_special_tokens=False)
        self.answered += 1
        return web.json_response({"prompt": text})

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "request body is not JSON", "BadRequestError")
        prompt = body.get("prompt") if isinstance(body, dict) else None
        add_special = body.get("add_special_tokens", True) if isinstance(body, dict) else True
        if not isinstance(prompt, str) or not isinstance(add_special, bool):
            return _error(400, "prompt must be a string", "BadRequestError")
        model = body.get("model")
        if model is not None and self.served_model is not None and model != self.served_model:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        ids = await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=add_special)
        self.tokenized += 1
        return web.json_response({"count": len(ids), "max_model_len": 1 << 20,
                                  "tokens": list(ids), "token_strs": None})

    async def _health(self, _: web.Request) -> web.StreamResponse:
        self.health_checks += 1
        self.health_checked.set()
        return web.Response(status=200 if self.healthy else 503)

    async def _tokenizer_info(self, _: web.Request) -> web.StreamResponse:
        if self.info is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response(self.info)

    async def start(self) -> Self:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/tokenizer_info", self._tokenizer_info)
        runner = await start_site(app, self.host, self.port, access_log=None)
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info("detokenize_server_listening", host=self.host, port=self.port)
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
