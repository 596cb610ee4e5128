"""Offline replay of a Mooncake-format trace through ``UnifiedRadixCache`` (one tier).

A Mooncake record carries ``hash_ids``: one chained block id per block of input tokens, so
two requests share block ``i`` exactly when they share the first ``i+1`` blocks. Each block
id is mapped to a deterministic synthetic token block (``tokens_per_block`` tokens, the id
and its position in the block), and the cache runs with ``page_size = tokens_per_block``, so
one block is one page. The metric is the block-level prefix hit rate the traces' README
uses: per request, the longest cached prefix of its blocks, summed, over all blocks; after
each request all its blocks are inserted and the cache is evicted back to ``capacity``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ReplayStats:
    policy: str
    capacity_blocks: int
    requests: int
    total_blocks: int
    hit_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def load_mooncake(path: str | Path) -> list[list[int]]:
    """The ``hash_ids`` of every record of a Mooncake-format JSON-lines trace, in order."""
    out: list[list[int]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from exc
            if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(f"{path}:{lineno}: hash_ids must be non-negative integers")
            out.append(ids)
    return out


def block_tokens(block_ids: Sequence[int], tokens_per_block: int) -> list[int]:
    """Synthetic tokens for a run of block ids: block ``b`` becomes ``b*T .. b*T+T-1``."""
    if tokens_per_block == 1:
        return list(block_ids)
    out: list[int] = []
    for b in block_ids:
        base = b * tokens_per_block
        out.extend(range(base, base + tokens_per_block))
    return out


def replay(requests: Iterable[Sequence[int]], capacity_blocks: int, policy: str = "lru",
           tokens_per_block: int = 1) -> ReplayStats:
    """Replay block-id sequences through a fresh single-tier cache of ``capacity_blocks``."""
    from hicache.memory.allocator import PageAllocator
    from hicache.tree.cache import UnifiedRadixCache
    from hicache.tree.components import FullComponent

    if capacity_blocks < 1:
        raise ValueError("capacity_blocks must be >= 1")
    reqs = [list(r) for r in requests]
    longest = max((len(r) for r in reqs), default=0)
    alloc = PageAllocator(capacity_blocks + longest + 1, "replay", checked=False)
    cache = UnifiedRadixCache([FullComponent(alloc)], tokens_per_block, eviction_policy=policy)
    core = cache.core
    hits = total = 0
    for ids in reqs:
        key = block_tokens(ids, tokens_per_block)
        m = cache.match_prefix(key)
        have = len(m.device_indices)
        hits += have
        total += len(ids)
        new = alloc.alloc(len(ids) - have)
        if new is None:  # pragma: no cover - the pool always has room for one request
            raise RuntimeError("replay: page pool exhausted")
        pages = m.device_indices + new
        r = cache.insert(key, pages, prev_prefix_len=m.device_len)
        dup = pages[have:r.prefix_len // tokens_per_block]
        if dup:
            alloc.free(dup)
        over = core.dev_total[0] - capacity_blocks
        if over > 0:
            cache.evict(over * tokens_per_block)
    return ReplayStats(policy, capacity_blocks, len(reqs), total, hits)
