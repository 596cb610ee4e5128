"""Sampling parameters and stop conditions: what a request asks for, without torch.

``SamplingParams`` validates itself (a ValueError naming the parameter). The tokenizer
process checks requests with it; the sampling itself (``hicache.model.sampling``) is the
scheduler's and needs torch, which this module does not import.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """``top_k`` 0 = off; ``top_p`` 1.0 = off; ``seed`` None = a fresh random seed per request
    (so not reproducible). ``stop_token_ids`` end generation and are included in the output;
    ``ignore_eos`` drops the model's own end-of-sequence ids from the stop set."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, tuple | list) or not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {stops!r}")
        if isinstance(stops, list):
            object.__setattr__(self, "stop_token_ids", tuple(stops))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a stop token id cannot exist in a vocabulary of ``vocab_size``."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be <= the vocabulary size {vocab_size}, got {self.top_k}")


def resolve_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one (draw once per request)."""
    return params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1



def finish_reason(
    output_ids: Sequence[int], params: SamplingParams, eos_token_ids: Sequence[int] = ()
) -> str | None:
    """``"stop"`` if the last generated token is a stop token, ``"length"`` once
    ``max_new_tokens`` are generated, else None."""
    if output_ids:
        last = output_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
            return "stop"
    if len(output_ids) >= params.max_new_tokens:
        return "length"
    return None
