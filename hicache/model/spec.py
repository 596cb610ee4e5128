"""The architecture of a decoder, independent of where its weights come from.

``DecoderSpec`` is the one description the weights, the runner and the pool geometry are
derived from. It is built either from the reference model's config
(``spec_from_reference``) or from a Hugging Face ``config.json`` (``spec_from_hf_config``),
and is torch-free so that the scheduler can size pools without importing torch.

Supported Hugging Face families: Llama, Qwen2, Qwen3 and Mistral (``*ForCausalLM``). A
Mistral config with ``sliding_window`` set maps every layer to ``swa`` (served with an
index-only Full component: ``hicache.model.geometry``); a config with
``layer_types`` (``full_attention`` / ``sliding_attention``) maps layer by layer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.config import REFERENCE_PRESETS, ModelConfig, ReferenceModelConfig
from hicache.model.hf_config import CheckpointError, attention_sizes, positive_int, read_hf_config

LAYER_KINDS = ("full", "swa", "mamba")
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
REFERENCE_ARCHITECTURE = "hicache-reference-v1"
"""Bump when the reference model's math or weight initialisation changes (it is part of
the model identity, so old cached pages stop matching)."""

MAMBA_EXPAND = 2
MAMBA_CONV_KERNEL = 4


@dataclass(frozen=True)
class RopeScaling:
    """``rope_type`` is ``linear`` or ``llama3``; the other fields are that type's parameters."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class DecoderSpec:
    """Everything about a decoder's shape and math; no weights.

    Layer ``i`` is ``layer_kinds[i]``: ``full`` (causal attention over the whole prefix),
    ``swa`` (causal attention over the last ``sliding_window`` tokens, the current one
    included) or ``mamba`` (a selective state-space mixer, reference model only).
    """

    architecture: str
    layer_kinds: tuple[str, ...]
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    dtype: str = "float32"
    sliding_window: int | None = None
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    mamba_d_inner: int = 0
    mamba_d_conv: int = MAMBA_CONV_KERNEL
    mamba_state_size: int = 0
    mamba_dt_rank: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = [k for k in self.layer_kinds if k not in LAYER_KINDS]
        if bad or not self.layer_kinds:
            raise ValueError(f"layer_kinds must be a non-empty sequence of {LAYER_KINDS}, got {self.layer_kinds}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if "swa" in self.layer_kinds and not self.sliding_window:
            raise ValueError("swa layers need sliding_window >= 1")
        if "mamba" in self.layer_kinds and not (self.mamba_d_inner and self.mamba_state_size and self.mamba_dt_rank):
            raise ValueError("mamba layers need mamba_d_inner, mamba_state_size and mamba_dt_rank")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def count(self, kind: str) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    def to_json(self) -> str:
        """A canonical JSON rendering (sorted keys), used by the model identity."""
        from dataclasses import asdict

        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def spec_from_reference(ref: ReferenceModelConfig, dtype: str = "float32") -> DecoderSpec:
    """The reference decoder for a (possibly unresolved) ``model.reference`` section."""
    preset = REFERENCE_PRESETS[ref.preset]

    def get(name: str) -> Any:
        value = getattr(ref, name)
        return preset[name] if value is None else value

    hidden = int(get("hidden_size"))
    d_inner = MAMBA_EXPAND * hidden
    return DecoderSpec(
        architecture=REFERENCE_ARCHITECTURE,
        layer_kinds=tuple(get("layers")),
        hidden_size=hidden,
        num_heads=int(get("num_heads")),
        num_kv_heads=int(get("num_kv_heads")),
        head_dim=int(get("head_dim")),
        intermediate_size=int(get("intermediate_size")),
        vocab_size=int(get("vocab_size")),
        max_context=int(get("max_context")),
        dtype=dtype,
        sliding_window=int(get("sliding_window")),
        mamba_d_inner=d_inner,
        mamba_state_size=int(get("mamba_state_size")),
        mamba_dt_rank=max(1, math.ceil(hidden / 16)),
    )


def _int_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return ()


def _rope_scaling(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):  # newer configs fold theta and scaling into one mapping
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    theta = 10000.0 if theta is None else float(theta)
    if not scaling:
        return theta, None
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise CheckpointError(f"{where}: rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def spec_from_hf_config(raw: dict[str, Any], dtype: str = "float32", where: str = "config.json") -> DecoderSpec:
    """Map a Llama / Qwen2 / Qwen3 / Mistral ``config.json`` onto a ``DecoderSpec``."""
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    family = SUPPORTED_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if family is None or not isinstance(arch, str):
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise CheckpointError(
            f"{where}: unsupported architecture {arch!r} (model_type {raw.get('model_type')!r}); supported: {supported}"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{where}: hidden_act {act!r} is not supported (only silu)")

    def need(name: str) -> int:
        return positive_int(raw, name, where)

    sizes = attention_sizes(raw, where)
    num_layers = sizes.num_layers
    window = raw.get("sliding_window")
    kinds: tuple[str, ...]
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        mapping = {"full_attention": "full", "sliding_attention": "swa"}
        unknown = sorted({t for t in layer_types if t not in mapping})
        if unknown:
            raise CheckpointError(f"{where}: layer_types {unknown} are not supported")
        kinds = tuple(mapping[t] for t in layer_types)
    elif family == "mistral" and window:
        kinds = ("swa",) * num_layers
    elif family in ("qwen2", "qwen3") and raw.get("use_sliding_window") and window:
        first = raw.get("max_window_layers", num_layers)
        kinds = tuple("swa" if i >= first else "full" for i in range(num_layers))
    else:
        kinds = ("full",) * num_layers
    if "swa" not in kinds:
        window = None
    theta, scaling = _rope_scaling(raw, where)
    try:
        return DecoderSpec(
            architecture=arch,
            layer_kinds=kinds,
            hidden_size=sizes.hidden_size,
            num_heads=sizes.num_heads,
            num_kv_heads=sizes.num_kv_heads,
            head_dim=sizes.head_dim,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            max_context=int(raw.get("max_position_embeddings") or 4096),
            dtype=dtype,
            sliding_window=int(window) if window else None,
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=family == "qwen2" or (family != "mistral" and bool(raw.get("attention_bias", False))),
            o_proj_bias=family in ("llama", "qwen3") and bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
            eos_token_ids=_int_list(raw.get("eos_token_id")),
        )
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc


def spec_for(model: ModelConfig) -> DecoderSpec:
    """The spec of the configured model (reads only config.json for ``hf``)."""
    if model.kind == "reference":
        return spec_from_reference(model.reference, model.dtype)
    if not model.path:
        raise CheckpointError("model.path is required when model.kind is hf")
    raw = read_hf_config(model.path)
    return spec_from_hf_config(raw, model.dtype, where=str(Path(model.path) / "config.json"))
