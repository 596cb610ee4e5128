"""The paged-KV model runner: one forward pass over a batch mixing prefills and decodes.

Ownership: the runner owns the weights (read-only) and nothing else. The pools
(``KVPools``) belong to the memory pools; the page tables, state slots and snapshot slots
are allocated by the cache/scheduler and passed in with each ``ForwardItem``. Per item the
runner

=====================  ===================================================================
reads                  Full KV of positions ``[0, start)`` through ``full_pages``; SWA KV
                       of positions ``[max(0, start - sliding_window + 1), start)`` through
                       ``swa_pages`` (entries for pages wholly before that are never
                       read, so the cache may have freed them); the Mamba state in
                       ``state_slot`` (the state after ``start`` tokens; ignored and
                       treated as zero when ``start == 0``).
writes                 Full and SWA KV of the new positions ``[start, end)`` into the
                       slots ``page * page_size + offset`` of those page tables (SWA pages
                       are written exactly like full pages; freeing those that fall out of
                       the window is the cache's decision); the Mamba state after ``end``
                       tokens into ``state_slot``; for each ``(position, slot)`` in
                       ``snapshots`` the Mamba state after ``position`` tokens into ``slot``.
never touches          any other page or slot.
=====================  ===================================================================

Determinism: in float32 a token's KV, Mamba state and logits are bitwise independent of
the batch (other items, other tokens, the token's row) — see ``hicache.model.ops`` and
``hicache.model.attention``. So a prefill that starts from a cached prefix (KV copied
between pools, Mamba state from a snapshot) produces exactly what a full recompute does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hicache.model import attention as attn_mod
from hicache.model.loader import LoadedModel
from hicache.model.mamba import causal_conv, selective_scan
from hicache.model.ops import apply_rope, linear, rms_norm, sigmoid, silu
from hicache.model.pools import KVPools
from hicache.model.rope import RotaryEmbedding

LogitsMode = Literal["last", "all", "none"]


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's share of a forward pass: compute ``token_ids`` at positions
    ``[start, start + len(token_ids))``.

    A prefill of an uncached prompt has ``start == 0``; a prefill after a cached prefix has
    ``start`` = the prefix length (page-aligned in practice, not required here); a decode
    step is one token at ``start`` = tokens already in the KV; a prefill chunk is any run.

    - ``full_pages`` / ``swa_pages``: page indices into the Full / SWA pools covering
      positions ``[0, end)`` (a partial last page is fine). Required when the model has
      layers of that kind.
    - ``state_slot``: the sequence's own Mamba state slot (required for mamba models).
    - ``snapshots``: ``(position, slot)`` pairs, ``start < position <= end``: save the
      Mamba state after ``position`` tokens into ``slot`` (e.g. at the last full page of a
      prompt, or of a finished sequence).
    - ``logits``: ``last`` (``[vocab]`` for the last token), ``all`` (``[T, vocab]``) or ``none``.
    """

    token_ids: Sequence[int]
    start: int = 0
    full_pages: Sequence[int] = ()
    swa_pages: Sequence[int] = ()
    state_slot: int | None = None
    snapshots: Sequence[tuple[int, int]] = ()
    logits: LogitsMode = "last"

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class ModelRunner:
    """Runs ``LoadedModel`` against externally owned L1 pools (CPU)."""

    def __init__(self, model: LoadedModel, pools: KVPools) -> None:
        pools.validate(model.geometry)
        self.model = model
        self.spec = model.spec
        self.weights = model.weights
        self.pools = pools
        self.rope = RotaryEmbedding(self.spec)
        self.scale = self.spec.head_dim ** -0.5
        # index of each layer within its kind's pool tensor
        counters = {"full": 0, "swa": 0, "mamba": 0}
        self.kind_index: list[int] = []
        for kind in self.spec.layer_kinds:
            self.kind_index.append(counters[kind])
            counters[kind] += 1

    # ------------------------------------------------------------------ validation

    def _check(self, items: Sequence[ForwardItem]) -> None:
        spec, ps = self.spec, self.pools.page_size
        own_slots: set[int] = set()
        all_own = {it.state_slot for it in items}
        for n, it in enumerate(items):
            where = f"batch item {n}"
            if len(it.token_ids) == 0:
                raise ValueError(f"{where}: token_ids is empty")
            if it.start < 0:
                raise ValueError(f"{where}: start must be >= 0, got {it.start}")
            if it.end > spec.max_context:
                raise ValueError(f"{where}: {it.end} tokens exceed the model's max context {spec.max_context}")
            bad = [t for t in it.token_ids if not 0 <= t < spec.vocab_size]
            if bad:
                raise ValueError(f"{where}: token id {bad[0]} is outside [0, {spec.vocab_size})")
            if it.logits not in ("last", "all", "none"):
                raise ValueError(f"{where}: logits must be last, all or none, got {it.logits!r}")
            need_pages = -(-it.end // ps)
            for name, table, n_pages, present in (
                ("full_pages", it.full_pages, self.pools.num_full_pages, self.pools.full_kv is not None),
                ("swa_pages", it.swa_pages, self.pools.num_swa_pages, self.pools.swa_kv is not None),
            ):
                if not present:
                    continue
                if len(table) < need_pages:
                    raise ValueError(f"{where}: {name} has {len(table)} pages, {need_pages} needed for {it.end} tokens")
                lo_page = 0
                if name == "swa_pages" and spec.sliding_window is not None:
                    lo_page = max(0, it.start - spec.sliding_window + 1) // ps
                used = table[lo_page:need_pages]
                if used and not (0 <= min(used) and max(used) < n_pages):
                    raise ValueError(f"{where}: {name} holds a page index outside [0, {n_pages})")
            if self.pools.mamba_ssm is not None:
                slots = self.pools.num_state_slots
                if it.state_slot is None or not 0 <= it.state_slot < slots:
                    raise ValueError(f"{where}: state_slot must be in [0, {slots}), got {it.state_slot}")
                if it.state_slot in own_slots:
                    raise ValueError(f"{where}: state_slot {it.state_slot} is used by another item of the batch")
                own_slots.add(it.state_slot)
                for pos, slot in it.snapshots:
                    if not it.start < pos <= it.end:
                        raise ValueError(f"{where}: snapshot position {pos} is outside ({it.start}, {it.end}]")
                    if not 0 <= slot < slots:
                        raise ValueError(f"{where}: snapshot slot {slot} is outside [0, {slots})")
                    if slot in all_own:
                        raise ValueError(f"{where}: snapshot slot {slot} is the state_slot of an item of the batch")

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor | None]:
        """Run one pass; returns per item its float32 logits (see ``ForwardItem.logits``).

        Raises ValueError (naming the item and field) for an invalid item; nothing is
        written to the pools in that case.
        """
        if not items:
            return []
        self._check(items)
        spec, w, ps = self.spec, self.weights, self.pools.page_size
        offsets = [0]
        for it in items:
            offsets.append(offsets[-1] + len(it.token_ids))
        tokens = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(it.start, it.end) for it in items])
        cos, sin = self.rope(positions)
        tables = {
            "full": [torch.tensor(list(it.full_pages), dtype=torch.long) for it in items],
            "swa": [torch.tensor(list(it.swa_pages), dtype=torch.long) for it in items],
        }
        slots = {}
        for kind in ("full", "swa"):
            if spec.count(kind):
                slots[kind] = torch.cat([
                    tables[kind][n][torch.arange(it.start, it.end) // ps] * ps + torch.arange(it.start, it.end) % ps
                    for n, it in enumerate(items)
                ])

        h = w.embed.index_select(0, tokens)
        for i, kind in enumerate(spec.layer_kinds):
            lw = w.layers[i]
            x = rms_norm(h, lw.input_norm, spec.rms_eps)
            if kind == "mamba":
                h = h + self._mamba(x, i, items, offsets)
            else:
                h = h + self._attention(x, i, kind, items, offsets, cos, sin, slots[kind], tables[kind])
            x = rms_norm(h, lw.post_norm, spec.rms_eps)
            gu = linear(x, lw.gate_up)
            gate, up = torch.split(gu, spec.intermediate_size, dim=-1)
            h = h + linear(silu(gate) * up, lw.down)

        rows: list[int] = []
        for n, it in enumerate(items):
            if it.logits == "all":
                rows.extend(range(offsets[n], offsets[n + 1]))
            elif it.logits == "last":
                rows.append(offsets[n + 1] - 1)
        out: list[torch.Tensor | None] = [None] * len(items)
        if rows:
            hs = rms_norm(h.index_select(0, torch.tensor(rows)), w.final_norm, spec.rms_eps)
            logits = linear(hs, w.lm_head).float()
            k = 0
            for n, it in enumerate(items):
                if it.logits == "all":
                    out[n] = logits[k : k + len(it.token_ids)]
                    k += len(it.token_ids)
                elif it.logits == "last":
                    out[n] = logits[k]
                    k += 1
        return out

    def _attention(
        self,
        x: torch.Tensor,
        layer: int,
        kind: str,
        items: Sequence[ForwardItem],
        offsets: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        tables: list[torch.Tensor],
    ) -> torch.Tensor:
        spec = self.spec
        aw = self.weights.layers[layer].attention
        assert aw is not None  # guaranteed by the spec: attention layers have attention weights
        d, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
        qkv = linear(x, aw.qkv, aw.qkv_bias)
        q = qkv[:, : nh * d].reshape(-1, nh, d)
        k = qkv[:, nh * d : (nh + nkv) * d].reshape(-1, nkv, d)
        v = qkv[:, (nh + nkv) * d :].reshape(-1, nkv, d)
        if aw.q_norm is not None and aw.k_norm is not None:
            q = rms_norm(q, aw.q_norm, spec.rms_eps)
            k = rms_norm(k, aw.k_norm, spec.rms_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        pool = self.pools.full_kv if kind == "full" else self.pools.swa_kv
        assert pool is not None  # checked by KVPools.validate
        li = self.kind_index[layer]
        pool[li, 0].index_copy_(0, slots, k.to(pool.dtype))
        pool[li, 1].index_copy_(0, slots, v.to(pool.dtype))
        window = spec.sliding_window if kind == "swa" else None
        out = torch.empty((x.shape[0], nh, d), dtype=torch.float32)
        for n, it in enumerate(items):
            lo = 0 if window is None else max(0, it.start - window + 1)
            block_lo = lo // attn_mod.KEY_BLOCK * attn_mod.KEY_BLOCK
            kk, vv = attn_mod.gather_kv(pool, li, tables[n], self.pools.page_size, lo, it.end, block_lo)
            out[offsets[n] : offsets[n + 1]] = attn_mod.attend(
                q[offsets[n] : offsets[n + 1]], kk, vv, it.start, block_lo, self.scale, window
            )
        return linear(out.reshape(x.shape[0], nh * d).to(x.dtype), aw.o, aw.o_bias)

    def _mamba(self, x: torch.Tensor, layer: int, items: Sequence[ForwardItem], offsets: list[int]) -> torch.Tensor:
        spec = self.spec
        mw = self.weights.layers[layer].mamba
        conv_pool, ssm_pool = self.pools.mamba_conv, self.pools.mamba_ssm
        assert mw is not None and conv_pool is not None and ssm_pool is not None  # validated
        li = self.kind_index[layer]
        di, n_state, r = spec.mamba_d_inner, spec.mamba_state_size, spec.mamba_dt_rank
        xz = linear(x.float(), mw.in_proj)
        xin, z = xz[:, :di], xz[:, di:]
        conv_out = torch.empty_like(xin)
        km1 = spec.mamba_d_conv - 1
        for n, it in enumerate(items):
            slot = it.state_slot
            prev = conv_pool[li, slot] if it.start > 0 else torch.zeros((km1, di))
            out, window = causal_conv(xin[offsets[n] : offsets[n + 1]], prev, mw.conv_w, mw.conv_b)
            conv_out[offsets[n] : offsets[n + 1]] = out
            for pos, snap in it.snapshots:
                rel = pos - it.start
                conv_pool[li, snap] = window[rel : rel + km1]
            conv_pool[li, slot] = window[len(it.token_ids) : len(it.token_ids) + km1]
        xc = silu(conv_out)
        dbc = linear(xc, mw.x_proj)
        dt = 0.5 * sigmoid(linear(dbc[:, :r].contiguous(), mw.dt_proj) + mw.dt_bias)
        b, c = dbc[:, r : r + n_state], dbc[:, r + n_state :]
        y = torch.empty_like(xc)
        for n, it in enumerate(items):
            sl = slice(offsets[n], offsets[n + 1])
            state = ssm_pool[li, it.state_slot].clone() if it.start > 0 else torch.zeros((di, n_state))
            wanted: dict[int, list[int]] = {pos - it.start: [] for pos, _ in it.snapshots}
            for pos, snap in it.snapshots:
                wanted[pos - it.start].append(snap)

            def on_step(done: int, s: torch.Tensor, wanted: dict[int, list[int]] = wanted) -> None:
                for snap in wanted.get(done, ()):
                    ssm_pool[li, snap] = s

            y[sl], final = selective_scan(
                xc[sl], dt[sl], b[sl], c[sl], mw.a, mw.d, state, on_step if wanted else None
            )
            ssm_pool[li, it.state_slot] = final
        return linear(y * silu(z), mw.out_proj).to(x.dtype)
