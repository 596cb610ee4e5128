"""The scheduler serving hybrid models in-process: Full + SWA, Full + Mamba, Full + SWA + Mamba
and all-SWA (no full-attention layer: the Full component is index-only, every KV byte is SWA's).

The oracle is the same as for full attention: a request's greedy output with the cache
must equal its output on a cold cache, bit for bit. After every run the cache must be
exact (``check_integrity(exact=True)``: every page and state slot of every component is
either in the tree or free) and every reservation returned.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hicache.config import HicacheConfig, config_from_dict
from hicache.model.geometry import geometry_for, unsupported_reason
from hicache.model.loader import load_model
from hicache.model.pools import allocate_pools
from hicache.scheduler.assembly import build_cache
from hicache.tree.node import ComponentType
from tests.support.rigs import L2Rig, L3AckRig, L3Rig, Rig, cold_tokens, gen

WINDOW = 16
PATTERNS = {"swa": ("full", "swa"), "mamba": ("full", "mamba"), "swa+mamba": ("full", "swa", "mamba", "full"),
            "all-swa": ("swa", "swa")}
HAS_SWA = {kind for kind, layers in PATTERNS.items() if "swa" in layers}
HAS_MAMBA = {kind for kind, layers in PATTERNS.items() if "mamba" in layers}


def _cfg(layers: tuple[str, ...], page_size: int, *, tokens: int | None = None, state_slots: int = 64,
         **sched: object) -> HicacheConfig:
    return config_from_dict({
        "model": {"reference": {"preset": "tiny", "layers": list(layers), "sliding_window": WINDOW}},
        "cache": {"page_size": page_size, "l1": {"tokens": tokens or 512 * page_size, "state_slots": state_slots},
                  "l2": {"enabled": False}, "l3": {"backend": "none"}},
        "scheduler": {"chunked_prefill_tokens": 8 * page_size, "max_prefill_tokens": 16 * page_size, **sched},
    })


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind", list(PATTERNS))
def test_shared_and_repeated_prompts_equal_cold_outputs(kind: str, page_size: int) -> None:
    cfg = _cfg(PATTERNS[kind], page_size)
    rng = random.Random(page_size)
    system = [rng.randrange(1, 500) for _ in range(40)]
    prompts = {f"r{i}": system + [rng.randrange(1, 500) for _ in range(rng.randrange(3, 30))] for i in range(4)}
    prompts["dup"] = list(prompts["r0"])
    expected = {rid: cold_tokens(cfg, rid, ids) for rid, ids in prompts.items() if rid != "dup"}
    expected["dup"] = expected["r0"]
    rig = Rig(cfg)
    rig.run([gen("r0", prompts["r0"])])  # warm the cache
    rig.run([gen(rid, ids) for rid, ids in prompts.items() if rid != "r0"])  # one batch, mixed hits
    for rid in prompts:
        assert rig.tokens(rid) == expected[rid], rid
    # a repeated prompt matches up to its last page boundary before its last token
    assert rig.cached("dup") == (len(prompts["dup"]) - 1) // page_size * page_size
    # (the shared prefix's end, 40, lies inside r0's prompt: r0 freed the SWA pages there as
    # its prefill moved past the window, so it is no valid SWA boundary; a hit there is not
    # promised, only the prompt boundary and the finished key's end keep their windows)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind", list(PATTERNS))
def test_multi_turn_conversation_reuses_the_previous_turn(kind: str, page_size: int) -> None:
    """Each turn's prompt is the previous prompt + its output + new text; the previous turn
    is cached up to the last full page of its computed tokens (KV and state written while
    decoding, past the sliding window)."""
    cfg = _cfg(PATTERNS[kind], page_size)
    rng = random.Random(10 + page_size)
    rig = Rig(cfg)
    prompt = [rng.randrange(1, 500) for _ in range(23)]
    n_new = 20  # decodes past the window of 16
    prev_computed = 0
    for turn in range(3):
        rid = f"t{turn}"
        rig.run([gen(rid, prompt, n_new)])
        assert rig.tokens(rid) == cold_tokens(cfg, rid, prompt, n_new), turn
        if turn:
            assert rig.cached(rid) == (prev_computed // page_size) * page_size, turn
        prev_computed = len(prompt) + n_new - 1  # tokens with KV when the turn finished
        prompt = prompt + rig.tokens(rid) + [rng.randrange(1, 500) for _ in range(5 + turn)]


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_chunked_prefill_equals_one_shot_and_is_reused(kind: str) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(1, 500) for _ in range(150)]
    one_shot = Rig(_cfg(PATTERNS[kind], 4, chunked_prefill_tokens=256, max_prefill_tokens=256))
    one_shot.run([gen("s", prompt, 8)])
    chunked = Rig(_cfg(PATTERNS[kind], 4, chunked_prefill_tokens=16, max_prefill_tokens=16))
    chunked.run([gen("s", prompt, 8)])
    assert chunked.tokens("s") == one_shot.tokens("s")
    chunked.run([gen("again", prompt, 8), gen("other", prompt[:60] + [3, 4, 5], 8)])
    assert chunked.tokens("again") == one_shot.tokens("s")
    assert chunked.cached("again") == 148
    assert chunked.tokens("other") == cold_tokens(_cfg(PATTERNS[kind], 4), "other", prompt[:60] + [3, 4, 5], 8)


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_abort_mid_run_gives_everything_back(kind: str) -> None:
    cfg = _cfg(PATTERNS[kind], 4, chunked_prefill_tokens=16, max_prefill_tokens=32)
    rig = Rig(cfg)
    prompt = list(range(1, 80))
    rig.sched.submit(gen("prefilling", prompt, 50))
    rig.sched.submit(gen("decoding", list(range(100, 130)), 50))
    for _ in range(4):  # "prefilling" is mid-prefill, "decoding" has started decoding
        rig.sched.step()
    assert rig.sched.by_rid["prefilling"].prefilling
    assert not rig.sched.by_rid["decoding"].prefilling
    rig.sched.abort("prefilling")
    rig.sched.abort("decoding")
    assert rig.final("prefilling").finish_reason == "abort"
    assert rig.final("decoding").finish_reason == "abort"
    assert not rig.sched.busy
    rig.assert_idle()
    # what the aborted requests computed is reusable and correct
    rig.run([gen("after", prompt, 6)])
    assert rig.tokens("after") == cold_tokens(cfg, "after", prompt, 6)
    assert rig.cached("after") > 0


@pytest.mark.parametrize(("kind", "short"), [(kind, short) for kind in PATTERNS for short in ("swa", "mamba", "both")
                                             if short == "both" and kind in HAS_SWA & HAS_MAMBA
                                             or short == "swa" and kind in HAS_SWA
                                             or short == "mamba" and kind in HAS_MAMBA])
def test_admission_queues_when_aux_memory_is_short(kind: str, short: str) -> None:
    # mamba: 4 state slots = one running request at a time; swa: L1 for about one and a half
    cfg = _cfg(PATTERNS[kind], 4, tokens=512 if short == "mamba" else 96, state_slots=64 if short == "swa" else 4,
               chunked_prefill_tokens=32)
    rig = Rig(cfg)
    prompts = {f"q{i}": [i + 1] * 40 for i in range(4)}
    rig.run([gen(rid, ids, 20) for rid, ids in prompts.items()])
    for rid, ids in prompts.items():
        assert rig.final(rid).finish_reason == "length"
        assert rig.tokens(rid) == cold_tokens(_cfg(PATTERNS[kind], 4), rid, ids, 20), rid


@pytest.mark.parametrize("kind", sorted(HAS_MAMBA))
def test_mamba_match_gives_the_request_its_own_copy_of_the_state(kind: str) -> None:
    """Two identical prompts decoding side by side from one cached state: each mutates its
    own copy, and the cached state stays intact for a third."""
    cfg = _cfg(PATTERNS[kind], 4)
    rig = Rig(cfg)
    prompt = [random.Random(3).randrange(1, 500) for _ in range(33)]
    rig.run([gen("warm", prompt, 4)])
    rig.run([gen("a", prompt, 12), gen("b", prompt, 12)])
    rig.run([gen("c", prompt, 12)])
    want = cold_tokens(cfg, "x", prompt, 12)
    assert rig.tokens("a") == rig.tokens("b") == rig.tokens("c") == want
    assert rig.cached("a") == rig.cached("b") == rig.cached("c") == 32
    assert rig.cache.total_size(ComponentType.MAMBA) >= 2


@pytest.mark.parametrize("layers", [("mamba",), ("mamba", "mamba")])
def test_patterns_without_an_attention_layer_are_refused_with_the_reason(layers: tuple[str, ...]) -> None:
    cfg = _cfg(layers, 4)
    reason = unsupported_reason(geometry_for(cfg.model))
    assert reason is not None and "at least one attention layer" in reason
    model = load_model(cfg.model)
    pools = allocate_pools(model.geometry, 64, 4, 8)
    with pytest.raises(ValueError, match="layers"):
        build_cache(cfg, model, 64, None, pools=pools)


@pytest.mark.parametrize("layers", [("swa",), ("swa", "swa", "swa")])
def test_all_swa_models_get_an_index_only_full_component(layers: tuple[str, ...]) -> None:
    """No full-attention layer: the tree still starts with FULL (zero layers, so its pool
    holds no bytes) and all KV is SWA's; a repeated prompt longer than the window hits."""
    cfg = _cfg(layers, 4)
    geometry = geometry_for(cfg.model)
    assert unsupported_reason(geometry) is None
    assert geometry.components == ("full", "swa") and geometry.full_index_only
    assert geometry.full is not None and geometry.full.num_layers == 0 and geometry.full.bytes_per_token == 0
    rig = Rig(cfg)
    assert [c.ctype for c in rig.cache.components] == [ComponentType.FULL, ComponentType.SWA]
    prompt = [random.Random(6).randrange(1, 500) for _ in range(3 * WINDOW + 5)]
    rig.run([gen("a", prompt, 2 * WINDOW)])
    rig.run([gen("b", prompt, 2 * WINDOW)])
    assert rig.tokens("a") == rig.tokens("b") == cold_tokens(cfg, "x", prompt, 2 * WINDOW)
    assert rig.cached("b") == (len(prompt) - 1) // 4 * 4


@pytest.mark.parametrize("layers", [("full", "swa", "full", "mamba"), ("mamba", "full", "swa"),
                                    ("swa", "mamba", "full"), ("swa", "mamba"), ("mamba", "swa", "swa")])
def test_full_swa_and_mamba_together_are_served_in_component_order(layers: tuple[str, ...]) -> None:
    """Whatever the layer order, the cache holds FULL, SWA, MAMBA (``geometry.components``);
    without a full layer the FULL component is index-only."""
    cfg = _cfg(layers, 4)
    geometry = geometry_for(cfg.model)
    assert unsupported_reason(geometry) is None
    assert geometry.components == ("full", "swa", "mamba")
    assert geometry.full_index_only == ("full" not in layers)
    rig = Rig(cfg)
    assert [c.ctype for c in rig.cache.components] == [ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA]
    prompt = [random.Random(4).randrange(1, 500) for _ in range(45)]
    rig.run([gen("a", prompt, 20)])
    rig.run([gen("b", prompt, 20)])
    assert rig.tokens("a") == rig.tokens("b") == cold_tokens(cfg, "x", prompt, 20)
    assert rig.cached("b") == 44
    stats = rig.sched.stats()["l1"]
    assert {"full", "swa", "mamba"} <= set(stats)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("kind", list(PATTERNS))
def test_identical_prompts_prefilled_side_by_side_equal_cold_outputs(kind: str, chunk: int | None,
                                                                     page_size: int) -> None:
    """Two requests with the same prompt prefilled in the same passes: the second one's
    inserts find the first one's pages (its own duplicates are freed and it reads the tree's
    from then on) while both decode past the window; a third reuses what they left."""
    sched = {"chunked_prefill_tokens": chunk * page_size, "max_prefill_tokens": 4 * chunk * page_size} if chunk else {}
    cfg = _cfg(PATTERNS[kind], page_size, **sched)
    rng = random.Random(30 + page_size)
    prompt = [rng.randrange(1, 500) for _ in range(3 * page_size + 37)]
    want = cold_tokens(_cfg(PATTERNS[kind], page_size), "x", prompt, 24)
    rig = Rig(cfg)
    rig.run([gen("a", prompt, 24), gen("b", prompt, 24)])
    rig.run([gen("c", prompt, 24), gen("d", prompt + want[:5], 10)])
    assert rig.tokens("a") == rig.tokens("b") == rig.tokens("c") == want
    assert rig.tokens("d") == cold_tokens(_cfg(PATTERNS[kind], page_size), "x", prompt + want[:5], 10)
    assert rig.cached("c") == (len(prompt) - 1) // page_size * page_size
    assert rig.cached("d") >= rig.cached("c")


def _l2_cfg(kind: str, *, l1: tuple[int, int], l2: tuple[int, int], chunk: int) -> HicacheConfig:
    """Pages of 4 with L2 on: ``l1`` / ``l2`` = (tokens, Mamba state slots); prefill chunks
    of ``chunk`` tokens, two per pass."""
    return config_from_dict({
        "model": {"reference": {"preset": "tiny", "layers": list(PATTERNS[kind]), "sliding_window": WINDOW}},
        "cache": {"page_size": 4, "l1": {"tokens": l1[0], "state_slots": l1[1]},
                  "l2": {"tokens": l2[0], "state_slots": l2[1]}, "l3": {"backend": "none"}, "load_back_threshold": 0},
        "scheduler": {"chunked_prefill_tokens": chunk, "max_prefill_tokens": 2 * chunk},
    })


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_prefix_evicted_to_l2_and_loaded_back_gives_the_same_output(kind: str) -> None:
    cfg = _l2_cfg(kind, l1=(256, 8), l2=(2048, 32), chunk=256)
    rng = random.Random(21)
    prompt = [rng.randrange(1, 500) for _ in range(99)]
    others = [[rng.randrange(1, 500) for _ in range(99)] for _ in range(4)]
    rig = L2Rig(cfg)
    try:
        rig.run([gen("first", prompt, 8)])
        for i, other in enumerate(others):  # 27 of 64 L1 pages each: "first" goes to L2
            rig.run([gen(f"o{i}", other, 8)])
        rig.run([gen("again", prompt, 8)])
        assert rig.tokens("again") == rig.tokens("first") == cold_tokens(_cfg(PATTERNS[kind], 4), "x", prompt, 8)
        usage = rig.final("again").usage
        assert usage is not None
        assert usage.cached_host > 0
        assert usage.cached_device + usage.cached_host == 96
        assert rig.tier.counters.loads >= 1 and rig.tier.counters.writes >= 1
    finally:
        rig.close()


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_prefix_flushed_out_of_l1_and_l2_comes_back_from_l3_with_the_same_output(kind: str, tmp_path: Path) -> None:
    """Backed up to a file L3 (an all-SWA model's Full pages as index markers, its KV as SWA
    objects), flushed from L1 and L2, prefetched back: the prompt's prefix up to its last
    page boundary comes from L3 and the output is the cold run's."""
    cfg = _l2_cfg(kind, l1=(256, 8), l2=(2048, 32), chunk=256)
    prompt = [random.Random(22).randrange(1, 500) for _ in range(61)]
    rig = L3Rig(cfg, str(tmp_path / "l3"))
    try:
        rig.run([gen("first", prompt, 8)])
        assert rig.tier.counters.backups >= 1 and rig.io.counters.backup_pages > 0
        rig.cache.flush()
        rig.assert_idle()
        assert rig.cache.total_size() == 0
        rig.run([gen("again", prompt, 8)])
        assert rig.tokens("again") == rig.tokens("first") == cold_tokens(_cfg(PATTERNS[kind], 4), "x", prompt, 8)
        usage = rig.final("again").usage
        assert usage is not None
        assert (usage.cached_device, usage.cached_host, usage.cached_storage) == (0, 0, 60), usage
        assert rig.tier.counters.prefetch_aux_units > 0  # the SWA / Mamba objects came back too
    finally:
        rig.close()


def test_multi_turn_waits_for_pinned_pages_instead_of_recomputing_what_l2_holds() -> None:
    """Regression: a load-back that could not get L1 pages *yet* (the only evictable leaf
    was pinned by its L2 write) made the request recompute its whole history."""
    cfg = config_from_dict({
        "cache": {"page_size": 16, "l1": {"tokens": 1280}, "l2": {"tokens": 10240}, "l3": {"backend": "none"},
                  "load_back_threshold": 16},
    })
    rig = L3AckRig(cfg)
    rig.tier.l3_enabled = True
    rng = random.Random(5)
    history: dict[int, list[int]] = {c: [] for c in range(4)}
    try:
        for rnd in range(4):
            for c in range(4):
                ids = history[c] + [rng.randrange(1, 250) for _ in range(192)]
                rid = f"{rnd}-{c}"
                rig.run([gen(rid, ids, 2)])
                history[c] = ids + rig.tokens(rid)
                usage = rig.final(rid).usage
                assert usage is not None
                # everything but the new question (page-aligned) comes from L1 or L2
                assert usage.cached_device + usage.cached_host == (len(ids) - 192) // 16 * 16, (rid, usage)
        assert rig.tier.counters.loads >= 8
    finally:
        rig.close()


def test_a_load_back_acknowledged_before_the_next_pass_joins_it() -> None:
    """The loop may wait (``load_join_wait_s``) for a load-back in flight while others run;
    once the ack is in, the next scheduling pass admits the request into that same forward."""
    from hicache.scheduler.request import LOADING, RUNNING
    from hicache.scheduler.scheduler import LOAD_JOIN_WAIT_MAX_S

    cfg = config_from_dict({
        "cache": {"page_size": 4, "l1": {"tokens": 256}, "l2": {"tokens": 2048}, "l3": {"backend": "none"},
                  "load_back_threshold": 0},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
    })
    rng = random.Random(8)
    prompt = [rng.randrange(1, 500) for _ in range(99)]
    rig = L2Rig(cfg)
    try:
        rig.run([gen("first", prompt, 4)])
        for i in range(4):  # push "first" out of L1 into L2
            rig.run([gen(f"o{i}", [rng.randrange(1, 500) for _ in range(99)], 4)])
        sched = rig.sched
        assert sched.load_join_wait_s() == 0.0  # nothing runs, nothing loads
        sched.submit(gen("long", [rng.randrange(1, 500) for _ in range(20)], 30))
        sched.step()
        rig.pump()
        assert sched.forward_s_ewma > 0.0
        sched.submit(gen("again", prompt, 4))
        sched.schedule()
        again = sched.by_rid["again"]
        assert again.status == LOADING and sched.loads_pending
        wait = sched.load_join_wait_s()
        assert 0.0 < wait <= LOAD_JOIN_WAIT_MAX_S
        assert again.hold is None
        rig.pump()  # the controller acknowledges the load
        assert not sched.loads_pending
        assert again.hold is not None and again.load_done_at is not None  # locked at the ack
        sched.schedule()
        assert again.status == RUNNING and again.computed < again.prompt_len
        sched.forward()  # the loaded request is prefilled in this very pass
        assert again.computed >= again.prompt_len and rig.tokens("again")
        for _ in range(200):
            if not sched.busy and not rig.tier.in_flight:
                break
            sched.step()
            rig.pump()
        rig.assert_idle()
        assert rig.tokens("again") == rig.tokens("first")
        usage = rig.final("again").usage
        assert usage is not None and usage.cached_host > 0
    finally:
        rig.close()


def test_a_load_back_lost_with_the_controller_is_recomputed_and_leaks_nothing() -> None:
    """The controller dies while a request's prefix loads back: the load ends as failed
    (its fresh L1 pages freed, the nodes L2-only again), nothing is locked for the request,
    and it is served by recomputing, with the same tokens as before."""
    from hicache.scheduler.request import LOADING

    cfg = config_from_dict({
        "cache": {"page_size": 4, "l1": {"tokens": 256}, "l2": {"tokens": 2048}, "l3": {"backend": "none"},
                  "load_back_threshold": 0},
    })
    rng = random.Random(9)
    prompt = [rng.randrange(1, 500) for _ in range(99)]
    rig = L2Rig(cfg)
    try:
        rig.run([gen("first", prompt, 4)])
        for i in range(4):  # push "first" out of L1 into L2
            rig.run([gen(f"o{i}", [rng.randrange(1, 500) for _ in range(99)], 4)])
        sched = rig.sched
        sched.submit(gen("again", prompt, 4))
        sched.schedule()
        again = sched.by_rid["again"]
        assert again.status == LOADING and again.load is not None
        assert rig.cache.tiers.open_transfers >= 1 and rig.cache.protected_size() > 0  # the load holds its pages
        assert rig.tier.on_controller_lost() >= 1
        rig.inbox.clear()  # what the dead controller never received
        assert again.load.ok is False and again.hold is None
        assert rig.tier.in_flight == 0 and rig.cache.tiers.open_transfers == 0
        rig.cache.check_integrity()
        rig.run([])
        assert rig.tokens("again") == rig.tokens("first")
        usage = rig.final("again").usage
        assert usage is not None and usage.cached_host == 0 and usage.load_ms >= 0.0
        assert rig.tier.counters.loads_failed == 1
    finally:
        rig.close()


@pytest.mark.parametrize("kind", sorted(HAS_SWA))
def test_a_window_recovered_after_its_nodes_l2_write_is_written_and_reused_from_l2(kind: str) -> None:
    """A chunked prompt's inner boundaries lose their SWA windows (freed once out of the
    window) after their Full pages went to L2. A later prompt that ends just past such a
    boundary recomputes the prefix and gives the tree its window back; the window then gets
    its own L2 write, so once L1 is evicted a third prompt still reuses the shared prefix
    from L2, with the cold output."""
    cfg = _l2_cfg(kind, l1=(1024, 16), l2=(4096, 64), chunk=32)
    rng = random.Random(5)
    first = [rng.randrange(1, 500) for _ in range(99)]
    second = first[:33]  # its prompt boundary is 32, inside ``first``'s first node
    third = first[:32] + [rng.randrange(1, 500) for _ in range(30)]
    rig = L2Rig(cfg)
    try:
        rig.run([gen("first", first, 4)])
        rig.run([gen("second", second, 4)])
        assert rig.tier.counters.writes >= 2
        rig.cache.evict_units({c.name: rig.cache.total_size(c.name) + 1 for c in rig.cache.components})
        assert rig.cache.total_size() == 0  # all in L2 now
        rig.run([gen("third", third, 4)])
        usage = rig.final("third").usage
        assert usage is not None
        assert usage.cached_device + usage.cached_host == 32, usage
        assert rig.tokens("third") == cold_tokens(_cfg(PATTERNS[kind], 4), "x", third, 4)
    finally:
        rig.close()
