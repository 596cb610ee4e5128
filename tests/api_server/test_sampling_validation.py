"""Validation of the sampling fields on every generation route.

Every value the sampler cannot honour is refused with a ``RequestError`` (HTTP 400) whose
message starts with the field as the route spells it; every value in the accepted ranges
(``hicache.model.sampling_params``) passes and reaches the scheduler unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest

import protos
from hicache.api_server.validation import (
    ModelLimits,
    PreparedRequest,
    RequestError,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json,
)
from hicache.model.sampling_params import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParamError, SamplingParams
from hicache.text import ByteTokenizer

from .harness import TokenizerProcess

TOK = ByteTokenizer()
VOCAB = 512
LIMITS = ModelLimits("m", vocab_size=VOCAB, max_context=64, max_new_tokens_limit=32, default_max_new_tokens=8)
Parser = Callable[[dict[str, Any], str, ByteTokenizer, ModelLimits], PreparedRequest]


def _generate(fields: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": [1, 2, 3], "sampling_params": fields}


def _completion(fields: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "hi", **fields}


def _chat(fields: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


# route -> (parser, body builder, prefix of the sampling fields, name of the token budget)
ROUTES: dict[str, tuple[Parser, Callable[[dict[str, Any]], dict[str, Any]], str, str]] = {
    "/generate": (parse_generate, _generate, "sampling_params.", "max_new_tokens"),
    "/v1/completions": (parse_completion, _completion, "", "max_tokens"),
    "/v1/chat/completions": (parse_chat, _chat, "", "max_tokens"),
}

NAN, INF = float("nan"), float("inf")
HUGE_INT = 10**400  # beyond the float range
BAD: dict[str, list[Any]] = {
    "temperature": [NAN, INF, -INF, -1.0, -1e-300, 1e-300, 5e-324, 1e-45, 1e-38, 1e-5, MIN_TEMPERATURE * 0.99,
                    MAX_TEMPERATURE * 1.01, 1e300, 1.7e308, HUGE_INT, -HUGE_INT, 2**64, True, False, "0.5", [0.5],
                    {"t": 1}],
    "top_p": [NAN, INF, -INF, 0, 0.0, -0.0, -5e-324, -1.0, 1.0000001, 2, 1e300, HUGE_INT, True, "1", [1]],
    "top_k": [-1, -(2**63), VOCAB + 1, 2**31, 2**63, 2**64 + 1, HUGE_INT, 1.5, 5.0, NAN, INF, True, "5", [5]],
    "seed": [-1, -(2**63), 2**63, 2**64, HUGE_INT, 1.0, NAN, INF, True, "7", [7]],
    "stop_token_ids": [[-1], [VOCAB], [2**31], [2**63], [HUGE_INT], [True], [1.0], [NAN], "x", 3, {"a": 1}],
    "ignore_eos": [1, 0, "true", [True]],
    "max_tokens": [0, -1, LIMITS.max_new_tokens_limit + 1, 2**31, 2**63, 2**64, HUGE_INT, -HUGE_INT, 1.5, 8.0,
                   NAN, INF, True, "8", [8]],
}
GOOD: dict[str, list[Any]] = {
    "temperature": [0, 0.0, -0.0, MIN_TEMPERATURE, 0.7, 1, 2.0, MAX_TEMPERATURE],
    "top_p": [5e-324, 1e-300, 1e-10, 0.5, 1, 1.0],
    "top_k": [0, 1, 40, VOCAB],
    "seed": [0, 1, 2**62, 2**63 - 1],
    "stop_token_ids": [[], [0], [VOCAB - 1, 3]],
    "ignore_eos": [True, False],
    "max_tokens": [1, LIMITS.max_new_tokens_limit],
}


def _field(route: str, name: str) -> str:
    """The field as ``route`` spells it (``max_tokens`` is ``max_new_tokens`` for /generate)."""
    _parser, _body, prefix, budget = ROUTES[route]
    return prefix + (budget if name == "max_tokens" else name)


def _body(route: str, name: str, value: Any) -> dict[str, Any]:
    _parser, build, _prefix, budget = ROUTES[route]
    key = budget if name == "max_tokens" else name
    return build({key: value})


def _parse(route: str, body: dict[str, Any]) -> PreparedRequest:
    parser = ROUTES[route][0]
    return parser(body, "rid", TOK, LIMITS)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in BAD.items() for v in vs],
                         ids=lambda x: repr(x)[:24])
def test_bad_values_are_refused_naming_the_field(route: str, name: str, value: Any) -> None:
    field = _field(route, name)
    with pytest.raises(RequestError) as info:
        _parse(route, _body(route, name, value))
    assert info.value.status == 400
    assert info.value.message.startswith(field + " ") or info.value.message.startswith(field + ":"), \
        info.value.message
    assert len(info.value.message) < 300  # a huge value is not echoed digit by digit


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in GOOD.items() for v in vs],
                         ids=lambda x: repr(x)[:24])
def test_good_values_reach_the_scheduler(route: str, name: str, value: Any) -> None:
    req = _parse(route, _body(route, name, value))
    s = req.to_message().sampling
    got = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
           "stop_token_ids": s.stop_token_ids, "ignore_eos": s.ignore_eos, "max_tokens": s.max_new_tokens}[name]
    assert got == value
    if name in ("temperature", "top_p"):
        assert type(got) is float and math.copysign(1.0, got) == 1.0  # -0.0 is sent as 0.0
    msg = req.to_message()
    assert protos.decode(protos.encode(msg)) == msg  # every accepted value fits the wire
    # and the scheduler accepts what validation accepted
    SamplingParams(s.max_new_tokens, s.temperature, s.top_k, s.top_p, s.seed, tuple(s.stop_token_ids),
                   s.ignore_eos).check_vocab(VOCAB)


def test_chat_names_max_completion_tokens() -> None:
    for value in (0, 2**64, HUGE_INT, True, 1.5):
        with pytest.raises(RequestError, match=r"^max_completion_tokens "):
            _parse("/v1/chat/completions", _chat({"max_completion_tokens": value}))


def test_json_overflow_is_infinity_and_refused() -> None:
    """``1e999`` parses as infinity: refused like one. A 400-digit integer is refused too."""
    for raw in (b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}',
                b'{"input_ids": [1], "sampling_params": {"temperature": -1e999}}',
                b'{"input_ids": [1], "sampling_params": {"top_p": 1e999}}',
                b'{"input_ids": [1], "sampling_params": {"temperature": ' + b"9" * 400 + b"}}"):
        with pytest.raises(RequestError, match=r"^sampling_params\.(temperature|top_p) "):
            parse_generate(parse_json(raw), "r", TOK, LIMITS)
    # beyond the interpreter's digit limit the body itself is refused, and the message is short
    with pytest.raises(RequestError, match="not valid JSON") as info:
        parse_json(b'{"input_ids": [1], "sampling_params": {"seed": ' + b"9" * 5000 + b"}}")
    assert len(info.value.message) < 300


def test_values_beyond_the_digit_limit_are_named_not_printed() -> None:
    for name in ("top_k", "seed", "temperature", "max_new_tokens"):
        with pytest.raises(SamplingParamError, match=f"^{name} .*too large to print"):
            SamplingParams(**{name: 10**5000})


def test_the_scheduler_side_check_names_the_field() -> None:
    """``SamplingParams`` (the scheduler checks every request with it too) refuses the same
    values, except a token budget above the configured limit, which only the scheduler knows."""
    for name, values in BAD.items():
        key = "max_new_tokens" if name == "max_tokens" else name
        for value in values:
            if name == "stop_token_ids":
                if not isinstance(value, list):
                    continue  # not a list: the wire cannot carry it
                value = tuple(value)
            if name == "max_tokens" and value == LIMITS.max_new_tokens_limit + 1:
                continue
            with pytest.raises(SamplingParamError) as info:
                SamplingParams(**{key: value}).check_vocab(VOCAB)
            assert info.value.field == key and str(info.value).startswith(key + " "), (name, value)


# --------------------------------------------------------------------------- over HTTP

HTTP_BAD = [
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": 1e-300}}, "sampling_params.temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": 10**400}}, "sampling_params.temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 5e-324 * -1}}, "sampling_params.top_p"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 2**70}}, "sampling_params.top_k"),
    ("/generate", {"input_ids": [1], "sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [2**70]}},
     "sampling_params.stop_token_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2**70}}, "sampling_params.max_new_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": 5e-324}, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": 1e308}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_k": -(2**70)}, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": -(2**70)}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**30}, "max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "field"), HTTP_BAD, ids=lambda x: json.dumps(x)[:40])
def test_http_refuses_with_400_naming_the_field(tok: TokenizerProcess, path: str, body: dict, field: str) -> None:
    r = tok.post(path, body)
    assert r.status == 400, (r.status, r.body)
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    assert err["message"].startswith(field + " "), err["message"]


def test_http_float_overflow_is_400(tok: TokenizerProcess) -> None:
    r = tok.post("/generate", raw=b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}')
    assert r.status == 400 and r.json()["error"]["message"].startswith("sampling_params.temperature ")
