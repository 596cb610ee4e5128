"""``POST /v1/completions`` and ``POST /v1/chat/completions``, OpenAI's dialect.

Temperature defaults to 1.0 as in the OpenAI API. ``n`` in ``[1, server.max_samples]``:
``n`` independent samples of one prompt (``PreparedRequest.samples``; with a ``seed``,
sample ``i`` uses ``seed + i``). Logprobs: completions ``logprobs: k``, chat ``logprobs:
true`` with ``top_logprobs: k``. A ``model`` that is not one of the served names
(``server.served_model_names``, by default the model's own name) is a 404; an empty or
omitted ``model`` means the served model. See docs/architecture.md §11.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hicache.api_server.validation.common import (
    MAX_CACHE_SALT_LENGTH,
    Asked,
    Extras,
    Fields,
    ModelLimits,
    PreparedRequest,
    RequestError,
    encode_prompt,
    finish_request,
    json_type,
    read_sampling,
)
from hicache.model.sampling_params import shown
from hicache.text import Tokenizer, TokenizerError

_OPENAI_COMMON = (
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    # extensions (as other OpenAI-compatible servers spell them)
    "top_k", "stop_token_ids", "ignore_eos", "cache_salt", "min_p", "repetition_penalty",
    "return_cached_tokens_details",
)
COMPLETION_FIELDS = (*_OPENAI_COMMON, "prompt", "echo", "best_of", "suffix")
CHAT_FIELDS = (*_OPENAI_COMMON, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                "tool_choice", "parallel_tool_calls")
CHAT_ROLES = ("system", "user", "assistant", "developer")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def served_model(f: Fields, limits: ModelLimits) -> str:
    """The name the response carries: the request's ``model`` when it is served, the first
    served name when it is empty or omitted; 404 (OpenAI's answer) for any other name."""
    model = f.get_str("model") or ""
    if not model:
        return limits.name
    if model not in limits.names:
        raise RequestError(f"The model `{model}` does not exist (this server serves: {', '.join(limits.names)})",
                           404, param="model")
    return model


def _openai_sampling(f: Fields, limits: ModelLimits, max_tokens_field: str = "max_tokens") -> Asked:
    """Sampling fields of an OpenAI body; temperature defaults to 1.0 as in the OpenAI API."""
    f.get_str("user")
    f.neutral("logit_bias", lambda v: v == {}, "logit_bias is not implemented")
    s = read_sampling(f, max_tokens_field, default_temperature=1.0)
    n = _or(f.get_int("n"), 1)
    if not 1 <= n <= limits.max_samples:
        raise f.error("n", f"must be an integer in [1, {limits.max_samples}] (server.max_samples), got {shown(n)}")
    return dataclasses.replace(s, n=n)  # the samples: PreparedRequest.samples


def _openai_extras(f: Fields, model: str) -> tuple[bool, Extras]:
    """``stream``, and what the response needs: the model name, ``stream_options.include_usage``
    and SGLang's ``return_cached_tokens_details``."""
    stream = f.get_bool("stream")
    opts = Fields(f.data.get("stream_options") or {}, ("include_usage", "continuous_usage_stats"),
                   "stream_options.")
    opts.get_bool("continuous_usage_stats")
    return stream, Extras(model=model, include_usage=opts.get_bool("include_usage"),
                           cache_details=f.get_bool("return_cached_tokens_details"))


def parse_completion(data: dict[str, Any], rid: str, tokenizer: Tokenizer, limits: ModelLimits) -> PreparedRequest:
    """``POST /v1/completions``: one prompt (a string or an array of token ids)."""
    f = Fields(data, COMPLETION_FIELDS)
    model = served_model(f, limits)
    f.neutral("echo", lambda v: v is False, "echo is not implemented")
    f.neutral("best_of", lambda v: v == 1, "only best_of = 1")
    f.neutral("suffix", lambda v: v == "", "suffix is not implemented")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        input_ids = encode_prompt(tokenizer, prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        input_ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise RequestError("prompt: only one prompt per request is supported", param="prompt")
    else:
        raise RequestError(f"prompt must be a string or an array of token ids, got {json_type(prompt)}",
                           param="prompt")
    s = _openai_sampling(f, limits).also(logprobs=f.get_int("logprobs"))
    stream, extras = _openai_extras(f, model)
    return finish_request(rid, input_ids, s, limits, stop=f.stop_strings("stop"), stream=stream,
                          cache_salt=f.get_str("cache_salt", "", MAX_CACHE_SALT_LENGTH) or "", extras=extras,
                          field="max_tokens", prompt_field="prompt")


def _message_content(msg: dict[str, Any], i: int) -> str:
    content = msg.get("content")
    if content is None and msg.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text
        out = []
        for j, part in enumerate(content):
            p = Fields(part, ("type", "text"), f"messages[{i}].content[{j}].")
            if p.get_str("type") != "text":
                raise RequestError(f"messages[{i}].content[{j}].type must be \"text\" (only text is supported)",
                                   param=f"messages[{i}].content[{j}].type")
            out.append(p.get_str("text") or "")
        return "".join(out)
    raise RequestError(f"messages[{i}].content must be a string or an array of text parts, got {json_type(content)}",
                       param=f"messages[{i}].content")


def parse_chat(data: dict[str, Any], rid: str, tokenizer: Tokenizer, limits: ModelLimits) -> PreparedRequest:
    """``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template."""
    f = Fields(data, CHAT_FIELDS)
    model = served_model(f, limits)
    f.neutral("response_format", lambda v: v == {"type": "text"}, "only the text response format")
    f.neutral("tools", lambda v: v == [], "tool calls are not implemented")
    f.neutral("tool_choice", lambda v: v == "none", "tool calls are not implemented")
    f.get_bool("parallel_tool_calls")
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty array of {role, content} objects", param="messages")
    messages = []
    for i, m in enumerate(raw):
        mf = Fields(m, ("role", "content", "name"), f"messages[{i}].")
        role = mf.get_str("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                               param=f"messages[{i}].role")
        mf.get_str("name")
        messages.append({"role": "system" if role == "developer" else role, "content": _message_content(m, i)})
    try:
        input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TokenizerError as exc:
        raise RequestError(f"messages: {exc}", param="messages") from None
    field = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    s = _openai_sampling(f, limits, field)
    top = f.get_int("top_logprobs")
    if f.get_bool("logprobs"):
        s = s.also(logprobs=0 if top is None else top)
    elif top:
        raise f.error("top_logprobs", "needs logprobs: true")
    stream, extras = _openai_extras(f, model)
    extras = dataclasses.replace(extras, logprobs_field="top_logprobs")
    return finish_request(rid, input_ids, s, limits, stop=f.stop_strings("stop"), stream=stream,
                          cache_salt=f.get_str("cache_salt", "", MAX_CACHE_SALT_LENGTH) or "", extras=extras,
                          field=field, prompt_field="messages")
