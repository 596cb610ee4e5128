"""What the simulated engines of ``hicache bench capacity`` send: loads, prompts, profiles.

A *load* is one engine's traffic: ``steps_per_s`` scheduler steps a second, ``running``
requests in flight (each decodes one token a step once its prompt is computed, prompts are
computed in chunks of at most ``max_batched_tokens`` tokens a step, as vLLM's chunked
prefill does), ``new_per_s`` arrivals a second. A request decodes
``running * steps_per_s / new_per_s`` tokens, so the engine holds ``running`` requests in a
steady state (Little's law).

Prompts come from a Mooncake-format trace (``hicache.replay_sim.trace``): request ``r``'s
chained block ids become tokens (block ``b`` is tokens ``b*B .. b*B + B - 1``), cut at
``max_prompt_tokens``, so requests share exactly the prefixes the trace says they share.
Engine ``e`` of ``E`` takes records ``e, e + E, e + 2E, ...`` in order, wrapping around.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace
from pathlib import Path

from hicache.replay_sim.trace import Trace, infer_block_size, load_trace

TOKEN_LIMIT = 2**32
"""Token ids travel as 4-byte unsigned integers (``protos.pack_tokens``)."""

DECODED_TOKENS_FROM = 3 * 2**30
"""Decoded token ids start here, above every prompt token a trace of up to 2**21 blocks of
512 makes, so a request's decoded pages are its own."""


@dataclass(frozen=True)
class Load:
    """One engine's traffic (see the module docstring)."""

    steps_per_s: float
    running: int
    new_per_s: float
    max_batched_tokens: int = 8192

    @property
    def decode_tokens(self) -> int:
        """Tokens each request decodes, so that ``running`` stay in flight."""
        return max(1, round(self.running * self.steps_per_s / self.new_per_s))

    def scaled(self, factor: float) -> Load:
        """This load ``factor`` times as fast: steps and arrivals; the same requests in flight."""
        return replace(self, steps_per_s=self.steps_per_s * factor, new_per_s=self.new_per_s * factor)


@dataclass(frozen=True)
class Profile:
    """A named preset: engines and their load, page size, L2 pages, L3 and where the numbers
    come from."""

    name: str
    engines: int
    load: Load
    page_size: int
    l2_pages: int
    l3: str
    source: str


PROFILES = {
    "node": Profile(
        "node", engines=8, load=Load(steps_per_s=30, running=256, new_per_s=8), page_size=16, l2_pages=2_000_000,
        l3="file",
        source=("one GPU node: eight engines (one per GPU), each stepping every 20-40 ms (30 steps/s) with a few "
                "hundred running requests (256) and 8 new requests a second; page 16 (vLLM's default block on "
                "GPUs); an L2 of millions of pages (2M pages of 16 tokens: 32M tokens, 1-2 TB of host memory at an "
                "8B model's 64 KiB/token... here with pages of a few hundred bytes, so it fits this machine); L3 "
                "on (a file store)"),
    ),
    "small": Profile(
        "small", engines=2, load=Load(steps_per_s=10, running=16, new_per_s=2), page_size=16, l2_pages=65_536,
        l3="file", source="a quick check of the benchmark itself: two light engines",
    ),
}


@dataclass
class Prompts:
    """The prompts of one engine, handed out in order (wrapping around)."""

    prompts: list[array[int]]
    next_index: int = 0

    def take(self) -> array[int]:
        p = self.prompts[self.next_index % len(self.prompts)]
        self.next_index += 1
        return p


def trace_prompts(trace: Trace, engine: int, engines: int, max_prompt_tokens: int) -> Prompts:
    """Engine ``engine``'s prompts from ``trace`` (see the module docstring)."""
    block = infer_block_size(trace) or 512
    out: list[array[int]] = []
    for r in range(engine, trace.requests, engines):
        ids = trace.blocks[r]
        given = trace.input_lengths[r] if r < len(trace.input_lengths) else None
        n = min(given or len(ids) * block, max_prompt_tokens, len(ids) * block)
        tokens = array("I")
        for b in ids:
            if len(tokens) >= n:
                break
            first = b * block
            if first + block >= DECODED_TOKENS_FROM:
                raise ValueError(f"trace {trace.name}: block id {b} makes token ids past {DECODED_TOKENS_FROM}")
            tokens.extend(range(first, first + block))
        del tokens[n:]
        if len(tokens) > 1:
            out.append(tokens)
    if not out:
        raise ValueError(f"trace {trace.name} has no prompt for engine {engine} of {engines}")
    return Prompts(out)


def load_prompts(path: str | Path, engine: int, engines: int, max_prompt_tokens: int) -> Prompts:
    return trace_prompts(load_trace(path), engine, engines, max_prompt_tokens)
