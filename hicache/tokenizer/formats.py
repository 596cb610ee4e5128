"""Response bodies of the generation routes: full responses, stream chunks, usage, errors.

One ``ResponseFormat`` per route, each turning the same generation events into that route's
shape:

- ``GenerateFormat`` (``POST /generate``): ``{"text", "output_ids", "meta_info"}``; a stream
  sends the new text and ids of each step (deltas, not the text so far), ``meta_info`` on
  every chunk (``completion_tokens`` counts the ids sent so far), with ``finish_reason``
  and the usage on the last one.
- ``CompletionFormat`` / ``ChatFormat``: the OpenAI ``text_completion`` /
  ``chat.completion`` objects and their ``.chunk`` stream forms. A full response always has
  ``usage``; a stream has it exactly once, only with ``stream_options.include_usage``: then
  every chunk carries ``"usage": null`` and a usage-only chunk with empty ``choices``
  follows the last one, as in the OpenAI API. SGLang's ``return_cached_tokens_details``
  adds ``"sglext": {"cached_tokens_details": {...}}`` to a full response, and to a stream
  one chunk with empty ``choices`` and ``sglext`` (before the usage chunk). A chat
  ``message`` has ``refusal: null``. Steps that add no text (token ids of a character not
  complete yet) produce no OpenAI chunk.

Usage everywhere: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens`` and ``cached_tokens_details`` ``{device, host,
storage}`` (prompt tokens served from L1, L2 and L3).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import protos


@dataclass(frozen=True)
class GenerationResult:
    """A finished request as the formats see it."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str
    usage: protos.Usage


@dataclass(frozen=True)
class Step:
    """One streamed step: new text and ids; ``finish_reason``/``usage`` set on the last."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: protos.Usage | None = None


def cached_details(u: protos.Usage) -> dict[str, int]:
    return {"device": u.cached_device, "host": u.cached_host, "storage": u.cached_storage}


def usage_dict(u: protos.Usage) -> dict[str, Any]:
    """The OpenAI ``usage`` object plus ``cached_tokens_details``."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "cached_tokens_details": cached_details(u),
    }


def error_body(message: str, status: int, kind: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    """The error body of every route, OpenAI's shape: ``{"error": {"message", "type", "param",
    "code"}}``; ``param`` names the field at fault (or is null), ``code`` is the HTTP status."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


@dataclass
class ResponseFormat:
    """Base: a format is built per request (it knows the request's id, model and time)."""

    rid: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    cache_details: bool = False
    """SGLang ``return_cached_tokens_details`` (OpenAI routes): add the ``sglext`` object."""

    def full(self, r: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, step: Step) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _openai_tail(self, body: dict[str, Any], step: Step) -> list[dict[str, Any]]:
        """A stream chunk ``body`` and what follows it: on the last step, the ``sglext`` chunk
        (if asked) and the usage-only chunk (only with ``include_usage``)."""
        if self.include_usage:
            body["usage"] = None
        out = [body]
        if step.usage is None:
            return out
        if self.cache_details:
            ext = self._base(body["object"])
            ext["choices"] = []
            ext["sglext"] = {"cached_tokens_details": cached_details(step.usage)}
            if self.include_usage:
                ext["usage"] = None
            out.append(ext)
        if self.include_usage:
            last = self._base(body["object"])
            last["choices"] = []
            last["usage"] = usage_dict(step.usage)
            out.append(last)
        return out

    def _openai_full(self, body: dict[str, Any], r: GenerationResult) -> dict[str, Any]:
        body["usage"] = usage_dict(r.usage)
        if self.cache_details:
            body["sglext"] = {"cached_tokens_details": cached_details(r.usage)}
        return body

    def _base(self, obj: str) -> dict[str, Any]:
        raise NotImplementedError


class GenerateFormat(ResponseFormat):
    _sent: int = 0

    def _meta(self, usage: protos.Usage | None, finish_reason: str | None) -> dict[str, Any]:
        u = usage or protos.Usage(completion_tokens=self._sent)
        return {
            "id": self.rid,
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "cached_tokens": u.cached_tokens,
            "cached_tokens_details": cached_details(u),
            "timings_ms": {"queue": round(u.queue_ms, 3), "load": round(u.load_ms, 3),
                           "prefill": round(u.prefill_ms, 3)},
            "finish_reason": finish_reason,
        }

    def full(self, r: GenerationResult) -> dict[str, Any]:
        return {"text": r.text, "output_ids": r.output_ids, "meta_info": self._meta(r.usage, r.finish_reason)}

    def chunks(self, step: Step) -> list[dict[str, Any]]:
        self._sent += len(step.token_ids)
        return [{"text": step.text, "output_ids": step.token_ids,
                 "meta_info": self._meta(step.usage, step.finish_reason)}]


class CompletionFormat(ResponseFormat):
    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": f"cmpl-{self.rid}", "object": obj, "created": self.created, "model": self.model}

    def full(self, r: GenerationResult) -> dict[str, Any]:
        body = self._base("text_completion")
        body["choices"] = [{"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}]
        return self._openai_full(body, r)

    def chunks(self, step: Step) -> list[dict[str, Any]]:
        if not step.text and step.finish_reason is None:
            return []  # ids without text yet (a split character): nothing to show
        body = self._base("text_completion")
        body["choices"] = [{"index": 0, "text": step.text, "logprobs": None, "finish_reason": step.finish_reason}]
        return self._openai_tail(body, step)


class ChatFormat(ResponseFormat):
    _started: bool = False

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{self.rid}", "object": obj, "created": self.created, "model": self.model}

    def full(self, r: GenerationResult) -> dict[str, Any]:
        body = self._base("chat.completion")
        body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": r.text, "refusal": None},
                            "logprobs": None, "finish_reason": r.finish_reason}]
        return self._openai_full(body, r)

    def chunks(self, step: Step) -> list[dict[str, Any]]:
        if not step.text and step.finish_reason is None and self._started:
            return []  # ids without text yet (a split character): nothing to show
        delta: dict[str, Any] = {}
        if not self._started:  # the first chunk names the role
            delta["role"] = "assistant"
            self._started = True
        if step.text or "role" in delta:
            delta["content"] = step.text
        body = self._base("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": step.finish_reason}]
        return self._openai_tail(body, step)
