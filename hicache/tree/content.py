"""Who is told when a tier's content changes (docs/architecture.md §4, "Content observer").

The tree calls a ``ContentObserver`` for the *primary* (Full) component only: a node's Full
pages say which token prefix a tier holds; auxiliary components (SWA, Mamba) ride on them.

| call                                   | when                                                     |
|----------------------------------------|----------------------------------------------------------|
| ``pages_added(node, Tier.DEVICE)``     | the node's Full L1 pages are set (insert), or a load-back|
|                                        | of them landed (``finish_load_back``)                    |
| ``pages_dropped(node, Tier.DEVICE)``   | they are cleared (eviction, delete)                      |
| ``pages_added(node, Tier.HOST)``       | the node's Full L2 pages are set (write, ``insert_host``)|
| ``pages_dropped(node, Tier.HOST)``     | they are cleared (L2 eviction, delete)                   |
| ``pages_added(node, Tier.STORAGE)``    | an L3 backup of the node's pages was acknowledged        |

L1 pages of a load-back in flight (``node.loading``) are not readable yet: no call is made
when they are set or cleared (a failed load, an insert that replaces them); the call comes
when the load lands.

A split moves pages between two nodes without a call: the pages, and so their hashes, stay
what they were. The node is attached (its key and its ancestors' are final) during each
call. The observer must not change the tree; it runs inside the tree's own calls.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hicache.tree.node import TreeNode


class Tier(str, Enum):
    """The tiers whose content the tree tracks."""

    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


class ContentObserver(Protocol):
    """Told of every change to the Full pages a tier holds (see the table above)."""

    def pages_added(self, node: TreeNode, tier: Tier) -> None: ...

    def pages_dropped(self, node: TreeNode, tier: Tier) -> None: ...
