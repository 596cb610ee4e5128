"""What the tree knows of a running request: ``RequestState`` (docs/architecture.md §4).

The scheduler (or a test) owns it; ``UnifiedRadixCache.cache_unfinished_req`` /
``cache_finished_req`` read it, insert what it computed, and give back what it held. Each
auxiliary component keeps its own part under its name in ``aux`` and is the only code that
reads it in the tree (its ``request_payload`` / ``release_request`` hooks): the SWA
component a ``SwaRequestPages``, the Mamba component a state slot. A new component adds its
own entry; nothing here changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.tree.node import LockToken, TreeNode


@dataclass
class RequestState:
    """The fields of a request that ``cache_finished_req`` / ``cache_unfinished_req`` use.

    ``kv_pages``: the request's FULL L1 pages, one per (possibly partial) page of its
    computed tokens; the first ``prefix_len // page_size`` are the tree's (from the match).
    ``aux[name]``: auxiliary component ``name``'s part (absent: the request holds none).
    """

    token_ids: Sequence[int]
    kv_pages: list[int]
    cache_salt: str = ""
    prefix_len: int = 0
    last_node: TreeNode | None = None
    lock: LockToken | None = None
    aux: dict[str, Any] = field(default_factory=dict)
