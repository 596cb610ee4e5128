"""Response bodies of the generation routes: full responses, stream chunks, usage, errors.

One ``ResponseFormat`` per route, each turning the same generation events into that route's
shape:

- ``GenerateFormat`` (``POST /generate``): ``{"text", "output_ids", "meta_info"}``; a stream
  sends the new text and ids of each step (deltas, not the text so far), ``meta_info`` on
  every chunk (``completion_tokens`` counts the ids sent so far), with ``finish_reason``
  and the usage on the last one. With ``return_logprob``, ``meta_info`` has SGLang's
  ``output_token_logprobs`` (``[logprob, id, text or null]`` per token) and
  ``output_top_logprobs`` (a list of such triples per token), of the chunk's tokens in a
  stream, and empty ``input_token_logprobs`` / ``input_top_logprobs``.
- ``CompletionFormat`` / ``ChatFormat``: the OpenAI ``text_completion`` /
  ``chat.completion`` objects and their ``.chunk`` stream forms, one choice per sample
  (``index`` 0 .. n-1; a stream interleaves the samples' chunks). A full response always
  has ``usage``; a stream has it exactly once, only with ``stream_options.include_usage``:
  then every chunk carries ``"usage": null`` and a usage-only chunk with empty ``choices``
  follows the last one (``tail``, after every sample ended), as in the OpenAI API. SGLang's
  ``return_cached_tokens_details`` adds ``"sglext": {"cached_tokens_details": {...}}`` to a
  full response, and to a stream one chunk with empty ``choices`` and ``sglext`` (before
  the usage chunk). A chat ``message`` has ``refusal: null``. Steps that add no text (token
  ids of a character not complete yet) produce no OpenAI chunk; their logprobs go with the
  next chunk of that choice.
- Logprobs (when asked): completions ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`` (``top_logprobs``: token text -> logprob, the chosen token included, as
  vLLM; tokens that decode to the same text share one key, the chosen token's value wins);
  chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}``. A token's text is its id decoded alone (special tokens
  included); ``bytes`` are that text's UTF-8 bytes.

Usage everywhere: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens`` and ``cached_tokens_details`` ``{device, host,
storage}`` (prompt tokens served from L1, L2 and L3). With ``n`` samples
(``combined_usage``): ``completion_tokens`` is their sum; the prompt figures are those of
sample 0.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import protos
from hicache.text import Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the most likely alternatives (id, logprob), most
    likely first (``protos.TokenOutput.logprobs``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(out: protos.TokenOutput) -> list[TokenLogprob]:
    """The logprob entries of a ``TokenOutput``, parallel to its ``token_ids`` ([] without)."""
    if out.logprobs is None:
        return []
    ids = out.top_ids or [[] for _ in out.logprobs]
    values = out.top_logprobs or [[] for _ in out.logprobs]
    return [TokenLogprob(t, lp, tuple(zip(i, v, strict=True)))
            for t, lp, i, v in zip(out.token_ids, out.logprobs, ids, values, strict=True)]


@dataclass(frozen=True)
class GenerationResult:
    """A finished request as the formats see it."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str
    usage: protos.Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """Parallel to ``output_ids`` when the request asked for logprobs, else empty."""


@dataclass(frozen=True)
class Step:
    """One streamed step: new text and ids; ``finish_reason``/``usage`` set on the last.
    ``logprobs`` parallel to ``token_ids`` when asked."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: protos.Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


def combined_usage(usages: Sequence[protos.Usage]) -> protos.Usage:
    """The usage of ``n`` samples of one prompt: sample 0's prompt and cache figures, the
    completion tokens of all."""
    return dataclasses.replace(usages[0], completion_tokens=sum(u.completion_tokens for u in usages))


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
    """Base: a format is built per request (it knows the request's id, model and time).

    ``full(results)``: the whole response (one result per sample). ``chunks(step, index)``:
    the stream chunks of one step of sample ``index``; ``tail(usage)``: what a stream sends
    after every sample ended (the ``sglext`` and usage chunks where asked)."""

    rid: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    cache_details: bool = False
    """SGLang ``return_cached_tokens_details`` (OpenAI routes): add the ``sglext`` object."""
    tokenizer: Tokenizer | None = None
    """Spells the tokens of logprob entries (needed only when logprobs are asked)."""
    wants_logprobs: bool = False
    """The request asked for logprobs: the responses carry them."""
    logprob_text: bool = False
    """``/generate``: SGLang's ``return_text_in_logprobs``."""
    _texts: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    def full(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, step: Step, index: int = 0) -> list[dict[str, Any]]:
        raise NotImplementedError

    def tail(self, usage: protos.Usage) -> list[dict[str, Any]]:
        return []

    def token_text(self, token_id: int) -> str:
        """The text of one token decoded alone (special tokens included), memoised."""
        text = self._texts.get(token_id)
        if text is None:
            assert self.tokenizer is not None, "logprobs need the format's tokenizer"
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _base(self, obj: str) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class _OpenAIFormat(ResponseFormat):
    """What the two OpenAI formats share: usage placement, ``sglext``, logprobs buffering."""

    _held: dict[int, list[TokenLogprob]] = field(default_factory=dict, init=False, repr=False)

    def _openai_full(self, body: dict[str, Any], results: Sequence[GenerationResult]) -> dict[str, Any]:
        usage = combined_usage([r.usage for r in results])
        body["usage"] = usage_dict(usage)
        if self.cache_details:
            body["sglext"] = {"cached_tokens_details": cached_details(usage)}
        return body

    def _chunk(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        body = self._base(self._chunk_object)
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return [body]

    def tail(self, usage: protos.Usage) -> list[dict[str, Any]]:
        out = []
        if self.cache_details:
            ext = self._base(self._chunk_object)
            ext["choices"] = []
            ext["sglext"] = {"cached_tokens_details": cached_details(usage)}
            if self.include_usage:
                ext["usage"] = None
            out.append(ext)
        if self.include_usage:
            last = self._base(self._chunk_object)
            last["choices"] = []
            last["usage"] = usage_dict(usage)
            out.append(last)
        return out

    def _step_logprobs(self, step: Step, index: int, shown: bool) -> list[TokenLogprob]:
        """The logprob entries a chunk of sample ``index`` carries: those held back from
        steps that showed no text, then this step's (all held back when ``shown`` is False)."""
        held = self._held.setdefault(index, [])
        held.extend(step.logprobs)
        if not shown:
            return []
        out = list(held)
        held.clear()
        return out

    _chunk_object = ""
    """The ``object`` of this format's stream chunks (a class constant, not a field)."""


@dataclass
class GenerateFormat(ResponseFormat):
    _sent: int = field(default=0, init=False, repr=False)

    def _meta(self, usage: protos.Usage | None, finish_reason: str | None,
              logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        u = usage or protos.Usage(completion_tokens=self._sent)
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "cached_tokens": u.cached_tokens,
            "cached_tokens_details": cached_details(u),
            "timings_ms": {"queue": round(u.queue_ms, 3), "load": round(u.load_ms, 3),
                           "prefill": round(u.prefill_ms, 3)},
            "finish_reason": finish_reason,
        }
        if logprobs is not None:
            meta["input_token_logprobs"] = []
            meta["input_top_logprobs"] = []
            meta["output_token_logprobs"] = [self._triple(e.logprob, e.token_id) for e in logprobs]
            meta["output_top_logprobs"] = [[self._triple(v, i) for i, v in e.top] for e in logprobs]
        return meta

    def _triple(self, logprob: float, token_id: int) -> list[Any]:
        return [logprob, token_id, self.token_text(token_id) if self.logprob_text else None]

    def full(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        (r,) = results
        return {"text": r.text, "output_ids": r.output_ids,
                "meta_info": self._meta(r.usage, r.finish_reason, r.logprobs if self.wants_logprobs else None)}

    def chunks(self, step: Step, index: int = 0) -> list[dict[str, Any]]:
        self._sent += len(step.token_ids)
        return [{"text": step.text, "output_ids": step.token_ids,
                 "meta_info": self._meta(step.usage, step.finish_reason,
                                         step.logprobs if self.wants_logprobs else None)}]


@dataclass
class CompletionFormat(_OpenAIFormat):
    _chunk_object = "text_completion"
    _offsets: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": f"cmpl-{self.rid}", "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: Sequence[TokenLogprob], index: int) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        offset = self._offsets.get(index, 0)
        tokens, offsets = [], []
        for e in entries:
            text = self.token_text(e.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{**{self.token_text(i): v for i, v in e.top},
                                  self.token_text(e.token_id): e.logprob} for e in entries],
                "text_offset": offsets}

    def full(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        body = self._base("text_completion")
        body["choices"] = [{"index": i, "text": r.text, "logprobs": self._logprobs(r.logprobs, i),
                            "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        return self._openai_full(body, results)

    def chunks(self, step: Step, index: int = 0) -> list[dict[str, Any]]:
        shown = bool(step.text) or step.finish_reason is not None
        entries = self._step_logprobs(step, index, shown)
        if not shown:
            return []  # ids without text yet (a split character): nothing to show
        return self._chunk({"index": index, "text": step.text, "logprobs": self._logprobs(entries, index),
                            "finish_reason": step.finish_reason})


@dataclass
class ChatFormat(_OpenAIFormat):
    _chunk_object = "chat.completion.chunk"
    _started: set[int] = field(default_factory=set, init=False, repr=False)

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{self.rid}", "object": obj, "created": self.created, "model": self.model}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        return {"content": [{**self._entry(e.token_id, e.logprob),
                             "top_logprobs": [self._entry(i, v) for i, v in e.top]} for e in entries],
                "refusal": None}

    def full(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        body = self._base("chat.completion")
        body["choices"] = [{"index": i, "message": {"role": "assistant", "content": r.text, "refusal": None},
                            "logprobs": self._logprobs(r.logprobs), "finish_reason": r.finish_reason}
                           for i, r in enumerate(results)]
        return self._openai_full(body, results)

    def chunks(self, step: Step, index: int = 0) -> list[dict[str, Any]]:
        first = index not in self._started
        shown = bool(step.text) or step.finish_reason is not None or first
        entries = self._step_logprobs(step, index, shown)
        if not shown:
            return []  # ids without text yet (a split character): nothing to show
        delta: dict[str, Any] = {}
        if first:  # the first chunk of each choice names the role
            delta["role"] = "assistant"
            self._started.add(index)
        if step.text or first:
            delta["content"] = step.text
        return self._chunk({"index": index, "delta": delta, "logprobs": self._logprobs(entries),
                            "finish_reason": step.finish_reason})
