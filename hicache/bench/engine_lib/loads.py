"""``bench engine --parts loads``: decodes running while long-prefix hits arrive and load.

``decoders`` short requests (under one block: never looked up nor saved) start together
and decode through the whole run; ``hits`` prompts of ``prompt_tokens`` arrive one at a time,
``GAP_STEPS`` engine steps apart, each asking for one token (``VllmProcess.steps``, which
stamps every token). Each engine first computed the hit prompts once: vLLM alone keeps them
in its own prefix cache (the reference: the same hits at no copy cost); each vLLM + hicache
engine, one per ``copy_modes`` entry (``hicache_copy``), saved them to one daemon's L2 and
then had its own prefix cache reset, so its hits are loaded from L2. Engines run one after
the other, bound to the same cores.

Figures, per copy mode: the decoders' inter-token latency p50 / p99 against vLLM alone's
(goal p99 <= 1.05x) and the hitting requests' TTFT (median, from their arrival to their
token) against vLLM alone's and against the ``sync`` mode's (goal <= 1.05x). Every run's
greedy tokens are compared with vLLM alone's.
"""

from __future__ import annotations

from typing import Any

from hicache.bench.engine_lib.harness import Bench, median, percentile, round_up
from hicache.bench.engine_lib.vllm_driver import VllmProcess, connector_config
from hicache.bench.report import Figure

GAP_STEPS = 8
"""Engine steps between two hits' arrivals: a hit's load and prefill are done before the next."""
FIRST_ARRIVAL = 4
"""The step the first hit arrives at (the decoders are running by then)."""
ITL_GOAL = 1.05
TTFT_GOAL = 1.05


def _latencies(run: dict[str, Any], decoders: int) -> tuple[list[float], list[float]]:
    """(inter-token gaps of the decoders, TTFT of each hit) of a ``steps`` answer, in seconds."""
    gaps = [b - a for times in run["token_at"][:decoders] for a, b in zip(times, times[1:], strict=False)]
    ttft = [times[0] - added for times, added in zip(run["token_at"][decoders:], run["added_at"][decoders:],
                                                      strict=True)]
    return gaps, ttft


def run_loads(b: Bench, *, prompt_tokens: int, hits: int, decoders: int,
              copy_modes: tuple[str, ...]) -> tuple[list[Figure], dict[str, Any]]:
    """The part (module docstring): its figures and the raw runs."""
    short = [[(7 * i + j) % (b.vocab - 1) + 1 for j in range(b.block_size // 2)] for i in range(decoders)]
    long = b.prompts(hits, prompt_tokens, seed=60)
    arrivals = [0] * decoders + [FIRST_ARRIVAL + GAP_STEPS * i for i in range(hits)]
    decode_tokens = FIRST_ARRIVAL + GAP_STEPS * hits + GAP_STEPS
    max_tokens = [decode_tokens] * decoders + [1] * hits
    max_len = round_up(prompt_tokens + b.block_size, b.block_size)
    blocks = hits * max_len // b.block_size + decoders * round_up(decode_tokens + b.block_size, b.block_size) \
        // b.block_size + 16
    common: dict[str, Any] = dict(prefix_caching=True, max_model_len=max(max_len, decode_tokens + b.block_size),
                                  num_blocks=blocks, max_num_seqs=decoders + hits + 4)
    prompts = short + long
    alone = b.engine("loads-vllm", **common)
    try:
        alone.generate(long, 1, timeout_s=3600)  # its own prefix cache holds the hits
        ref = alone.steps(prompts, arrivals, max_tokens)
    finally:
        alone.stop()
    ref_gaps, ref_ttft = _latencies(ref, decoders)
    b.progress(f"loads vLLM alone: ITL p50 {median(ref_gaps) * 1000:.1f} ms, hit TTFT {median(ref_ttft) * 1000:.1f} ms")
    daemon = b.daemon("loads-hicache", round_up(2 * hits * max_len + 4096, b.block_size))
    runs: dict[str, dict[str, Any]] = {}
    try:
        for mode in copy_modes:
            eng: VllmProcess | None = None
            try:
                eng = b.engine(f"loads-hicache-{mode}", kv_transfer=connector_config(str(daemon.config), copy_mode=mode),
                               **common)
                eng.generate(long, 1, timeout_s=3600)  # saved to L2 (by the first mode's engine; hits after)
                daemon.wait_backups()
                eng.reset_prefix_cache()  # vLLM forgets them: hicache's L2 serves the hits
                runs[mode] = eng.steps(prompts, arrivals, max_tokens)
            finally:
                if eng is not None:
                    eng.stop()
            gaps, ttft = _latencies(runs[mode], decoders)
            b.progress(f"loads vLLM + hicache ({mode}): ITL p50 {median(gaps) * 1000:.1f} ms, "
                       f"hit TTFT {median(ttft) * 1000:.1f} ms")
    finally:
        daemon.stop()
    figures: list[Figure] = []
    base_ttft = _latencies(runs["sync"], decoders)[1] if "sync" in runs else None
    n = prompt_tokens
    for mode, run in runs.items():
        gaps, ttft = _latencies(run, decoders)
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            figures.append(Figure(f"loads ({mode} copies): decode ITL {label} while {n}-token hits load", "ms",
                                  percentile(gaps, q) * 1000, "vLLM alone (own prefix hits)",
                                  percentile(ref_gaps, q) * 1000, higher_is_better=False,
                                  goal=ITL_GOAL if label == "p99" else None))
        figures.append(Figure(f"loads ({mode} copies): TTFT of a {n}-token L2 hit", "ms", median(ttft) * 1000,
                              "vLLM alone (own prefix hit)", median(ref_ttft) * 1000, higher_is_better=False))
        if base_ttft is not None and mode != "sync":
            figures.append(Figure(f"loads ({mode} copies): TTFT of a {n}-token L2 hit", "ms", median(ttft) * 1000,
                                  "sync copies", median(base_ttft) * 1000, higher_is_better=False, goal=TTFT_GOAL))
    extra: dict[str, Any] = {
        "prompt_tokens": n, "hits": hits, "decoders": decoders, "decode_tokens": decode_tokens,
        "gap_steps": GAP_STEPS, "vllm": {"itl_s": ref_gaps, "ttft_s": ref_ttft, "cached": ref["cached"][decoders:]},
    }
    for mode, run in runs.items():
        gaps, ttft = _latencies(run, decoders)
        extra[mode] = {"same_output_tokens": run["outputs"] == ref["outputs"], "itl_s": gaps, "ttft_s": ttft,
                       "cached": run["cached"][decoders:], "steps": len(run["step_s"])}
    return figures, extra
