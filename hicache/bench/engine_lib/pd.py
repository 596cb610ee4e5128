"""``bench engine --parts pd``: a prefill engine and a decode engine through hicache against one
colocated engine, on the same requests.

``requests`` prompts of ``prompt_tokens`` arrive ``GAP_STEPS`` engine steps apart and decode
``decode_tokens`` tokens each, all concurrently (``VllmProcess.steps``, which stamps every
token). The colocated reference is vLLM alone, prefilling and decoding them in one engine.
The pair is the recipe of docs/engine-mode.md: a ``kv_producer`` engine prefills each prompt
with one output token (``hicache_copy: async``; its saves go to the daemon's L2), then a
``kv_consumer`` engine gets the same requests at the same steps and loads every full block
of each prompt from L2, computing only the last partial block. The two engines run one
after the other on the same cores (a real pair runs on two hosts), so the pair's TTFT is
the prefill engine's time for the prompt (a ``max_tokens=1`` ``generate``, one at a time)
plus the decode engine's time from the request's arrival to its first token.

Figures: TTFT p50 / p99 and the decoding inter-token latency p50 / p99 of the pair against
the colocated engine's. The decode engine's greedy tokens are compared with vLLM alone's.
"""

from __future__ import annotations

from typing import Any

from hicache.bench.engine_lib.harness import Bench, percentile, round_up
from hicache.bench.engine_lib.vllm_driver import VllmProcess, connector_config
from hicache.bench.report import Figure

GAP_STEPS = 4
"""Engine steps between two requests' arrivals."""


def _ttft_and_gaps(run: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(each request's time from its arrival to its first token, every inter-token gap), seconds."""
    ttft = [times[0] - added for times, added in zip(run["token_at"], run["added_at"], strict=True)]
    gaps = [b - a for times in run["token_at"] for a, b in zip(times, times[1:], strict=False)]
    return ttft, gaps


def run_pd(b: Bench, *, prompt_tokens: int, requests: int, decode_tokens: int) -> tuple[list[Figure], dict[str, Any]]:
    """The part (module docstring): its figures and the raw runs."""
    prompts = b.prompts(requests, prompt_tokens, seed=80)
    arrivals = [GAP_STEPS * i for i in range(requests)]
    max_len = round_up(prompt_tokens + decode_tokens + b.block_size, b.block_size)
    common: dict[str, Any] = dict(prefix_caching=True, max_model_len=max_len,
                                  num_blocks=requests * max_len // b.block_size + 16, max_num_seqs=requests + 4)
    colocated = b.engine("pd-colocated", **common)
    try:
        ref = colocated.steps(prompts, arrivals, decode_tokens)
    finally:
        colocated.stop()
    daemon = b.daemon("pd-hicache", round_up(2 * requests * max_len + 4096, b.block_size))
    prefill_s: list[float] = []
    try:
        eng: VllmProcess | None = None
        try:
            eng = b.engine("pd-prefill", kv_transfer=connector_config(str(daemon.config), copy_mode="async",
                                                                      role="kv_producer"), **common)
            for p in prompts:
                prefill_s.append(float(eng.generate([p], 1, timeout_s=1800)["elapsed_s"]))
        finally:
            if eng is not None:
                eng.stop()
        daemon.wait_backups()
        eng = None
        try:
            eng = b.engine("pd-decode", kv_transfer=connector_config(str(daemon.config), copy_mode="async",
                                                                     role="kv_consumer"), **common)
            got = eng.steps(prompts, arrivals, decode_tokens)
        finally:
            if eng is not None:
                eng.stop()
    finally:
        daemon.stop()
    ref_ttft, ref_gaps = _ttft_and_gaps(ref)
    decode_ttft, gaps = _ttft_and_gaps(got)
    ttft = [p + d for p, d in zip(prefill_s, decode_ttft, strict=True)]
    b.progress(f"pd: TTFT p50 {percentile(ttft, 0.5) * 1000:.0f} ms (colocated {percentile(ref_ttft, 0.5) * 1000:.0f}"
               f" ms), ITL p50 {percentile(gaps, 0.5) * 1000:.1f} ms (colocated {percentile(ref_gaps, 0.5) * 1000:.1f} ms)")
    n = prompt_tokens
    figures = [Figure(f"pd: TTFT {label} ({requests} x {n}-token prompts)", "ms", percentile(ttft, q) * 1000,
                      "one colocated engine (vLLM alone)", percentile(ref_ttft, q) * 1000, higher_is_better=False)
               for q, label in ((0.5, "p50"), (0.99, "p99"))]
    figures += [Figure(f"pd: decode ITL {label}", "ms", percentile(gaps, q) * 1000,
                       "one colocated engine (vLLM alone)", percentile(ref_gaps, q) * 1000, higher_is_better=False)
                for q, label in ((0.5, "p50"), (0.99, "p99"))]
    extra = {"prompt_tokens": n, "requests": requests, "decode_tokens": decode_tokens, "gap_steps": GAP_STEPS,
             "same_output_tokens": got["outputs"] == ref["outputs"], "decode_cached": got["cached"],
             "prefill_s": prefill_s, "decode_ttft_s": decode_ttft, "ttft_s": ttft, "itl_s": gaps,
             "colocated": {"ttft_s": ref_ttft, "itl_s": ref_gaps, "cached": ref["cached"]}}
    return figures, extra
