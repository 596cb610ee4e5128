"""Shared helpers: tiny models and a minimal driver that plays scheduler and cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from hicache.config import ModelConfig, ReferenceModelConfig
from hicache.model.loader import LoadedModel, load_model
from hicache.model.pools import allocate_pools
from hicache.model.runner import ForwardItem, ModelRunner
from hicache.model.sampling import sample_next
from hicache.model.sampling_params import SamplingParams, resolve_seed

_MODELS: dict[tuple, LoadedModel] = {}


def tiny_model(layers: tuple[str, ...], dtype: str = "float32", **overrides: object) -> LoadedModel:
    key = (layers, dtype, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        ref = ReferenceModelConfig(preset="tiny", layers=layers, **overrides)  # type: ignore[arg-type]
        _MODELS[key] = load_model(ModelConfig(kind="reference", dtype=dtype, reference=ref))  # type: ignore[arg-type]
    return _MODELS[key]


@dataclass
class Req:
    """A request as the driver sees it. ``cached`` tokens of the prompt are already in the
    pages/slot given at creation; ``snap_at`` are positions whose Mamba state to keep."""

    prompt: list[int]
    params: SamplingParams
    cached: int = 0
    pages: list[int] = field(default_factory=list)
    swa_pages: list[int] = field(default_factory=list)
    slot: int | None = None
    snap_at: tuple[int, ...] = ()
    snaps: dict[int, int] = field(default_factory=dict)
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    kv_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        self.kv_len = self.cached
        self.seed = resolve_seed(self.params)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.params.max_new_tokens


class Driver:
    """Allocates pages and slots from plain free lists and runs requests step by step."""

    def __init__(self, model: LoadedModel, page_size: int, num_pages: int | None = None, slots: int = 64) -> None:
        self.model = model
        self.page_size = page_size
        num_pages = num_pages or 3000 // page_size + 100
        self.pools = allocate_pools(model.geometry, num_pages, page_size, slots if model.geometry.mamba else 0)
        self.runner = ModelRunner(model, self.pools)
        self.free_pages = list(range(num_pages))
        self.free_swa = list(range(num_pages))
        self.free_slots = list(range(slots))

    def new_slot(self) -> int:
        return self.free_slots.pop(0)

    def _cover(self, req: Req, end: int) -> None:
        need = -(-end // self.page_size)
        while len(req.pages) < need:
            req.pages.append(self.free_pages.pop(0))
        while len(req.swa_pages) < need:
            req.swa_pages.append(self.free_swa.pop(0))

    def run(self, reqs: list[Req], join: list[int] | None = None, chunk: int | None = None) -> None:
        """Run to completion; request ``i`` joins at step ``join[i]``; prefills in ``chunk``-token runs."""
        join = join or [0] * len(reqs)
        for r in reqs:
            if self.model.geometry.mamba is not None and r.slot is None:
                r.slot = self.new_slot()
        step = 0
        while not all(r.done for r in reqs):
            batch: list[tuple[Req, ForwardItem]] = []
            for r, j in zip(reqs, join, strict=True):
                if j > step or r.done:
                    continue
                if r.kv_len < len(r.prompt):
                    n = len(r.prompt) - r.kv_len if chunk is None else min(chunk, len(r.prompt) - r.kv_len)
                    toks = r.prompt[r.kv_len : r.kv_len + n]
                else:
                    toks = [r.out[-1]]
                start, end = r.kv_len, r.kv_len + len(toks)
                self._cover(r, end)
                snaps = []
                for pos in r.snap_at:
                    if start < pos <= end and self.model.geometry.mamba is not None:
                        r.snaps[pos] = self.new_slot()
                        snaps.append((pos, r.snaps[pos]))
                geo = self.model.geometry
                batch.append((r, ForwardItem(
                    toks, start,
                    full_pages=r.pages if geo.full else (),
                    swa_pages=r.swa_pages if geo.swa else (),
                    state_slot=r.slot, snapshots=snaps,
                    logits="last" if end >= len(r.prompt) else "none",
                )))
            step += 1
            if not batch:
                continue
            outs = self.runner.forward([it for _, it in batch])
            for (r, it), lg in zip(batch, outs, strict=True):
                r.kv_len = it.end
                if lg is not None:
                    r.logits.append(lg)
                    r.out.append(sample_next(lg, r.params, r.seed, len(r.out)))

    def cached_copy(self, src: Req, tokens: int, prompt: list[int], params: SamplingParams) -> Req:
        """A new request whose first ``tokens`` (page-aligned) come from ``src``'s pages, copied
        out into an L2-shaped host buffer ``[pages, layers, 2, page_size, heads, dim]`` and back
        into fresh L1 pages; Mamba state from ``src``'s snapshot at ``tokens`` into a new slot.
        SWA pages wholly outside the window are left unmapped (-1)."""
        ps = self.page_size
        assert tokens % ps == 0
        k = tokens // ps
        geo = self.model.geometry
        req = Req(prompt, params, cached=tokens)
        for kind, pool, free in (("full", self.pools.full_kv, self.free_pages), ("swa", self.pools.swa_kv, self.free_swa)):
            if pool is None:
                continue
            src_pages = src.pages if kind == "full" else src.swa_pages
            first = 0
            if kind == "swa":
                first = max(0, tokens - geo.sliding_window) // ps  # pages holding the last `window` tokens
            layers, _, slots, heads, dim = pool.shape  # layers is 0 for an index-only Full pool
            paged = pool.view(layers, 2, slots // ps, ps, heads, dim)
            l2 = paged[:, :, src_pages[first:k]].permute(2, 0, 1, 3, 4, 5).contiguous()
            dst = [free.pop(0) for _ in range(first, k)]
            paged[:, :, dst] = l2.permute(1, 2, 0, 3, 4, 5)
            table = [-1] * first + dst
            if kind == "full":
                req.pages = table
            else:
                req.swa_pages = table
        if geo.mamba is not None:
            req.slot = self.new_slot()
            snap = src.snaps[tokens]
            self.pools.mamba_conv[:, req.slot] = self.pools.mamba_conv[:, snap]
            self.pools.mamba_ssm[:, req.slot] = self.pools.mamba_ssm[:, snap]
        return req


@pytest.fixture
def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=8)
