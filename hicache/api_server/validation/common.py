"""What every generation route shares: the request and limit types, JSON parsing, typed
field reads and the checks of ``finish_request``. Every problem is a ``RequestError``.

``finish_request``: the prompt is non-empty, every token id is in ``[0, vocab_size)`` of the
model, the prompt leaves room in the model's context, ``max_new_tokens`` is in ``[1,
scheduler.max_new_tokens_limit]`` and fits the context, and the sampling parameters pass
``hicache.model.sampling_params.SamplingParams`` (its module docstring lists the accepted
ranges and why). A request that does not say how many tokens to generate gets
``min(scheduler.default_max_new_tokens, room left in the context)``. Numbers are JSON
numbers: NaN, infinities (also ``1e999``), booleans and integers too large for a float are
refused, never converted. Text must be valid Unicode: a lone surrogate (JSON ``"\\ud800"``)
anywhere in the body is a 400. Every ``RequestError`` names the offending field in
``param`` (None when no single field is at fault). See docs/architecture.md §11.
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
from hicache.config import HicacheConfig
from hicache.model.sampling_params import MAX_SEED, SamplingParamError, shown, to_wire
from hicache.model.sampling_params import SamplingParams as CheckedSampling
from hicache.model.spec import spec_for
from hicache.tenants import tenant_salt
from hicache.text import Tokenizer

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
        ``{rid}-{i}``, with ``seed + i`` when a seed is set (``finish_request`` checked it fits)."""
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
        raise RequestError(f"the request body must be a JSON object, got {json_type(data)}")
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


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- field access


class Fields:
    """Typed reads of one JSON object; ``where`` prefixes every message (e.g. ``sampling_params.``)."""

    def __init__(self, data: Any, allowed: Sequence[str], where: str = "") -> None:
        if not isinstance(data, dict):
            raise RequestError(f"{where.rstrip('.') or 'the body'} must be a JSON object, got {json_type(data)}",
                               param=where.rstrip(".") or None)
        unknown = sorted(k for k in data if k not in allowed)
        if unknown:
            raise RequestError(f"unknown field(s): {', '.join(where + k for k in unknown)}", param=where + unknown[0])
        self.data = data
        self.where = where

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def _bad(self, name: str, expected: str) -> RequestError:
        return self.error(name, f"must be {expected}, got {json_type(self.data[name])}")

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
class Asked:
    """What a body asked for, before the context-dependent checks: the token budget (None:
    the default), ``n``, and the sampling fields it set, under their ``SamplingParams``
    names (the one definition of them; absent fields keep its defaults)."""

    max_new_tokens: int | None = None
    n: int = 1
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def also(self, **sampling: Any) -> Asked:
        return dataclasses.replace(self, sampling={**self.sampling, **sampling})


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "input_ids") -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise RequestError(f"{what}[{i}] = {shown(t)} is outside the vocabulary [0, {vocab_size})", param=what)


@dataclass(frozen=True)
class Extras:
    """What a route adds to a ``PreparedRequest`` beyond the prompt and sampling."""

    model: str = ""
    include_usage: bool = False
    keep_stop: bool = False
    cache_details: bool = False
    logprob_text: bool = False
    logprobs_field: str = "logprobs"
    """The route's name of the number of alternatives (``top_logprobs`` in chat)."""


def finish_request(rid: str, input_ids: list[int], s: Asked, limits: ModelLimits, *, stop: tuple[str, ...],
                   stream: bool, cache_salt: str, extras: Extras = Extras(), field: str = "max_new_tokens",
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


_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_INTEGERS = ("top_k", "seed")


def read_sampling(f: Fields, max_tokens_field: str, *, default_temperature: float) -> Asked:
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
    return Asked(budget, 1, asked)
