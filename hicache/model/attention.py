"""Causal attention of one sequence's new tokens over its paged KV, batch-invariant.

The keys are processed in blocks of ``KEY_BLOCK`` positions aligned to absolute positions
(block ``b`` holds positions ``[b*KEY_BLOCK, (b+1)*KEY_BLOCK)``), the queries in padded
blocks of ``QUERY_BLOCK`` rows, with an online softmax whose running max, sum and output
are updated block by block in increasing key order. A key block that is entirely masked
for a query row leaves that row bitwise unchanged, so a token's output depends only on its
own position and keys — not on how many other queries share the pass, nor where its row
sits among them. (See ``hicache.model.ops`` for why the products are invariant.)
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 32
KEY_BLOCK = 256


def gather_kv(
    pool: torch.Tensor, layer: int, page_table: torch.Tensor, page_size: int, lo: int, hi: int, block_lo: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for positions ``[block_lo, ceil(hi/KEY_BLOCK)*KEY_BLOCK)`` as float32 ``[L, heads, dim]``.

    Only positions ``[lo, hi)`` are read from ``pool`` (through ``page_table``); the rest are
    zeros, so pages outside the needed range (e.g. SWA pages already freed) are never read.
    """
    padded_hi = -(-hi // KEY_BLOCK) * KEY_BLOCK
    length = padded_hi - block_lo
    heads, dim = pool.shape[-2], pool.shape[-1]
    k = torch.zeros((length, heads, dim), dtype=torch.float32)
    v = torch.zeros((length, heads, dim), dtype=torch.float32)
    pos = torch.arange(lo, hi)
    slots = page_table[pos // page_size] * page_size + pos % page_size
    k[lo - block_lo : hi - block_lo] = pool[layer, 0].index_select(0, slots).float()
    v[lo - block_lo : hi - block_lo] = pool[layer, 1].index_select(0, slots).float()
    return k, v


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    k_start: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention output ``[T, heads, dim]`` (float32) for queries ``q [T, heads, dim]`` at
    absolute positions ``q_start..q_start+T-1`` over keys ``k``/``v`` ``[L, kv_heads, dim]``
    at positions ``k_start..`` (``k_start`` a multiple of ``KEY_BLOCK``, ``L`` too).

    Query ``i`` sees key ``j`` iff ``j <= i`` and (``window`` None or ``j > i - window``).
    """
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    n_qb = -(-t // QUERY_BLOCK)
    rows = QUERY_BLOCK * group
    qf = torch.zeros((n_qb * QUERY_BLOCK, heads, dim), dtype=torch.float32)
    qf[:t] = q.float() * scale
    # [n_qb, kv_heads, QUERY_BLOCK*group, dim]: row r = (query r // group, head r % group of the group)
    qb = qf.view(n_qb, QUERY_BLOCK, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(n_qb, kv_heads, rows, dim)
    qpos = torch.arange(n_qb * QUERY_BLOCK) + q_start
    qpos[t:] = q_start + t - 1  # padding rows attend like the last real row, and are dropped
    row_pos = qpos.view(n_qb, QUERY_BLOCK).repeat_interleave(group, dim=1).view(n_qb, 1, rows, 1)
    block_min = qpos.view(n_qb, QUERY_BLOCK)[:, 0]
    block_max = qpos.view(n_qb, QUERY_BLOCK)[:, -1]

    m = torch.full((n_qb, kv_heads, rows, 1), float("-inf"))
    acc = torch.zeros((n_qb, kv_heads, rows, dim))
    denom = torch.zeros((n_qb, kv_heads, rows, 1))
    kt = k.permute(1, 2, 0)  # [kv_heads, dim, L]
    vt = v.permute(1, 0, 2)  # [kv_heads, L, dim]
    first_kb = k_start // KEY_BLOCK
    last_kb = (q_start + t - 1) // KEY_BLOCK
    lo_needed = block_min - (window - 1) if window is not None else None
    for kb in range(first_kb, last_kb + 1):
        key_lo = kb * KEY_BLOCK
        key_hi = key_lo + KEY_BLOCK
        need = block_max >= key_lo
        if lo_needed is not None:
            need &= lo_needed < key_hi
        idx = torch.nonzero(need).flatten()
        if idx.numel() == 0:
            continue
        a, b = int(idx[0]), int(idx[-1]) + 1  # needed query blocks form one contiguous run
        off = key_lo - k_start
        kblk = kt[:, :, off : off + KEY_BLOCK].contiguous()
        vblk = vt[:, off : off + KEY_BLOCK].contiguous()
        s = torch.matmul(qb[a:b], kblk)  # [n, kv_heads, rows, KEY_BLOCK]
        kpos = torch.arange(key_lo, key_hi).view(1, 1, 1, KEY_BLOCK)
        rp = row_pos[a:b]
        masked = kpos > rp
        if window is not None:
            masked |= kpos <= rp - window
        s.masked_fill_(masked, float("-inf"))
        m_old = m[a:b]
        m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha = torch.exp(m_old - m_safe)
        p = torch.exp(s - m_safe)
        denom[a:b] = denom[a:b] * alpha + p.sum(-1, keepdim=True)
        acc[a:b] = acc[a:b] * alpha + torch.matmul(p, vblk)
        m[a:b] = m_new
    out = acc / denom
    out = out.view(n_qb, kv_heads, QUERY_BLOCK, group, dim).permute(0, 2, 1, 3, 4).reshape(-1, heads, dim)
    return out[:t]
