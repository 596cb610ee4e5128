"""Rotary position embeddings (Llama-style half split), with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch

from hicache.model.spec import DecoderSpec


class RotaryEmbedding:
    """Per-position ``cos``/``sin`` tables ``[T, head_dim]`` (float32) for absolute positions."""

    def __init__(self, spec: DecoderSpec) -> None:
        dim = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = spec.rope_scaling
        if scaling is not None and scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling is not None and scaling.rope_type == "llama3":
            inv_freq = _llama3(inv_freq, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                               scaling.original_max_position_embeddings)
        self.inv_freq = inv_freq

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _llama3(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
