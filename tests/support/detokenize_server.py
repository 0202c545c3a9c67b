"""A real engine-like `/detokenize` HTTP server for tests (aiohttp on 127.0.0.1, port 0).

It decodes with a real tokenizer (the tiny fixture tokenizers) and answers in the engine's
shape: vLLM `{"prompt"}` (decode keeps special tokens, like vLLM 0.10.2's
`tokenizer.decode(ids)`), SGLang `{"text"}` honouring `skip_special_tokens` with SGLang's
default `true` (so a client that forgets to send `false` loses the role markers, as with the
real engine). Failures are scripted: `script` lists, per request, an HTTP status to answer,
"garbage", "wrong-shape", "redirect", or "hold" (wait for `release`, then answer normally: a
client times out, or a test controls when an answer comes, without any sleep).
`/tokenizer_info` answers `tokenizer_info` when set, else 404 (vLLM without
`--enable-tokenizer-info-endpoint`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web


class DetokenizeServer:
    def __init__(self, tokenizer: Any, engine: str = "vllm",
                 tokenizer_info: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.tokenizer_info = tokenizer_info
        self.requests: list[dict[str, Any]] = []
        self.script: list[int | str] = []
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()  # set when a request arrives
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/detokenize"

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

    async def _tokenizer_info(self, request: web.Request) -> web.StreamResponse:
        if self.tokenizer_info is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response(self.tokenizer_info)

    async def start(self) -> DetokenizeServer:
        app = web.Application()
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/tokenizer_info", self._tokenizer_info)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def close(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> DetokenizeServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
