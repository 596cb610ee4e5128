"""End to end: logprobs, ``n`` samples, penalties and ``min_p`` on a real daemon, through the
OpenAI SDK where the route is OpenAI's (its response models check the shapes).

One daemon with the tiny reference model (seeded random weights: deterministic). The
checks do not trust the server's word: the penalties are re-derived from the logprobs the
daemon returns (greedy with penalties must pick the largest penalized logprob among the
alternatives), ``n`` samples are compared with single requests using the documented seeds,
and a cached prompt must give bit-identical logprobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.daemon import Daemon

PROMPT = "Tell me about caches"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp: Path = tmp_path_factory.mktemp("sampling")
    d = Daemon(tmp, {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 8192}, "l2": {"enabled": False}, "l3": {"backend": "none"}},
        "scheduler": {"max_new_tokens_limit": 256},
        "logging": {"level": "warning"},
    })
    d.start()
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def _generate(d: Daemon, sampling: dict[str, Any], **top: Any) -> dict[str, Any]:
    status, body = d.request("POST", "/generate", {"text": PROMPT, "sampling_params": sampling, **top})
    assert status == 200, (status, body, d.log())
    return body


def test_logprobs_come_back_bit_identical_from_the_cache_and_describe_the_greedy_choice(
        daemon: Daemon, client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
                                  top_logprobs=5)
    cold = client.chat.completions.create(**kwargs)
    warm = client.chat.completions.create(**kwargs)
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert warm.usage.prompt_tokens_details.cached_tokens > 0  # the second came from the cache
    cold_lp, warm_lp = cold.choices[0].logprobs, warm.choices[0].logprobs
    assert cold_lp is not None and warm_lp is not None and cold_lp.content is not None
    assert [e.model_dump() for e in cold_lp.content] == [e.model_dump() for e in warm_lp.content]
    assert len(cold_lp.content) == cold.usage.completion_tokens == 12  # type: ignore[union-attr]
    for e in cold_lp.content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, tops[0])  # greedy took the most likely
        assert e.bytes == list(e.token.encode("utf-8", "surrogatepass"))

    # the same tokens and logprobs streamed (chunk by chunk) and on the other two routes
    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(e.model_dump() for e in chunk.choices[0].logprobs.content or [])
    assert streamed == [e.model_dump() for e in cold_lp.content]
    comp = client.completions.create(model="", prompt=PROMPT + " and tiers", max_tokens=12, temperature=0,
                                     logprobs=2)
    legacy = comp.choices[0].logprobs
    assert legacy is not None and legacy.tokens is not None and legacy.text_offset is not None
    assert len(legacy.tokens) == comp.usage.completion_tokens  # type: ignore[union-attr]
    assert legacy.text_offset == sorted(legacy.text_offset) and legacy.text_offset[0] == 0
    for token, lp, top in zip(legacy.tokens, legacy.token_logprobs or [], legacy.top_logprobs or [], strict=True):
        assert top[token] == lp and max(top.values()) == lp  # the chosen token is listed, and it is the best
    gen = _generate(daemon, {"max_new_tokens": 12, "temperature": 0}, return_logprob=True, top_logprobs_num=3,
                    return_text_in_logprobs=True)
    meta = gen["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == gen["output_ids"]
    assert all(len(top) == 3 and top[0][0] == t[0] for t, top in
               zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True))
    assert all(isinstance(t[2], str) for t in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"] == []


def test_n_samples_are_the_single_requests_with_seeds_seed_plus_i(daemon: Daemon, client: openai.OpenAI) -> None:
    common: dict[str, Any] = dict(model="", prompt=PROMPT, max_tokens=10, temperature=1.0)
    many = client.completions.create(**common, n=3, seed=5)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.completions.create(**common, seed=5 + i) for i in range(3)]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in many.choices}) > 1  # the samples differ (temperature 1, three seeds)
    assert many.usage is not None
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)  # type: ignore[union-attr]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # type: ignore[union-attr]

    # streamed chat: chunks of both choices interleaved, each finished once, usage once at the end
    texts: dict[int, str] = {0: "", 1: ""}
    finished: list[int] = []
    usage_chunks = []
    for chunk in client.chat.completions.create(model="", messages=MESSAGES, max_tokens=10, temperature=1.0,
                                                seed=9, n=2, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage_chunks.append(chunk.usage)
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.append(c.index)
    assert sorted(finished) == [0, 1] and len(usage_chunks) == 1
    full = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=10, temperature=1.0, seed=9, n=2)
    assert [c.message.content for c in full.choices] == [texts[0], texts[1]]
    assert usage_chunks[0].completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]


def test_greedy_with_penalties_picks_the_largest_penalized_logprob(daemon: Daemon) -> None:
    """presence / frequency penalties subtract from the logits, so from the logprobs too (the
    log-sum-exp is the same for every token): the chosen token must be the best of
    ``logprob - frequency * count - presence * (count > 0)`` over the alternatives, counting
    the tokens generated before it."""
    presence, frequency = 1.5, 0.5
    gen = _generate(daemon, {"max_new_tokens": 48, "temperature": 0, "presence_penalty": presence,
                             "frequency_penalty": frequency}, return_logprob=True, top_logprobs_num=20)
    counts: dict[int, int] = {}
    differs = 0
    for (_lp, token, _), top in zip(gen["meta_info"]["output_token_logprobs"], gen["meta_info"]["output_top_logprobs"],
                                   strict=True):
        scored = [(v - frequency * counts.get(i, 0) - presence * (i in counts), -i) for v, i, _ in top]
        best = -max(scored)[1]
        assert token == best, (token, best, top, counts)
        differs += token != top[0][1]
        counts[token] = counts.get(token, 0) + 1
    assert differs > 0  # the penalties changed at least one choice (else this test proves nothing)
    plain = _generate(daemon, {"max_new_tokens": 48, "temperature": 0})
    assert plain["output_ids"] != gen["output_ids"]
    # repetition_penalty: a different, deterministic output (its exact rule is unit-tested)
    rep = [_generate(daemon, {"max_new_tokens": 48, "temperature": 0, "repetition_penalty": 1.8})["output_ids"]
           for _ in range(2)]
    assert rep[0] == rep[1] and rep[0] != plain["output_ids"]


def test_min_p_of_one_samples_only_the_most_likely_token(daemon: Daemon) -> None:
    greedy = _generate(daemon, {"max_new_tokens": 16, "temperature": 0})["output_ids"]
    for seed in (1, 2, 3):
        sampled = _generate(daemon, {"max_new_tokens": 16, "temperature": 1.5, "min_p": 1.0, "seed": seed})
        assert sampled["output_ids"] == greedy
    loose = [_generate(daemon, {"max_new_tokens": 16, "temperature": 1.5, "min_p": 0.0, "seed": s})["output_ids"]
             for s in (1, 2, 3)]
    assert any(ids != greedy for ids in loose)  # without min_p the same seeds do wander off
