"""Sampling parameters and stop conditions: what a request asks for, without torch.

``SamplingParams`` validates itself (a ``SamplingParamError``, a ValueError whose ``field``
names the parameter): it is the one definition of the sampling fields and of their checks.
The tokenizer process checks requests with it (``to_wire`` makes the message's
``protos.SamplingParams``, the same fields) and the scheduler checks them again
(``from_wire``); the sampling itself (``hicache.model.sampling``) is the scheduler's and needs
torch, which this module does not import.

Accepted values (everything else is refused, so that ``sample_next`` is never asked for a
value it cannot honour; bools never count as numbers, NaN and infinities are refused):

- ``temperature``: ``0`` (greedy) or a float in ``[MIN_TEMPERATURE, MAX_TEMPERATURE]``.
  The model emits float32 logits, ``|x| <= 3.4e38``. Dividing them by ``t`` in float32 is
  what cannot be honoured: ``t = 1e-300`` (or any value below the smallest float32, 1.4e-45)
  rounds to ``0`` and ``x / 0`` is inf/NaN; a subnormal or small ``t`` overflows ``x / t``
  to inf for large logits (``t = 0.1`` already for ``|x| > 3.4e37``), and softmax of inf is
  NaN. ``sample_next`` therefore works in float64 and divides ``x - max(x)`` (in
  ``[-6.8e38, 0]`` for every finite float32 logit) by ``t``: with ``t >= MIN_TEMPERATURE``
  every score is a finite float64 (at most ``6.8e38 / 0.01 = 6.8e40`` in magnitude, far from
  the float64 limit 1.8e308) and the best one is exactly ``0``, so softmax neither
  overflows nor produces NaN, whatever the logits. ``MIN_TEMPERATURE`` is 0.01, the floor
  vLLM silently clamps to (refused here instead, so that a client learns it): at 0.01 a
  logit gap of 1 is already a probability ratio of ``e**100``, so anything lower is greedy
  in all but name, and greedy is asked for with ``0``. ``MAX_TEMPERATURE`` is 100: there
  the distribution is already close to uniform noise for any real model, and a larger
  value is a mistake rather than a wish;
- ``top_p``: a float in ``(0, 1]`` (``1`` = off). Any positive value is honoured: the
  most likely token is always kept;
- ``top_k``: an integer in ``[0, MAX_TOP_K]`` (``0`` = off); ``check_vocab`` also refuses
  one above the vocabulary, and ``sample_next`` clamps to the vocabulary in any case;
- ``seed``: ``None`` or an integer in ``[0, 2**63)`` (a signed 64-bit integer on the wire);
- ``max_new_tokens``: an integer in ``[1, MAX_NEW_TOKENS]`` (the scheduler's configured
  limit is lower and checked where it is known);
- ``stop_token_ids``: integers in ``[0, 2**31)`` (``check_vocab`` bounds them by the
  vocabulary);
- ``presence_penalty`` / ``frequency_penalty``: numbers in ``[-2, 2]`` (the OpenAI range;
  ``0`` = off). A generated token's logit loses ``presence_penalty`` once it has appeared
  in the output and ``frequency_penalty`` per appearance (at most ``2 * MAX_NEW_TOKENS``,
  a finite float64);
- ``repetition_penalty``: a number in ``[MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]``
  (``1`` = off): the logit of every token seen in the prompt or the output is divided by it
  when positive, multiplied when negative (as in vLLM and SGLang). The bounds keep a float32
  logit finite in float64 (``3.4e38 / 0.01``) and refuse values that only a mistake asks for;
- ``min_p``: a number in ``[0, 1]`` (``0`` = off): after ``top_k`` / ``top_p``, tokens less
  likely than ``min_p`` times the most likely one are dropped (the most likely is kept);
- ``logprobs``: ``None`` (off) or an integer in ``[0, MAX_LOGPROBS]``: each generated token
  comes with its own log-probability and the ``logprobs`` most likely alternatives.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import protos

MIN_TEMPERATURE = 0.01
"""The smallest positive temperature (see the module docstring for why)."""
MAX_TEMPERATURE = 100.0
"""The largest temperature."""
MAX_TOP_K = 2**31 - 1
"""The largest ``top_k`` (before the vocabulary check)."""
MAX_NEW_TOKENS = 2**31 - 1
"""The largest ``max_new_tokens`` (before the scheduler's own, lower limit)."""
MAX_SEED = 2**63 - 1
"""The largest seed."""
MAX_TOKEN_ID = 2**31 - 1
"""The largest token id (before the vocabulary check)."""
MAX_PENALTY = 2.0
"""The bound of ``presence_penalty`` and ``frequency_penalty`` (either sign)."""
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
"""The range of ``repetition_penalty``."""
MAX_LOGPROBS = 20
"""The most alternatives a token's logprobs list (vLLM's default ``max_logprobs``)."""


class SamplingParamError(ValueError):
    """A sampling parameter out of its accepted range. ``field`` is the parameter's name
    (``temperature``, ``top_p`` ...); the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.detail = message
        """The message without the field name (for callers that spell the field differently)."""


def shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters (a request may
    carry a 4,000-digit integer or a list of thousands)."""
    try:
        text = repr(value)
    except ValueError:  # an integer beyond the interpreter's digit limit for str()
        return "an integer too large to print"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite_float(v: object) -> float | None:
    """``v`` as a finite float, or None when it is not a number (bools are not), is NaN or
    infinite, or is an integer too large for a float."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


@dataclass(frozen=True)
class SamplingParams:
    """``top_k`` 0 = off; ``top_p`` 1.0 = off; ``seed`` None = a fresh random seed per request
    (so not reproducible). ``stop_token_ids`` end generation and are included in the output;
    ``ignore_eos`` drops the model's own end-of-sequence ids from the stop set. Penalties,
    ``min_p`` and ``logprobs``: module docstring.

    Construction refuses every value outside the ranges of the module docstring with a
    ``SamplingParamError`` naming the parameter; ``temperature`` and ``top_p`` are stored as
    floats (an integer ``1`` becomes ``1.0``, ``-0.0`` becomes ``0.0``)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise SamplingParamError(
                "max_new_tokens", f"must be an integer in [1, {MAX_NEW_TOKENS}], got {shown(self.max_new_tokens)}")
        t = _finite_float(self.temperature)
        if t is None or not (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise SamplingParamError(
                "temperature", f"must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                f"got {shown(self.temperature)}")
        object.__setattr__(self, "temperature", t + 0.0)  # -0.0 -> 0.0
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise SamplingParamError(
                "top_k", f"must be an integer in [0, {MAX_TOP_K}] (0 disables it), got {shown(self.top_k)}")
        p = _finite_float(self.top_p)
        if p is None or not 0.0 < p <= 1.0:
            raise SamplingParamError("top_p", f"must be a number in (0, 1], got {shown(self.top_p)}")
        object.__setattr__(self, "top_p", p)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise SamplingParamError("seed", f"must be an integer in [0, 2**63), got {shown(self.seed)}")
        stops = self.stop_token_ids
        if not isinstance(stops, tuple | list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in stops):
            raise SamplingParamError(
                "stop_token_ids", f"must be a list of integers in [0, {MAX_TOKEN_ID}], got {shown(stops)}")
        if isinstance(stops, list):
            object.__setattr__(self, "stop_token_ids", tuple(stops))
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamError("ignore_eos", f"must be true or false, got {shown(self.ignore_eos)}")
        for name in ("presence_penalty", "frequency_penalty"):
            self._number(name, -MAX_PENALTY, MAX_PENALTY)
        self._number("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        self._number("min_p", 0.0, 1.0)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamError(
                "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (or absent), got {shown(self.logprobs)}")

    def _number(self, name: str, low: float, high: float) -> None:
        """Check the float field ``name`` is in ``[low, high]`` and store it as a float."""
        value = getattr(self, name)
        f = _finite_float(value)
        if f is None or not low <= f <= high:
            raise SamplingParamError(name, f"must be a number in [{low:g}, {high:g}], got {shown(value)}")
        object.__setattr__(self, name, f + 0.0)

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``SamplingParamError`` if a stop token id cannot exist in a vocabulary of
        ``vocab_size``, or ``top_k`` exceeds it."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise SamplingParamError("stop_token_ids",
                                     f"holds {shown(bad[0])}, outside the vocabulary [0, {vocab_size})")
        if self.top_k > vocab_size:
            raise SamplingParamError("top_k", f"must be <= the vocabulary size {vocab_size}, got {shown(self.top_k)}")


def to_wire(params: SamplingParams) -> protos.SamplingParams:
    """The wire form of checked parameters (``protos.SamplingParams``: the same fields under the
    same names; ``protos`` cannot import this module, a test keeps the two field lists equal)."""
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    values["stop_token_ids"] = list(params.stop_token_ids)
    return protos.SamplingParams(**values)


def from_wire(wire: protos.SamplingParams) -> SamplingParams:
    """Check parameters that came over the wire (``SamplingParamError`` naming the field)."""
    values = {f.name: getattr(wire, f.name) for f in dataclasses.fields(wire)}
    values["stop_token_ids"] = tuple(wire.stop_token_ids)
    return SamplingParams(**values)


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
