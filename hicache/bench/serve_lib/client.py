"""The async HTTP client of ``hicache bench serve`` (aiohttp).

``HttpClient`` talks to one daemon: ``health``, ``model_info``, ``metrics_text``, ``flush``
and ``generate``. ``generate`` posts a streaming ``/generate`` request (greedy,
``ignore_eos`` so every answer has its full length) and times it on the caller's clock:

- TTFT: from just before the request is sent to the first SSE chunk carrying output ids;
- inter-token latency: the gap between consecutive chunks carrying ids, split evenly over
  the ids of the later chunk (``completion_tokens - 1`` values when each chunk carries one);
- end-to-end: to the ``[DONE]`` event.

It never raises for a failed request: a refused, broken or failed request comes back as a
``RequestRecord`` with ``ok=False`` and ``error`` saying why. The other calls raise
``DaemonError`` with the URL and the reason (unreachable, refused, unexpected answer).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = ["DaemonError", "HttpClient", "ModelInfo", "RequestRecord"]


class DaemonError(RuntimeError):
    """The daemon cannot be reached or answered something unexpected."""


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /v1/models`` says about the served model."""

    name: str
    max_context: int


@dataclass
class RequestRecord:
    """One request as measured. Times are seconds on the run's clock (0 = the run's start).

    ``cached_*`` are the response's ``meta_info.cached_tokens_details`` (prompt tokens
    served from L1 ``device``, L2 ``host``, L3 ``storage``); ``queue_ms`` / ``load_ms`` /
    ``prefill_ms`` are the scheduler's TTFT breakdown from ``meta_info.timings_ms`` (None when
    the daemon does not send it); ``output_ids`` are kept for the next turn of a
    conversation and left out of the JSON.
    """

    cid: int
    turn: int
    prompt_len: int
    start_s: float
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    end_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    cached_tokens: int = 0
    queue_ms: float | None = None
    load_ms: float | None = None
    prefill_ms: float | None = None
    output_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The record without ``output_ids``; latencies rounded to microseconds."""
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "cid": self.cid, "turn": self.turn, "prompt_len": self.prompt_len, "start_s": r(self.start_s),
            "ok": self.ok, "error": self.error, "ttft_s": r(self.ttft_s), "e2e_s": r(self.e2e_s),
            "end_s": r(self.end_s), "itl_s": [round(x, 6) for x in self.itl_s],
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_details": {"device": self.cached_device, "host": self.cached_host,
                                      "storage": self.cached_storage},
            "timings_ms": {"queue": self.queue_ms, "load": self.load_ms, "prefill": self.prefill_ms},
        }


def _error_message(status: int, raw: bytes) -> str:
    try:
        body = json.loads(raw)
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode(errors="replace").strip()[:300]
    return f"HTTP {status}: {message}"


class HttpClient:
    """A client for one daemon at ``base_url`` (``http://host:port``). Use it as an async
    context manager; ``api_key`` is sent as a bearer token when given."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 900.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("HttpClient used outside 'async with'")
        return self._session

    async def _get(self, path: str, timeout_s: float = 30.0) -> tuple[int, bytes]:
        url = self.base_url + path
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise DaemonError(f"cannot reach the daemon at {self.base_url} ({path}): "
                              f"{type(exc).__name__}: {exc}") from exc

    async def health(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """``GET /health``; ``DaemonError`` unless it answers 200 with status ok."""
        status, raw = await self._get("/health", timeout_s)
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        if status != 200 or not isinstance(body, dict) or body.get("status") != "ok":
            raise DaemonError(f"the daemon at {self.base_url} is not healthy: HTTP {status} "
                              f"{raw.decode(errors='replace')[:300]}")
        return body

    async def model_info(self) -> ModelInfo:
        """The model's name and context length from ``GET /v1/models``."""
        status, raw = await self._get("/v1/models")
        if status != 200:
            raise DaemonError(f"GET {self.base_url}/v1/models: {_error_message(status, raw)}")
        try:
            entry = json.loads(raw)["data"][0]
            return ModelInfo(str(entry["id"]), int(entry["max_model_len"]))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise DaemonError(f"GET {self.base_url}/v1/models: unexpected answer {raw[:300]!r}") from exc

    async def metrics_text(self) -> str | None:
        """The Prometheus exposition of ``GET /metrics``; None when metrics are disabled (404)."""
        status, raw = await self._get("/metrics")
        if status == 404:
            return None
        if status != 200:
            raise DaemonError(f"GET {self.base_url}/metrics: {_error_message(status, raw)}")
        return raw.decode()

    async def flush(self) -> None:
        """``POST /cache/flush`` (L1 and L2); ``DaemonError`` if refused."""
        try:
            async with self.session.post(self.base_url + "/cache/flush") as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise DaemonError(f"POST {self.base_url}/cache/flush: {_error_message(resp.status, raw)}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise DaemonError(f"cannot reach the daemon at {self.base_url}: {exc}") from exc

    async def generate(self, prompt: list[int], max_new_tokens: int, *, cid: int, turn: int,
                       t0: float) -> RequestRecord:
        """Send one streaming ``/generate`` request; ``t0`` is the run's ``perf_counter`` origin.

        Returns its record, ``ok`` only if the stream ended with ``[DONE]`` and no error event.
        """
        body = {"input_ids": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        start = time.perf_counter()
        rec = RequestRecord(cid, turn, len(prompt), start - t0)
        last_tokens_at: float | None = None
        done = False
        try:
            async with self.session.post(self.base_url + "/generate", json=body) as resp:
                if resp.status != 200:
                    rec.error = _error_message(resp.status, await resp.read())
                    return rec
                async for raw_line in resp.content:
                    line = raw_line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        err = chunk["error"]
                        rec.error = f"stream error: {err.get('message') if isinstance(err, dict) else err}"
                        continue
                    ids = chunk.get("output_ids") or []
                    if ids:
                        if last_tokens_at is None:
                            rec.ttft_s = now - start
                        else:
                            gap = (now - last_tokens_at) / len(ids)
                            rec.itl_s.extend([gap] * len(ids))
                        last_tokens_at = now
                        rec.output_ids.extend(ids)
                    meta = chunk.get("meta_info") or {}
                    if meta.get("finish_reason") is not None:
                        details = meta.get("cached_tokens_details") or {}
                        rec.prompt_tokens = int(meta.get("prompt_tokens", 0))
                        rec.completion_tokens = int(meta.get("completion_tokens", 0))
                        rec.cached_device = int(details.get("device", 0))
                        rec.cached_host = int(details.get("host", 0))
                        rec.cached_storage = int(details.get("storage", 0))
                        rec.cached_tokens = int(meta.get("cached_tokens", 0))
                        timings = meta.get("timings_ms") or {}
                        if timings:
                            rec.queue_ms = float(timings.get("queue", 0.0))
                            rec.load_ms = float(timings.get("load", 0.0))
                            rec.prefill_ms = float(timings.get("prefill", 0.0))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return rec
        end = time.perf_counter()
        rec.end_s = end - t0
        rec.e2e_s = end - start
        if not done and rec.error is None:
            rec.error = "the stream ended without [DONE]"
        rec.ok = rec.error is None
        if rec.ok and rec.completion_tokens == 0:
            rec.completion_tokens = len(rec.output_ids)
        return rec
