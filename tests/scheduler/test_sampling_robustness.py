"""The sampler the scheduler runs never raises for parameters ``SamplingParams`` accepts,
whatever float32 logits the model emits (huge, tiny, subnormal, ``±inf``, NaN), and
``SamplingParams`` accepts exactly the documented ranges."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.model.sampling import greedy_token, sample_next
from hicache.model.sampling_params import (
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    SamplingParamError,
    SamplingParams,
)

F32_MAX = float(torch.finfo(torch.float32).max)
SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-38, F32_MAX, -F32_MAX, F32_MAX / 2, math.inf, -math.inf, math.nan]
logit = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from(SPECIAL))
logits_st = st.lists(logit, min_size=1, max_size=40)
temperature_st = st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, MAX_TEMPERATURE),
                           st.sampled_from([MIN_TEMPERATURE, MAX_TEMPERATURE]))
top_p_st = st.one_of(st.floats(0.0, 1.0, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1.0]))
params_st = st.builds(SamplingParams, temperature=temperature_st, top_p=top_p_st,
                      top_k=st.one_of(st.integers(0, 50), st.just(MAX_TOP_K)), seed=st.integers(0, MAX_SEED))


@settings(max_examples=400, deadline=None)
@given(values=logits_st, params=params_st, step=st.integers(0, 10_000))
def test_sample_next_never_raises_and_picks_a_sensible_token(values: list[float], params: SamplingParams,
                                                              step: int) -> None:
    logits = torch.tensor(values, dtype=torch.float32)
    token = sample_next(logits, params, params.seed or 0, step)
    assert 0 <= token < len(values)
    chosen = values[token]
    if any(v == math.inf for v in values):
        assert chosen == math.inf  # +inf beats every finite logit
    elif any(math.isfinite(v) for v in values):
        assert math.isfinite(chosen)  # never NaN, never -inf while a number exists
    else:
        assert token == 0  # nothing to choose from: the documented answer
    if params.greedy:
        assert token == greedy_token(logits)
    assert token == sample_next(logits, params, params.seed or 0, step)  # deterministic


def test_top_k_beyond_the_vocabulary_is_clamped() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0])
    params = SamplingParams(temperature=1.0, top_k=MAX_TOP_K, seed=1)
    assert {sample_next(logits, params, s, 0) for s in range(50)} == {0, 1, 2}


def test_large_logits_at_low_temperature_are_sampled_not_nan() -> None:
    """``x / t`` overflows float32 here; the float64 scores keep the right distribution."""
    logits = torch.tensor([F32_MAX, F32_MAX, -F32_MAX, 0.0])
    params = SamplingParams(temperature=MIN_TEMPERATURE)
    assert {sample_next(logits, params, s, 0) for s in range(60)} == {0, 1}


def _finite(v: object) -> bool:
    """A number (not a bool) that is a finite float."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


@settings(max_examples=300, deadline=None)
@given(t=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**80), 2**80),
                   st.sampled_from([5e-324, 1e-300, MIN_TEMPERATURE, MAX_TEMPERATURE, 10**400, True])))
def test_temperature_is_accepted_exactly_in_its_range(t: float) -> None:
    ok = _finite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)
    try:
        p = SamplingParams(temperature=t)
    except SamplingParamError as exc:
        assert not ok and exc.field == "temperature"
    else:
        assert ok and p.temperature == float(t) and type(p.temperature) is float


@settings(max_examples=300, deadline=None)
@given(v=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**80), 2**80), st.booleans()))
def test_top_p_is_accepted_exactly_in_its_range(v: float) -> None:
    ok = _finite(v) and 0 < v <= 1
    try:
        SamplingParams(top_p=v)
    except SamplingParamError as exc:
        assert not ok and exc.field == "top_p"
    else:
        assert ok


@settings(max_examples=300, deadline=None)
@given(v=st.one_of(st.integers(-(2**80), 2**80), st.sampled_from([0, 1, MAX_TOP_K, MAX_SEED, 2**63, 2**64])),
       field=st.sampled_from(["top_k", "seed", "max_new_tokens"]))
def test_integer_fields_are_accepted_exactly_in_their_range(v: int, field: str) -> None:
    lo, hi = {"top_k": (0, MAX_TOP_K), "seed": (0, MAX_SEED), "max_new_tokens": (1, 2**31 - 1)}[field]
    try:
        SamplingParams(**{field: v})
    except SamplingParamError as exc:
        assert not lo <= v <= hi and exc.field == field
    else:
        assert lo <= v <= hi
