"""A prefill/decode proxy for vLLM engines that share one hicache daemon.

Each OpenAI completion or chat request goes first to a prefill engine (``kv_role:
kv_producer``) with one output token and no streaming, then, unchanged, to a decode engine
(``kv_role: kv_consumer``), whose answer (streamed or not) is the client's. The prefill
engine's connector saves the prompt's KV into hicache's L2; the decode engine's connector
loads it and vLLM computes only the prompt's last partial block (docs/engine-mode.md,
"Copy modes and roles"). Both legs carry the same ``X-Request-Id``.

What can go wrong, and what the client sees:

=================================  ==============================================================
case                               answer
=================================  ==============================================================
the body is not a JSON object      400, nothing sent to an engine
the prefill leg fails or times     the decode leg still runs (it computes what it cannot load:
out                                the same tokens, later)
the decode engine cannot be        502 with the reason
reached
the decode engine answers an       its status and body, passed through
error
=================================  ==============================================================

Run (engines from docs/engine-mode.md; several ``--prefill`` / ``--decode`` take turns)::

    python examples/pd_proxy/pd_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Only aiohttp (a hicache dependency) is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("pd_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("Authorization",)
"""Client headers both legs carry (besides ``X-Request-Id``)."""


class Proxy:
    """Sends each request to the next prefill engine, then to the next decode engine."""

    def __init__(self, prefill: list[str], decode: list[str], prefill_timeout_s: float) -> None:
        self.prefill: Iterator[str] = itertools.cycle([u.rstrip("/") for u in prefill])
        self.decode: Iterator[str] = itertools.cycle([u.rstrip("/") for u in decode])
        self.prefill_timeout = aiohttp.ClientTimeout(total=prefill_timeout_s)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the body must be a JSON object"}}, status=400)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid, **{h: request.headers[h] for h in PASSED_HEADERS if h in request.headers}}
        await self._prefill(request.path, prefill_body(body), headers)
        url = next(self.decode) + request.path
        try:
            async with self.session.post(url, json=body, headers=headers) as answer:
                out = web.StreamResponse(status=answer.status, headers={
                    "Content-Type": answer.headers.get("Content-Type", "application/json"), "X-Request-Id": rid})
                await out.prepare(request)
                async for chunk in answer.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except aiohttp.ClientError as exc:
            log.warning("request %s: the decode engine %s failed: %s", rid, url, exc)
            return web.json_response({"error": {"message": f"the decode engine failed: {exc}"}}, status=502)

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        """The first leg; a failure is logged and the decode leg computes what it lacks."""
        assert self.session is not None
        url = next(self.prefill) + path
        try:
            async with self.session.post(url, json=body, headers=headers, timeout=self.prefill_timeout) as answer:
                await answer.read()
                if answer.status != 200:
                    log.warning("request %s: the prefill engine %s answered %d", headers["X-Request-Id"], url,
                                answer.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("request %s: the prefill engine %s failed: %s", headers["X-Request-Id"], url, exc)

    async def models(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        url = next(self.decode) + "/v1/models"
        try:
            async with self.session.get(url) as answer:
                return web.Response(status=answer.status, body=await answer.read(),
                                    content_type=answer.content_type)
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"message": f"the decode engine failed: {exc}"}}, status=502)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill engine gets: one output token, not streamed."""
    first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    first["max_tokens"] = 1
    if "max_completion_tokens" in body:
        first["max_completion_tokens"] = 1
    return first


async def health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app(prefill: list[str], decode: list[str], prefill_timeout_s: float = 600.0) -> web.Application:
    proxy = Proxy(prefill, decode, prefill_timeout_s)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    for route in ROUTES:
        app.router.add_post(route, proxy.generate)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", action="append", required=True, help="a prefill engine's base URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="a decode engine's base URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill-timeout-s", type=float, default=600.0,
                   help="how long the prefill leg may take before the decode leg runs without it")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(make_app(args.prefill, args.decode, args.prefill_timeout_s), host=args.host, port=args.port,
                print=lambda *_: log.info("serving on http://%s:%d", args.host, args.port))


if __name__ == "__main__":
    main()
