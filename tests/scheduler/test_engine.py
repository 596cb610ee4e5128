"""The scheduler core in-process: cached prefixes give exactly the uncached outputs."""

from __future__ import annotations

import random

import pytest

import protos
from hicache.config import HicacheConfig, config_from_dict
from tests.support.rigs import Rig, cold_tokens, gen


def _cfg(page_size: int, **sched: object) -> HicacheConfig:
    return config_from_dict({
        "cache": {"page_size": page_size, "l1": {"tokens": 512 * page_size}, "l2": {"enabled": False},
                  "l3": {"backend": "none"}},
        "scheduler": {"chunked_prefill_tokens": 8 * page_size, "max_prefill_tokens": 16 * page_size, **sched},
    })


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_outputs_with_cache_equal_outputs_without(page_size: int) -> None:
    rng = random.Random(page_size)
    system = [rng.randrange(1, 500) for _ in range(40)]
    prompts = {f"r{i}": system + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))] for i in range(6)}
    prompts["dup"] = list(prompts["r0"])
    expected = {}
    for rid, ids in prompts.items():  # each alone, on a cold cache
        rig = Rig(_cfg(page_size))
        rig.run([gen(rid, ids)])
        expected[rid] = rig.tokens(rid)
    shared = Rig(_cfg(page_size))
    shared.run([gen("r0", prompts["r0"])])  # warm the cache
    shared.run([gen(rid, ids) for rid, ids in prompts.items() if rid != "r0"])
    for rid in prompts:
        assert shared.tokens(rid) == expected[rid], rid
    assert shared.final("dup").usage.cached_device >= (len(prompts["dup"]) - 1) // page_size * page_size
    assert shared.final("r3").usage.cached_device >= 40 // page_size * page_size


def test_seed_split_bug_end_to_end() -> None:
    rig = Rig(_cfg(1))
    enc = lambda s: list(s.encode())  # noqa: E731 - byte-level token ids
    rig.run([gen("a", enc("Hello_L.A.!"), 3)])
    rig.run([gen("b", enc("Hello_L.A.!world"), 3)])
    rig.run([gen("c", enc("Hello_world"), 3)])
    assert rig.final("c").usage.cached_device == 6
    cold = Rig(_cfg(1))
    cold.run([gen("c", enc("Hello_world"), 3)])
    assert rig.tokens("c") == cold.tokens("c")


def test_streaming_chunked_prefill_and_sampling_are_deterministic() -> None:
    rng = random.Random(7)
    long_prompt = [rng.randrange(1, 500) for _ in range(150)]
    a, b = Rig(_cfg(4)), Rig(_cfg(4, chunked_prefill_tokens=16, max_prefill_tokens=16))
    req = gen("s", long_prompt, 10, stream=True, temperature=0.8, top_k=20, seed=3)
    a.run([req])
    b.run([req])
    assert a.tokens("s") == b.tokens("s") and len(a.tokens("s")) == 10
    assert len(b.out["s"]) == 10  # one message per token; the last one is final
    assert b.final("s").usage.completion_tokens == 10
    # chunked prefill cached its chunks as it went: a repeat hits nearly all of the prompt
    b.run([gen("s2", long_prompt, 2)])
    assert b.final("s2").usage.cached_device == 148


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"input_ids": []}, "must not be empty"),
    ({"input_ids": [1, 99999]}, "outside the vocabulary"),
    ({"sampling": protos.SamplingParams(max_new_tokens=0)}, "max_new_tokens"),
    ({"sampling": protos.SamplingParams(max_new_tokens=5000)}, "max_new_tokens"),
    ({"input_ids": [1] * 4090, "sampling": protos.SamplingParams(max_new_tokens=100)}, "context"),
    ({"sampling": protos.SamplingParams(top_p=0.0)}, "top_p"),
])
def test_bad_requests_get_an_error_and_nothing_else_changes(kwargs: dict, needle: str) -> None:
    rig = Rig(_cfg(4))
    base = {"rid": "bad", "input_ids": [1, 2, 3], "sampling": protos.SamplingParams(max_new_tokens=2)}
    base.update(kwargs)
    rig.run([protos.GenerateRequest(**base)])  # type: ignore[arg-type]
    final = rig.final("bad")
    assert final.finish_reason == "error" and final.error and needle in final.error
    rig.run([gen("ok", [1, 2, 3, 4, 5], 2)])
    assert rig.final("ok").finish_reason == "length"


def test_abort_frees_everything() -> None:
    rig = Rig(_cfg(4))
    rig.sched.submit(gen("x", list(range(1, 60)), 50))
    rig.sched.step()
    rig.sched.step()
    rig.sched.abort("x")
    assert rig.final("x").finish_reason == "abort"
    assert not rig.sched.busy
    rig.assert_idle()  # the budget's check: nothing reserved


def test_admission_queues_when_l1_is_full() -> None:
    cfg = config_from_dict({"cache": {"page_size": 4, "l1": {"tokens": 96}, "l2": {"enabled": False},
                                      "l3": {"backend": "none"}},
                            "scheduler": {"chunked_prefill_tokens": 32}})
    rig = Rig(cfg)
    reqs = [gen(f"q{i}", [i + 1] * 40, 20) for i in range(4)]  # each needs 15 of 24 pages
    rig.run(reqs)
    for i in range(4):
        assert rig.final(f"q{i}").finish_reason == "length"


def test_usage_reports_where_the_time_to_first_token_went() -> None:
    clock = [0.0]
    rig = Rig(_cfg(4))
    rig.sched.clock = lambda: clock[0]
    rig.sched.submit(gen("t", list(range(1, 40)), 2))
    clock[0] = 0.25
    rig.sched.step()  # admitted at 0.25 s; first prefill chunk (32 of 39 tokens)
    clock[0] = 0.5
    rig.run([])  # second chunk and the first token at 0.5 s
    usage = rig.final("t").usage
    assert usage is not None
    assert usage.queue_ms == 250.0 and usage.load_ms == 0.0 and usage.prefill_ms == 250.0


@pytest.mark.parametrize(("page_size", "prompt_len"), [(1, 75), (4, 75), (16, 64)])
def test_a_prompt_prefilled_in_one_chunk_is_matched_while_it_decodes(page_size: int, prompt_len: int) -> None:
    """The pass that completes a prompt's prefill (the chunk with logits) caches its pages:
    a request with the same prompt arriving one step later, while the first decodes, hits
    everything the match may use (all but the last token, page-aligned), and both produce
    exactly the tokens of an uncached run."""
    cfg = _cfg(page_size, chunked_prefill_tokens=256, max_prefill_tokens=512)
    prompt = [random.Random(40 + page_size).randrange(1, 500) for _ in range(prompt_len)]
    rig = Rig(cfg)
    rig.sched.submit(gen("first", prompt, 12))
    rig.sched.step()  # the whole prompt in one chunk, and the first token
    first = rig.sched.by_rid["first"]
    assert not first.prefilling and len(rig.tokens("first")) == 1
    rig.sched.submit(gen("second", prompt, 12))
    rig.sched.step()  # "second" is admitted and prefilled while "first" decodes
    assert rig.sched.by_rid.get("first") is first and not first.finished
    assert not rig.sched.by_rid["second"].prefilling
    rig.run([])
    assert rig.cached("first") == 0
    assert rig.cached("second") == (prompt_len - 1) // page_size * page_size
    want = cold_tokens(cfg, "cold", prompt, 12)
    assert rig.tokens("first") == want and rig.tokens("second") == want


def test_a_request_waiting_many_passes_counts_one_hit() -> None:
    """A queued request is matched on every scheduling pass; only its admission counts a hit
    (``hit_count`` drives write_through_selective, SLRU and LFU)."""
    cfg = config_from_dict({"cache": {"page_size": 4, "l1": {"tokens": 96}, "l2": {"enabled": False},
                                      "l3": {"backend": "none"}},
                            "scheduler": {"chunked_prefill_tokens": 32}})
    rig = Rig(cfg)
    shared = list(range(1, 17))  # four pages
    rig.run([gen("first", shared, 2)])
    rig.sched.submit(gen("big", [7] * 40, 20))  # 15 of 24 pages while it runs
    rig.sched.step()
    rig.sched.submit(gen("waiter", shared + [9] * 24, 20))  # another 15: waits for big to finish
    waited = 0
    while "waiter" not in rig.out:
        rig.sched.step()
        waited += 1
    assert waited >= 5, waited  # it was matched on each of these passes
    rig.run([])
    assert rig.cached("waiter") == len(shared)
    m = rig.cache.match_prefix(shared)
    assert m.device_len == len(shared)
    assert m.last_device_node.hit_count == 1  # the waiter's admission, once
