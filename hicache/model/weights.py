"""The weight tensors of a decoder, and the seeded initialisation of the reference model.

``DecoderWeights`` is owned by the runner (read-only after loading). Projections are
stored fused where the math allows (``qkv``, ``gate_up``), in the model dtype, except the
Mamba parameters, which are float32 (their state is float32, see ``geometry``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hicache.model.pools import torch_dtype
from hicache.model.spec import DecoderSpec


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # [(heads + 2*kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None


@dataclass
class MambaWeights:
    """A selective state-space mixer (Mamba-1 style, reference model only).

    ``x, z = in_proj(h)``; ``x`` runs through a depthwise causal conv (kernel ``d_conv``) and
    SiLU; ``dt, B, C = x_proj(x)``; ``dt = 0.5 * sigmoid(dt_proj(dt) + dt_bias)``; per channel
    ``s = exp(dt * a) * s + dt * x * B``, ``y = s . C + d * x``; output
    ``out_proj(y * silu(z))``.
    """

    in_proj: torch.Tensor  # [2 * d_inner, hidden]
    conv_w: torch.Tensor  # [d_conv, d_inner]
    conv_b: torch.Tensor  # [d_inner]
    x_proj: torch.Tensor  # [dt_rank + 2 * state, d_inner]
    dt_proj: torch.Tensor  # [d_inner, dt_rank]
    dt_bias: torch.Tensor  # [d_inner]
    a: torch.Tensor  # [d_inner, state], negative
    d: torch.Tensor  # [d_inner]
    out_proj: torch.Tensor  # [hidden, d_inner]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate rows first, then up
    down: torch.Tensor  # [hidden, intermediate]
    attention: AttentionWeights | None = None
    mamba: MambaWeights | None = None


@dataclass
class DecoderWeights:
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; may be the same tensor as ``embed``
    layers: list[LayerWeights] = field(default_factory=list)


def init_reference_weights(spec: DecoderSpec, seed: int) -> DecoderWeights:
    """Weights drawn in a fixed order from ``torch.Generator().manual_seed(seed)`` in float32
    on the CPU, then cast: every machine builds bitwise the same model."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch_dtype(spec.dtype)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    h, d = spec.hidden_size, spec.head_dim
    depth_scale = 1.0 / math.sqrt(2 * spec.num_layers)
    embed = normal(spec.vocab_size, h, std=1.0)
    layers: list[LayerWeights] = []
    for kind in spec.layer_kinds:
        attention = mamba = None
        if kind in ("full", "swa"):
            qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * d
            attention = AttentionWeights(
                qkv=normal(qkv_rows, h, std=1 / math.sqrt(h)).to(dtype),
                o=normal(h, spec.num_heads * d, std=depth_scale / math.sqrt(spec.num_heads * d)).to(dtype),
            )
        else:
            di, n, r, kconv = spec.mamba_d_inner, spec.mamba_state_size, spec.mamba_dt_rank, spec.mamba_d_conv
            mamba = MambaWeights(
                in_proj=normal(2 * di, h, std=1 / math.sqrt(h)),
                conv_w=normal(kconv, di, std=1 / math.sqrt(kconv)),
                conv_b=normal(di, std=0.02),
                x_proj=normal(r + 2 * n, di, std=1 / math.sqrt(di)),
                dt_proj=normal(di, r, std=1 / math.sqrt(r)),
                dt_bias=normal(di, std=0.5) - 1.0,
                a=-torch.arange(1, n + 1, dtype=torch.float32).repeat(di, 1),
                d=torch.ones(di),
                out_proj=normal(h, di, std=depth_scale / math.sqrt(di)),
            )
        layers.append(
            LayerWeights(
                input_norm=torch.ones(h, dtype=dtype),
                post_norm=torch.ones(h, dtype=dtype),
                gate_up=normal(2 * spec.intermediate_size, h, std=1 / math.sqrt(h)).to(dtype),
                down=normal(h, spec.intermediate_size, std=depth_scale / math.sqrt(spec.intermediate_size)).to(dtype),
                attention=attention,
                mamba=mamba,
            )
        )
    lm_head = normal(spec.vocab_size, h, std=1 / math.sqrt(h)).to(dtype)
    return DecoderWeights(embed=embed.to(dtype), final_norm=torch.ones(h, dtype=dtype), lm_head=lm_head, layers=layers)
