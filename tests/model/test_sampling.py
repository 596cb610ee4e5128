from __future__ import annotations

import pytest
import torch

from hicache.model.sampling import LOGPROB_FLOOR, PenaltyState, sample_next, token_logprobs
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
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=float("inf")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=1e-300), "repetition_penalty"),
        (dict(repetition_penalty=True), "repetition_penalty"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=1.0), "logprobs"),
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


def _state(prompt: list[int], outputs: list[int], vocab: int) -> PenaltyState:
    state = PenaltyState(prompt, vocab)
    for t in outputs:
        state.add(t)
    return state


def test_presence_and_frequency_penalties_subtract_per_generated_token() -> None:
    """OpenAI's definition: logit - frequency * count - presence * (count > 0), counting the
    generated tokens only (the prompt's do not count)."""
    x = torch.tensor([1.0, 2.0, 3.0, 0.5], dtype=torch.float64)
    state = _state(prompt=[0, 0, 1], outputs=[2, 2, 3], vocab=4)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    assert state.apply(x, p).tolist() == [1.0, 2.0, 3.0 - 0.5 - 0.5, 0.5 - 0.25 - 0.5]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    x = torch.tensor([2.0, -2.0, 4.0, -1.0], dtype=torch.float64)
    state = _state(prompt=[0, 1], outputs=[2], vocab=4)  # 3 never seen
    assert state.apply(x, SamplingParams(repetition_penalty=2.0)).tolist() == [1.0, -4.0, 2.0, -1.0]


def test_greedy_decoding_takes_the_largest_penalized_logit() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0])
    state = _state(prompt=[], outputs=[1], vocab=4)
    assert sample_next(logits, SamplingParams(), 0, 1, state) == 1
    assert sample_next(logits, SamplingParams(presence_penalty=0.2), 0, 1, state) == 2
    assert sample_next(logits, SamplingParams(repetition_penalty=1.1), 0, 1, state) == 2  # 3 / 1.1 < 2.9


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    """min_p = 1 keeps only the most likely token: sampling is then greedy for any seed;
    min_p = 0.5 keeps exactly those with at least half its probability."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    only_best = SamplingParams(temperature=1.0, min_p=1.0)
    assert {sample_next(logits, only_best, seed, 0) for seed in range(50)} == {0}
    half = SamplingParams(temperature=1.0, min_p=0.5)
    assert {sample_next(logits, half, seed, 0) for seed in range(200)} == {0, 1}


def test_penalised_sampling_stays_finite_at_the_extremes() -> None:
    """The largest float32 logits with the most extreme accepted values: no NaN, no raise."""
    logits = torch.tensor([3.4e38, -3.4e38, 0.0, 3.3e38], dtype=torch.float32)
    state = _state(prompt=[0, 1, 2, 3], outputs=[0] * 1000, vocab=4)
    for p in (SamplingParams(temperature=0.01, repetition_penalty=0.01, frequency_penalty=-2.0, presence_penalty=-2.0),
              SamplingParams(temperature=100.0, repetition_penalty=100.0, frequency_penalty=2.0, min_p=1.0),
              SamplingParams(repetition_penalty=100.0, frequency_penalty=2.0, presence_penalty=2.0)):
        assert 0 <= sample_next(logits, p, 7, 3, state) < 4


def test_token_logprobs_are_the_raw_log_softmax_with_the_most_likely_alternatives() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, -2.0, float("-inf")])
    expected = torch.log_softmax(logits.to(torch.float64), dim=-1)
    chosen, ids, values = token_logprobs(logits, 3, 3)
    assert chosen == float(expected[3])
    assert ids == [1, 2, 0]  # most likely first, the lower id first among equals
    assert values == [float(expected[i]) for i in ids]
    assert token_logprobs(logits, 4, 0) == (LOGPROB_FLOOR, [], [])  # zero probability: the floor, not -inf
    assert token_logprobs(torch.full((3,), float("nan")), 0, 2) == (LOGPROB_FLOOR, [0, 1], [LOGPROB_FLOOR] * 2)


def test_the_wire_form_has_exactly_the_checked_fields_and_round_trips() -> None:
    """``protos.SamplingParams`` cannot import the checked class: the two field lists are
    kept equal here, so a field added to one and not the other fails at once."""
    import dataclasses

    import protos
    from hicache.model.sampling_params import from_wire, to_wire

    names = lambda cls: sorted(f.name for f in dataclasses.fields(cls))  # noqa: E731
    assert names(protos.SamplingParams) == names(SamplingParams)
    p = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop_token_ids=(4, 5),
                       ignore_eos=True, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                       min_p=0.1, logprobs=4)
    wire = to_wire(p)
    assert wire.stop_token_ids == [4, 5] and from_wire(wire) == p
    assert from_wire(protos.decode(protos.encode(protos.GenerateRequest("r", [1], wire))).sampling) == p
    with pytest.raises(ValueError, match="min_p"):
        from_wire(dataclasses.replace(wire, min_p=2.0))
