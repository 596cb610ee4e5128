"""SWA memory: a running request keeps only its windows, so the SWA pool can be far below
the Full pool at the same hit rate.

The workload: multi-turn conversations with prompts and decodes long next to the window,
served (chunked prefill) once with an SWA pool as large as the Full pool and once with the
default, window-sized one. Outputs must be the same bit for bit (and equal a cold run's),
the hits the same, the peak SWA pages in use far below the peak Full pages, and the cache
exact when idle.
"""

from __future__ import annotations

import random

import pytest

from hicache.config import HicacheConfig, config_from_dict, swa_min_pages, swa_request_pages
from hicache.tree.node import ComponentType
from tests.support.rigs import Rig, cold_tokens, gen

WINDOW = 16
PATTERNS = {"swa": ("full", "swa"), "swa+mamba": ("full", "swa", "mamba", "full")}


def _cfg(layers: tuple[str, ...], page_size: int, swa_tokens: int | None = None) -> HicacheConfig:
    l1: dict[str, object] = {"tokens": 256 * page_size if page_size > 1 else 1024, "state_slots": 64}
    if swa_tokens is not None:
        l1["swa_tokens"] = swa_tokens
    return config_from_dict({
        "model": {"reference": {"preset": "tiny", "layers": list(layers), "sliding_window": WINDOW}},
        "cache": {"page_size": page_size, "l1": l1, "l2": {"enabled": False}, "l3": {"backend": "none"}},
        "scheduler": {"chunked_prefill_tokens": 4 * max(page_size, 4), "max_prefill_tokens": 8 * max(page_size, 4),
                      "max_running_requests": 3},
    })


def _serve(cfg: HicacheConfig, conversations: int, turns: int, seed: int) -> tuple[Rig, dict[str, object]]:
    """Serve the conversations turn by turn (each turn's requests in one batch); the peak
    L1 pages in use per component and the hits."""
    rig = Rig(cfg)
    rng = random.Random(seed)
    prompts = {c: [rng.randrange(1, 500) for _ in range(rng.randrange(60, 110))] for c in range(conversations)}
    peak = {ComponentType.FULL: 0, ComponentType.SWA: 0}
    allocs = {ComponentType.FULL: rig.cache.full.allocator}
    assert rig.cache.swa is not None
    allocs[ComponentType.SWA] = rig.cache.swa.allocator
    hits = prompt_tokens = 0
    requests: dict[str, list[int]] = {}
    for turn in range(turns):
        for c in range(conversations):
            rid = f"c{c}t{turn}"
            requests[rid] = list(prompts[c])
            rig.sched.submit(gen(rid, prompts[c], 40))
        for _ in range(3000):
            if not rig.sched.busy:
                break
            rig.sched.step()
            for k, a in allocs.items():
                peak[k] = max(peak[k], a.used)
        assert not rig.sched.busy
        rig.assert_idle()
        for c in range(conversations):
            rid = f"c{c}t{turn}"
            hits += rig.cached(rid)
            prompt_tokens += len(prompts[c])
            prompts[c] = prompts[c] + rig.tokens(rid) + [rng.randrange(1, 500) for _ in range(7)]
    return rig, {"peak": peak, "hits": hits, "prompt_tokens": prompt_tokens, "requests": requests}


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind", list(PATTERNS))
def test_small_swa_pool_same_outputs_and_hits_far_fewer_pages(kind: str, page_size: int) -> None:
    layers = PATTERNS[kind]
    big_cfg = _cfg(layers, page_size, swa_tokens=(256 * page_size if page_size > 1 else 1024))
    small_cfg = _cfg(layers, page_size)
    assert small_cfg.cache.l1.swa_tokens is not None
    assert small_cfg.cache.l1.swa_tokens < big_cfg.cache.l1.tokens  # the default is window-sized
    big, b = _serve(big_cfg, 3, 3, seed=page_size)
    small, s = _serve(small_cfg, 3, 3, seed=page_size)
    for rid in b["requests"]:  # type: ignore[attr-defined]
        assert small.tokens(rid) == big.tokens(rid), rid
    rid = "c1t2"  # and equal a cold run's (one request: a cold run per request is slow)
    ids = s["requests"][rid]  # type: ignore[index]
    assert small.tokens(rid) == cold_tokens(small_cfg, rid, ids, 40)
    assert s["hits"] == b["hits"] and s["hits"] > 0  # type: ignore[operator]
    peak_full = s["peak"][ComponentType.FULL]  # type: ignore[index]
    peak_swa = s["peak"][ComponentType.SWA]  # type: ignore[index]
    # the bound: each running request holds at most its swa_request_pages; each finished
    # one leaves (no eviction here: the pool never fills) the window before its prompt
    # boundary and the window before its end's last page boundary with the page after it.
    # Those windows stay cached for every earlier turn too (a later turn extends the key and
    # adds its own), so they add up over the 3 * 2 requests finished before the last turn
    # runs; Full keeps every token, so that bound is below the Full pages once the turns are
    # long next to the window (not at page size 16, where a window is one page)
    chunk = small_cfg.scheduler.chunked_prefill_tokens
    per_request = swa_request_pages(WINDOW, chunk, page_size)
    per_finished = 2 * -(-WINDOW // page_size) + 1
    bound = 3 * per_request + 3 * 2 * per_finished
    assert peak_swa <= bound, (peak_swa, bound, peak_full)
    assert peak_swa < peak_full, (peak_swa, peak_full)
    if page_size < 16:
        assert bound < peak_full, (bound, peak_full)
    # with a Full-sized pool the pages are freed just the same (the pool is only larger)
    assert b["peak"][ComponentType.SWA] == peak_swa  # type: ignore[index]


def test_a_request_needs_only_its_windows_of_swa_pages() -> None:
    """Admission of a request much longer than the SWA pool holds: it reserves and holds
    only its windows and a chunk, so it runs (it used to need a page per token)."""
    ps = 4
    cfg = _cfg(PATTERNS["swa"], ps, swa_tokens=ps * swa_min_pages(WINDOW, 16, ps))
    rig = Rig(cfg)
    rng = random.Random(3)
    prompt = [rng.randrange(1, 500) for _ in range(300)]
    rig.run([gen("long", prompt, 80)])
    assert rig.final("long").finish_reason == "length"
    assert rig.tokens("long") == cold_tokens(_cfg(PATTERNS["swa"], ps, swa_tokens=256 * ps), "long", prompt, 80)
    rig.run([gen("again", prompt, 80)])
    assert rig.tokens("again") == rig.tokens("long")
    assert rig.cached("again") == (len(prompt) - 1) // ps * ps  # the prompt boundary kept its window
