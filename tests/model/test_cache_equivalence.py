"""Generating from a cached prefix gives exactly what recomputing gives (docs/architecture.md §9)."""

from __future__ import annotations

import random

import pytest
import torch

from hicache.model.sampling_params import SamplingParams
from tests.model.conftest import Driver, Req, tiny_model

PATTERNS = {
    "full": ("full",),
    "full_swa": ("full", "swa"),
    "full_mamba": ("full", "mamba"),
    "mixed": ("swa", "full", "mamba", "swa"),
    "all_swa": ("swa", "swa"),
    "swa_mamba": ("swa", "mamba", "swa"),
}
N_NEW = 6


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(length + 3 * i)] for i in range(n)]


def assert_same(a: Req, b: Req) -> None:
    assert a.out == b.out, f"tokens differ: {a.out} vs {b.out}"
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.equal(x, y), f"logits differ by {(x - y).abs().max().item()}"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_cached_prefix_matches_recompute(pattern: str, page_size: int) -> None:
    # a small window so that SWA pages really fall out of it
    model = tiny_model(PATTERNS[pattern], sliding_window=8)
    drv = Driver(model, page_size)
    params = SamplingParams(max_new_tokens=N_NEW)
    ps = prompts(3, 37)
    ks = sorted({1, 2, (36 // page_size) // 2, 36 // page_size})  # at least one prompt token is computed
    bounds = tuple(k * page_size for k in ks)
    # reference: all prompts in one batch, recomputed from scratch, snapshots at the boundaries
    ref = [Req(p, params, snap_at=bounds) for p in ps]
    drv.run(ref)
    # alone vs batched: the same
    alone = Req(ps[1], params)
    drv.run([alone])
    assert_same(alone, ref[1])
    # from the cache, for every k, in a mixed batch (prefills join while others decode)
    for k in ks:
        cached = [drv.cached_copy(r, k * page_size, r.prompt, params) for r in ref]
        drv.run(cached, join=[0, 2, 3])
        for a, b in zip(cached, ref, strict=True):
            assert_same(a, b)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_chunked_prefill_and_next_turn(pattern: str) -> None:
    """Chunked prefill equals one-shot; the next turn of a conversation, cached up to the last
    full page of the finished sequence (KV written by decode, state snapshotted in decode),
    equals recomputing the whole conversation."""
    page_size = 4
    model = tiny_model(PATTERNS[pattern], sliding_window=8)
    drv = Driver(model, page_size)
    params = SamplingParams(max_new_tokens=N_NEW)
    prompt = prompts(1, 30, seed=3)[0]
    total = len(prompt) + N_NEW - 1  # tokens whose KV exists when the sequence finishes
    boundary = total // page_size * page_size
    first = Req(prompt, params, snap_at=(boundary,))
    drv.run([first])
    chunked = Req(prompt, params)
    drv.run([chunked], chunk=8)
    assert_same(chunked, first)

    turn2 = prompt + first.out + [7, 8, 9, 10, 11]
    recompute = Req(turn2, params)
    drv.run([recompute])
    cached = drv.cached_copy(first, boundary, turn2, params)
    drv.run([cached])
    assert_same(cached, recompute)


def test_seeded_sampling_is_reproducible_from_cache() -> None:
    model = tiny_model(("full", "mamba"))
    drv = Driver(model, 4)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    prompt = prompts(1, 20, seed=5)[0]
    ref = Req(prompt, params, snap_at=(16,))
    drv.run([ref])
    cached = drv.cached_copy(ref, 16, prompt, params)
    drv.run([cached, Req(prompts(1, 9, seed=6)[0], params)])
    assert cached.out == ref.out
    other_seed = Req(prompt, SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=99))
    drv.run([other_seed])
    assert other_seed.out != ref.out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_runs_and_stays_close(dtype: str) -> None:
    """Low precision: cache hits still reproduce recomputation on this machine; logits are
    only close to float32."""
    model = tiny_model(("full", "swa"), dtype=dtype)
    drv = Driver(model, 4)
    params = SamplingParams(max_new_tokens=4)
    prompt = prompts(1, 21, seed=7)[0]
    ref = Req(prompt, params)
    drv.run([ref])
    cached = drv.cached_copy(ref, 16, prompt, params)
    drv.run([cached])
    assert cached.out == ref.out
    f32 = Req(prompt, params)
    Driver(tiny_model(("full", "swa")), 4).run([f32])
    assert torch.allclose(ref.logits[0], f32.logits[0], atol=0.25, rtol=0.05)
