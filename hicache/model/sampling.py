"""Next-token sampling.

Sampling is per request and deterministic given the request's ``seed``: the random draw for
the ``n``-th generated token comes from a generator seeded with ``(seed, n)``, so it does
not depend on the batch, on the other requests, or on whether the prompt came from a cache.
``temperature == 0`` is greedy (the lowest token id wins a tie). The parameters themselves
live in ``hicache.model.sampling_params`` (no torch there), which also explains the accepted
ranges.

``sample_next`` never raises for parameters ``SamplingParams`` accepts, whatever the logits:

- the scores are computed in float64 as ``(x - max(x)) / temperature``: all ``<= 0``, the
  best exactly ``0``, so softmax cannot overflow or give NaN for finite logits;
- ``top_k`` above the vocabulary size is clamped to it; ``top_p`` always keeps the most
  likely token;
- non-finite logits: NaN is never chosen (it counts as ``-inf``); a ``+inf`` logit, or any
  other case where the probabilities come out non-finite or all zero, falls back to greedy
  over the logits (``+inf`` beats every finite logit; the lowest id wins a tie). When no
  logit is a number at all (all NaN or ``-inf``), the answer is token 0.
"""

from __future__ import annotations

import hashlib

import torch

from hicache.model.sampling_params import SamplingParams


def _step_generator(seed: int, step: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def greedy_token(logits: torch.Tensor) -> int:
    """The id of the largest logit, NaN counting as ``-inf``; the lowest id wins a tie (so
    0 when every logit is NaN or ``-inf``)."""
    return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"),
                                             neginf=float("-inf"))))


def _probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The float64 distribution to draw from, or None when it cannot be formed from these
    logits (a ``+inf`` or no number at all): the caller then decodes greedily."""
    x = logits.detach().to(torch.float64)
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    best = x.max()
    if not torch.isfinite(best):
        return None
    scores = (x - best) / params.temperature  # <= 0, the best exactly 0 (module docstring)
    k = min(params.top_k, scores.numel())
    if k:
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=0)
        drop = (cum - sorted_p) >= params.top_p  # keep the smallest prefix reaching top_p
        drop[0] = False  # and never less than the most likely token
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        return None
    return probs


def sample_next(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """The next token for one request from its float logits ``[vocab]``.

    ``step`` is the index of the token being generated (0 for the first), ``seed`` from
    ``resolve_seed``. Greedy ignores both. Never raises for accepted ``params`` (module
    docstring: non-finite logits fall back to greedy).
    """
    if params.greedy:
        return greedy_token(logits)
    probs = _probabilities(logits, params)
    if probs is None:
        return greedy_token(logits)
    return int(torch.multinomial(probs, 1, generator=_step_generator(seed, step)))
