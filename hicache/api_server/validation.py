"""Request bodies -> validated requests. Every problem is a ``RequestError`` naming it.

The three generation routes share the checks of ``_finish``: the prompt is non-empty, every
token id is in ``[0, vocab_size)`` of the model, the prompt leaves room in the model's
context, ``max_new_tokens`` is in ``[1, scheduler.max_new_tokens_limit]`` and fits the
context, and the sampling parameters pass ``hicache.model.sampling_params.SamplingParams``
(its module docstring lists the accepted ranges: temperature 0 or in [0.01, 100], top_p in
(0, 1], top_k in [0, vocabulary size], seed in [0, 2**63), and why). Every refusal is a 400
whose message starts with the field as the route spells it (``sampling_params.temperature``
for ``/generate``, ``temperature`` for the OpenAI routes). Numbers are JSON numbers: NaN,
infinities (also ``1e999``, which JSON parsers read as infinity), booleans and integers too
large for a float are refused, never converted. When a request does not say how many
tokens to generate, it gets ``min(scheduler.default_max_new_tokens, room left in the
context)``.

Penalties (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``), ``min_p``
and logprobs are honoured on every route (completions ``logprobs: k``; chat ``logprobs:
true`` with ``top_logprobs: k``; ``/generate`` SGLang's ``return_logprob`` with
``top_logprobs_num: k``), ``k`` at most ``MAX_LOGPROBS``. The OpenAI routes take ``n`` in
``[1, MAX_N]``: ``n`` independent samples of one prompt (``PreparedRequest.samples``; with a
``seed``, sample ``i`` uses ``seed + i``).

Unknown fields are refused (a typo must not silently change behaviour). Fields this server
does not implement (OpenAI's ``logit_bias``, ``echo``; SGLang's ``regex``, ``json_schema``,
``lora_path``, prompt logprobs, ``n`` on ``/generate`` ...) are accepted only with their
neutral value (``logit_bias: {}``, ``lora_path: null``, ``n: 1`` ...) and refused by name
otherwise: a field that would change the result is never silently ignored. Fields that
cannot change the result (SGLang's ``rid``, ``priority`` ...) are type-checked and ignored,
as SGLang ignores them.

Every ``RequestError`` names the offending field in ``param`` (``sampling_params.top_p``,
``messages[0].content``, ``model`` ...; None when no single field is at fault). Text must
be valid Unicode: a string with a lone surrogate (JSON ``"\\ud800"``) anywhere in the body
is refused with 400. An OpenAI ``model`` that is not one of the served names
(``server.served_model_names``, by default the model's own name) is a 404; an empty or
omitted ``model`` means the served model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import protos
from hicache.config import DEFAULT_STORE, HicacheConfig, to_dict
from hicache.model.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParamError, shown, to_wire
from hicache.model.sampling_params import SamplingParams as CheckedSampling
from hicache.model.spec import spec_for
from hicache.tenants import tenant_salt
from hicache.text import Tokenizer, TokenizerError

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_CACHE_SALT_LENGTH = 256
MAX_N = 128
"""The most samples (OpenAI ``n``) one request may ask for (the OpenAI API's own bound)."""


class RequestError(Exception):
    """A request that cannot be served as sent: ``status`` (400, 401, 404, 409, 413, 503 ...)
    and a message for the client. ``kind`` is the OpenAI error ``type``, ``param`` the field
    at fault (OpenAI's ``param``; None when no single field is)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.param = param


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    name: str
    """The name responses carry when the request names no model (the first served name)."""
    vocab_size: int
    max_context: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    served_names: tuple[str, ...] = ()
    """The names an OpenAI ``model`` field may carry; empty: only ``name``."""
    max_samples: int = MAX_N
    """The largest OpenAI ``n`` (``server.max_samples``)."""

    @property
    def names(self) -> tuple[str, ...]:
        """The served model names, ``name`` first."""
        return self.served_names or (self.name,)

    @classmethod
    def from_config(cls, config: HicacheConfig) -> ModelLimits:
        """From the config (reads only ``config.json`` for an ``hf`` model; no weights, no torch).
        ``server.served_model_names`` (when set) replaces the model's own name."""
        spec = spec_for(config.model)
        if config.model.kind == "hf":
            name = Path(config.model.path or "model").name
        else:
            name = f"hicache-reference-{config.model.reference.preset}"
        served = tuple(config.server.served_model_names or (name,))
        return cls(served[0], spec.vocab_size, spec.max_context, config.scheduler.max_new_tokens_limit,
                   config.scheduler.default_max_new_tokens, served, config.server.max_samples)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated generation request, ready to become a ``GenerateRequest``."""

    rid: str
    input_ids: list[int]
    sampling: protos.SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    cache_salt: str = ""
    include_usage: bool = False
    """OpenAI ``stream_options.include_usage``: add the usage-only chunk at the end of a stream."""
    model: str = ""
    """The model name the response carries (the one the request named, else the first served)."""
    keep_stop: bool = False
    """SGLang ``no_stop_trim``: the text keeps the stop string that ended it."""
    cache_details: bool = False
    """SGLang ``return_cached_tokens_details`` on the OpenAI routes: add ``sglext``."""
    n: int = 1
    """OpenAI ``n``: how many samples of this prompt the response holds (``samples``)."""
    logprob_text: bool = False
    """SGLang ``return_text_in_logprobs``: the logprob entries of ``/generate`` carry the text."""

    @property
    def logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    def for_tenant(self, tenant: str | None) -> PreparedRequest:
        """This request as ``tenant`` sends it: ``cache_salt`` becomes ``tenant_salt(tenant,
        cache_salt)``; ``self`` when ``tenant`` is None."""
        if tenant is None:
            return self
        return dataclasses.replace(self, cache_salt=tenant_salt(tenant, self.cache_salt))

    def samples(self) -> list[PreparedRequest]:
        """The requests of the ``n`` samples: ``self`` when ``n == 1``; else one per sample,
        ``{rid}-{i}``, with ``seed + i`` when a seed is set (``_finish`` checked it fits)."""
        if self.n == 1:
            return [self]
        out = []
        for i in range(self.n):
            seed = None if self.sampling.seed is None else self.sampling.seed + i
            sampling = dataclasses.replace(self.sampling, seed=seed, stop_token_ids=list(self.sampling.stop_token_ids))
            out.append(dataclasses.replace(self, rid=f"{self.rid}-{i}", sampling=sampling, n=1))
        return out

    def to_message(self) -> protos.GenerateRequest:
        """The scheduler's message. A request with stop strings is sent as streaming, whatever
        the client asked: the scheduler then sends each token as it is made, so that a stop
        string is seen, and the request aborted, at once instead of after ``max_new_tokens``."""
        return protos.GenerateRequest(self.rid, self.input_ids, self.sampling, self.stream or bool(self.stop),
                                      self.cache_salt)


# --------------------------------------------------------------------------- JSON


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: the only way a JSON text can spell a string that is
not valid Unicode (a lone one) once it decoded as UTF-8."""


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; RequestError for anything else, and for a string anywhere in
    it that is not valid Unicode (a lone surrogate), naming where it is."""
    if not raw:
        raise RequestError("the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {_json_type(data)}")
    if _SURROGATE_ESCAPE.search(raw):
        check_unicode(data)
    return data


def check_unicode(value: Any, path: str = "") -> None:
    """RequestError (400, ``param`` = the path) for the first string or key in ``value`` that
    does not encode as UTF-8 (it holds a lone surrogate)."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                name = where or "the body"
                raise RequestError(f"{name} is not valid Unicode text: a lone surrogate "
                                   f"(U+{ord(v[exc.start]):04X}) at character {exc.start}",
                                   param=where or None) from None
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, where))
                stack.append((x, f"{where}.{k}" if where else str(k)))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- field access


class _Fields:
    """Typed reads of one JSON object; ``where`` prefixes every message (e.g. ``sampling_params.``)."""

    def __init__(self, data: Any, allowed: Sequence[str], where: str = "") -> None:
        if not isinstance(data, dict):
            raise RequestError(f"{where.rstrip('.') or 'the body'} must be a JSON object, got {_json_type(data)}",
                               param=where.rstrip(".") or None)
        unknown = sorted(k for k in data if k not in allowed)
        if unknown:
            raise RequestError(f"unknown field(s): {', '.join(where + k for k in unknown)}", param=where + unknown[0])
        self.data = data
        self.where = where

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def _bad(self, name: str, expected: str) -> RequestError:
        return self.error(name, f"must be {expected}, got {_json_type(self.data[name])}")

    def error(self, name: str, detail: str, status: int = 400) -> RequestError:
        """``<where><name> <detail>``, with ``param`` naming the field."""
        return RequestError(f"{self.where}{name} {detail}", status, param=self.where + name)

    def get_int(self, name: str) -> int | None:
        v = self.data.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(name, "an integer")
        return v

    def get_number(self, name: str) -> float | None:
        v = self.data.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self._bad(name, "a number")
        try:
            f = float(v)
        except OverflowError:  # an integer beyond the float range
            raise self.error(name, "must be a finite number, got an integer too large") from None
        if not math.isfinite(f):
            raise self.error(name, f"must be a finite number, got {f}")
        return f

    def get_bool(self, name: str, default: bool = False) -> bool:
        v = self.data.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._bad(name, "true or false")
        return v

    def get_str(self, name: str, default: str | None = None, max_length: int | None = None) -> str | None:
        v = self.data.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._bad(name, "a string")
        if max_length is not None and len(v) > max_length:
            raise self.error(name, f"must be at most {max_length} characters")
        return v

    def stop_strings(self, name: str) -> tuple[str, ...]:
        v = self.data.get(name)
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self._bad(name, "a string or an array of strings")
        if len(items) > MAX_STOP_STRINGS:
            raise self.error(name, f"may hold at most {MAX_STOP_STRINGS} strings")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in items):
            raise RequestError(f"{self.where}{name}: each stop string must have 1 to {MAX_STOP_LENGTH} characters",
                               param=self.where + name)
        return tuple(items)

    def int_list(self, name: str) -> list[int]:
        v = self.data.get(name)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self._bad(name, "an array of integers")
        return v

    def neutral(self, name: str, ok: Callable[[Any], bool], meaning: str) -> None:
        """A field this server does not implement: only null and its neutral value pass; any
        other value is refused by name (400)."""
        v = self.data.get(name)
        if v is not None and not ok(v):
            raise self.error(name, f"is not supported by this server ({meaning})")


# --------------------------------------------------------------------------- shared checks


@dataclass(frozen=True)
class _Asked:
    """What a body asked for, before the context-dependent checks: the token budget (None:
    the default), ``n``, and the sampling fields it set, under their ``SamplingParams``
    names (the one definition of them; absent fields keep its defaults)."""

    max_new_tokens: int | None = None
    n: int = 1
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def also(self, **sampling: Any) -> _Asked:
        return dataclasses.replace(self, sampling={**self.sampling, **sampling})


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "input_ids") -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise RequestError(f"{what}[{i}] = {shown(t)} is outside the vocabulary [0, {vocab_size})", param=what)


@dataclass(frozen=True)
class _Extras:
    """What a route adds to a ``PreparedRequest`` beyond the prompt and sampling."""

    model: str = ""
    include_usage: bool = False
    keep_stop: bool = False
    cache_details: bool = False
    logprob_text: bool = False
    logprobs_field: str = "logprobs"
    """The route's name of the number of alternatives (``top_logprobs`` in chat)."""


def _finish(rid: str, input_ids: list[int], s: _Asked, limits: ModelLimits, *, stop: tuple[str, ...],
            stream: bool, cache_salt: str, extras: _Extras = _Extras(), field: str = "max_new_tokens",
            where: str = "", prompt_field: str | None = None) -> PreparedRequest:
    """The checks every route shares. ``field`` is the route's name for the token budget,
    ``where`` the prefix of its sampling fields (``sampling_params.`` or nothing),
    ``prompt_field`` the field that holds the prompt (the ``param`` of prompt errors).
    The sampling parameters are checked by ``CheckedSampling`` (their one definition) and
    sent field by field under the same names."""
    n = len(input_ids)
    if n == 0:
        raise RequestError("the prompt is empty", param=prompt_field)
    check_token_ids(input_ids, limits.vocab_size)
    room = limits.max_context - n
    if room <= 0:
        raise RequestError(f"the prompt is {n} tokens long, but the model's context is {limits.max_context} tokens",
                           param=prompt_field)
    max_new = s.max_new_tokens
    if max_new is None:
        max_new = min(limits.default_max_new_tokens, room)
    elif max_new < 1:
        raise RequestError(f"{field} must be >= 1, got {shown(max_new)}", param=field)
    elif max_new > limits.max_new_tokens_limit:
        raise RequestError(f"{field} must be <= {limits.max_new_tokens_limit}, got {shown(max_new)}", param=field)
    elif max_new > room:
        raise RequestError(
            f"the prompt ({n} tokens) plus {field} ({max_new}) exceeds the model's context of "
            f"{limits.max_context} tokens", param=field)
    try:
        checked = CheckedSampling(max_new_tokens=max_new, **s.sampling)
        checked.check_vocab(limits.vocab_size)
    except SamplingParamError as exc:
        name = {"max_new_tokens": field, "logprobs": extras.logprobs_field}.get(exc.field, where + exc.field)
        raise RequestError(f"{name} {exc.detail}", param=name) from None
    if checked.seed is not None and checked.seed + s.n - 1 > MAX_SEED:
        raise RequestError(f"{where}seed must be <= 2**63 - n = {MAX_SEED - s.n + 1} with n = {s.n} "
                           "(sample i uses seed + i)", param=where + "seed")
    return PreparedRequest(rid, input_ids, to_wire(checked), stop, stream, cache_salt, extras.include_usage, extras.model,
                           extras.keep_stop, extras.cache_details, s.n, extras.logprob_text)


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """A text prompt's ids, as every route without a chat template makes them."""
    return tokenizer.encode(text, add_special_tokens=True)


# --------------------------------------------------------------------------- POST /generate

_GENERATE_FIELDS = (
    "text", "input_ids", "sampling_params", "stream", "cache_salt",
    # SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py), as its own client sends it
    "rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "return_text_in_logprobs", "return_hidden_states", "return_routed_experts", "modalities", "image_data",
    "video_data", "audio_data", "input_embeds", "session_params", "session_id", "lora_path", "lora_id",
    "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "decode_tp_size", "data_parallel_rank", "routed_dp_rank", "priority", "extra_key", "log_metrics", "no_logs",
    "custom_labels", "conversation_id", "routing_key", "return_cached_tokens_details",
)
_GENERATE_SAMPLING = (
    "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
    # SGLang's SamplingParams (python/sglang/srt/sampling/sampling_params.py)
    "sampling_seed", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stream_interval",
    "min_new_tokens", "n", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "json_schema",
    "regex", "ebnf", "structural_tag", "stop_regex", "logit_bias", "custom_params",
)
_MEDIA_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds")
_DISAGG_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size")


def _empty(v: Any) -> bool:
    return v in ([], {}, "")


def _sglang_fields(f: _Fields) -> None:
    """SGLang's top-level ``/generate`` fields: type-check the ones that cannot change the
    result (ignored, as SGLang ignores them without logprobs), refuse by name the ones this
    server does not implement when they are set."""
    rid = f.data.get("rid")
    if isinstance(rid, list):
        raise f.error("rid", "is a list: batches are not supported (send one request per prompt)")
    f.get_str("rid")
    if f.get_bool("return_logprob"):  # the output's logprobs are honoured, the prompt's are not
        f.neutral("logprob_start_len", lambda v: v == -1, "prompt logprobs are not implemented: only -1")
        f.neutral("token_ids_logprob", _empty, "logprobs of chosen ids are not implemented")
    f.get_int("logprob_start_len")
    f.int_list("token_ids_logprob")
    f.neutral("return_hidden_states", lambda v: v is False, "hidden states are not returned")
    f.neutral("return_routed_experts", lambda v: v is False, "routed experts are not returned")
    modalities = f.data.get("modalities")
    if modalities is not None and not (isinstance(modalities, list)
                                       and all(m is None or isinstance(m, str) for m in modalities)):
        raise f._bad("modalities", "an array of strings")
    for name in _MEDIA_FIELDS:
        f.neutral(name, _empty, "only text prompts")
    f.neutral("session_params", _empty, "sessions are not implemented")
    f.get_str("session_id")
    f.neutral("lora_path", lambda v: v == [] or (isinstance(v, list) and all(x is None for x in v)),
              "LoRA adapters are not supported")
    f.neutral("lora_id", lambda v: False, "LoRA adapters are not supported")
    f.neutral("custom_logit_processor", lambda v: False, "custom logit processors are not supported")
    for name in _DISAGG_FIELDS:
        f.neutral(name, lambda v: False, "prefill-decode disaggregation is not supported")
    for name in ("data_parallel_rank", "routed_dp_rank"):
        f.neutral(name, lambda v: v == 0, "this server has one data-parallel rank, 0")
        f.get_int(name)
    f.get_int("priority")
    f.get_bool("log_metrics", True)
    f.get_bool("no_logs")
    custom_labels = f.data.get("custom_labels")
    if custom_labels is not None and not isinstance(custom_labels, dict):
        raise f._bad("custom_labels", "an object")
    f.get_str("conversation_id")
    f.get_str("routing_key")
    f.get_bool("return_cached_tokens_details")  # meta_info always has cached_tokens_details


def _sglang_sampling(sp: _Fields) -> None:
    """SGLang's sampling fields that this server does not implement: neutral values only."""
    sp.neutral("n", lambda v: v == 1, "only n = 1 on /generate; the OpenAI routes take n")
    sp.neutral("min_new_tokens", lambda v: v == 0, "min_new_tokens is not implemented")
    for name in ("json_schema", "regex", "ebnf", "structural_tag"):
        sp.neutral(name, lambda v: False, "constrained decoding is not implemented")
    sp.neutral("stop_regex", _empty, "stop_regex is not implemented")
    sp.neutral("logit_bias", _empty, "logit_bias is not implemented")
    sp.neutral("custom_params", _empty, "custom_params are not supported")
    sp.neutral("skip_special_tokens", lambda v: v is True, "special tokens are always skipped in the text")
    sp.get_bool("spaces_between_special_tokens", True)  # moot: special tokens are skipped
    sp.get_int("stream_interval")  # how often a stream sends; this server sends every step


def parse_generate(data: dict[str, Any], rid: str, tokenizer: Tokenizer, limits: ModelLimits) -> PreparedRequest:
    """``{"text" | "input_ids", "sampling_params", "stream", "cache_salt"}``; greedy by default.

    Also takes the fields SGLang's ``/generate`` takes (its own benchmark client sends
    ``lora_path: null``, ``return_logprob: false``, ``logprob_start_len: -1`` ...), see
    ``_sglang_fields`` and ``_sglang_sampling``: ``sampling_seed`` is the seed,
    ``no_stop_trim`` keeps the stop string in the text, ``extra_key`` joins ``cache_salt`` in
    separating cached prefixes.
    """
    f = _Fields(data, _GENERATE_FIELDS)
    if f.has("text") == f.has("input_ids"):
        raise RequestError("give exactly one of text and input_ids", param="text")
    if isinstance(data.get("text"), list) or (isinstance(data.get("input_ids"), list) and data["input_ids"]
                                               and isinstance(data["input_ids"][0], list)):
        raise RequestError("a batch of prompts is not supported (send one request per prompt)",
                           param="text" if f.has("text") else "input_ids")
    _sglang_fields(f)
    text = f.get_str("text")
    input_ids = encode_prompt(tokenizer, text) if text is not None else list(f.int_list("input_ids"))
    sp = _Fields(data.get("sampling_params") or {}, _GENERATE_SAMPLING, "sampling_params.")
    _sglang_sampling(sp)
    s = _sampling(sp, "max_new_tokens", default_temperature=0.0)
    top = f.get_int("top_logprobs_num")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise f.error("top_logprobs_num", f"must be an integer in [0, {MAX_LOGPROBS}], got {shown(top)}")
    if f.get_bool("return_logprob"):
        s = s.also(logprobs=top or 0)
    sampling_seed = sp.get_int("sampling_seed")
    if sampling_seed is not None:
        seed = s.sampling.get("seed")
        if seed is not None and seed != sampling_seed:
            raise sp.error("sampling_seed", f"({sampling_seed}) differs from sampling_params.seed ({seed})")
        s = s.also(seed=sampling_seed)
    salt = f.get_str("cache_salt", "", MAX_CACHE_SALT_LENGTH) or ""
    extra_key = f.get_str("extra_key", "", MAX_CACHE_SALT_LENGTH) or ""
    if extra_key:
        salt = f"{salt}\x00extra_key={extra_key}"
    return _finish(rid, input_ids, s, limits, stop=sp.stop_strings("stop"), stream=f.get_bool("stream"),
                   cache_salt=salt, extras=_Extras(keep_stop=sp.get_bool("no_stop_trim"),
                                                   logprob_text=f.get_bool("return_text_in_logprobs"),
                                                   logprobs_field="top_logprobs_num"),
                   field="sampling_params.max_new_tokens", where="sampling_params.",
                   prompt_field="text" if text is not None else "input_ids")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_INTEGERS = ("top_k", "seed")


def _sampling(f: _Fields, max_tokens_field: str, *, default_temperature: float) -> _Asked:
    """The sampling fields every route shares, read from ``f`` (type checks here, in this
    order, so the first bad one is the one reported; ranges by ``CheckedSampling``)."""
    budget = f.get_int(max_tokens_field)
    asked: dict[str, Any] = {"temperature": default_temperature}
    for name in _NUMBERS:
        value = f.get_number(name)
        if value is not None:
            asked[name] = value
    for name in _INTEGERS:
        value = f.get_int(name)
        if value is not None:
            asked[name] = value
    asked["stop_token_ids"] = tuple(f.int_list("stop_token_ids"))
    asked["ignore_eos"] = f.get_bool("ignore_eos")
    return _Asked(budget, 1, asked)


# --------------------------------------------------------------------------- OpenAI routes

_OPENAI_COMMON = (
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    # extensions (as other OpenAI-compatible servers spell them)
    "top_k", "stop_token_ids", "ignore_eos", "cache_salt", "min_p", "repetition_penalty",
    "return_cached_tokens_details",
)
_COMPLETION_FIELDS = (*_OPENAI_COMMON, "prompt", "echo", "best_of", "suffix")
_CHAT_FIELDS = (*_OPENAI_COMMON, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                "tool_choice", "parallel_tool_calls")
_CHAT_ROLES = ("system", "user", "assistant", "developer")


def served_model(f: _Fields, limits: ModelLimits) -> str:
    """The name the response carries: the request's ``model`` when it is served, the first
    served name when it is empty or omitted; 404 (OpenAI's answer) for any other name."""
    model = f.get_str("model") or ""
    if not model:
        return limits.name
    if model not in limits.names:
        raise RequestError(f"The model `{model}` does not exist (this server serves: {', '.join(limits.names)})",
                           404, param="model")
    return model


def _openai_sampling(f: _Fields, limits: ModelLimits, max_tokens_field: str = "max_tokens") -> _Asked:
    """Sampling fields of an OpenAI body; temperature defaults to 1.0 as in the OpenAI API."""
    f.get_str("user")
    f.neutral("logit_bias", lambda v: v == {}, "logit_bias is not implemented")
    s = _sampling(f, max_tokens_field, default_temperature=1.0)
    n = _or(f.get_int("n"), 1)
    if not 1 <= n <= limits.max_samples:
        raise f.error("n", f"must be an integer in [1, {limits.max_samples}] (server.max_samples), got {shown(n)}")
    return dataclasses.replace(s, n=n)  # the samples: PreparedRequest.samples


def _openai_extras(f: _Fields, model: str) -> tuple[bool, _Extras]:
    """``stream``, and what the response needs: the model name, ``stream_options.include_usage``
    and SGLang's ``return_cached_tokens_details``."""
    stream = f.get_bool("stream")
    opts = _Fields(f.data.get("stream_options") or {}, ("include_usage", "continuous_usage_stats"),
                   "stream_options.")
    opts.get_bool("continuous_usage_stats")
    return stream, _Extras(model=model, include_usage=opts.get_bool("include_usage"),
                           cache_details=f.get_bool("return_cached_tokens_details"))


def parse_completion(data: dict[str, Any], rid: str, tokenizer: Tokenizer, limits: ModelLimits) -> PreparedRequest:
    """``POST /v1/completions``: one prompt (a string or an array of token ids)."""
    f = _Fields(data, _COMPLETION_FIELDS)
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
        raise RequestError(f"prompt must be a string or an array of token ids, got {_json_type(prompt)}",
                           param="prompt")
    s = _openai_sampling(f, limits).also(logprobs=f.get_int("logprobs"))
    stream, extras = _openai_extras(f, model)
    return _finish(rid, input_ids, s, limits, stop=f.stop_strings("stop"), stream=stream,
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
            p = _Fields(part, ("type", "text"), f"messages[{i}].content[{j}].")
            if p.get_str("type") != "text":
                raise RequestError(f"messages[{i}].content[{j}].type must be \"text\" (only text is supported)",
                                   param=f"messages[{i}].content[{j}].type")
            out.append(p.get_str("text") or "")
        return "".join(out)
    raise RequestError(f"messages[{i}].content must be a string or an array of text parts, got {_json_type(content)}",
                       param=f"messages[{i}].content")


def parse_chat(data: dict[str, Any], rid: str, tokenizer: Tokenizer, limits: ModelLimits) -> PreparedRequest:
    """``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template."""
    f = _Fields(data, _CHAT_FIELDS)
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
        mf = _Fields(m, ("role", "content", "name"), f"messages[{i}].")
        role = mf.get_str("role")
        if role not in _CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}; got {role!r}",
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
    return _finish(rid, input_ids, s, limits, stop=f.stop_strings("stop"), stream=stream,
                   cache_salt=f.get_str("cache_salt", "", MAX_CACHE_SALT_LENGTH) or "", extras=extras,
                   field=field, prompt_field="messages")


# --------------------------------------------------------------------------- PUT /cache/storage


STORAGE_FIELDS = ("store",)


def parse_storage_choice(data: dict[str, Any], config: HicacheConfig) -> dict[str, Any]:
    """``PUT /cache/storage``'s body ``{"store": NAME}`` -> the ``storage_attach`` op's args
    ``{"l3": <that store's resolved cache.l3 section>}``.

    ``NAME`` is one the operator's config names: ``default`` (``cache.l3`` itself, when it
    names a store) or a key of ``cache.l3_stores``, checked with the rest of the config at
    start (its keys, files, and the tenants' L3 quotas). A body naming anything else (a
    backend, a URL, a directory, a password source) is refused: what the daemon reaches and
    which secrets it sends are the config's alone (README "Security"). The scheduler can
    rebuild the ``L3Config`` with ``config_from_dict({"cache": {"l3": args["l3"]}})``."""
    stores = attachable_stores(config)
    named = ", ".join(stores) or "none: cache.l3_stores is empty"
    unknown = sorted(set(data) - set(STORAGE_FIELDS))
    if unknown:
        raise RequestError(f"PUT /cache/storage takes {{\"store\": NAME}}, a store the config names "
                           f"({named}); got {', '.join(unknown)}", param=unknown[0])
    if not config.cache.l2.enabled:
        raise RequestError("an L3 backend needs cache.l2.enabled: true, and this daemon runs without L2", 409)
    name = data.get("store")
    if not isinstance(name, str) or name not in stores:
        raise RequestError(f"store must name a store of the config ({named}), got {name!r}", param="store")
    return {"l3": to_dict(stores[name])}


def attachable_stores(config: HicacheConfig) -> dict[str, Any]:
    """The stores ``PUT /cache/storage`` may attach, by name (``parse_storage_choice``)."""
    stores: dict[str, Any] = {}
    if config.cache.l3.backend != "none":
        stores[DEFAULT_STORE] = config.cache.l3
    stores.update(config.cache.l3_stores)
    return stores
