"""``PackedTokens``: a request's tokens packed once, every span equal to packing its slice anew
(no vLLM needed: token lists as vLLM's ``Request`` holds them)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import overload

import pytest

import protos
from hicache.connectors.token_pack import PackedTokens

BS = 32


class ConstantList(Sequence[int]):
    """A read-only view of a list, as vLLM's ``Request.all_token_ids`` is."""

    def __init__(self, items: list[int]) -> None:
        self._x = items

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        return self._x[i]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator[int]:
        return iter(self._x)


def _check_every_span(packed: PackedTokens, tokens: Sequence[int]) -> None:
    n = len(packed)
    for lo, hi in [(0, n), (0, 0), (n, n), (BS, n), (n // 2, n), (3, min(n, 70))]:
        if lo <= hi:
            assert packed.span(lo, hi) == protos.pack_tokens(list(tokens[lo:hi])), (lo, hi)


def test_a_request_packed_step_by_step_equals_its_tokens_packed_anew() -> None:
    """The connector's calls over a request's life: the prompt at its lookup, then each
    step's save ranges up to its computed full pages, as decode appends a token a step."""
    rng = random.Random(7)
    prompt = [rng.randrange(2**32) for _ in range(5 * BS + 7)]
    all_ids = list(prompt)
    tokens = ConstantList(all_ids)
    packed = PackedTokens()
    packed.extend(prompt, len(prompt))  # the lookup: the whole prompt, once
    assert len(packed) == len(prompt)
    _check_every_span(packed, prompt)
    computed = len(prompt)
    for _ in range(3 * BS):
        all_ids.append(rng.randrange(2**32))  # the token sampled in the step
        end = computed // BS * BS
        packed.extend(tokens, end)  # a save range: computed full pages only
        assert len(packed) == max(len(prompt), end)
        _check_every_span(packed, tokens)
        computed += 1
    assert len(packed) == (computed - 1) // BS * BS


def test_a_resumed_or_updated_request_keeps_its_packed_prefix_and_packs_only_what_follows() -> None:
    """A preempted request resumes with the same tokens; a streaming session drops its last
    sampled (uncomputed) token and appends a new input chunk: only the new tokens are packed,
    and the spans still equal the current tokens packed anew."""
    rng = random.Random(8)
    prompt = [rng.randrange(50_000) for _ in range(2 * BS + 1)]
    packed = PackedTokens()
    packed.extend(prompt, len(prompt))
    all_ids = prompt + [rng.randrange(50_000) for _ in range(BS)]
    computed = len(all_ids) - 1  # the last one was sampled, not computed
    packed.extend(ConstantList(all_ids), computed // BS * BS)
    assert len(packed) == 3 * BS
    # a streaming update: the uncomputed token goes, a new chunk comes
    del all_ids[computed:]
    chunk = [rng.randrange(50_000) for _ in range(BS + 5)]
    all_ids += chunk
    new_prompt = list(all_ids)
    packed.extend(new_prompt, len(new_prompt))  # the lookup of the updated session
    assert len(packed) == len(new_prompt)
    _check_every_span(packed, new_prompt)
    # resumed after preemption: nothing changes, nothing is packed again
    before = packed.span(0, len(packed))
    packed.extend(new_prompt, len(new_prompt))
    packed.extend(ConstantList(all_ids), 2 * BS)
    assert packed.span(0, len(packed)) == before


def test_a_bad_token_id_packs_nothing_and_a_span_past_the_packed_tokens_is_refused() -> None:
    packed = PackedTokens()
    with pytest.raises(OverflowError):
        packed.extend([1, 2, 2**32], 3)
    with pytest.raises(OverflowError):
        protos.pack_tokens([1, 2, 2**32])  # as the wire's own packing
    assert len(packed) == 0
    packed.extend([1, 2, 3], 3)
    with pytest.raises(OverflowError):
        packed.extend([1, 2, 3, -1], 4)
    assert len(packed) == 3
    with pytest.raises(ValueError):
        packed.span(0, 4)
    assert packed.span(1, 3) == protos.pack_tokens([2, 3])
