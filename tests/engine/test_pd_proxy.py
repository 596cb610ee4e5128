"""The prefill/decode proxy of ``examples/pd_proxy`` as a real process between real sockets.

The two engines here are small OpenAI-shaped HTTP servers that record what they are sent
(real vLLM engines in the P/D set-up are tested in ``test_vllm_pd_recipe.py``): each request
reaches a prefill engine with one output token and no streaming, then a decode engine
unchanged, both under one ``X-Request-Id``; the decode engine's answer (streamed or not) is
the client's; a failed prefill leg still gets an answer, a decode engine that cannot be
reached a 502.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp import web

from hicache.bench.loopback_ports import free_port

PROXY = Path(__file__).resolve().parents[2] / "examples" / "pd_proxy" / "pd_proxy.py"


class FakeEngine:
    """An OpenAI-shaped server in a thread: answers ``/v1/completions`` and
    ``/v1/chat/completions`` (streamed as two SSE events when asked), records each request."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name, self.status = name, status
        self.seen: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.name}]})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body, {k.lower(): v for k, v in request.headers.items()}))
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} refused"}}, status=self.status)
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for piece in ("a", "b"):
                await out.write(f"data: {json.dumps({'from': self.name, 'text': piece})}\n\n".encode())
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        return web.json_response({"from": self.name, "max_tokens": body.get("max_tokens")})

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def wait_serving(url: str, proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float) -> None:
    """Until ``GET {url}/health`` answers 200; fails with the log's tail if ``proc`` exits or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"{what} exited:\n{log.read_text()[-4000:]}"
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"{what} did not start:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


class ProxyProcess:
    def __init__(self, prefill: list[str], decode: list[str], log: Path, timeout_s: float = 600.0) -> None:
        self.port = free_port()
        args = [sys.executable, str(PROXY), "--port", str(self.port), "--prefill-timeout-s", str(timeout_s)]
        for u in prefill:
            args += ["--prefill", u]
        for u in decode:
            args += ["--decode", u]
        self.log = log
        self.proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_serving(self.url, self.proc, log, "the proxy", 30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def engines() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode")
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_each_request_is_prefilled_with_one_token_then_decoded_unchanged(engines: tuple[FakeEngine, FakeEngine],
                                                                          tmp_path: Path) -> None:
    prefill, decode = engines
    proxy = ProxyProcess([prefill.url], [decode.url], tmp_path / "proxy.log")
    try:
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0}
        r = requests.post(f"{proxy.url}/v1/completions", json=body, headers={"X-Request-Id": "req-7"}, timeout=10)
        assert r.status_code == 200 and r.json() == {"from": "decode", "max_tokens": 16}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                "stream": True, "stream_options": {"include_usage": True}}
        s = requests.post(f"{proxy.url}/v1/chat/completions", json=chat, timeout=10, stream=True)
        events = [line for line in s.iter_lines() if line]
        assert events[-1] == b"data: [DONE]" and [json.loads(e[6:])["text"] for e in events[:-1]] == ["a", "b"]
        assert [p for p, _, _ in prefill.seen] == ["/v1/completions", "/v1/chat/completions"]
        assert [p for p, _, _ in decode.seen] == ["/v1/completions", "/v1/chat/completions"]
        (_, first, h1), (_, first_chat, h2) = prefill.seen
        assert first == {**body, "max_tokens": 1}
        assert first_chat == {"model": "m", "messages": chat["messages"], "max_completion_tokens": 1, "max_tokens": 1}
        assert decode.seen[0][1] == body and decode.seen[1][1] == chat
        assert h1["x-request-id"] == decode.seen[0][2]["x-request-id"] == "req-7"
        assert h2["x-request-id"] == decode.seen[1][2]["x-request-id"]  # one id made for both legs
        assert requests.get(f"{proxy.url}/v1/models", timeout=10).json() == {"data": [{"id": "decode"}]}
    finally:
        proxy.stop()


def test_a_failed_prefill_still_gets_the_decode_answer_and_a_missing_decode_engine_a_502(
        engines: tuple[FakeEngine, FakeEngine], tmp_path: Path) -> None:
    _, decode = engines
    refusing = FakeEngine("refusing", status=500)
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    try:
        proxy = ProxyProcess([refusing.url, gone], [decode.url], tmp_path / "proxy.log")
        try:
            for _ in range(2):  # the two prefill engines take turns: one refuses, one cannot be reached
                r = requests.post(f"{proxy.url}/v1/completions", json={"prompt": [1], "max_tokens": 4}, timeout=10)
                assert r.status_code == 200 and r.json()["from"] == "decode"
            assert len(refusing.seen) == 1 and len(decode.seen) == 2
            bad = requests.post(f"{proxy.url}/v1/completions", data=b"[1, 2", timeout=10)
            assert bad.status_code == 400 and len(decode.seen) == 2
        finally:
            proxy.stop()
        proxy = ProxyProcess([decode.url], [gone], tmp_path / "proxy2.log")
        try:
            r = requests.post(f"{proxy.url}/v1/completions", json={"prompt": [1], "max_tokens": 4}, timeout=10)
            assert r.status_code == 502 and "decode engine" in r.json()["error"]["message"]
        finally:
            proxy.stop()
    finally:
        refusing.close()
