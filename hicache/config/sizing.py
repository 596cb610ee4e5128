"""Pool sizing derived from the config: the SWA window pools, Mamba state slots, KV bytes per
token, and ``resolve`` (the reference preset's unset fields and the derived SWA pool sizes,
filled in once at load). Pure functions of a ``HicacheConfig``. See docs/architecture.md §10.
"""

from __future__ import annotations

import dataclasses

from hicache.config.schema import DTYPE_BYTES, REFERENCE_PRESETS, HicacheConfig

STATE_SLOTS_PER_REQUEST = 3
"""A running request of a Mamba model holds up to three L1 state slots: its own state, the
prompt-boundary snapshot and the latest page-boundary snapshot."""

def swa_request_pages(sliding_window: int, tokens: int, page_size: int) -> int:
    """The most SWA L1 pages a running request is charged for while its forward passes
    compute up to ``tokens`` tokens each (a prefill chunk; 1 while decoding).

    ``ceil(tokens / ps) + 2 * ceil(window / ps) + 1``: the pages of the tokens being
    computed, the window before them (kept down to the window before the last page
    boundary, so that the tokens cached at finish end on a valid SWA boundary; one page
    more for the partial page), and the window before the prompt's last page boundary,
    which the request hands to the tree (so a repeat of the prompt matches it) and which
    stays charged to it until it finishes. Pages wholly before that are freed as the
    request's computed position advances (the runner never reads them again).
    """
    def cdiv(a: int) -> int:
        return -(-a // page_size)

    return cdiv(tokens) + 2 * cdiv(sliding_window) + 1


def swa_min_pages(sliding_window: int, tokens: int, page_size: int) -> int:
    """The smallest SWA L1 pool that serves any request: one request's
    ``swa_request_pages`` and the window of SWA pages its match keeps locked."""
    return swa_request_pages(sliding_window, tokens, page_size) + -(-sliding_window // page_size) + 1


ENGINE_WINDOW_SHARE = 4
"""Engine mode, a model with window layers, ``cache.l2.swa_tokens`` unset: the window pool
gets 1 / this of the full pool's pages (a cached prefix keeps its window part for the pages
of its last window only)."""


def engine_window_pages(cfg: HicacheConfig) -> int:
    """Pages of the engine-mode window pool: ``cache.l2.swa_tokens``, or
    ``ENGINE_WINDOW_SHARE``'s share of ``cache.l2.tokens`` (at least one page)."""
    ps = cfg.cache.page_size
    if cfg.cache.l2.swa_tokens is not None:
        return cfg.cache.l2.swa_tokens // ps
    return max(1, cfg.cache.l2.tokens // ps // ENGINE_WINDOW_SHARE)


def swa_pool_tokens(cfg: HicacheConfig, sliding_window: int) -> tuple[int, int]:
    """``(L1, L2)`` SWA pool sizes in tokens for a model with swa layers (L2 0 when off).

    Set by ``cache.l1.swa_tokens`` / ``cache.l2.swa_tokens``; unset, L1 gets::

        2 * max_running_requests * swa_request_pages(window, 1)
          + ceil((max_prefill_tokens + chunk) / page_size)          (pages)

    (chunk = ``min(chunked_prefill_tokens, max_prefill_tokens)``): every running request's
    decode windows, the prefill chunks one forward pass computes (the admission step stops
    once ``max_prefill_tokens`` are taken, overshooting by at most one chunk), and as much
    again for the windows the tree keeps cached; never less than one prefilling request's
    ``swa_min_pages``, never more than the Full pool. L2 gets the same
    share of ``cache.l2.tokens``.
    """
    c, s = cfg.cache, cfg.scheduler
    ps = c.page_size
    full1 = c.l1.tokens // ps
    chunk = min(s.chunked_prefill_tokens, s.max_prefill_tokens)
    if c.l1.swa_tokens is not None:
        l1 = c.l1.swa_tokens // ps
    else:
        derived = (2 * s.max_running_requests * swa_request_pages(sliding_window, 1, ps)
                   + -(-(s.max_prefill_tokens + chunk) // ps))
        l1 = min(full1, max(derived, swa_min_pages(sliding_window, chunk, ps)))
    if not c.l2.enabled:
        return l1 * ps, 0
    full2 = c.l2.tokens // ps
    if c.l2.swa_tokens is not None:
        l2 = c.l2.swa_tokens // ps
    else:
        l2 = min(full2, -(-full2 * l1 // full1)) if full1 else full2
    return l1 * ps, l2 * ps


MIN_L1_STATE_SLOTS = STATE_SLOTS_PER_REQUEST + 1
"""One more than a request holds: the cached state it matched stays locked while it runs,
so a request can always be admitted once nothing else runs."""


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kv_bytes_per_token(cfg: HicacheConfig) -> int | None:
    """Bytes of Full+SWA KV one token takes in one tier, for the reference model; None for hf."""
    if cfg.model.kind != "reference":
        return None
    ref = cfg.model.reference
    assert ref.layers is not None and ref.num_kv_heads is not None and ref.head_dim is not None
    attn_layers = sum(1 for kind in ref.layers if kind in ("full", "swa"))
    return attn_layers * 2 * ref.num_kv_heads * ref.head_dim * DTYPE_BYTES[cfg.model.dtype]


def resolve(cfg: HicacheConfig) -> HicacheConfig:
    """Fill the reference model's unset fields from its preset, and for a reference model
    with swa layers the SWA pool sizes (``swa_pool_tokens``) left unset (an ``hf`` model's
    window is known only from its checkpoint: the launcher derives its sizes)."""
    ref = cfg.model.reference
    preset = REFERENCE_PRESETS[ref.preset]
    filled = {k: v for k, v in preset.items() if getattr(ref, k) is None}
    if filled:
        ref = dataclasses.replace(ref, **filled)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, reference=ref))
    c = cfg.cache
    window = ref.sliding_window
    if (cfg.model.kind == "reference" and "swa" in (ref.layers or ()) and window is not None and window > 0
            and power_of_two(c.page_size) and c.l1.tokens > 0 and (c.l1.swa_tokens is None or
                                                                     c.l2.swa_tokens is None)):
        l1, l2 = swa_pool_tokens(cfg, window)
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(
            c, l1=dataclasses.replace(c.l1, swa_tokens=l1 if c.l1.swa_tokens is None else c.l1.swa_tokens),
            l2=dataclasses.replace(c.l2, swa_tokens=l2 if c.l2.enabled and c.l2.swa_tokens is None
                                   else c.l2.swa_tokens)))
    return cfg
