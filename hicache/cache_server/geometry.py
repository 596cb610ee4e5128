"""What one KV page of an engine is: the model it belongs to and its byte geometry.

Both sides compute it: the daemon from ``engine.*`` in its config (``geometry_from_config``)
and the connector from what vLLM tells it; the daemon refuses an engine whose geometry
differs in any field (``EngineKVGeometry.mismatch``), so a page is only ever read by an
engine whose KV has exactly the layout it was written in.

The identity that namespaces page hashes covers the checkpoint (config + weights, as for
the builtin model: ``hicache.model.fingerprint``), the KV dtype and the engine's per-block
byte layout, so two engines with another model, dtype or layout never share a page, in L2
or in L3.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from hicache.model import hf_config
from hicache.model.hf_config import CheckpointError
from protos import KV_DTYPE_BYTES, EngineKVGeometry

if TYPE_CHECKING:
    from hicache.config import DType

ENGINE_IDENTITY_VERSION = b"hicache-engine-identity-v1"

_MODEL_DTYPES: dict[str, DType] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
"""The KV dtypes (``KV_DTYPE_BYTES``) as ``ModelConfig.dtype`` values."""


class EngineModelError(ValueError):
    """The engine's model cannot be served in engine mode; the message says why."""


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (``hicache.model.hf_config``), EngineModelError naming the file."""
    try:
        return hf_config.read_hf_config(model_dir)
    except CheckpointError as exc:
        raise EngineModelError(str(exc)) from None


def checkpoint_dtype(raw: dict[str, Any]) -> str:
    """The dtype a checkpoint's config names (``torch_dtype``, or ``dtype`` in newer files)."""
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if name not in KV_DTYPE_BYTES:
        raise EngineModelError(f"config.json dtype {name!r} is not one of {', '.join(KV_DTYPE_BYTES)}")
    return str(name)


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""``layer_types`` values engine mode holds: attention layers, full or sliding-window (their
KV has one shape; vLLM's hybrid allocator keeps them in separate groups, the connector
copies each with its group's blocks)."""

STATE_LAYER_KEYS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "mamba_d_state",
                    "ssm_state_size", "linear_num_value_heads")
"""config.json keys of models with recurrent-state layers (Mamba, GDN / linear attention).
Engine mode holds the state of ``GDN_MODEL_TYPES`` only; the others are refused naming the key."""

GDN_MODEL_TYPES = ("qwen3_next",)
"""``model_type`` values whose ``linear_attention`` layers are a gated delta net, whose state
engine mode holds (``state_shape``)."""

STATE_LAYER_TYPE = "linear_attention"
"""The ``layer_types`` value of a GDN layer."""

def gdn_ssm_dtype_bytes(kv_dtype: str) -> int:
    """Bytes of one element of a GDN layer's recurrent (SSM) state as vLLM 0.32's CPU build
    keeps it with ``mamba_ssm_cache_dtype`` left at ``auto``: on a host with AVX-512 BF16 it
    resets the state to float32 for its accelerated GDN kernel (4 bytes); elsewhere the state
    has the model's dtype. The conv state always has the model's dtype. The engine states its
    own bytes when it registers, so a rule that drifts is refused by name, never misread."""
    return 4 if _cpu_has_avx512_bf16() else KV_DTYPE_BYTES[kv_dtype]


def _cpu_has_avx512_bf16() -> bool:
    """The ``avx512_bf16`` CPU flag, which vLLM tests (through torch) before that reset; read
    from ``/proc/cpuinfo`` so that the daemon need not import torch."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in f)
    except OSError:
        return False


def state_shape(raw: dict[str, Any], kv_dtype: str, where: str = "config.json") -> tuple[int, int]:
    """``(state_layers, state_bytes)`` of a GDN model (``GDN_MODEL_TYPES``): its
    ``linear_attention`` layers and the bytes of one such layer's state as vLLM keeps it per
    block (the conv state, ``linear_conv_kernel_dim - 1`` rows of the query, key and value
    channels, in ``kv_dtype``, then the SSM state, ``value heads x key dim x value dim`` in
    ``gdn_ssm_dtype_bytes``); ``(0, 0)`` for another model."""
    if raw.get("model_type") not in GDN_MODEL_TYPES:
        return 0, 0
    types = raw.get("layer_types")
    if not isinstance(types, list):
        raise EngineModelError(f"{where}: a {raw.get('model_type')} config without layer_types")
    layers = sum(1 for t in types if t == STATE_LAYER_TYPE)
    if not layers:
        return 0, 0
    try:
        kheads, kdim, vheads, vdim, kernel = (hf_config.positive_int(raw, k, where) for k in (
            "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
            "linear_conv_kernel_dim"))
    except CheckpointError as exc:
        raise EngineModelError(str(exc)) from None
    conv = (kernel - 1) * (2 * kheads * kdim + vheads * vdim) * KV_DTYPE_BYTES[kv_dtype]
    ssm = vheads * kdim * vdim * gdn_ssm_dtype_bytes(kv_dtype)
    return layers, conv + ssm


def window_shape(raw: dict[str, Any], where: str = "config.json") -> tuple[int, int]:
    """``(window_layers, sliding_window)``: how many layers have a sliding window, and its
    tokens (``(0, 0)`` for none). ``layer_types`` names them where the config has it;
    without it, a ``sliding_window`` (not turned off by ``use_sliding_window: false``) is
    every layer's (Mistral)."""
    try:
        layers = hf_config.attention_sizes(raw, where).num_layers
    except CheckpointError as exc:
        raise EngineModelError(str(exc)) from None
    types = raw.get("layer_types")
    window = raw.get("sliding_window")
    if isinstance(types, list):
        count = sum(1 for t in types if t == "sliding_attention")
    else:
        count = layers if window is not None and raw.get("use_sliding_window") is not False else 0
    if not count:
        return 0, 0
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise EngineModelError(f"{where}: {count} sliding-window layers, but sliding_window is {window!r}")
    return count, window


def attention_shape(raw: dict[str, Any], where: str = "config.json") -> tuple[int, int, int, str]:
    """``(num_layers, num_kv_heads, head_dim, kv_kind)`` of a decoder's attention layers,
    full or sliding-window (every layer's KV block has that shape); a model with
    ``kv_lora_rank`` caches a latent (``mla``: one head of ``kv_lora_rank +
    qk_rope_head_dim``).

    A GDN model's ``linear_attention`` layers are not counted (``state_shape`` sizes their
    state); other models with recurrent-state layers (Mamba, linear attention) are refused,
    naming what says so."""

    try:
        sizes = hf_config.attention_sizes(raw, where)
        latent = (hf_config.positive_int(raw, "kv_lora_rank", where)
                  + hf_config.positive_int(raw, "qk_rope_head_dim", where) if raw.get("kv_lora_rank") else 0)
    except CheckpointError as exc:
        raise EngineModelError(str(exc)) from None
    types = raw.get("layer_types")
    gdn = raw.get("model_type") in GDN_MODEL_TYPES
    held = (*ATTENTION_LAYER_TYPES, STATE_LAYER_TYPE) if gdn else ATTENTION_LAYER_TYPES
    layers = sizes.num_layers
    if isinstance(types, list):
        other = sorted({str(t) for t in types} - set(held))
        if other:
            raise EngineModelError(f"{where}: layer_types {other}: engine mode holds attention KV "
                                   f"({', '.join(ATTENTION_LAYER_TYPES)}) and the gated delta net state of "
                                   f"{', '.join(GDN_MODEL_TYPES)} only")
        layers = sum(1 for t in types if t != STATE_LAYER_TYPE)
    state = [k for k in STATE_LAYER_KEYS if raw.get(k) not in (None, [], "") and not gdn]
    if state:
        raise EngineModelError(f"{where}: {', '.join(state)} set: a model with recurrent-state (Mamba / linear "
                               f"attention) layers; engine mode holds the gated delta net state of "
                               f"{', '.join(GDN_MODEL_TYPES)} only")
    if latent:
        return layers, 1, latent, "mla"
    return layers, sizes.num_kv_heads, sizes.head_dim, "kv"


NAMESPACE_CHARS = 32
"""Hex characters of an engine's runtime identity that prefix its session's salts (128 bits):
its *namespace* (docs/architecture.md §13)."""


def namespace_of(runtime_identity: str) -> str:
    """The namespace of the engines with ``runtime_identity``: they share pages, and only they."""
    return runtime_identity[:NAMESPACE_CHARS]


def engine_identity(model_dir: str, kv_dtype: str, kv_layout: str) -> str:
    """64 hex characters naming (checkpoint, KV dtype, KV layout)."""
    from hicache.config import ModelConfig
    from hicache.model.fingerprint import model_identity

    dtype = _MODEL_DTYPES.get(kv_dtype)
    if dtype is None:
        raise EngineModelError(f"KV dtype {kv_dtype!r} is not one of {', '.join(_MODEL_DTYPES)}")
    try:
        weights = model_identity(ModelConfig(kind="hf", path=model_dir, dtype=dtype))
    except (OSError, ValueError) as exc:
        raise EngineModelError(f"cannot fingerprint the checkpoint {model_dir}: {exc}") from exc
    h = hashlib.sha256(ENGINE_IDENTITY_VERSION)
    for part in (weights, kv_dtype, kv_layout):
        h.update(len(part).to_bytes(4, "little") + part.encode())
    return h.hexdigest()


def geometry_from_config(cfg: Any) -> EngineKVGeometry:
    """The geometry the daemon serves, from ``engine.*`` and ``cache.page_size`` of a
    ``HicacheConfig``. Raises EngineModelError naming the problem."""
    e = cfg.engine
    if not e.model:
        raise EngineModelError("engine.model is not set")
    raw = read_hf_config(e.model)
    dtype = checkpoint_dtype(raw) if e.kv_dtype == "auto" else e.kv_dtype
    where = f"{e.model}/config.json"
    layers, kv_heads, head_dim, kind = attention_shape(raw, where)
    window_layers, _ = window_shape(raw, where)
    state_layers, state_bytes = state_shape(raw, dtype, where)
    return EngineKVGeometry(engine_identity(e.model, dtype, e.kv_layout), dtype, cfg.cache.page_size, layers,
                            kv_heads, head_dim, e.kv_layout, kind, window_layers, state_layers, state_bytes)


def block_size_hint(daemon: int, engine: int) -> str:
    """What a refusal for another page size (``EngineKVGeometry.block_size``: tokens per page,
    the engine's block) adds: the setting to change on either side."""
    return (f"the daemon's pages are cache.page_size tokens: set cache.page_size: {engine} in its YAML "
            f"(and cache.l2.tokens a multiple of it), or start the engine with --block-size {daemon} where "
            f"vLLM keeps that block (it raises a hybrid model's; `hicache check-config` prints the block "
            f"vLLM runs engine.model with)")


def sliding_window_from_config(cfg: Any) -> int:
    """The sliding window (tokens) of ``engine.model``'s window layers, 0 without any: the
    window of the daemon's SWA component (a hit is valid where that many tokens before it
    have their window part)."""
    return window_shape(read_hf_config(cfg.engine.model), f"{cfg.engine.model}/config.json")[1]
