"""End to end, a property: no sampling value a client sends can take the daemon down.

Hypothesis throws the whole range of numbers (tiny, subnormal, huge, negative, NaN,
infinities, integers beyond 2**63, booleans) at every sampling field of every generation
route of a real daemon (tiny reference model), one field at a time, ``EXAMPLES_PER_FIELD``
examples each, beside valid values of some other fields so that an accepted value reaches
the sampler (about 300 requests, ten seconds). Every answer must be a 200 with an output,
or a 400 JSON error that names one of the fields sent (NaN and infinities are not JSON: the
body itself is refused then). Afterwards the daemon still serves: the same processes, and a
normal greedy request gives the same tokens as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.daemon import DaemonFactory

MAX_NEW = 4
"""``scheduler.max_new_tokens_limit``: every accepted request generates at most this many."""

ROUTES: dict[str, tuple[dict[str, Any], str | None, tuple[str, ...]]] = {
    # route -> (body without sampling fields, object holding them (None: the body), fields)
    "/generate": ({"input_ids": [5, 6, 7, 8, 9]}, "sampling_params",
                  ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")),
    "/v1/completions": ({"prompt": "hello", "logprobs": 2}, None,
                        ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
                         "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logprobs")),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hello"}], "logprobs": True}, None,
                             ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                              "stop_token_ids", "ignore_eos", "n", "presence_penalty", "frequency_penalty",
                              "repetition_penalty", "min_p", "top_logprobs")),
}
BUDGET = {"/generate": "max_new_tokens", "/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens"}

SPECIAL: list[Any] = [
    0, 1, -1, 2, 3, 4, 5, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63), -(2**64), 10**30,
    10**300, 0.0, -0.0, 5e-324, -5e-324, 1e-320, 1e-300, 1e-45, 1e-38, 2.2250738585072014e-308, 1e-10, 1e-5, 0.0099,
    0.01, 0.5, 0.9999999, 1.0, 1.0000001, 2.0, 100.0, 100.5, 1e30, 3.4e38, 1e300, 1.7976931348623157e308,
    math.inf, -math.inf, math.nan, True, False, None,
]
number = st.one_of(
    st.sampled_from(SPECIAL),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e-37, max_value=1e-37),  # tiny and subnormal: x / t overflows float32
    st.floats(min_value=-2.0, max_value=2.0),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.integers(min_value=-3, max_value=600),
)
value = st.one_of(number, st.lists(number, max_size=3))  # lists for stop_token_ids (and wrong elsewhere)
PLAIN: dict[str, list[Any]] = {"temperature": [0, 0.7, 1.0], "top_p": [1.0, 0.9], "top_k": [0, 20], "seed": [1, 42],
                               "presence_penalty": [0, 1.5], "repetition_penalty": [1.0, 1.3], "min_p": [0, 0.05]}
"""Valid values for other fields, sent beside the one under test (so that it reaches the sampler)."""
EXAMPLES_PER_FIELD = 12


def _body(route: str, sampling: dict[str, Any]) -> dict[str, Any]:
    """The request body for ``route`` with these sampling fields (a short budget unless set)."""
    base, where, _fields = ROUTES[route]
    fields = dict(sampling)
    budget = BUDGET[route]
    if budget not in fields and "max_completion_tokens" not in fields:
        fields[budget] = 2  # keep accepted requests short
    body = json.loads(json.dumps(base))
    if where is None:
        body.update(fields)
    else:
        body[where] = fields
    return body


def _finite_json(v: Any) -> bool:
    """Whether ``v`` is JSON without NaN or infinities (``json.dumps`` writes those bare)."""
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_finite_json(x) for x in v)
    if isinstance(v, dict):
        return all(_finite_json(x) for x in v.values())
    return True


def test_no_sampling_value_takes_the_daemon_down(daemons: DaemonFactory) -> None:
    d = daemons({
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 2048}, "l2": {"enabled": False}, "l3": {"backend": "none"}},
        "scheduler": {"max_new_tokens_limit": MAX_NEW, "default_max_new_tokens": MAX_NEW},
        "logging": {"level": "warning"},
    })
    pids = d.pids()
    probe = [11, 12, 13, 14, 15, 16, 17]
    expected = d.generate(probe, MAX_NEW)["output_ids"]
    assert len(expected) == MAX_NEW
    seen = {200: 0, 400: 0}

    def answer_is_sound(route: str, sampling: dict[str, Any]) -> None:
        body = _body(route, sampling)
        # json.dumps writes NaN / Infinity as the bare constants, which the server must refuse
        status, answer = d.request("POST", route, json.dumps(body).encode(), timeout=60)
        assert status in (200, 400), f"POST {route} {body}: {status} {answer}\n{d.log()}"
        assert isinstance(answer, dict), (route, body, answer)
        seen[status] += 1
        if status == 400:
            err = answer["error"]
            assert err["code"] == 400 and err["type"] == "invalid_request_error", answer
            message = err["message"]
            assert isinstance(message, str) and message, answer
            if _finite_json(body):
                named = [f for f in sampling if message.startswith((f + " ", f + ":", "sampling_params." + f))]
                assert named, f"POST {route} {body}: the error names none of the fields sent: {message}"
            return
        if route == "/generate":
            assert 1 <= len(answer["output_ids"]) <= MAX_NEW and answer["meta_info"]["finish_reason"], answer
        else:
            n = body.get("n") or 1  # accepted: an integer in [1, 128]
            assert [c["index"] for c in answer["choices"]] == list(range(n)), answer
            assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"]), answer
            assert n <= answer["usage"]["completion_tokens"] <= MAX_NEW * n, answer  # the sum over the samples

    def property_of(route: str, field: str) -> Callable[[], None]:
        """Any value in ``field`` of ``route``, beside valid values of some other fields."""
        others = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in PLAIN.items() if k != field})

        @settings(max_examples=EXAMPLES_PER_FIELD, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(v=value, rest=others)
        def check(v: Any, rest: dict[str, Any]) -> None:
            answer_is_sound(route, {**rest, field: v})

        return check

    for route, (_base, _where, fields) in ROUTES.items():  # every sampling field of every route
        for field in fields:
            property_of(route, field)()

    assert seen[200] > 10 and seen[400] > 10, seen  # both kinds of answer were exercised
    assert d.pids() == pids, f"a process was restarted:\n{d.log()}"
    assert d.generate(probe, MAX_NEW)["output_ids"] == expected
    # and a sampled request with the most extreme accepted values is served
    for extreme in ({"temperature": 0.01, "top_p": 5e-324, "top_k": 512, "seed": 2**63 - 1},
                    {"temperature": 100.0, "top_p": 1.0, "top_k": 0, "seed": 0},
                    {"temperature": 0.5, "presence_penalty": -2.0, "frequency_penalty": 2.0,
                     "repetition_penalty": 0.01, "min_p": 1.0, "seed": 3},
                    {"temperature": 0, "presence_penalty": 2.0, "frequency_penalty": -2.0, "repetition_penalty": 100}):
        status, answer = d.request("POST", "/generate", _body("/generate", extreme))
        assert status == 200 and len(answer["output_ids"]) == 2, (extreme, status, answer)
