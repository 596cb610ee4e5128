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

The order of the steps (SGLang's): penalties on the logits (``PenaltyState``: presence and
frequency count the generated tokens, repetition the prompt's and the generated ones), then
temperature, ``top_k``, ``top_p`` and ``min_p``. Greedy decoding takes the largest
penalized logit.

Logprobs (``token_logprobs``) are those of the model's raw distribution, before penalties,
temperature and truncation (vLLM's default ``raw_logprobs``), so they do not depend on how
a token was chosen; a probability of zero is reported as ``LOGPROB_FLOOR`` (JSON has no
``-inf``; vLLM uses the same value).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from hicache.model.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0
"""The logprob reported for a token the model gives probability zero."""


class PenaltyState:
    """What one request's penalties need, kept up to date token by token: how often each id
    was generated and which ids the prompt or the output hold. ``add`` costs O(1) per
    token, ``apply`` O(vocab) per step, whatever the lengths. Owned by the request; built
    on its first sampled token (the vocabulary is the logits' length)."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.float64)
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        if len(prompt_ids):
            self.seen[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True

    def add(self, token: int) -> None:
        if 0 <= token < self.counts.numel():
            self.counts[token] += 1.0
            self.seen[token] = True

    def apply(self, x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """``x`` (float64 ``[vocab]``, no NaN) with the penalties of ``params`` applied."""
        if params.repetition_penalty != 1.0:
            x = torch.where(self.seen, torch.where(x > 0, x / params.repetition_penalty,
                                                   x * params.repetition_penalty), x)
        if params.frequency_penalty != 0.0:
            x = x - params.frequency_penalty * self.counts
        if params.presence_penalty != 0.0:
            x = x - params.presence_penalty * (self.counts > 0).to(torch.float64)
        return x


def _step_generator(seed: int, step: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def greedy_token(logits: torch.Tensor) -> int:
    """The id of the largest logit, NaN counting as ``-inf``; the lowest id wins a tie (so
    0 when every logit is NaN or ``-inf``)."""
    return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"),
                                             neginf=float("-inf"))))


def _scores(logits: torch.Tensor, params: SamplingParams, penalties: PenaltyState | None) -> torch.Tensor:
    """The logits in float64, NaN as ``-inf``, penalties applied."""
    x = logits.detach().to(torch.float64)
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    if penalties is not None and params.penalized:
        x = penalties.apply(x, params)
    return x


def _probabilities(x: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The float64 distribution to draw from (``x`` from ``_scores``), or None when it cannot
    be formed (a ``+inf`` or no number at all): the caller then decodes greedily."""
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
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)  # the most likely stays
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        return None
    return probs


def sample_next(logits: torch.Tensor, params: SamplingParams, seed: int, step: int,
                penalties: PenaltyState | None = None) -> int:
    """The next token for one request from its float logits ``[vocab]``.

    ``step`` is the index of the token being generated (0 for the first), ``seed`` from
    ``resolve_seed``. Greedy ignores both. ``penalties`` is the request's state (needed when
    ``params.penalized``; the caller adds the chosen token to it). Never raises for accepted
    ``params`` (module docstring: non-finite logits fall back to greedy).
    """
    if not params.penalized and params.greedy:
        return greedy_token(logits)
    x = _scores(logits, params, penalties)
    if params.greedy:
        return greedy_token(x)
    probs = _probabilities(x, params)
    if probs is None:
        return greedy_token(x)
    return int(torch.multinomial(probs, 1, generator=_step_generator(seed, step)))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[int], list[float]]:
    """``token``'s logprob under the raw distribution of ``logits``, and the ``top`` most
    likely ids with theirs (most likely first; the lowest id first among equals). Zero
    probability is ``LOGPROB_FLOOR``; logits with no finite maximum give the floor for all."""
    x = torch.nan_to_num(logits.detach().to(torch.float64), nan=float("-inf"), posinf=float("inf"),
                         neginf=float("-inf"))
    if not bool(torch.isfinite(x.max())):
        lp = torch.full_like(x, LOGPROB_FLOOR)
    else:
        lp = torch.log_softmax(x, dim=-1).clamp(min=LOGPROB_FLOOR)
    ids: list[int] = []
    values: list[float] = []
    k = min(top, lp.numel())
    if k:
        order = torch.sort(lp, descending=True, stable=True).indices[:k]
        ids = [int(i) for i in order]
        values = [float(lp[i]) for i in ids]
    return float(lp[token]), ids, values
