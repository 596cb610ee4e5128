"""Mamba state at branch points: conversations that share a system prompt share its state.

A Mamba layer's state after a prefix can only be cached where a prefill computed it, so a
prompt that forks from a cached path inside a node finds no state there. The prefill of a
request records the state where its prompt leaves the cached path (the fork) and every
``cache.mamba_branch_interval`` tokens, so a later request sharing that prefix matches it.
Every output is compared with a cold run of the same prompt; the tree is checked exactly
when idle.
"""

from __future__ import annotations

import random

import pytest

from hicache.config import HicacheConfig, config_from_dict
from tests.support.rigs import Rig, gen

PATTERNS = {"mamba": ("full", "mamba", "full", "mamba"), "swa+mamba": ("full", "swa", "mamba", "full")}


def _cfg(layers: tuple[str, ...], page_size: int, interval: int) -> HicacheConfig:
    return config_from_dict({
        "model": {"reference": {"preset": "tiny", "layers": list(layers), "sliding_window": 24}},
        "cache": {"page_size": page_size, "l1": {"tokens": 512 * page_size, "state_slots": 64},
                  "l2": {"enabled": False}, "l3": {"backend": "none"}, "mamba_branch_interval": interval},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
    })


def _cached(rig: Rig, rid: str) -> int:
    u = rig.final(rid).usage
    assert u is not None
    return u.cached_device + u.cached_host + u.cached_storage


def _cold(cfg, prompt: list[int], n: int) -> list[int]:
    rig = Rig(cfg)
    rig.run([gen("cold", prompt, n)])
    return rig.tokens("cold")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kind", list(PATTERNS))
def test_conversations_sharing_a_system_prompt_share_its_state(kind: str, page_size: int) -> None:
    cfg = _cfg(PATTERNS[kind], page_size, interval=0)  # the fork alone, no interval states
    rng = random.Random(page_size)
    system = [rng.randrange(1, 500) for _ in range(70)]
    users = [[rng.randrange(1, 500) for _ in range(20 + i)] for i in range(3)]  # past a page
    rig = Rig(cfg)
    for i, user in enumerate(users):
        rig.run([gen(f"c{i}", system + user, 6)])
        rig.assert_idle()
    shared = len(system) // page_size * page_size
    # the first computes cold; the second forks from the first's path inside a node (no
    # state there: nothing valid to match) and records the state at the fork; the third
    # matches the whole shared system prompt
    assert _cached(rig, "c0") == 0
    assert _cached(rig, "c1") == 0
    assert _cached(rig, "c2") == shared
    for i, user in enumerate(users):
        assert rig.tokens(f"c{i}") == _cold(cfg, system + user, 6), f"conversation {i}"


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_interval_states_serve_a_prefix_no_request_forked_at_yet(kind: str) -> None:
    cfg = _cfg(PATTERNS[kind], 4, interval=32)
    rng = random.Random(5)
    first = [rng.randrange(1, 500) for _ in range(100)]
    other = first[:75] + [rng.randrange(1, 500) for _ in range(20)]  # shares 75 tokens
    rig = Rig(cfg)
    rig.run([gen("first", first, 4)])
    rig.assert_idle()
    rig.run([gen("other", other, 4)])
    rig.assert_idle()
    assert _cached(rig, "other") == 64  # the last interval state before the fork
    assert rig.tokens("other") == _cold(cfg, other, 4)
    assert rig.tokens("first") == _cold(cfg, first, 4)


def test_the_first_sibling_finds_no_state_at_the_fork() -> None:
    """The reference for the tests above: with the interval off, the first prompt to fork
    from a cached path inside a node finds no Mamba state there (no prefill computed
    through that point before), so it matches nothing."""
    cfg = _cfg(PATTERNS["mamba"], 4, interval=0)
    rng = random.Random(7)
    system = [rng.randrange(1, 500) for _ in range(70)]
    rig = Rig(cfg)
    rig.run([gen("a", system + [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)])
    rig.run([gen("b", system + [9, 8, 7, 6, 5, 4, 3, 2, 1], 4)])
    assert _cached(rig, "b") == 0
    rig.assert_idle()
