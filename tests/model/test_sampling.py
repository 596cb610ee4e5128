from __future__ import annotations

import pytest
import torch

from hicache.model.sampling import sample_next
from hicache.model.sampling_params import SamplingParams, finish_reason


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=-3), "seed"),
        (dict(stop_token_ids=(1, -2)), "stop_token_ids"),
        (dict(max_new_tokens=True), "max_new_tokens"),
    ],
)
def test_bad_params_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_vocab_checks() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(600,)).check_vocab(512)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=1000, temperature=1.0).check_vocab(512)


def test_greedy_and_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 3.0, 1.0, -1.0])
    assert sample_next(logits, SamplingParams(), seed=0, step=0) == 1  # ties: lowest id
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert sample_next(logits, top1, seed=5, step=3) == 1
    k2 = SamplingParams(temperature=5.0, top_k=2)
    assert {sample_next(logits, k2, seed=s, step=0) for s in range(60)} == {1, 2}
    p_small = SamplingParams(temperature=1.0, top_p=0.3)
    assert {sample_next(torch.tensor([0.0, 5.0, 1.0]), p_small, seed=s, step=0) for s in range(30)} == {1}


def test_seeded_sampling_is_deterministic() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample_next(logits, params, 7, i) for i in range(20)]
    assert a == [sample_next(logits, params, 7, i) for i in range(20)]
    assert a != [sample_next(logits, params, 8, i) for i in range(20)]


def test_finish_reason() -> None:
    p = SamplingParams(max_new_tokens=3, stop_token_ids=(9,))
    assert finish_reason([1], p, eos_token_ids=(2,)) is None
    assert finish_reason([1, 9], p) == "stop"
    assert finish_reason([1, 2], p, eos_token_ids=(2,)) == "stop"
    assert finish_reason([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True), eos_token_ids=(2,)) is None
    assert finish_reason([1, 3, 4], p) == "length"
