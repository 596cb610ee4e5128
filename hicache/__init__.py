"""hicache: a tiered KV-cache daemon for LLM serving.

One radix tree (``hicache.tree``) keeps the KV of computed prefixes across L1 device
memory, L2 shared host memory and L3 (Redis or a file store). See README.md, then docs/.
"""

from __future__ import annotations

__version__ = "0.1.0"
