"""What the connector needs to know of one vLLM engine's KV cache, read once at start.

``check_setup`` refuses, saying why, an engine hicache cannot serve (its vLLM version,
pipeline parallelism, a CUDA cache, an unchecked MLA backend, KV heads a rank count does not
divide, a KV cache group hicache cannot hold, another block layout). ``VllmKVLayout.of``
then reads the KV cache groups into the layout the connector works with:

====================  ==================================================================
field                 what it is
====================  ==================================================================
``layer_names``       the attention layers, in model order: an L2 page holds one block
                      of each (``layer_groups``: each one's KV cache group)
``layer_window``      which of them have a sliding window (their blocks are a page's
                      window part)
``state_layer_names`` the layers that keep a recurrent state instead of KV (a GDN's), in
                      model order (``state_layer_groups``: their groups)
``kv_groups``         the attention groups; ``state_groups`` the state groups
``state_bytes``       this rank's share of one state layer's state in a block
``geometry``          the page as the daemon sees it (``protos.EngineKVGeometry``): the
                      whole model's, every rank's heads
====================  ==================================================================

Nothing here changes after start; the connector holds one ``VllmKVLayout`` per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

import protos
from hicache.cache_server.geometry import engine_identity
from hicache.connectors.kv_copy import CUDA_REFUSAL
from hicache.connectors.runtime_identity import mla_backend

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

SUPPORTED_VLLM = ("0.32.",)
"""vLLM versions whose connector API this module was written and tested against."""

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

HELD_SPECS = (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec)
"""The attention KV cache group kinds hicache holds (exactly these classes, not other
subclasses): attention KV, full or sliding-window, or MLA's latent, of one shape across groups.
Beside them, ``MambaSpec`` groups in vLLM's ``align`` mode (a GDN's state, kept at block ends)."""


class ConnectorRefused(RuntimeError):
    """This vLLM setup cannot use hicache; the message says why."""


def is_state_group(spec: Any) -> bool:
    """Whether a KV cache group's spec is recurrent state (``MambaSpec``: Mamba, GDN), not KV."""
    return isinstance(spec, MambaSpec)


def kv_groups_problem(kv_cache_config: KVCacheConfig) -> str | None:
    """None if hicache can hold every KV cache group of this engine, else which group it
    cannot and why: each attention group must be full or sliding-window attention
    (``HELD_SPECS``) with the block size, heads, head size and dtype of the first (an L2 page
    is one block of every attention layer); a state group (``MambaSpec``) must keep states at
    block ends (vLLM's ``align`` mode, on with prefix caching) of that block size."""
    groups = kv_cache_config.kv_cache_groups
    attention = [g for g in groups if not is_state_group(g.kv_cache_spec)]
    if not attention:
        return "the engine has no attention KV cache group (a model of state layers only)"
    first = attention[0].kv_cache_spec
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = (f"KV cache group {i} ({type(spec).__name__}, layers {', '.join(group.layer_names[:3])}"
                f"{', ...' if len(group.layer_names) > 3 else ''})")
        if not group.enable_kv_transfer:
            return f"{name}: vLLM marks it as not transferable"
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                return (f"{name}: mamba_cache_mode {spec.mamba_cache_mode!r}; hicache keeps the states vLLM keeps "
                        "at block ends ('align', on with --enable-prefix-caching)")
            if spec.block_size != first.block_size:
                return f"{name}: block_size {spec.block_size} differs from the attention groups' {first.block_size}"
            continue
        if type(spec) not in HELD_SPECS:
            return (f"{name}: hicache holds full and sliding-window attention KV, MLA's latent and the state "
                    f"of Mamba-kind layers kept at block ends ({', '.join(c.__name__ for c in HELD_SPECS)}, "
                    "MambaSpec) only")
        if isinstance(spec, MLAAttentionSpec) != isinstance(first, MLAAttentionSpec):
            return f"{name}: MLA and other attention in one engine (an L2 page holds one kind)"
        assert isinstance(spec, AttentionSpec) and isinstance(first, AttentionSpec)
        for attr in ("block_size", "num_kv_heads", "head_size", "dtype"):
            if getattr(spec, attr) != getattr(first, attr):
                return (f"{name}: {attr} {getattr(spec, attr)} differs from group 0's {getattr(first, attr)} "
                        "(an L2 page holds one block of every layer, of one shape)")
    return None


def check_setup(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Refuse (``ConnectorRefused``, saying why) a vLLM setup hicache cannot serve."""
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise ConnectorRefused(f"vLLM {vllm.__version__} is not supported (supported: "
                               f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)})")
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        raise ConnectorRefused(f"pipeline parallelism is not supported (pipeline_parallel_size "
                               f"{par.pipeline_parallel_size}): a page holds every layer, which no rank has")
    if vllm_config.device_config.device_type == "cuda":
        raise ConnectorRefused(CUDA_REFUSAL)
    mla = vllm_config.model_config.use_mla
    if mla and mla_backend(vllm_config) != "CPU_MLA":
        raise ConnectorRefused(f"vLLM's {mla_backend(vllm_config)} backend has not run with hicache (its latent "
                               "layout is unchecked); set the attention backend to CPU_MLA, or run without hicache")
    kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    if not mla and kv_heads % par.tensor_parallel_size:
        raise ConnectorRefused(f"tensor_parallel_size {par.tensor_parallel_size} does not divide the model's "
                               f"{kv_heads} KV heads (vLLM replicates them across ranks; hicache stores "
                               "each head once)")
    problem = kv_groups_problem(kv_cache_config)
    if problem:
        raise ConnectorRefused(problem)
    if kv_cache_config.kv_cache_layout != "LBHNC" and not (mla and kv_cache_config.kv_cache_layout == "LBNHC"):
        raise ConnectorRefused(f"KV cache layout {kv_cache_config.kv_cache_layout!r} is not supported "
                               "(supported: LBHNC, vLLM's CPU layout)")


@dataclass(frozen=True)
class VllmKVLayout:
    """One engine's KV cache as the connector sees it (the module docstring's table)."""

    layer_names: list[str]
    layer_groups: list[int]
    layer_window: list[bool]
    state_layer_names: list[str]
    state_layer_groups: list[int]
    state_groups: list[int]
    kv_groups: list[int]
    state_bytes: int
    """Bytes of this rank's share of one state layer's state in one block (vLLM pads its
    blocks; those bytes are not kept); a slot holds every rank's share side by side."""
    num_groups: int
    group_window: list[bool]
    window_tokens: int
    """The engine's sliding window (0: none)."""
    block_size: int
    num_blocks: int
    head_size: int
    tp: int
    """Tensor-parallel ranks: each holds ``num_kv_heads / tp`` heads of every layer."""
    kv_dtype: torch.dtype
    mla: bool
    """Multi-head latent attention: every rank holds the whole latent (one "head"), so
    rank 0 alone saves it, once, and every rank loads it."""
    geometry: protos.EngineKVGeometry

    @property
    def windowed(self) -> bool:
        """A group holds blocks of the window only: a block before it may be gone."""
        return any(self.layer_window)

    @property
    def load_async(self) -> bool:
        """vLLM maps a failed block of a load back to its request with one KV cache group
        only; with several, a hit loads asynchronously (the request waits for the step that
        loads it), so a failed load is reported for the request and recomputed."""
        return self.num_groups > 1

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> VllmKVLayout:
        """The layout of an engine ``check_setup`` accepted; ``ConnectorRefused`` for a KV dtype
        hicache does not hold."""
        groups = kv_cache_config.kv_cache_groups
        spec = next(g.kv_cache_spec for g in groups if not is_state_group(g.kv_cache_spec))
        assert isinstance(spec, AttentionSpec)  # check_setup refused every other kind
        # An L2 page holds one block of every attention layer, in model order; a layer's block ids are its group's.
        by_layer = sorted((extract_layer_index(n), n, g) for g, group in enumerate(groups) for n in group.layer_names)
        attention = [(n, g) for _, n, g in by_layer if not is_state_group(groups[g].kv_cache_spec)]
        state = [(n, g) for _, n, g in by_layer if is_state_group(groups[g].kv_cache_spec)]
        state_groups = sorted({g for _, g in state})
        state_specs = [g.kv_cache_spec for g in groups if is_state_group(g.kv_cache_spec)]
        state_bytes = state_specs[0].state_content_size_bytes if state_specs else 0
        group_window = [isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups]
        layer_window = [group_window[g] for _, g in attention]
        tp = vllm_config.parallel_config.tensor_parallel_size
        dtype = _DTYPE_NAMES.get(spec.dtype)
        if dtype is None:
            raise ConnectorRefused(f"KV dtype {spec.dtype} is not supported (supported: {', '.join(_DTYPE_NAMES.values())})")
        mla = isinstance(spec, MLAAttentionSpec)
        # check_setup accepted LBHNC, and MLA's LBNHC: with its one head, the same bytes
        block_layout = "LBHNC" if mla else kv_cache_config.kv_cache_layout
        assert block_layout is not None
        heads = 1 if mla else spec.num_kv_heads * tp
        geometry = protos.EngineKVGeometry(
            engine_identity(vllm_config.model_config.model, dtype, block_layout), dtype, spec.block_size,
            len(attention), heads, spec.head_size, block_layout, "mla" if mla else "kv", sum(layer_window),
            len(state), state_bytes * tp)
        return cls(
            layer_names=[n for n, _ in attention], layer_groups=[g for _, g in attention], layer_window=layer_window,
            state_layer_names=[n for n, _ in state], state_layer_groups=[g for _, g in state],
            state_groups=state_groups, kv_groups=[g for g in range(len(groups)) if g not in state_groups],
            state_bytes=state_bytes, num_groups=len(groups), group_window=group_window,
            window_tokens=max((g.kv_cache_spec.sliding_window for g in groups
                               if isinstance(g.kv_cache_spec, SlidingWindowSpec)), default=0),
            block_size=spec.block_size, num_blocks=kv_cache_config.num_blocks, head_size=spec.head_size, tp=tp,
            kv_dtype=spec.dtype, mla=mla, geometry=geometry)
