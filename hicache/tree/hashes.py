"""PageHashes: the page hashes of the tree's nodes, the names of their pages in L3
(docs/architecture.md §6).

One ``PageHasher`` per cache salt (each salt its own chain), derived from the cache's
hasher; a node's hashes are computed on first use, with its missing ancestors', and kept on
the node (``TreeNode.hash_value``). ``UnifiedRadixCache`` holds one as ``hashes``; the tier
calls use it for backups and for ``write_through_filtered``'s admission.
"""

from __future__ import annotations

from hicache.hashing import HASH_BYTES, HashNamespace, PageHasher
from hicache.tree.base import CacheBase
from hicache.tree.node import TreeNode


class PageHashes:
    """The page hashes of ``tree``'s nodes; ``hasher``: the cache's (None: no page hashes,
    and every call raises ``RuntimeError``)."""

    def __init__(self, tree: CacheBase, hasher: PageHasher | HashNamespace | None = None) -> None:
        if isinstance(hasher, HashNamespace):
            hasher = PageHasher(hasher)
        if hasher is not None and hasher.page_size != tree.page_size:
            raise ValueError("the hasher's page size differs from the cache's")
        self.tree = tree
        self.hasher = hasher
        self._hashers: dict[str, PageHasher] = {}

    def hasher_for(self, salt: str) -> PageHasher:
        """The page hasher of ``salt``'s namespace (the chain of docs/architecture.md §6); one per
        salt, kept."""
        if self.hasher is None:
            raise RuntimeError("page hashes need a hasher (pass hasher= to UnifiedRadixCache)")
        h = self._hashers.get(salt)
        if h is None:
            h = self.hasher if salt == self.hasher.namespace.cache_salt else PageHasher(
                self.hasher.namespace.with_salt(salt))
            self._hashers[salt] = h
        return h

    def node_digests(self, node: TreeNode) -> bytes:
        """The node's page hashes as the node keeps them: raw digests, ``HASH_BYTES`` a page,
        in one buffer (computed now if needed, with its missing ancestors')."""
        if node.parent is None:
            return b""
        chain = []
        n = node
        while n.parent is not None and n.hash_value is None:
            chain.append(n)
            n = n.parent
        parent = n.hash_value[-HASH_BYTES:] if n.parent is not None and n.hash_value else None
        hasher = self.hasher_for(self.tree.salt_of(node))
        for x in reversed(chain):
            x.hash_value = hasher.digest_pages(x.key, parent)
            parent = x.hash_value[-HASH_BYTES:]
        return node.hash_value  # type: ignore[return-value]

    def node_hashes(self, node: TreeNode) -> list[str]:
        """The node's page hashes, one hex string a page (a new list: ``node_digests``, decoded)."""
        d = self.node_digests(node)
        return [d[i:i + HASH_BYTES].hex() for i in range(0, len(d), HASH_BYTES)]

    def last_page_hash(self, node: TreeNode) -> str | None:
        """The hash of the node's last page (None for a root): continue the chain into L3."""
        d = self.node_digests(node)
        return d[-HASH_BYTES:].hex() if d else None
