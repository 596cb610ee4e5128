"""A trace prepared for replay: block and page geometry and the keys the tree sees."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

from hicache.replay_sim.trace import Trace, check_geometry, infer_block_size, page_keys
from hicache.tree.node import KEY_TYPECODE


class TokenKeys(Sequence["array[int]"]):  # a string: array is not subscriptable before 3.12
    """Real synthetic token keys (block ``b`` -> ``b*B .. b*B+B-1``), built per request on
    access so a large trace never holds all of them at once."""

    def __init__(self, trace: Trace, block_size: int) -> None:
        self._blocks = trace.blocks
        self._b = block_size

    def __len__(self) -> int:
        return len(self._blocks)

    @overload
    def __getitem__(self, i: int) -> array[int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[array[int]]: ...

    def __getitem__(self, i: int | slice) -> array[int] | list[array[int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        b = self._b
        key = array(KEY_TYPECODE)
        for x in self._blocks[i]:
            key.extend(range(x * b, x * b + b))
        return key


@dataclass
class Workload:
    """``pages[r]``: request ``r`` as page ids (``B / P`` per block), the unit of Belady,
    of the ceiling and of the tree when ``token_level`` is off; ``keys``: what the tree
    replays (the page ids, or real tokens with a tree page size of ``page_size``)."""

    trace: Trace
    block_size: int
    page_size: int
    token_level: bool
    pages: list[array[int]]

    @classmethod
    def build(cls, trace: Trace, block_size: int | None = None, page_size: int | None = None,
              token_level: bool = False) -> Workload:
        """``block_size`` None: inferred from ``input_length`` (``ValueError`` if it cannot
        be); ``page_size`` None: the block size."""
        if block_size is None:
            block_size = infer_block_size(trace)
            if block_size is None:
                raise ValueError(f"{trace.name}: cannot infer the block size from input_length; "
                                 "pass --block-size")
        if page_size is None:
            page_size = block_size
        k = check_geometry(block_size, page_size)
        return cls(trace, block_size, page_size, token_level, page_keys(trace, k))

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.page_size

    @property
    def tree_page_size(self) -> int:
        return self.page_size if self.token_level else 1

    @property
    def keys(self) -> Sequence[array[int]]:
        return TokenKeys(self.trace, self.block_size) if self.token_level else self.pages

    @property
    def total_pages(self) -> int:
        return sum(len(p) for p in self.pages)

    def unique_pages(self) -> int:
        seen: set[int] = set()
        for p in self.pages:
            seen.update(p)
        return len(seen)

    def longest_pages(self) -> int:
        return max((len(p) for p in self.pages), default=0)
