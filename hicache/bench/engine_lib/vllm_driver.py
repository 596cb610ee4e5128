"""A vLLM engine in a child process, driven over its stdin/stdout: tests and ``bench engine``.

``python -m hicache.bench.engine_lib.vllm_driver --model DIR [--hicache-config YAML] ...``
starts ``vllm.LLM`` (with ``HiCacheConnector`` when ``--hicache-config`` is given), prints
``{"ready": true, "start_s": ...}`` and then answers one JSON line per JSON request line:

* ``{"op": "generate", "prompts": [[ids...]], "max_tokens": N, "cache_salt": S|null}``
  -> ``{"outputs": [[ids...]], "cached": [n...], "finish": [reason...], "elapsed_s": t}``
  (greedy; ``cached`` is vLLM's ``num_cached_tokens``: its own prefix hit plus what the
  connector loaded; ``finish``: each request's finish reason, ``error`` for a failed one);
* ``{"op": "reset_prefix_cache", "reset_connector": bool}`` -> ``{"ok": bool}`` (drops vLLM's
  own prefix cache; with ``reset_connector``, the connector's too, as vLLM does after a
  weight update);
* ``{"op": "reset_while_running", "prompt": [ids...], "max_tokens": N, "steps": K}`` -> the
  prompt added and stepped ``K`` times, then ``reset_prefix_cache(reset_connector=True)``
  while it still holds blocks, then stepped to its end: ``{"ok": bool, "outputs": [[ids...]],
  "cached": [n]}`` (``ok``: what the reset returned; vLLM's own fails while a request holds
  blocks);
* ``{"op": "metrics", "prefix": P}`` -> ``{"metrics": [{"name", "labels", "value"}...]}``:
  vLLM's own Prometheus metrics whose name starts with ``P`` (needs ``--log-stats``);
* ``{"op": "steps", "prompts": [[ids...]], "arrivals": [step...], "max_tokens": N or [N...]}``
  -> the prompts fed to the engine step by step (prompt ``i`` added before step
  ``arrivals[i]``, decoding ``max_tokens`` or ``max_tokens[i]`` tokens), stepped until all
  finished: ``{"outputs", "cached", "finished_at": [...], "added_at": [...], "token_at":
  [[...]...], "step_s": [...], "schedule_s": [...]}``: when each request finished, was added
  and got each of its tokens (``time.monotonic()``, comparable across processes), the wall
  time of each engine step and of the scheduler's part of it (``schedule`` and
  ``update_from_output``, where a KV connector's scheduler half runs; empty unless the
  engine core runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
* ``{"op": "exit"}`` -> exits.

``--num-blocks`` sets vLLM's KV space in blocks (``num_gpu_blocks_override``: the
``VLLM_CPU_KVCACHE_SPACE`` variable takes whole GiB only); ``--kv-transfer-json`` loads any
other connector (vLLM's ``OffloadingConnector``, LMCache's) for comparisons;
``--kv-events-json`` turns vLLM's own KV event publisher on (its ``kv_events_config``).

``VllmProcess`` is the parent side. Nothing here is imported by the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def connector_config(hicache_config: str, copy_mode: str = "sync", role: str = "kv_both") -> dict[str, Any]:
    """The ``kv_transfer_config`` of an engine with the connector (docs/engine-mode.md)."""
    return {"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache.connectors.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"hicache_config": hicache_config, "hicache_copy": copy_mode}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--hicache-config", default=None)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefix-caching", action="store_true", help="keep vLLM's own prefix cache on")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks, each in a worker process of its own (VLLM_CPU_OMP_THREADS_BIND: one core list per rank)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="vLLM's KV space in blocks (VLLM_CPU_KVCACHE_SPACE takes whole GiB only)")
    p.add_argument("--log-stats", action="store_true", help="keep vLLM's stats on (the metrics op)")
    p.add_argument("--kv-transfer-json", default=None,
                   help="any kv_transfer_config (another connector, or hicache's with other settings); "
                        "it wins over --hicache-config")
    p.add_argument("--kv-events-json", default=None,
                   help="vLLM's kv_events_config (its own KV event publisher), as JSON")
    p.add_argument("--attention-backend", default=None,
                   help="vLLM's attention backend by name (e.g. CPU_MLA: the reference MLA backend, which "
                        "vLLM's CPU platform otherwise replaces by AMX_MLA where the CPU has AMX tiles)")
    args = p.parse_args(argv)
    # Only answers go to the parent's pipe: vLLM and its engine-core child print to fd 1.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if args.kv_transfer_json:  # given with --hicache-config too: the connector's other settings
        kw["kv_transfer_config"] = json.loads(args.kv_transfer_json)
    elif args.hicache_config:
        kw["kv_transfer_config"] = connector_config(args.hicache_config)
    if args.num_blocks:
        kw["num_gpu_blocks_override"] = args.num_blocks
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.log_stats:
        kw["disable_log_stats"] = False
    if args.kv_events_json:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(**json.loads(args.kv_events_json))
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = args.tensor_parallel_size
        kw["distributed_executor_backend"] = "mp"
    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    began = time.perf_counter()
    try:
        llm = LLM(model=args.model, skip_tokenizer_init=True, block_size=args.block_size, dtype=args.dtype,
                  max_model_len=args.max_model_len, enforce_eager=True, enable_prefix_caching=args.prefix_caching,
                  max_num_seqs=args.max_num_seqs, **kw)
    except Exception as exc:  # a refused start: say why, and exit at once (no wait for vLLM's
        # workers to wind down: the parent kills the driver's whole session)
        import traceback

        traceback.print_exc()
        answer({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        sys.stderr.flush()
        os._exit(1)

    answer({"ready": True, "start_s": time.perf_counter() - began})
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        if op == "exit":
            break
        if op == "reset_prefix_cache":
            answer({"ok": bool(llm.reset_prefix_cache(reset_connector=bool(req.get("reset_connector"))))})
            continue
        if op == "reset_while_running":
            answer(_reset_while_running(llm, TokensPrompt(prompt_token_ids=req["prompt"]),  # type: ignore[typeddict-item]
                                        SamplingParams(max_tokens=int(req.get("max_tokens", 8)), temperature=0.0,
                                                       ignore_eos=True), int(req.get("steps", 1))))
            continue
        if op == "metrics":
            prefix = str(req.get("prefix", ""))
            answer({"metrics": [{"name": m.name, "labels": m.labels, "value": getattr(m, "value", None)}
                                for m in llm.get_metrics() if m.name.startswith(prefix)]})
            continue
        if op not in ("generate", "steps"):
            answer({"error": f"unknown op {op!r}"})
            continue
        salt = req.get("cache_salt")
        prompts: list[TokensPrompt] = []
        for ids in req["prompts"]:
            # vLLM marks the optional keys with typing.NotRequired, unknown to mypy for Python 3.10
            prompt = TokensPrompt(prompt_token_ids=ids)  # type: ignore[typeddict-item]
            if salt:
                prompt["cache_salt"] = salt
            prompts.append(prompt)
        wanted = req.get("max_tokens", 8)
        if op == "steps":
            each = wanted if isinstance(wanted, list) else [wanted] * len(prompts)
            answer(_steps(llm, prompts, [int(a) for a in req["arrivals"]],
                          [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in each]))
            continue
        params = SamplingParams(max_tokens=int(wanted), temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        answer({"outputs": [list(r.outputs[0].token_ids) for r in results],
                "cached": [int(r.num_cached_tokens or 0) for r in results],
                "finish": [str(r.outputs[0].finish_reason) for r in results], "elapsed_s": elapsed})
    return 0


def _reset_while_running(llm: Any, prompt: Any, params: Any, steps: int) -> dict[str, Any]:
    """The ``reset_while_running`` op (see the module docstring)."""
    engine = llm.llm_engine
    engine.add_request("running", prompt, params)
    done: list[Any] = []
    for _ in range(steps):
        done += [o for o in engine.step() if o.finished]
    ok = bool(llm.reset_prefix_cache(reset_connector=True))
    while not done:
        done += [o for o in engine.step() if o.finished]
    return {"ok": ok, "outputs": [list(done[0].outputs[0].token_ids)], "cached": [int(done[0].num_cached_tokens or 0)]}


def _steps(llm: Any, prompts: list[Any], arrivals: list[int], params: list[Any]) -> dict[str, Any]:
    """The ``steps`` op (see the module docstring)."""
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)  # in-process engine core only
    scheduler_s = [0.0]
    restore: list[tuple[Any, str, Any]] = []
    if core is not None:
        sched = core.scheduler
        for name in ("schedule", "update_from_output"):
            original = getattr(sched, name)

            def timed(*a: Any, _original: Any = original, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _original(*a, **kw)
                finally:
                    scheduler_s[0] += time.perf_counter() - t

            setattr(sched, name, timed)
            restore.append((sched, name, original))
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    results: dict[str, Any] = {}
    finished_at: dict[str, float] = {}
    added_at: dict[str, float] = {}
    token_at: dict[str, list[float]] = {f"steps-{i}": [] for i in range(len(prompts))}
    step_s: list[float] = []
    schedule_s: list[float] = []
    step = 0
    try:
        while len(results) < len(prompts):
            while order and arrivals[order[0]] <= step:
                i = order.pop(0)
                engine.add_request(f"steps-{i}", prompts[i], params[i])
                added_at[f"steps-{i}"] = time.monotonic()
            scheduler_s[0] = 0.0
            t0 = time.perf_counter()
            outs = engine.step()
            step_s.append(time.perf_counter() - t0)
            if core is not None:
                schedule_s.append(scheduler_s[0])
            now = time.monotonic()
            for out in outs:
                times = token_at[out.request_id]
                times += [now] * (len(out.outputs[0].token_ids) - len(times))
                if out.finished:
                    results[out.request_id] = out
                    finished_at[out.request_id] = time.monotonic()
            step += 1
    finally:
        for obj, name, original in restore:
            setattr(obj, name, original)
    done = [results[f"steps-{i}"] for i in range(len(prompts))]
    return {"outputs": [list(r.outputs[0].token_ids) for r in done],
            "cached": [int(r.num_cached_tokens or 0) for r in done],
            "finished_at": [finished_at[f"steps-{i}"] for i in range(len(prompts))],
            "added_at": [added_at[f"steps-{i}"] for i in range(len(prompts))],
            "token_at": [token_at[f"steps-{i}"] for i in range(len(prompts))], "step_s": step_s,
            "schedule_s": schedule_s}


def _all_cores(ranks: int = 1) -> str:
    """The cores this process may run on, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` list: one
    list per tensor-parallel rank, ``|`` between them (the cores dealt out in turn; a rank
    shares a core when there are fewer cores than ranks).

    Left to itself (``auto``) vLLM keeps one core back for its own threads, but not when a
    KV connector is configured, so an engine with a connector computes on more threads than
    one without: a comparison of the two must bind both to the same cores."""
    cores = sorted(os.sched_getaffinity(0))
    lists = [cores[r::ranks] or [cores[r % len(cores)]] for r in range(ranks)]
    return "|".join(",".join(str(c) for c in cpus) for cpus in lists)


class VllmError(RuntimeError):
    """The engine process failed to start or to answer; the message carries its log's tail."""


class VllmProcess:
    """The parent side: start the driver, send requests, read answers, stop it.

    ``env`` is added to the child's environment (``VLLM_CPU_KVCACHE_SPACE`` and the like);
    the child's stderr goes to ``log_path``.
    """

    def __init__(self, model: str, log_path: str | Path, *, hicache_config: str | None = None,
                 block_size: int = 32, max_model_len: int = 2048, dtype: str = "auto", prefix_caching: bool = False,
                 max_num_seqs: int = 16, max_num_batched_tokens: int | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 300.0,
                 num_blocks: int | None = None, kv_transfer: dict[str, Any] | None = None,
                 log_stats: bool = False, tensor_parallel: int = 1, kv_events: dict[str, Any] | None = None,
                 attention_backend: str | None = None) -> None:
        cmd = [sys.executable, "-m", "hicache.bench.engine_lib.vllm_driver", "--model", model,
               "--block-size", str(block_size), "--max-model-len", str(max_model_len), "--dtype", dtype,
               "--max-num-seqs", str(max_num_seqs)]
        if hicache_config:
            cmd += ["--hicache-config", hicache_config]
        if prefix_caching:
            cmd.append("--prefix-caching")
        if max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if num_blocks:
            cmd += ["--num-blocks", str(num_blocks)]
        if kv_transfer is not None:
            cmd += ["--kv-transfer-json", json.dumps(kv_transfer)]
        if log_stats:
            cmd.append("--log-stats")
        if kv_events is not None:
            cmd += ["--kv-events-json", json.dumps(kv_events)]
        if tensor_parallel > 1:
            cmd += ["--tensor-parallel-size", str(tensor_parallel)]
        if attention_backend:
            cmd += ["--attention-backend", attention_backend]
        self.log_path = Path(log_path)
        child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                     "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_OMP_THREADS_BIND": _all_cores(tensor_parallel), **(env or {})}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=child_env, text=True, start_new_session=True)
        try:
            ready = self._read(start_timeout_s)
            if not ready.get("ready"):
                raise VllmError(f"vLLM did not start: {ready.get('error', ready)}; log tail:\n{self.log_tail()}")
        except VllmError:
            self.kill()
            raise
        self.start_s = float(ready["start_s"])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def processes(self) -> dict[int, str]:
        """The engine's live processes (the driver, vLLM's engine core, its workers): pid ->
        command line, read from /proc (all run in the driver's session)."""
        out: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_bytes()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2:].split()
            if int(fields[3]) == self.proc.pid and fields[0] not in (b"Z", b"X"):  # field 6: the session
                out[int(entry.name)] = cmdline
        return out

    def _read(self, timeout_s: float) -> dict[str, Any]:
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                line = self.proc.stdout.readline()
                if line:
                    message: dict[str, Any] = json.loads(line)  # the driver answers one JSON object a line
                    return message
            if self.proc.poll() is not None:
                break
        raise VllmError(f"vLLM (pid {self.proc.pid}) gave no answer (exit code {self.proc.poll()}); "
                        f"log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def request(self, obj: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, cache_salt: str | None = None,
                 timeout_s: float = 300.0) -> dict[str, Any]:
        return self.request({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                             "cache_salt": cache_salt}, timeout_s)

    def steps(self, prompts: list[list[int]], arrivals: list[int], max_tokens: int | list[int],
              timeout_s: float = 3600.0) -> dict[str, Any]:
        """The ``steps`` op: per-step wall times of a staggered batch (module docstring)."""
        return self.request({"op": "steps", "prompts": prompts, "arrivals": arrivals, "max_tokens": max_tokens},
                            timeout_s)

    def metrics(self, prefix: str) -> list[dict[str, Any]]:
        """vLLM's own metrics whose name starts with ``prefix`` (started with ``log_stats``)."""
        out: list[dict[str, Any]] = self.request({"op": "metrics", "prefix": prefix})["metrics"]
        return out

    def reset_while_running(self, prompt: list[int], max_tokens: int, steps: int = 1) -> dict[str, Any]:
        """The ``reset_while_running`` op (module docstring)."""
        return self.request({"op": "reset_while_running", "prompt": prompt, "max_tokens": max_tokens, "steps": steps})

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        return bool(self.request({"op": "reset_prefix_cache", "reset_connector": reset_connector}).get("ok"))

    def kill(self) -> None:
        """SIGKILL the whole engine (its engine-core child too)."""
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"op": "exit"}, timeout_s=0.1)
            except (VllmError, OSError, ValueError):
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.kill()
            return
        import signal

        try:  # the engine core may outlive the driver for a moment
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()


def save_random_model(out_dir: str | Path, *, arch: str = "llama", layers: int = 2, hidden: int = 128,
                      heads: int = 4, kv_heads: int = 2, head_dim: int = 32, vocab: int = 1024,
                      intermediate: int = 256, dtype: str = "bfloat16", seed: int = 0,
                      max_positions: int = 8192, sliding_window: int = 64, linear_heads: int = 1) -> Path:
    """Save a small checkpoint with random weights (nothing is downloaded): ``llama``,
    ``qwen2``, ``gemma3`` (text only; layers alternate a sliding window of
    ``sliding_window`` tokens and full attention, the first sliding), ``mistral`` (every
    layer has the sliding window), ``qwen3_next`` (gated delta net layers, whose state vLLM
    keeps per block, alternating with full attention, the first a GDN layer; ``linear_heads``
    key and value heads of 128 each) or
    ``deepseek_v2`` (multi-head latent attention with
    vLLM's CPU MLA sizes: a latent of 512 + 64 rotary; dense MLPs; ``head_dim`` is the
    per-head query and value size)."""
    import torch
    import transformers

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  torch_dtype=dtype)
    cfg: transformers.PretrainedConfig
    cls: Any  # the causal-LM class of cfg (each takes its own config class only)
    if arch == "llama":
        cfg = transformers.LlamaConfig(head_dim=head_dim, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        if hidden // heads != head_dim:
            raise ValueError("qwen2 derives head_dim from hidden_size / num_attention_heads")
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "gemma3":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        cfg = transformers.Gemma3TextConfig(head_dim=head_dim, sliding_window=sliding_window, layer_types=types,
                                            query_pre_attn_scalar=head_dim, **common)
        cls = transformers.Gemma3ForCausalLM
    elif arch == "deepseek_v2":
        cfg = transformers.DeepseekV2Config(kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=None,
                                            qk_nope_head_dim=head_dim, v_head_dim=head_dim,
                                            first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=intermediate // 4, **common)
        cls = transformers.DeepseekV2ForCausalLM
    elif arch == "qwen3_next":
        # gated delta net layers ("linear_attention") alternate with full attention, the first linear;
        # vLLM's CPU GDN kernel wants key / value head dims of 128; a tiny MoE
        types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        cfg = transformers.Qwen3NextConfig(head_dim=head_dim, layer_types=types, linear_num_key_heads=linear_heads,
                                           linear_num_value_heads=linear_heads, linear_key_head_dim=128,
                                           linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=intermediate // 4,
                                           shared_expert_intermediate_size=intermediate // 4, decoder_sparse_step=1,
                                           **common)
        cls = transformers.Qwen3NextForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(head_dim=head_dim, sliding_window=sliding_window, **common)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    from hicache.runtime.proc import exit_after_orderly_stop

    code = main()  # vLLM's engine shuts down in its atexit finalizers, which still run
    exit_after_orderly_stop(code)
