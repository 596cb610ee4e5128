"""Batch-invariant tensor primitives.

Every function here computes each row of its output with exactly the same sequence of
floating-point operations whatever the number of rows and the row's position, so that a
token's hidden state, KV and logits are bitwise the same whether it is computed alone, in a
decode batch, or inside a long prefill next to other requests (on the same machine, build
and thread count).

How:
- matrix products run on fixed-size row blocks (``ROW_BLOCK`` rows, the last block padded
  with zeros), so the BLAS kernel, its blocking and its reduction order never depend on
  how many tokens share the pass;
- row reductions (sum / mean / max over the last dimension) are per-row in ATen;
- only element-wise functions whose vectorised and scalar paths agree bitwise are used
  (``exp``, ``sqrt``, ``cos``, ``sin`` and IEEE arithmetic); ``silu``, ``sigmoid`` and
  ``rsqrt`` are built from them, because ATen's own versions round differently in the
  vectorised body and the scalar tail of a loop.
"""

from __future__ import annotations

import torch

ROW_BLOCK = 64
"""Rows per matrix-product call. Larger is faster for prefill, smaller for decode."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [T, K]``, ``weight [N, K]``, in fixed row blocks."""
    rows, k = x.shape
    n = weight.shape[0]
    out = x.new_empty((rows, n))
    wt = weight.t()
    full = rows - rows % ROW_BLOCK
    for i in range(0, full, ROW_BLOCK):
        torch.mm(x[i : i + ROW_BLOCK], wt, out=out[i : i + ROW_BLOCK])
    if full < rows:
        pad = x.new_zeros((ROW_BLOCK, k))
        pad[: rows - full] = x[full:]
        out[full:] = torch.mm(pad, wt)[: rows - full]
    if bias is not None:
        out += bias
    return out


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32, returned in ``x``'s dtype."""
    xf = x.float()
    var = (xf * xf).mean(-1, keepdim=True)
    xf = xf / torch.sqrt(var + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, dim]`` rotated by per-position ``cos``/``sin`` ``[T, dim]`` (half-split layout)."""
    c = cos[:, None, :].to(x.dtype)
    s = sin[:, None, :].to(x.dtype)
    return x * c + rotate_half(x) * s
