"""The math of the reference model's selective state-space (Mamba) mixer, per sequence.

The conv and the scan run token by token in a fixed order with element-wise operations
and per-row reductions only, so the state after ``p`` tokens is bitwise the same whether
the ``p`` tokens were processed in one prefill, in several chunks, or decoded one by one.
All tensors here are float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SCAN_CHUNK = 64


def causal_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x [T, d_inner]`` continuing from ``conv_state [k-1, d_inner]``
    (the previous ``k-1`` inputs, oldest first).

    Returns ``(out [T, d_inner], window [T + k - 1, d_inner])``; the conv state after the
    first ``n`` tokens of ``x`` is ``window[n : n + k - 1]``.
    """
    kernel = weight.shape[0]
    window = torch.cat([conv_state, x], dim=0)
    t = x.shape[0]
    out = window[0:t] * weight[0]
    for j in range(1, kernel):
        out = out + window[j : j + t] * weight[j]
    return out + bias, window


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``s_t = exp(dt_t * a) * s_{t-1} + dt_t * x_t * b_t``, ``y_t = s_t . c_t + d * x_t``.

    ``x, dt [T, d_inner]``, ``b, c [T, N]``, ``a [d_inner, N]``, ``state [d_inner, N]`` (not
    modified). ``on_step(n, s)`` is called after each token with the number of tokens done
    and the state then (the caller copies it if it wants to keep it).
    Returns ``(y [T, d_inner], final state)``.
    """
    t_total = x.shape[0]
    ys = torch.empty_like(x)
    s = state
    for c0 in range(0, t_total, SCAN_CHUNK):
        c1 = min(t_total, c0 + SCAN_CHUNK)
        decay = torch.exp(dt[c0:c1, :, None] * a)
        u = (dt[c0:c1] * x[c0:c1])[:, :, None] * b[c0:c1, None, :]
        hs = torch.empty_like(decay)
        for i in range(c1 - c0):
            s = s * decay[i]
            s = s + u[i]
            hs[i] = s
            if on_step is not None:
                on_step(c0 + i + 1, s)
        ys[c0:c1] = (hs * c[c0:c1, None, :]).sum(-1) + d * x[c0:c1]
    return ys, s
