"""``hicache bench engine``: vLLM with hicache beside it, against vLLM alone.

Every figure comes with its reference measured in the same run, as medians and ratios:

* ``ttft``: time to first token (wall time of a ``max_tokens=1`` ``generate``) of a long
  prompt (``--prompt-tokens``), ``--repeats`` different prompts: vLLM cold; vLLM's own
  prefix-cache hit (same engine, the prompt again: the floor); hicache L2 hit (a second engine
  with the connector, configured alike: the prompt again after its own prefix cache was
  reset, loaded from hicache's L2); hicache L3 hit (the daemon restarted between save and
  load, so L2 is empty: prefetched from the file store); and the first request of the
  hicache engine (a miss that also saves), against cold. Both engines are bound to the same
  cores and take turns prompt by prompt (``engine_lib.parts.run_ttft``).
* ``multiturn``: ``--conversations`` x ``--rounds`` chats, each round's prompt = the previous
  prompt + its answer + a new question; per round, each conversation's prompt alone with
  ``max_tokens=1`` (its TTFT), then the prompts for ``--answer-tokens``, ``--answer-batch``
  at a time (default: as many as vLLM's KV space runs at once, so that every run answers in
  the same batches) (the round's latency; throughput = prompt + output tokens of these
  answer calls per second of their wall time). vLLM's KV space (``--kv-space-gib``, default a
  third of the working set) is below the working set (conversations x final length). vLLM alone (its prefix
  caching on) against vLLM + hicache (prefix caching on too), and vLLM alone given KV
  space for the whole working set (goal: hicache within 1.2x of it, throughput and TTFT
  p50); vLLM's ``num_cached_tokens`` as hit tokens; the runs' greedy tokens compared.
* ``decode``: a long decode (``--decode-contexts``, ``--decode-tokens``): Reserve messages
  and token ids sent to the daemon per generated block, at each context length against the
  shortest one (goal: constant, ratio <= 1.1; ``engine_lib.parts.run_decode``).
* ``steps``: vLLM's step time (p50, p99) and its scheduler part under a mixed workload of
  ``--steps-requests`` concurrent requests, a third of them L3 hits, a third L2 hits, with
  hicache against vLLM alone serving the same hits from its own prefix cache (goal: p99 step
  time <= 1.1x; ``engine_lib.parts.run_steps``), once per ``--copy-modes`` entry (the
  connector's ``hicache_copy``: ``sync`` copies on the forward pass, ``async`` beside it,
  ``layer`` loads layer by layer during it).
* ``loads``: ``--loads-decoders`` requests decoding while ``--loads-hits`` prompts of
  ``--loads-prompt-tokens`` arrive one at a time and load from L2: the decoders' inter-token
  latency p50 / p99 against vLLM alone serving the same hits from its own prefix cache (goal
  p99 <= 1.05x), and the hits' TTFT against vLLM alone's and against ``sync`` copies (goal
  <= 1.05x), once per ``--copy-modes`` entry (``engine_lib.loads``).
* ``pd``: ``--pd-requests`` prompts of ``--pd-prompt-tokens`` through a prefill engine and a
  decode engine (the recipe of docs/engine-mode.md) against one colocated engine: TTFT and
  inter-token latency p50 / p99 (``engine_lib.pd``).
* ``lookup``: the connector's side of a lookup that hits L2, first ask and ask again, at
  ``--lookup-tokens`` lengths against the shortest (goal for the longest: 1 ms;
  ``engine_lib.lookup.run_lookup``). No vLLM runs in this part.
* ``copy``: ``BlockCopier`` load and save against raw torch copies of the same blocks, in
  this process (``hicache.bench.engine_lib.copy_bench``).
* ``peers``: what a vLLM-on-CPU user has without hicache: vLLM's ``OffloadingConnector``
  (its refusal), vLLM's ``SimpleCPUOffloadConnector`` (its refusal, or where it runs a
  repeat served from its CPU tier against the first request) and LMCache (installed into the work directory without dependencies if it is
  not importable; if its engine starts, a repeated prompt's TTFT against its first request).

The model has random weights (``save_random_model``), kept under ``--workdir``: a Llama
(``--model-kind llama``, full attention), a Gemma 3 (``--model-kind gemma3``: layers
alternate a ``--sliding-window`` window and full attention, which vLLM's hybrid allocator
keeps in two KV cache groups; the connector loads those asynchronously) or a Qwen3-Next
(``--model-kind qwen3_next``: gated delta net layers, whose state vLLM keeps per block,
alternate with full attention, one GDN head per rank; always bfloat16, the only dtype vLLM's
CPU GDN kernel runs,
and the block is the one vLLM picks so that a page holds a GDN layer's state:
``hybrid_block_size``). With
``--tensor-parallel N`` every engine of the run (vLLM alone and vLLM + hicache alike) runs at
that rank count, its ranks bound to the same cores. Its dtype
is bfloat16 where the CPU computes bfloat16 natively (AVX512-BF16 or AMX) and float32
elsewhere (``--dtype auto``): without those instructions torch's bfloat16 matrix products
run tens of times slower than float32 ones, and prefill alone would take many minutes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

PARTS = ("ttft", "multiturn", "decode", "steps", "loads", "pd", "lookup", "copy", "peers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="a short run with a tiny model (used by a test)")
    parser.add_argument("--workdir", default=None, help="models, daemon state and logs (default: a temp dir, "
                        "removed at the end)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    g = parser.add_argument_group("model (random weights)")
    g.add_argument("--model-kind", default="llama", choices=("llama", "gemma3", "qwen3_next"),
                   help="llama: full attention; gemma3: sliding-window and full layers alternating; "
                   "qwen3_next: gated delta net (state) and full layers alternating")
    g.add_argument("--sliding-window", type=int, default=1024, help="gemma3: the window of its sliding layers")
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--head-dim", type=int, default=64, help="vLLM CPU: one of 32, 64, 80, 96, 112, 128")
    g.add_argument("--intermediate", type=int, default=2816)
    g.add_argument("--vocab", type=int, default=8192)
    g.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    g.add_argument("--block-size", type=int, default=32, help="vLLM block = hicache page (CPU: a multiple of 32)")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="vLLM's --tensor-parallel-size for every engine (CPU: one worker process per rank)")
    g = parser.add_argument_group("ttft")
    g.add_argument("--prompt-tokens", type=int, default=4096)
    g.add_argument("--repeats", type=int, default=3, help="different prompts; medians over them")
    g = parser.add_argument_group("multiturn")
    g.add_argument("--conversations", type=int, default=8)
    g.add_argument("--rounds", type=int, default=6)
    g.add_argument("--question-tokens", type=int, default=256)
    g.add_argument("--answer-tokens", type=int, default=16)
    g.add_argument("--answer-batch", type=int, default=0,
                   help="conversations per answer call (default 0: as many as the KV space runs at once)")
    g.add_argument("--kv-space-gib", type=float, default=None,
                   help="vLLM's KV space (default: a third of the working set), set exactly as a block count")
    g = parser.add_argument_group("decode")
    g.add_argument("--decode-contexts", default="1024,4096,16384", help="context lengths, comma-separated")
    g.add_argument("--decode-tokens", type=int, default=1024)
    g = parser.add_argument_group("steps")
    g.add_argument("--steps-requests", type=int, default=12)
    g.add_argument("--steps-prompt-tokens", type=int, default=1024)
    g.add_argument("--steps-max-tokens", type=int, default=32)
    g.add_argument("--copy-modes", default="sync,async,layer",
                   help="the connector's hicache_copy values to run the hicache engine with, comma-separated "
                        "(each against the same vLLM-alone reference)")
    g = parser.add_argument_group("loads")
    g.add_argument("--loads-prompt-tokens", type=int, default=4096, help="tokens of each hitting prompt")
    g.add_argument("--loads-hits", type=int, default=6, help="hitting prompts, arriving one at a time")
    g.add_argument("--loads-decoders", type=int, default=4, help="requests decoding meanwhile")
    g = parser.add_argument_group("pd")
    g.add_argument("--pd-prompt-tokens", type=int, default=2048)
    g.add_argument("--pd-requests", type=int, default=8)
    g.add_argument("--pd-decode-tokens", type=int, default=32)
    g = parser.add_argument_group("lookup")
    g.add_argument("--lookup-tokens", default="1024,32768", help="prompt lengths, comma-separated")
    g.add_argument("--lookup-repeats", type=int, default=50)
    g = parser.add_argument_group("copy")
    g.add_argument("--copy-sizes", default="1,4,16", help="MiB per copy call, comma-separated")
    g.add_argument("--copy-repeats", type=int, default=7)
    g.add_argument("--copy-threads", type=int, default=1, help="torch threads for the copies (vLLM's CPU worker "
                   "here runs with OMP_NUM_THREADS=1)")
    g = parser.add_argument_group("peers")
    g.add_argument("--peer-prompt-tokens", type=int, default=1024)
    g.add_argument("--peer-repeats", type=int, default=1)


def _native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((ln for ln in fh if ln.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def hybrid_block_size(model_dir: str, block_size: int) -> int:
    """The block vLLM 0.32 runs a GDN hybrid with (its ``_align_hybrid_block_size``): the
    smallest multiple of ``block_size`` whose attention page (one layer's K and V) holds one
    GDN layer's state; ``block_size`` for a model without state layers."""
    import json
    from pathlib import Path

    from hicache.cache_server.geometry import checkpoint_dtype, state_shape
    from protos import KV_DTYPE_BYTES

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = checkpoint_dtype(raw)
    _, state = state_shape(raw, dtype)
    per_token = int(raw["num_key_value_heads"]) * int(raw["head_dim"]) * 2 * KV_DTYPE_BYTES[dtype]
    return max(block_size, block_size * -(-state // (block_size * per_token)))


def _apply_quick(args: argparse.Namespace) -> None:
    args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim = 2, 256, 4, 2, 64
    args.intermediate, args.vocab = 512, 1024
    args.prompt_tokens, args.repeats = 512, 1
    args.conversations, args.rounds, args.question_tokens, args.answer_tokens = 2, 2, 64, 4
    args.copy_sizes, args.copy_repeats = "0.25,1", 3
    args.peer_prompt_tokens = 256
    args.decode_contexts, args.decode_tokens = "256,1024", 128
    args.peer_repeats = 1
    args.steps_requests, args.steps_prompt_tokens, args.steps_max_tokens = 6, 256, 8
    args.lookup_tokens, args.lookup_repeats = "1024,8192", 10
    args.loads_prompt_tokens, args.loads_hits, args.loads_decoders = 512, 2, 2
    args.pd_prompt_tokens, args.pd_requests, args.pd_decode_tokens = 256, 3, 8


def _per_mode_notes(notes: list[str], part: str, result: dict[str, Any], modes: tuple[str, ...],
                    detail: Callable[[dict[str, Any]], str]) -> int:
    """Append a part's note per copy mode (its outputs against vLLM alone's, then ``detail``);
    1 when a mode's outputs differ, else 0."""
    code = 0
    for mode in modes:
        m = result[mode]
        notes.append(f"{part} ({mode} copies): greedy outputs with hicache equal vLLM alone's: "
                     f"{m['same_output_tokens']}; {detail(m)}")
        code |= 0 if m["same_output_tokens"] else 1
    return code


def run(args: argparse.Namespace) -> int:
    import shutil
    import sys
    import tempfile
    import time
    from pathlib import Path

    from hicache.bench.report import Figure, print_table, write_json

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"hicache: unknown part(s) {', '.join(unknown)} (known: {', '.join(PARTS)})")
        return 2
    if args.quick:
        _apply_quick(args)
    if args.block_size % 32 or args.head_dim not in (32, 64, 80, 96, 112, 128):
        print("hicache: vLLM on the CPU needs a block size that is a multiple of 32 and head_dim in "
              "{32, 64, 80, 96, 112, 128}")
        return 2
    if args.tensor_parallel < 1 or args.kv_heads % args.tensor_parallel:
        print(f"hicache: --tensor-parallel {args.tensor_parallel} must be >= 1 and divide --kv-heads {args.kv_heads} "
              "(vLLM would replicate KV heads, which the connector refuses)")
        return 2
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if _native_bf16() else "float32")
    if args.model_kind == "qwen3_next":
        if args.dtype == "float32":
            print("hicache: --model-kind qwen3_next runs in bfloat16 (the only dtype of vLLM's CPU GDN kernel)")
            return 2
        dtype = "bfloat16"
    began = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f} s] {msg}", file=sys.stderr, flush=True)

    own_tmp = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="hicache-bench-engine-") if own_tmp else args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    figures: list[Figure] = []
    extra: dict[str, object] = {"parts": parts, "dtype": dtype, "workdir": str(workdir),
                                "tensor_parallel": args.tensor_parallel}
    notes: list[str] = []
    code = 0
    try:
        if "copy" in parts:
            from hicache.bench.engine_lib.copy_bench import run_copy

            progress("copy: BlockCopier against torch copies")
            sizes = [float(s) for s in args.copy_sizes.split(",") if s.strip()]
            copy = run_copy(sizes_mib=sizes, num_layers=args.layers, kv_heads=args.kv_heads,
                            block_size=args.block_size, head_dim=args.head_dim, repeats=args.copy_repeats,
                            threads=args.copy_threads, progress=progress)
            extra["copy"] = copy
            for row in copy["results"]:
                figures.append(Figure(f"copy {row['op']} {row['pattern']} {row['size_mib']:g} MiB", "GiB/s",
                                      row["hicache_gib_s"], "torch index copy", row["torch_gib_s"], goal=0.8))
            ok = all(copy["checks"].values())
            notes.append(f"copy: load and save checked bitwise against their source: {'ok' if ok else 'FAILED'} "
                         f"({', '.join(f'{k} {v}' for k, v in copy['checks'].items())})")
            if not ok:
                code = 1
        vllm_parts = [p for p in parts if p != "copy"]  # and lookup, which needs the model's geometry
        if vllm_parts:
            from hicache.bench.engine_lib.harness import Bench
            from hicache.bench.engine_lib.parts import ChatShape, kv_bytes_per_token
            from hicache.bench.engine_lib.vllm_driver import save_random_model

            # room for the longest decode context (and at least the 8k the other parts use)
            contexts = [int(c) for c in args.decode_contexts.split(",") if c.strip()]
            positions = max([8192] + [c + args.decode_tokens + 2 * args.block_size for c in contexts])
            kind = args.model_kind + (f"-w{args.sliding_window}" if args.model_kind == "gemma3" else "")
            kind += f"-g{args.tensor_parallel}" if args.model_kind == "qwen3_next" else ""  # GDN heads: one per rank
            key = (f"{kind}-l{args.layers}-h{args.hidden}-a{args.heads}-kv{args.kv_heads}-d{args.head_dim}"
                   f"-i{args.intermediate}-v{args.vocab}-p{positions}-{dtype}")
            model_dir = workdir / "models" / key
            progress(f"model: {key} at {model_dir}")
            save_random_model(model_dir, arch=args.model_kind, layers=args.layers, hidden=args.hidden,
                              heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, vocab=args.vocab,
                              intermediate=args.intermediate, dtype=dtype, max_positions=positions,
                              sliding_window=args.sliding_window, linear_heads=args.tensor_parallel)
            per_token = kv_bytes_per_token(str(model_dir), 2 if dtype == "bfloat16" else 4)
            block = hybrid_block_size(str(model_dir), args.block_size)
            if block != args.block_size:
                progress(f"model: vLLM runs it with blocks of {block} tokens (a page holds a GDN layer's state)")
            bench = Bench(workdir, str(model_dir), block, per_token, args.vocab, dtype, progress,
                          tensor_parallel=args.tensor_parallel)
            extra["model"] = {"dir": str(model_dir), "key": key, "kv_bytes_per_token": per_token}
            if "ttft" in parts:
                from hicache.bench.engine_lib.parts import run_ttft

                f, x = run_ttft(bench, prompt_tokens=args.prompt_tokens, repeats=args.repeats)
                figures += f
                extra["ttft"] = x
                notes.append(f"ttft: every case returned the cold output token: {x['same_output_tokens']}; "
                             f"L2 hit tokens {x['cached_tokens']['l2']}, L3 hit tokens {x['cached_tokens']['l3']} "
                             f"(of {args.prompt_tokens})")
            if "multiturn" in parts:
                from hicache.bench.engine_lib.parts import run_multiturn

                shape = ChatShape(args.conversations, args.rounds, args.question_tokens, args.answer_tokens,
                                  args.answer_batch)
                f, x = run_multiturn(bench, shape, args.kv_space_gib)
                figures += f
                extra["multiturn"] = x
                same = "identical" if x["same_answer_tokens"] else f"DIFFERENT (first: {x['first_difference']})"
                notes.append(f"multiturn: greedy answer tokens of the two runs: {same}; 1-token probes "
                             f"{'identical' if x['same_probe_tokens'] else 'DIFFERENT'}; vLLM alone with room "
                             f"for the working set: {'identical' if x['roomy_same_answer_tokens'] else 'DIFFERENT'}. "
                             f"Answers {x['answer_batch']} conversations at a time. "
                             f"vLLM KV space {x['kv_space_mib']:.1f} MiB ({x['kv_blocks']} blocks) < working set "
                             f"{x['working_set_mib']:.1f} MiB ({x['roomy_kv_blocks']} blocks for the roomy run)")
            if "decode" in parts:
                from hicache.bench.engine_lib.parts import run_decode

                f, x = run_decode(bench, contexts=contexts, decode_tokens=args.decode_tokens)
                figures += f
                extra["decode"] = x
            modes = tuple(m.strip() for m in args.copy_modes.split(",") if m.strip())
            if "steps" in parts:
                from hicache.bench.engine_lib.parts import run_steps

                f, x = run_steps(bench, requests=args.steps_requests, prompt_tokens=args.steps_prompt_tokens,
                                 max_tokens=args.steps_max_tokens, copy_modes=modes)
                figures += f
                extra["steps"] = x
                code |= _per_mode_notes(notes, "steps", x, modes, lambda m: f"hit tokens per kind "
                                        f"{m['hicache_cached']}; daemon {m['daemon']}")
            if "loads" in parts:
                from hicache.bench.engine_lib.loads import run_loads

                f, x = run_loads(bench, prompt_tokens=args.loads_prompt_tokens, hits=args.loads_hits,
                                 decoders=args.loads_decoders, copy_modes=modes)
                figures += f
                extra["loads"] = x
                alone_hits = x["vllm"]["cached"]
                code |= _per_mode_notes(notes, "loads", x, modes, lambda m: f"hit tokens {m['cached']} "
                                        f"(vLLM alone {alone_hits})")
            if "pd" in parts:
                from hicache.bench.engine_lib.pd import run_pd

                f, x = run_pd(bench, prompt_tokens=args.pd_prompt_tokens, requests=args.pd_requests,
                              decode_tokens=args.pd_decode_tokens)
                figures += f
                extra["pd"] = x
                notes.append(f"pd: the decode engine's greedy tokens equal vLLM alone's: {x['same_output_tokens']}; "
                             f"its hit tokens {x['decode_cached']}")
                code |= 0 if x["same_output_tokens"] else 1
            if "lookup" in parts:
                from hicache.bench.engine_lib.lookup import run_lookup

                lengths = [int(n) for n in args.lookup_tokens.split(",") if n.strip()]
                f, x = run_lookup(bench, lengths=lengths, repeats=args.lookup_repeats)
                figures += f
                extra["lookup"] = x
                met = "met" if x["longest_first_ask_ms"] <= x["goal_ms"] else "NOT met"
                notes.append(f"lookup: {x['longest']}-token L2 hit, connector side: first ask "
                             f"{x['longest_first_ask_ms']:.3f} ms (goal {x['goal_ms']:g} ms: {met}; p99 "
                             f"{x['longest_first_ask_p99_ms']:.3f} ms), ask again "
                             f"{x['longest_ask_again_ms']:.3f} ms (medians of {x['repeats']})")
            if "peers" in parts:
                from hicache.bench.engine_lib.peers import run_peers

                x = run_peers(bench, prompt_tokens=args.peer_prompt_tokens,
                              repeats=args.peer_repeats)
                extra["peers"] = x
                off = x["offloading"]
                notes.append("peers: vLLM OffloadingConnector on the CPU: " + (
                    f"refused at start: {off['refusal']}" if not off["started"] else off["note"]))
                sc = x["simple_cpu_offload"]
                notes.append("peers: vLLM SimpleCPUOffloadConnector on the CPU: " + (
                    f"refused at start: {sc['refusal']}" if not sc["started"] else
                    f"started; repeat after a prefix-cache reset: TTFT {sc['repeat_over_first']:.2f}x its first "
                    f"request, hit tokens {sc['repeat_cached']}, same tokens {sc['same_output_tokens']}"))
                lm = x["lmcache"]
                if lm.get("started"):
                    notes.append(f"peers: LMCache {lm['version']} ({lm['install']}): started; repeated prompt "
                                 f"TTFT {lm['repeat_over_first']:.2f}x its first request, repeat hit tokens "
                                 f"{lm['repeat_cached']}; log: {'; '.join(lm['log_warnings']) or 'no warnings'}")
                elif "started" in lm:
                    notes.append(f"peers: LMCache {lm['version']} ({lm['install']}): vLLM did not start: "
                                 f"{lm['refusal']}")
                else:
                    notes.append(f"peers: LMCache {lm['version']}: {lm['install']}")
            extra["logs"] = bench.logs
    except Exception as exc:
        progress(f"failed: {type(exc).__name__}: {exc}")
        extra["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    finally:
        if figures:
            print_table(f"hicache bench engine ({dtype}; medians; ratios against references from this run)",
                        figures)
        for n in notes:
            print(n)
        if args.json:
            write_json(args.json, "engine", figures, extra)
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)
    return code
