"""The cache server's monotonic counters (``stats()["engine"]`` and the metrics): every part
of the server adds to the one ``EngineCounters`` the ``CacheServer`` holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineCounters:
    """Monotonic counters for stats and metrics (pages unless the name says otherwise)."""

    lookups: int = 0
    lookup_hit_pages: int = 0
    lookup_storage_pages: int = 0
    loaded_host_pages: int = 0
    loaded_storage_pages: int = 0
    reserved_pages: int = 0
    reserve_short_pages: int = 0
    committed_pages: int = 0
    committed_window_pages: int = 0
    """Window parts of the committed pages (models with window layers)."""
    lookup_window_pages: int = 0
    """Window parts answered with lookup hits."""
    dropped_window_pages: int = 0
    """Window parts of a request's earlier save ends dropped as it went on (``_slide_window``)."""
    reserve_short_window_pages: int = 0
    """Window parts a save range went without (no room in L2 for them)."""
    committed_states: int = 0
    """States after committed pages (models with state layers)."""
    lookup_states: int = 0
    """States answered with hits."""
    reserve_short_states: int = 0
    """States a save asked for that found no room in L2 (their pages are kept without)."""
    commit_duplicate_pages: int = 0
    commit_failed_pages: int = 0
    refused: int = 0
    bad_requests: int = 0
    stale_run: int = 0
    """Messages of an earlier daemon run (refused or dropped)."""
    unknown_requests: int = 0
    """Lookups and save ranges that named tokens the server did not hold (``unknown_request``)."""
    lookup_pending: int = 0
    """Lookups answered ``pending`` (a prefetch from L3 in flight)."""
    lookup_save_waits: int = 0
    """Lookups answered ``pending`` because another reservation was saving the pages after
    the hit (``engine.save_wait_ms``)."""
    lookup_tokens_received: int = 0
    """Token ids received in Lookups (with ``base``, only the new ones)."""
    reserves: int = 0
    """Reserve messages served (one per engine step that saves)."""
    save_ranges: int = 0
    """Save ranges in them (one per request and step)."""
    reserve_tokens_received: int = 0
    """Token ids received in Reserves (with ``base``, only the new ones)."""
    orphans_ended_late: int = 0
    """Orphaned leases ended by their late Release / Commit."""
    orphans_ended_gone: int = 0
    """Orphaned leases ended because their engine process is gone."""
    reserve_walked_pages: int = 0
    """Pages of tree nodes walked to find where save ranges start (a full-attention model's
    range resumes from its request's ``SaveCursor``: about the pages committed since its last one)."""
    reserve_resumed: int = 0
    """Save ranges whose match resumed from their request's ``SaveCursor``."""
    save_new_pages: int = 0
    """Pages from ``SaveRange.start_page`` to the range's end that L2 lacked: the new content asked."""
    resaved_pages: int = 0
    """Pages reserved before ``SaveRange.start_page`` (a running request's evicted prefix saved again)."""
    resave_refused_pages: int = 0
    """Evicted pages before ``SaveRange.start_page`` that went unsaved (more than the request's
    ``SaveCursor.credit``), with the range's whole save."""
    busy: int = 0
    """Lookups and reserves answered ``protos.BUSY`` (``busy``: their engine's queue was full)."""
