"""Memory bookkeeping owned by the scheduler: page-index allocators (and, later, pools)."""

from __future__ import annotations

from hicache.memory.allocator import AllocatorError, PageAllocator, PageIndices

__all__ = ["AllocatorError", "PageAllocator", "PageIndices"]
