"""The engine's runtime identity: everything besides the checkpoint that changes KV bytes.

Two engines of one checkpoint, dtype and block size can still write different bytes for the
same tokens: another vLLM or torch version, another attention backend, another kernel ISA
(vLLM's CPU attention picks ``amx``, ``vec``, ``vec16``, ``neon``... per host, and the AMX
kernels write K/V in a packed layout), a KV cache dtype, a RoPE scaling or any other
``hf_overrides``, a quantization, a compilation mode, a tensor-parallel degree. ``runtime_identity`` hashes all of
them, with the engine's cache-reset generation, into 64 hex characters; the daemon keeps
each identity's pages in a namespace of their own (``hicache.cache_server.server``), in L2
and in L3.

Every field of vLLM's ``ModelConfig``, ``CacheConfig``, ``AttentionConfig``, ``LoadConfig``
(which weights: ``--load-format dummy`` runs random ones on the same model directory) and
``CompilationConfig`` is classified here, as changing values (hashed) or not (ignored). A
field this module does not know (another vLLM) refuses the engine, naming the field; so
does a value it cannot encode stably.

Tests replace entries of the identity through a fault point (``hicache.connectors.faults``)
to model an engine of another host.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from typing import Any

import torch
import vllm

RUNTIME_IDENTITY_VERSION = "hicache-runtime-identity-v2"


class UnclassifiedOption(ValueError):
    """An engine option whose effect on KV bytes is unknown; the message names it."""


# Per config section: the fields whose values can change the KV bytes an engine writes for
# the same tokens (hashed), and those that cannot (scheduling, memory, I/O, naming; the
# checkpoint itself is fingerprinted separately, ``hicache.cache_server.geometry``).
VALUE_FIELDS: dict[str, frozenset[str]] = {
    "model": frozenset({
        "model_weights", "runner", "convert", "dtype", "hf_config", "revision", "code_revision",
        "trust_remote_code", "quantization", "quantization_config", "disable_sliding_window", "hf_overrides",
        "model_class_overrides", "model_impl", "enforce_eager",
    }),
    "cache": frozenset({
        "block_size", "kv_cache_layout", "cache_dtype", "kv_cache_dtype_skip_layers", "sliding_window",
        "is_attention_free", "mamba_block_size", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_cache_mode",
        "effective_attention_block_size", "kv_sharing_fast_prefill", "use_replayssm", "use_kda_recoverssm",
        "replayssm_buffer_len", "swa_bounded_replay", "enable_mamba_shared_prefix_checkpoint",
    }),
    "attention": frozenset({"*"}),  # every attention option picks kernels: all hashed
    # which weights the engine runs: ``dummy`` (random values), another format or loader
    # option on the same model directory writes other bytes than its checkpoint fingerprint says
    "load": frozenset({
        "load_format", "download_dir", "safetensors_load_strategy", "model_loader_extra_config", "device",
        "ignore_patterns", "pt_load_map_location",
    }),
    "compilation": frozenset({"mode", "backend", "custom_ops", "splitting_ops", "use_inductor_graph_partition",
                              "pass_config", "inductor_compile_config", "compile_sizes", "fuse_ops"}),
}
NEUTRAL_FIELDS: dict[str, frozenset[str]] = {
    "model": frozenset({
        "model", "tokenizer", "tokenizer_mode", "seed", "hf_text_config", "is_submodel_config",
        "word_embeddings_untied_by_checkpoint", "hf_config_path", "allowed_local_media_path",
        "allowed_media_domains", "tokenizer_revision", "max_model_len", "spec_target_max_model_len",
        "allow_deprecated_quantization", "return_sampling_mask", "max_logprobs", "logprobs_mode",
        "use_fp64_gumbel", "enable_trace_replay", "disable_cascade_attn", "skip_tokenizer_init",
        "enable_prompt_embeds", "served_model_name", "config_format", "hf_token", "generation_config",
        "override_generation_config", "enable_sleep_mode", "sleep_preserve_parameter_names", "sleep_mode_backend",
        "sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend", "enable_cumem_allocator", "logits_processors",
        "io_processor_plugin", "renderer_num_workers", "pooler_config", "multimodal_config",
    }),
    "cache": frozenset({
        "user_specified_block_size", "prefix_match_unit", "gpu_memory_utilization", "num_gpu_blocks_override",
        "enable_prefix_caching", "prefix_caching_hash_algo", "prefix_cache_retention_interval",
        "mamba_page_size_padded", "skip_page_size_padded", "num_gpu_blocks", "num_cpu_blocks",
        "kv_cache_size_tokens", "kv_cache_max_concurrency", "hash_block_size", "cache_hit_alignment_tokens",
        "kv_cache_memory_bytes", "kv_offloading_size", "kv_offloading_backend", "_block_size_resolved",
    }),
    "attention": frozenset(),
    "load": frozenset({"safetensors_prefetch_num_threads", "safetensors_prefetch_block_size", "use_tqdm_on_load"}),
    # the rest of CompilationConfig: what is captured, cached or logged, not which kernels run
    "compilation": frozenset({"*"}),
}


def _stable(value: Any, where: str) -> Any:
    """``value`` as JSON data that is the same in every process, or UnclassifiedOption."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, enum.Enum):
        return _stable(value.value, where)
    if isinstance(value, dict):
        return {str(k): _stable(v, f"{where}.{k}") for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_stable(v, where) for v in value]
        return sorted(items, key=json.dumps) if isinstance(value, (set, frozenset)) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _stable(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _stable(to_dict(), where)
    if hasattr(value, "model_dump"):
        return _stable(value.model_dump(), where)
    raise UnclassifiedOption(f"{where}: a {type(value).__name__} value that cannot be compared across engines")


def _section(name: str, config: Any) -> dict[str, Any]:
    """The hashed fields of one config section; refuses a field it does not classify."""
    values, neutral = VALUE_FIELDS[name], NEUTRAL_FIELDS[name]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name in neutral or ("*" in neutral and f.name not in values):
            continue
        if f.name not in values and "*" not in values:
            raise UnclassifiedOption(f"{name}_config.{f.name}: hicache does not know whether it changes KV bytes")
        out[f.name] = _stable(getattr(config, f.name), f"{name}_config.{f.name}")
    if isinstance(out.get("hf_config"), dict):
        out["hf_config"].pop("_name_or_path", None)  # where the checkpoint lies changes no byte
    return out


def attention_isa(vllm_config: Any, head_size: int) -> str:
    """The kernel ISA vLLM's CPU attention uses for this engine (its own choice function)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache = vllm_config.cache_config
    return str(_get_attn_isa(vllm_config.model_config.dtype, cache.block_size, head_size, cache.cache_dtype))


def mla_backend(vllm_config: Any) -> str:
    """The MLA backend vLLM's CPU platform picks for this engine (its own rule): AMX where
    the CPU has AMX tiles and the reference backend was not asked for, else the reference."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import CpuArchEnum

    asked = vllm_config.attention_config.backend
    amx = CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()
    return "AMX_MLA" if amx and getattr(asked, "name", None) != "CPU_MLA" else "CPU_MLA"


def runtime_entries(vllm_config: Any, head_size: int, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the identity hashes, by name (but the reset generation); ``override`` replaces
    entries (a test's fault point)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    mla = vllm_config.model_config.use_mla
    entries: dict[str, Any] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": vllm_config.device_config.device_type,
        "attention_backend": mla_backend(vllm_config) if mla else CPUAttentionBackend.get_name(),
        "isa": "" if mla else attention_isa(vllm_config, head_size),
        # ranks all-reduce partial sums: another rank count writes other bytes for the same tokens
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "model_config": _section("model", vllm_config.model_config),
        "cache_config": _section("cache", vllm_config.cache_config),
        "attention_config": _section("attention", vllm_config.attention_config),
        "load_config": _section("load", vllm_config.load_config),
        "compilation_config": _section("compilation", vllm_config.compilation_config),
    }
    entries.update(override or {})
    return entries


def runtime_identity(entries: dict[str, Any], reset_generation: str) -> str:
    """64 hex characters naming ``entries`` and the engine's cache-reset generation
    (empty until the engine's first ``reset_cache``)."""
    doc = json.dumps({"version": RUNTIME_IDENTITY_VERSION, "entries": entries, "reset": reset_generation},
                     sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()
