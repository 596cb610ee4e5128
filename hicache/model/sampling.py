"""Next-token sampling.

Sampling is per request and deterministic given the request's ``seed``: the random draw for
the ``n``-th generated token comes from a generator seeded with ``(seed, n)``, so it does
not depend on the batch, on the other requests, or on whether the prompt came from a cache.
``temperature == 0`` is greedy (the lowest token id wins a tie). The parameters themselves
live in ``hicache.model.sampling_params`` (no torch there).
"""

from __future__ import annotations

import hashlib

import torch

from hicache.model.sampling_params import SamplingParams


def _step_generator(seed: int, step: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample_next(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """The next token for one request from its float logits ``[vocab]``.

    ``step`` is the index of the token being generated (0 for the first), ``seed`` from
    ``resolve_seed``. Greedy ignores both.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=0)
        drop = (cum - sorted_p) >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=_step_generator(seed, step)))
