"""The vLLM parts of ``bench engine`` that run hicache beside vLLM alone: ``ttft``,
``multiturn``, ``decode`` and ``steps`` (``peers`` and ``lookup`` have modules of their own;
``Bench``, what every part needs: ``harness``).

Each part starts its own engines (``VllmProcess``: vLLM in a child process) one after the
other, never two at once, so they do not share the CPUs. Times are the driver's
``elapsed_s``: the wall time of one ``LLM.generate`` call inside the engine process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.bench.engine_lib.harness import Bench, median, percentile, round_up
from hicache.bench.engine_lib.vllm_driver import VllmProcess, connector_config
from hicache.bench.report import Figure

# ---------------------------------------------------------------------- ttft


def run_ttft(b: Bench, *, prompt_tokens: int, repeats: int) -> tuple[list[Figure], dict[str, Any]]:
    """TTFT of a ``prompt_tokens`` prompt (``max_tokens=1``), ``repeats`` different prompts.

    Both engines stay up and take turns prompt by prompt (never running at once), so the
    machine's noise falls on both alike. Engine A (vLLM alone, its prefix caching on):
    ``cold`` (first request) and ``vllm_hit`` (the same prompt again: vLLM's own prefix
    cache, the floor; measured again beside each ``l3`` case, as ``vllm_hit_l3``, the
    reference of the L3 figures). Engine B (vLLM + hicache,
    configured like A): ``hicache_miss`` (first request: computed and saved to L2); then
    vLLM's own prefix cache is reset (as when vLLM evicted the prompt or another engine
    asks), so ``l2`` (the same prompt again) is loaded from hicache's L2 into blocks vLLM
    has used before, as in steady state; then the daemon is restarted (L2 empty, the file L3
    kept) and, after another reset, ``l3`` (prefetched from L3 into L2, loaded). Before each
    hit the daemon's L3 backup of the saved prompt is let finish: on a 2-core machine it
    would otherwise compete with the load for the CPU (a serving host has cores for it).
    Every case must return the cold output token.
    """
    prompts = b.prompts(repeats, prompt_tokens, seed=1)
    max_len = round_up(prompt_tokens + b.block_size, b.block_size)
    blocks = max(64, 2 * repeats * max_len // b.block_size + 16)
    times: dict[str, list[float]] = {k: [] for k in ("cold", "vllm_hit", "hicache_miss", "l2", "vllm_hit_l3", "l3")}
    cached: dict[str, list[int]] = {k: [] for k in times}
    outputs: dict[str, list[tuple[int, list[int]]]] = {k: [] for k in times}

    def one(eng: VllmProcess, case: str, ids: list[int], rep: int) -> None:
        r = eng.generate([ids], 1, timeout_s=1800)
        times[case].append(float(r["elapsed_s"]))
        cached[case].append(int(r["cached"][0]))
        outputs[case].append((rep, list(r["outputs"][0])))
        b.progress(f"ttft {case:12s} prompt {rep}: {r['elapsed_s'] * 1000:9.1f} ms, cached {r['cached'][0]}")

    l2_tokens = round_up(2 * repeats * max_len + 4096, b.block_size)
    daemon = b.daemon("ttft-hicache", l2_tokens)
    restarted = False
    alone: VllmProcess | None = None
    eng: VllmProcess | None = None
    try:
        # both engines stay up and take turns, prompt by prompt: the machine's noise falls on
        # the reference and on hicache alike (they never run at the same time)
        alone = b.engine("ttft-vllm", prefix_caching=True, max_model_len=max_len, num_blocks=blocks)
        eng = b.engine("ttft-hicache", prefix_caching=True, max_model_len=max_len, num_blocks=blocks,
                       hicache_config=str(daemon.config))
        for rep, ids in enumerate(prompts):
            one(alone, "cold", ids, rep)
            one(alone, "vllm_hit", ids, rep)
            one(eng, "hicache_miss", ids, rep)
            daemon.wait_backups()
            eng.reset_prefix_cache()
            one(eng, "l2", ids, rep)
        backed_up = daemon.wait_backups()
        stats_before = daemon.stats()
        b.progress(f"ttft: L3 backups {'complete' if backed_up else 'NOT complete'}; restarting the daemon")
        daemon.restart()
        restarted = True
        for rep, ids in enumerate(prompts):
            one(alone, "vllm_hit_l3", ids, rep)
            eng.reset_prefix_cache()
            one(eng, "l3", ids, rep)
        stats_after = daemon.stats()
    finally:
        for e in (alone, eng):
            if e is not None:
                e.stop()
        daemon.stop()
    cold_out = dict(outputs["cold"])  # each case against the cold answer to its own prompt
    same = all(out == cold_out[rep] for c in outputs for rep, out in outputs[c])
    cold = median(times["cold"]) * 1000
    hit = median(times["vllm_hit"]) * 1000
    l2 = median(times["l2"]) * 1000
    l3 = median(times["l3"]) * 1000
    hit_l3 = median(times["vllm_hit_l3"]) * 1000  # measured beside the L3 cases
    miss = median(times["hicache_miss"]) * 1000
    n = prompt_tokens
    figures = [
        Figure(f"TTFT vLLM own prefix hit ({n} tok)", "ms", hit, "vLLM cold", cold, higher_is_better=False),
        Figure(f"TTFT hicache L2 hit ({n} tok)", "ms", l2, "vLLM cold", cold, higher_is_better=False, goal=0.1),
        Figure(f"TTFT hicache L2 hit ({n} tok)", "ms", l2, "vLLM own prefix hit", hit, higher_is_better=False,
               goal=1.5),
        Figure(f"TTFT hicache L3 hit ({n} tok)", "ms", l3, "vLLM cold", cold, higher_is_better=False),
        Figure(f"TTFT hicache L3 hit ({n} tok)", "ms", l3, "vLLM own prefix hit", hit_l3, higher_is_better=False),
        Figure(f"TTFT hicache miss + save ({n} tok)", "ms", miss, "vLLM cold", cold, higher_is_better=False),
    ]
    stored = l2_bytes_per_cached_token(stats_before, b.block_size)
    if stored is not None:
        figures.append(Figure("L2 bytes per cached token", "B", stored, "every layer's KV (a full-attention model)",
                              b.kv_bytes_per_token, higher_is_better=False))
    extra = {"prompt_tokens": n, "l2": stats_before.get("l2"), "repeats": repeats, "times_s": times, "cached_tokens": cached,
             "same_output_tokens": same, "daemon_restarted": restarted,
             "daemon_stats_before_restart": stats_before.get("engine"),
             "daemon_stats_after_restart": {"engine": stats_after.get("engine"), "tiers": stats_after.get("tiers")}}
    return figures, extra


# ---------------------------------------------------------------------- multiturn


@dataclass
class ChatShape:
    conversations: int
    rounds: int
    question_tokens: int
    answer_tokens: int
    answer_batch: int = 0
    """Conversations answered per ``generate`` call (0: as many as vLLM's KV space runs at
    once in the last round, ``answer_batch_for``)."""

    @property
    def final_tokens(self) -> int:
        """Tokens of one conversation after its last answer."""
        return self.rounds * (self.question_tokens + self.answer_tokens)


def chat_kv_blocks(b: Bench, shape: ChatShape, kv_space_gib: float | None) -> tuple[int, int, int]:
    """(vLLM KV blocks, working-set blocks, max_model_len) for the multi-turn part: by
    default a third of the working set, at least ``max_model_len`` and a block more."""
    max_len = round_up(shape.final_tokens + b.block_size, b.block_size)
    working = shape.conversations * round_up(shape.final_tokens, b.block_size) // b.block_size
    block_bytes = b.kv_bytes_per_token * b.block_size
    if kv_space_gib is not None:
        blocks = int(kv_space_gib * (1 << 30)) // block_bytes
    else:
        blocks = working // 3
    blocks = max(blocks, max_len // b.block_size + 1)
    return blocks, working, max_len


def answer_batch_for(shape: ChatShape, blocks: int, block_size: int) -> int:
    """``shape.answer_batch``, or by default the conversations whose last-round prompts and
    answers fit in ``blocks`` together (at least one): a batch that vLLM runs without
    preempting, so that every run answers in the same batches whatever its KV space, and
    the throughput compares the caches, not the batch sizes."""
    if shape.answer_batch:
        return min(shape.answer_batch, shape.conversations)
    per_conversation = -(-(shape.final_tokens + block_size) // block_size)
    return max(1, min(shape.conversations, blocks // per_conversation))


def _chat_run(b: Bench, name: str, shape: ChatShape, blocks: int, max_len: int,
              hicache_config: str | None, batch: int) -> dict[str, Any]:
    """One multi-turn run: per round, a ``max_tokens=1`` probe of each conversation's prompt
    alone (its TTFT), then the conversations' prompts ``batch`` at a time, one ``generate``
    each, for the answers."""
    questions = [b.prompts(shape.rounds, shape.question_tokens, seed=100 + c) for c in range(shape.conversations)]
    history: list[list[int]] = [[] for _ in range(shape.conversations)]
    out: dict[str, Any] = {"ttft_s": [], "probe_cached": [], "round_s": [], "round_tokens": [],
                           "answer_cached": [], "answers": [], "probe_tokens": []}
    eng = b.engine(name, prefix_caching=True, max_model_len=max_len, num_blocks=blocks,
                   max_num_seqs=max(16, shape.conversations), hicache_config=hicache_config)
    try:
        for r in range(shape.rounds):
            prompts = [history[c] + questions[c][r] for c in range(shape.conversations)]
            for p in prompts:
                res = eng.generate([p], 1, timeout_s=1800)
                out["ttft_s"].append(float(res["elapsed_s"]))
                out["probe_cached"].append(int(res["cached"][0]))
                out["probe_tokens"].append(list(res["outputs"][0]))
            answers, cached, elapsed = [], [], 0.0
            for first in range(0, len(prompts), batch):
                res = eng.generate(prompts[first:first + batch], shape.answer_tokens, timeout_s=1800)
                answers += [list(o) for o in res["outputs"]]
                cached += [int(x) for x in res["cached"]]
                elapsed += float(res["elapsed_s"])
            out["round_s"].append(elapsed)
            out["round_tokens"].append(sum(len(p) for p in prompts) + sum(len(a) for a in answers))
            out["answer_cached"].append(cached)
            out["answers"].append(answers)
            ttft_round = out["ttft_s"][-shape.conversations:]
            b.progress(f"multiturn {name}: round {r + 1}/{shape.rounds}: answers {elapsed:.2f} s, "
                       f"TTFT p50 {median(ttft_round) * 1000:.0f} ms, hit tokens "
                       f"{sum(out['answer_cached'][-1])}/{sum(len(p) for p in prompts)}")
            history = [prompts[c] + answers[c] for c in range(shape.conversations)]
    finally:
        eng.stop()
    return out


ROOMY_GOAL = 1.2
"""hicache with a KV space below the working set, against vLLM alone with room for all of it:
throughput and TTFT p50 within this factor."""


def run_multiturn(b: Bench, shape: ChatShape, kv_space_gib: float | None) -> tuple[list[Figure], dict[str, Any]]:
    """vLLM alone against vLLM + hicache (prefix caching on in both) on a multi-turn chat
    whose working set is larger than vLLM's KV space (see ``_chat_run`` for what runs), and
    vLLM alone given KV space for the whole working set (``roomy``: what hicache's L2 stands
    in for) as the second reference."""
    blocks, working, max_len = chat_kv_blocks(b, shape, kv_space_gib)
    block_bytes = b.kv_bytes_per_token * b.block_size
    batch = answer_batch_for(shape, blocks, b.block_size)
    b.progress(f"multiturn: working set {working} blocks ({working * block_bytes / (1 << 20):.1f} MiB), "
               f"vLLM KV space {blocks} blocks ({blocks * block_bytes / (1 << 20):.1f} MiB), "
               f"answers {batch} conversations at a time")
    alone = _chat_run(b, "chat-vllm", shape, blocks, max_len, None, batch)
    roomy_blocks = working + max_len // b.block_size + 16
    roomy = _chat_run(b, "chat-vllm-roomy", shape, roomy_blocks, max_len, None, batch)
    l2_tokens = round_up(4 * working * b.block_size + 4096, b.block_size)
    daemon = b.daemon("chat-hicache", l2_tokens)
    try:
        with_hc = _chat_run(b, "chat-hicache", shape, blocks, max_len, str(daemon.config), batch)
        stats = daemon.stats()
    finally:
        daemon.stop()

    def tput(run: dict[str, Any]) -> float:
        tokens_per_s: float = sum(run["round_tokens"]) / sum(run["round_s"])
        return tokens_per_s

    same_answers = alone["answers"] == with_hc["answers"]
    same_probes = alone["probe_tokens"] == with_hc["probe_tokens"]
    first_diff = None
    if not same_answers:
        for r, (x, y) in enumerate(zip(alone["answers"], with_hc["answers"], strict=True)):
            diffs = [c for c in range(len(x)) if x[c] != y[c]]
            if diffs:
                first_diff = {"round": r, "conversations": diffs}
                break
    hits = {name: {"answer_hit_tokens": sum(sum(x) for x in run["answer_cached"]),
                   "probe_hit_tokens": sum(run["probe_cached"]),
                   "answer_prompt_tokens": sum(run["round_tokens"]) - shape.conversations * shape.rounds
                   * shape.answer_tokens}
            for name, run in (("vllm", alone), ("hicache", with_hc))}
    c, r = shape.conversations, shape.rounds
    figures = [
        Figure(f"chat throughput ({c} conv x {r} rounds)", "tok/s", tput(with_hc), "vLLM alone", tput(alone),
               goal=2.0),
        Figure("chat TTFT p50 (1-token probe)", "ms", median(with_hc["ttft_s"]) * 1000, "vLLM alone",
               median(alone["ttft_s"]) * 1000, higher_is_better=False, goal=0.4),
        Figure("chat round latency p50 (answers)", "ms", median(with_hc["round_s"]) * 1000, "vLLM alone",
               median(alone["round_s"]) * 1000, higher_is_better=False),
        Figure(f"chat throughput ({c} conv x {r} rounds)", "tok/s", tput(with_hc),
               "vLLM alone, KV space >= working set", tput(roomy), goal=round(1 / ROOMY_GOAL, 2)),
        Figure("chat TTFT p50 (1-token probe)", "ms", median(with_hc["ttft_s"]) * 1000,
               "vLLM alone, KV space >= working set", median(roomy["ttft_s"]) * 1000, higher_is_better=False,
               goal=ROOMY_GOAL),
        Figure("chat answer hit tokens", "tok", hits["hicache"]["answer_hit_tokens"], "vLLM alone",
               hits["vllm"]["answer_hit_tokens"]),
        Figure("chat probe hit tokens", "tok", hits["hicache"]["probe_hit_tokens"], "vLLM alone",
               hits["vllm"]["probe_hit_tokens"]),
    ]
    extra = {"shape": vars(shape), "answer_batch": batch, "kv_blocks": blocks, "working_set_blocks": working, "max_model_len": max_len,
             "kv_space_mib": blocks * block_bytes / (1 << 20),
             "working_set_mib": working * block_bytes / (1 << 20), "hits": hits,
             "same_answer_tokens": same_answers, "same_probe_tokens": same_probes, "first_difference": first_diff,
             "roomy_kv_blocks": roomy_blocks,
             "roomy_same_answer_tokens": roomy["answers"] == alone["answers"],
             "roomy": {k: v for k, v in roomy.items() if k not in ("answers", "probe_tokens")},
             "vllm": {k: v for k, v in alone.items() if k not in ("answers", "probe_tokens")},
             "hicache": {k: v for k, v in with_hc.items() if k not in ("answers", "probe_tokens")},
             "daemon_stats": {"engine": stats.get("engine"), "tiers": stats.get("tiers")}}
    return figures, extra


def l2_bytes_per_cached_token(stats: dict[str, Any], block_size: int) -> float | None:
    """L2 bytes the daemon holds per cached token (the full parts of its pages, the window
    parts where the model has window layers, the states where it has state layers), from its
    ``/cache/stats``; None when it holds nothing."""
    l2 = stats.get("l2") or {}
    tokens = int((l2.get("full") or {}).get("used_tokens") or 0)
    if not tokens:
        return None
    held = sum(int(part.get("used_tokens") or 0) * int(part.get("page_bytes") or 0) / block_size
               + int(part.get("used_slots") or 0) * int(part.get("slot_bytes") or 0) for part in l2.values())
    return held / tokens


def kv_bytes_per_token(model_dir: str, dtype_bytes: int) -> int:
    """K and V bytes of one token over all layers, from the checkpoint's ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"] * kv_heads * head_dim * 2 * dtype_bytes)


# ---------------------------------------------------------------------- decode


def run_decode(b: Bench, *, contexts: list[int], decode_tokens: int) -> tuple[list[Figure], dict[str, Any]]:
    """What a long decode sends the daemon per generated block, at several context lengths.

    One engine with the connector; for each context length a new random prompt is first
    prefilled (``max_tokens=1``: its pages are saved), then the same prompt decodes
    ``decode_tokens`` tokens. The daemon's counters over that second call give the Reserve
    messages and the token ids they carried per generated block (the lookup of the prompt,
    once per request, is not counted). Reference: the shortest context, in the same run;
    the goal is a ratio of at most 1.1 (constant in the context length)."""
    longest = max(contexts)
    max_len = round_up(longest + decode_tokens + 2 * b.block_size, b.block_size)
    blocks = 2 * max_len // b.block_size + 16
    daemon = b.daemon("decode-hicache", round_up(2 * max_len * len(contexts), b.block_size))
    rows: list[dict[str, Any]] = []
    eng: VllmProcess | None = None
    try:
        eng = b.engine("decode-hicache", max_model_len=max_len, num_blocks=blocks, hicache_config=str(daemon.config))
        for i, ctx in enumerate(sorted(contexts)):
            [ids] = b.prompts(1, ctx, seed=100 + i)
            eng.generate([ids], 1, timeout_s=3600)
            daemon.wait_backups()
            before = daemon.stats()["engine"]
            r = eng.generate([ids], decode_tokens, timeout_s=3600)
            daemon.wait_backups()
            after = daemon.stats()["engine"]
            gen_blocks = decode_tokens / b.block_size
            row = {"context": ctx, "generated_blocks": gen_blocks,
                   "reserves_per_block": (after["reserves"] - before["reserves"]) / gen_blocks,
                   "tokens_per_block": (after["reserve_tokens_received"] - before["reserve_tokens_received"])
                   / gen_blocks, "cached": int(r["cached"][0])}
            rows.append(row)
            b.progress(f"decode {ctx:6d}-token context: {row['reserves_per_block']:.2f} reserves and "
                       f"{row['tokens_per_block']:.1f} token ids per generated block")
    finally:
        if eng is not None:
            eng.stop()
        daemon.stop()
    ref = rows[0]
    figures = []
    for row in rows[1:]:
        figures.append(Figure(f"decode: token ids sent per block, {row['context']}-token context", "ids/block",
                              row["tokens_per_block"], f"{ref['context']}-token context", ref["tokens_per_block"],
                              higher_is_better=False, goal=1.1))
        figures.append(Figure(f"decode: reserves per block, {row['context']}-token context", "msgs/block",
                              row["reserves_per_block"], f"{ref['context']}-token context",
                              ref["reserves_per_block"], higher_is_better=False, goal=1.1))
    return figures, {"rows": rows, "decode_tokens": decode_tokens, "block_size": b.block_size}


# ---------------------------------------------------------------------- steps


STEP_KINDS = ("l3", "l2", "miss")
"""The mixed workload of ``run_steps``: request ``i`` is a ``STEP_KINDS[i % 3]``."""


def run_steps(b: Bench, *, requests: int, prompt_tokens: int, max_tokens: int,
              copy_modes: tuple[str, ...] = ("sync",)) -> tuple[list[Figure], dict[str, Any]]:
    """vLLM's step time under a mixed workload, with hicache against vLLM alone.

    ``requests`` prompts arrive two engine steps apart (``VllmProcess.steps``: the engine
    core runs in the driver's process, so each step's wall time and its scheduler part are
    measured there) and decode ``max_tokens`` tokens each, all concurrently. A third of the
    prompts are L3 hits for hicache (saved, backed up, then flushed from L2: the daemon
    prefetches them while vLLM goes on with the others), a third L2 hits, a third misses.
    The reference is vLLM alone serving the same hits from its own prefix cache (it
    computed those prompts first), so both engines do the same model work and the ratio is
    what hicache costs per step: lookups, reserves, loads, saves and the wait for L3. The
    hicache engine runs once per ``copy_modes`` entry (``hicache_copy``), each with a new
    daemon, against the one reference. Every run's greedy outputs are compared with it."""
    prompts = b.prompts(requests, prompt_tokens, seed=40)
    kinds = [STEP_KINDS[i % len(STEP_KINDS)] for i in range(requests)]
    arrivals = [2 * i for i in range(requests)]
    max_len = round_up(prompt_tokens + max_tokens + b.block_size, b.block_size)
    blocks = 3 * requests * max_len // b.block_size + 16
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    hits = {k: [p for p, kind in zip(prompts, kinds, strict=True) if kind == k] for k in STEP_KINDS}
    common: dict[str, Any] = dict(prefix_caching=True, max_model_len=max_len, num_blocks=blocks,
                                  max_num_seqs=max(16, requests), env=in_process)
    alone = b.engine("steps-vllm", **common)
    try:
        alone.generate(hits["l3"] + hits["l2"], 1, timeout_s=3600)  # its own prefix cache holds the hits
        ref = alone.steps(prompts, arrivals, max_tokens)
    finally:
        alone.stop()
    b.progress(f"steps vLLM alone: {len(ref['step_s'])} steps")
    figures = []
    extra: dict[str, Any] = {"requests": requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                             "kinds": kinds, "vllm_cached": ref["cached"], "vllm_steps": len(ref["step_s"]),
                             "vllm_step_s": ref["step_s"], "vllm_schedule_s": ref["schedule_s"]}
    for mode in copy_modes:
        got, counters = _steps_with_hicache(b, mode, prompts, arrivals, max_tokens, hits, common,
                                            round_up(2 * requests * max_len + 4096, b.block_size))
        for name, key in (("step time", "step_s"), ("scheduler time per step", "schedule_s")):
            mine, theirs = got[key], ref[key]
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                figures.append(Figure(f"steps ({mode} copies): vLLM {name} {label} (a third L3 hits)", "ms",
                                      percentile(mine, q) * 1000, "vLLM alone (own prefix hits)",
                                      percentile(theirs, q) * 1000, higher_is_better=False,
                                      goal=1.1 if key == "step_s" and label == "p99" else None))
        extra[mode] = {"same_output_tokens": got["outputs"] == ref["outputs"],
                       "hicache_cached": {k: [c for c, kind in zip(got["cached"], kinds, strict=True) if kind == k]
                                          for k in STEP_KINDS},
                       "steps": len(got["step_s"]), "daemon": counters, "step_s": got["step_s"],
                       "schedule_s": got["schedule_s"]}
    return figures, extra


def _steps_with_hicache(b: Bench, mode: str, prompts: list[list[int]], arrivals: list[int], max_tokens: int,
                        hits: dict[str, list[list[int]]], common: dict[str, Any],
                        l2_tokens: int) -> tuple[dict[str, Any], dict[str, int]]:
    """``run_steps``'s hicache run with ``hicache_copy: mode``: its L3 and L2 hits placed, then
    the steps; the engine's answers and the daemon's counters over the steps."""
    daemon = b.daemon(f"steps-hicache-{mode}", l2_tokens)
    eng: VllmProcess | None = None
    try:
        eng = b.engine(f"steps-hicache-{mode}", kv_transfer=connector_config(str(daemon.config), copy_mode=mode),
                       **common)
        eng.generate(hits["l3"], 1, timeout_s=3600)
        daemon.wait_backups()
        daemon.flush()  # L2 forgets them; the file L3 keeps them
        eng.generate(hits["l2"], 1, timeout_s=3600)
        daemon.wait_backups()
        eng.reset_prefix_cache()  # vLLM forgets all of them: hicache serves the hits
        before = daemon.stats()["engine"]
        got = eng.steps(prompts, arrivals, max_tokens)
        after = daemon.stats()["engine"]
    finally:
        if eng is not None:
            eng.stop()
        daemon.stop()
    b.progress(f"steps vLLM + hicache ({mode} copies): {len(got['step_s'])} steps")
    counters = {k: after[k] - before[k] for k in ("lookups", "lookup_pending", "lookup_storage_pages",
                                                  "lookup_hit_pages", "reserves", "save_ranges")}
    return got, counters
