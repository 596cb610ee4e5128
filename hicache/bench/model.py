"""``hicache bench model``: reference-model prefill and decode speed against a KV page copy.

Figures (medians over ``--repeats``):

- prefill tokens/s for one ``--prompt-tokens`` prompt;
- decode tokens/s for a batch of ``--decode-batch`` sequences at ``--decode-context`` tokens;
- the time to copy that prompt's Full KV pages from an L2-shaped, page-contiguous host
  buffer ``[pages, layers, 2, page_size, kv_heads, head_dim]`` into the L1 pool layout
  (``[layers, 2, slots, kv_heads, head_dim]``, scattered destination pages), against a raw
  ``memcpy`` of the same bytes;
- the headline ratio: prefill time / L2->L1 copy time — what a cache hit saves.

Heavy imports (torch, the model) happen inside ``run``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="bench", choices=("tiny", "small", "bench"),
                        help="reference model preset (default: bench)")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="prefill prompt length (default: 4096)")
    parser.add_argument("--decode-batch", type=int, default=8, help="sequences decoded together (default: 8)")
    parser.add_argument("--decode-context", type=int, default=512,
                        help="tokens already in each decoding sequence (default: 512)")
    parser.add_argument("--decode-steps", type=int, default=8, help="timed decode steps (default: 8)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    parser.add_argument("--repeats", type=int, default=3, help="prefill repetitions; medians are reported")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    for name in ("prompt_tokens", "decode_batch", "decode_context", "decode_steps", "page_size", "repeats"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    import torch

    from hicache.config import ModelConfig, ReferenceModelConfig
    from hicache.model.loader import load_model
    from hicache.model.pools import allocate_pools
    from hicache.model.runner import ForwardItem, ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    ps = args.page_size
    model = load_model(ModelConfig(reference=ReferenceModelConfig(preset=args.preset)))
    spec, geo = model.spec, model.geometry
    if args.prompt_tokens > spec.max_context or args.decode_context + args.decode_steps > spec.max_context:
        print(f"prompt/context exceeds the model's max context {spec.max_context}", file=sys.stderr)
        return 2
    prompt_pages = -(-args.prompt_tokens // ps)
    seq_pages = -(-(args.decode_context + args.decode_steps) // ps)
    num_pages = 2 * prompt_pages + args.decode_batch * seq_pages + 1
    slots = args.decode_batch + 2 if geo.mamba else 0
    pools = allocate_pools(geo, num_pages, ps, slots)
    runner = ModelRunner(model, pools)
    gen = torch.Generator().manual_seed(0)
    # one token sequence for both parts: the prefill prompt is its start, each decode sequence
    # its first decode_context tokens and then one token per step (so neither may run past it)
    tokens = torch.randint(0, spec.vocab_size, (max(args.prompt_tokens, args.decode_context + args.decode_steps),),
                           generator=gen).tolist()
    prompt = tokens[: args.prompt_tokens]
    pages = list(range(prompt_pages))
    geo_full, geo_swa = geo.full is not None, geo.swa is not None

    def item(tokens: list[int], start: int, table: list[int], slot: int | None) -> ForwardItem:
        return ForwardItem(tokens, start, table if geo_full else (), table if geo_swa else (), state_slot=slot)

    print(f"model: reference/{args.preset} layers={len(spec.layer_kinds)} hidden={spec.hidden_size} "
          f"heads={spec.num_heads}/{spec.num_kv_heads}x{spec.head_dim} vocab={spec.vocab_size}; "
          f"threads={torch.get_num_threads()}", flush=True)
    runner.forward([item(prompt[:64], 0, pages, 0 if slots else None)])  # warm-up
    prefill_s = _median_time(lambda: runner.forward([item(prompt, 0, pages, 0 if slots else None)]), args.repeats)

    # decode: a batch of sequences with decode_context tokens each
    base = prompt_pages + 1
    tables = [list(range(base + i * seq_pages, base + (i + 1) * seq_pages)) for i in range(args.decode_batch)]
    ctx = args.decode_context
    for i, table in enumerate(tables):
        runner.forward([item(tokens[:ctx], 0, table, i + 1 if slots else None)])
    step_times = []
    for step in range(args.decode_steps):
        batch = [item([tokens[ctx + step]], ctx + step, t, i + 1 if slots else None) for i, t in enumerate(tables)]
        t0 = time.perf_counter()
        runner.forward(batch)
        step_times.append(time.perf_counter() - t0)
    decode_step_s = statistics.median(step_times)

    # L2 -> L1 copy of the prompt's Full KV pages
    copy_s = memcpy_s = float("nan")
    kv_bytes = 0
    if pools.full_kv is not None and geo.full is not None:
        pool = pools.full_kv
        layers, _, _, heads, dim = pool.shape
        l2 = torch.randn((prompt_pages, *geo.full.l2_page_shape(ps)), generator=gen).to(pool.dtype)
        kv_bytes = l2.numel() * l2.element_size()
        dst = torch.tensor(list(range(num_pages - 1, num_pages - 1 - prompt_pages, -1)))  # scattered, reversed
        paged = pool.view(layers, 2, -1, ps, heads, dim)

        def copy_pages() -> None:
            paged[:, :, dst] = l2.permute(1, 2, 0, 3, 4, 5)

        flat_src = l2.flatten()
        flat_dst = torch.empty_like(flat_src)
        copy_reps = max(5, 4 * args.repeats)
        copy_pages()
        copy_s = _median_time(copy_pages, copy_reps)
        memcpy_s = _median_time(lambda: flat_dst.copy_(flat_src), copy_reps)
        if not torch.equal(paged[:, :, dst[0]], l2[0]):
            print("internal error: the page copy did not land where expected", file=sys.stderr)
            return 1

    n = args.prompt_tokens
    figures: list[dict[str, Any]] = [
        {"name": "prefill_tokens_per_s", "value": n / prefill_s, "unit": "tok/s",
         "reference": None, "ratio": None, "note": f"{n}-token prompt, {prefill_s:.3f} s"},
        {"name": "decode_tokens_per_s", "value": args.decode_batch / decode_step_s, "unit": "tok/s",
         "reference": None, "ratio": None,
         "note": f"batch {args.decode_batch} at {ctx} tokens, {decode_step_s * 1e3:.1f} ms/step"},
        {"name": "l2_to_l1_copy_s", "value": copy_s, "unit": "s", "reference": memcpy_s,
         "ratio": copy_s / memcpy_s, "note": f"{kv_bytes / 2**20:.1f} MiB in {prompt_pages} pages; reference: raw memcpy"},
        {"name": "prefill_over_copy", "value": prefill_s / copy_s, "unit": "x", "reference": copy_s,
         "ratio": prefill_s / copy_s, "note": f"prefill {prefill_s:.3f} s vs L2->L1 copy {copy_s * 1e3:.2f} ms"},
    ]
    print(f"{'figure':<24}{'value':>14}  {'unit':<6}{'reference':>12}{'ratio':>10}  note")
    for f in figures:
        ref = "" if f["reference"] is None else f"{f['reference']:.4g}"
        ratio = "" if f["ratio"] is None else f"{f['ratio']:.1f}"
        print(f"{f['name']:<24}{f['value']:>14.4g}  {f['unit']:<6}{ref:>12}{ratio:>10}  {f['note']}")
    if args.json:
        payload = {"benchmark": "model", "preset": args.preset, "page_size": ps,
                   "threads": torch.get_num_threads(), "figures": figures}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2, allow_nan=True)
    return 0
