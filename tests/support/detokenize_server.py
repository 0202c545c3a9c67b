"""A real engine-like `/detokenize` HTTP server for tests (aiohttp on 127.0.0.1, port 0).

It decodes with a real tokenizer (the tiny fixture tokenizers) and answers in the engine's
shape: vLLM `{"prompt"}` (decode keeps special tokens, like vLLM 0.10.2's
`tokenizer.decode(ids)`), SGLang `{"text"}` honouring `skip_special_tokens` with SGLang's
default `true` (so a client that forgets to send `false` loses the role markers, as with the
real engine). Failures are scripted: `script` lists, per request, an HTTP status to answer,
"garbage", "wrong-shape", "deep" (JSON nested 100,000 levels), "redirect", or "hold" (wait for
`release`, then answer normally: a client times out, or a test controls when an answer comes,
without any sleep).
`/tokenizer_info` answers `tokenizer_info` when set, else 404 (vLLM without
`--enable-tokenizer-info-endpoint`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from kv_listener.sim.detokenize_server import DetokenizeServer as SimDetokenizeServer


class DetokenizeServer(SimDetokenizeServer):
    """The package's engine stand-in (`kv_listener.sim.detokenize_server`) with SGLang's shape
    and scripted failures added; it reuses the stand-in's server lifecycle and /tokenizer_info."""

    def __init__(self, tokenizer: Any, engine: str = "vllm",
                 tokenizer_info: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, info=tokenizer_info)
        self.engine = engine
        self.requests: list[dict[str, Any]] = []  # type: ignore[assignment]
        self.script: list[int | str] = []
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()  # set when a request arrives

    @property
    def tokenizer_info(self) -> dict[str, Any] | None:
        return self.info

    @tokenizer_info.setter
    def tokenizer_info(self, value: dict[str, Any] | None) -> None:
        self.info = value

    async def _detokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.arrived.set()
        if self.script:
            step = self.script.pop(0)
            if step == "hold":  # then answer normally
                await self.release.wait()
            elif step == "garbage":
                return web.Response(text="<html>not json</html>", content_type="text/html")
            elif step == "deep":
                return web.Response(text="[" * 100_000, content_type="application/json")
            elif step == "wrong-shape":
                return web.json_response({"tokens": body.get("tokens")})
            elif step == "redirect":
                raise web.HTTPFound("/elsewhere")
            else:
                assert isinstance(step, int)
                return web.json_response({"object": "error", "code": step}, status=step)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return web.json_response({"error": "bad tokens"}, status=400)
        if any(t < 0 or t >= len(self.tokenizer) for t in tokens):
            return web.json_response({"error": "token id out of range"}, status=400)
        if self.engine == "sglang":
            skip = body.get("skip_special_tokens", True)
            return web.json_response(
                {"text": self.tokenizer.decode(tokens, skip_special_tokens=skip)})
        return web.json_response({"prompt": self.tokenizer.decode(tokens,
                                                                   skip_special_tokens=False)})

    async def close(self) -> None:
        self.release.set()  # a held request must not outlive the server
        await super().close()
