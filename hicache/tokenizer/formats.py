"""Response bodies of the generation routes: full responses, stream chunks, usage, errors.

One ``ResponseFormat`` per route, each turning the same generation events into that route's
shape:

- ``GenerateFormat`` (``POST /generate``): ``{"text", "output_ids", "meta_info"}``; a stream
  sends the new text and ids of each step (deltas, not the text so far), ``meta_info`` on
  every chunk, with ``finish_reason`` and the usage on the last one.
- ``CompletionFormat`` / ``ChatFormat``: the OpenAI ``text_completion`` /
  ``chat.completion`` objects and their ``.chunk`` stream forms. The last chunk (the one
  with a ``finish_reason``) carries ``usage`` too; with ``stream_options.include_usage``
  a usage-only chunk with empty ``choices`` follows, as in the OpenAI API. Steps that add
  no text (token ids of a character not complete yet) produce no OpenAI chunk.

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


def error_body(message: str, status: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    """The error body of every route (OpenAI's shape)."""
    return {"error": {"message": message, "type": kind, "code": status}}


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

    def full(self, r: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, step: Step) -> list[dict[str, Any]]:
        raise NotImplementedError


class GenerateFormat(ResponseFormat):
    def _meta(self, usage: protos.Usage | None, finish_reason: str | None) -> dict[str, Any]:
        u = usage or protos.Usage()
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
        return [{"text": step.text, "output_ids": step.token_ids,
                 "meta_info": self._meta(step.usage, step.finish_reason)}]


class CompletionFormat(ResponseFormat):
    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": f"cmpl-{self.rid}", "object": obj, "created": self.created, "model": self.model}

    def full(self, r: GenerationResult) -> dict[str, Any]:
        body = self._base("text_completion")
        body["choices"] = [{"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}]
        body["usage"] = usage_dict(r.usage)
        return body

    def chunks(self, step: Step) -> list[dict[str, Any]]:
        if not step.text and step.finish_reason is None:
            return []  # ids without text yet (a split character): nothing to show
        body = self._base("text_completion")
        body["choices"] = [{"index": 0, "text": step.text, "logprobs": None, "finish_reason": step.finish_reason}]
        out = [body]
        if step.usage is not None:
            body["usage"] = usage_dict(step.usage)
            if self.include_usage:
                last = self._base("text_completion")
                last["choices"] = []
                last["usage"] = usage_dict(step.usage)
                out.append(last)
        return out


class ChatFormat(ResponseFormat):
    _started: bool = False

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{self.rid}", "object": obj, "created": self.created, "model": self.model}

    def full(self, r: GenerationResult) -> dict[str, Any]:
        body = self._base("chat.completion")
        body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                            "finish_reason": r.finish_reason}]
        body["usage"] = usage_dict(r.usage)
        return body

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
        out = [body]
        if step.usage is not None:
            body["usage"] = usage_dict(step.usage)
            if self.include_usage:
                last = self._base("chat.completion.chunk")
                last["choices"] = []
                last["usage"] = usage_dict(step.usage)
                out.append(last)
        return out
