"""What the L1/L2 pools must hold for a model: per-component shapes, page-size independent.

This module is torch-free: the scheduler and the memory pools size their shared-memory
segments from it without importing the model, and the start checks (``hicache serve``,
``hicache check-config``: ``hicache.daemon.startup_checks``) refuse a model the scheduler cannot
serve (``unsupported_reason``) without importing torch.

Pool layout (the contract between the memory pools and the runner; ``S = num_pages *
page_size`` token slots, token ``j`` of page ``p`` lives in slot ``p * page_size + j``):

=========  =====================================================================
component  L1 tensor(s)
=========  =====================================================================
full       ``[full.num_layers, 2, S_full, full.num_kv_heads, full.head_dim]`` (k=0, v=1)
swa        ``[swa.num_layers, 2, S_swa, swa.num_kv_heads, swa.head_dim]`` (own page pool)
mamba      conv ``[mamba.num_layers, num_state_slots, *mamba.conv_shape]`` and
           ssm  ``[mamba.num_layers, num_state_slots, *mamba.ssm_shape]``
=========  =====================================================================

The layer axis counts only the layers of that kind, in model order (the ``i``-th ``swa``
layer of the model is index ``i`` of the SWA tensor).

A model with sliding-window layers but no full-attention layer (every layer ``swa``, or
``swa`` and ``mamba``) still has a ``full`` component, *index-only*: ``full.num_layers ==
0`` (``ModelGeometry.full_index_only``). The tree's first component must be Full (its pages
decide which nodes exist), so the Full page indices are allocated as for any model and
bound the number of cached token pages, but its pools hold no bytes (``[0, 2, S_full, ...]``
tensors, no shared-memory segment, copies of it move nothing) and every KV byte lives in
the SWA pool, with its window semantics. In L3 each of its Full pages is a one-byte index
marker under the page hash (``controller.storage_io.INDEX_LAYOUT_ID``), so the hash chain
says which prefix L3 holds, and its KV goes as the node's SWA (and Mamba) objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hicache.config import DTYPE_BYTES, ModelConfig
from hicache.model.spec import DecoderSpec, spec_for

SUPPORTED_COMPONENTS: tuple[tuple[str, ...], ...] = (
    ("full",), ("full", "swa"), ("full", "mamba"), ("full", "swa", "mamba"))
"""The component sets the scheduler serves: Full KV plus any of SWA and Mamba (in this order,
the order of ``ModelGeometry.components`` and of the tree's components). ``full`` may be
index-only (no layers) when the model has ``swa`` layers."""

MAMBA_STATE_DTYPE = "float32"
"""Mamba states are kept in float32 whatever the model dtype: they accumulate over the
whole sequence and low precision would drift."""


@dataclass(frozen=True)
class AttentionGeometry:
    """KV of one attention component (``full`` or ``swa``).

    ``num_layers == 0`` only for an index-only ``full`` component (a model without
    full-attention layers, see the module doc): zero bytes per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers of this component."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def page_bytes(self, page_size: int) -> int:
        return self.bytes_per_token * page_size

    def l1_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_pages * page_size, self.num_kv_heads, self.head_dim)

    def l2_page_shape(self, page_size: int) -> tuple[int, ...]:
        """One page in a page-contiguous host buffer: ``[layers, 2, page_size, heads, dim]``."""
        return (self.num_layers, 2, page_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class MambaGeometry:
    """Per-sequence recurrent state of the mamba layers (one state slot per sequence/snapshot)."""

    num_layers: int
    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    dtype: str = MAMBA_STATE_DTYPE

    def conv_l1_shape(self, num_state_slots: int) -> tuple[int, ...]:
        return (self.num_layers, num_state_slots, *self.conv_shape)

    def ssm_l1_shape(self, num_state_slots: int) -> tuple[int, ...]:
        return (self.num_layers, num_state_slots, *self.ssm_shape)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one state slot (conv and ssm state of every mamba layer)."""
        return self.num_layers * (math.prod(self.conv_shape) + math.prod(self.ssm_shape)) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ModelGeometry:
    """The pool-relevant shape of a model. ``swa`` / ``mamba`` are None when the model has no
    layer of that kind; ``full`` is None only when it has no attention layer at all (a model
    with ``swa`` but no ``full`` layers gets an index-only ``full``: see ``full_index_only``)."""

    layer_kinds: tuple[str, ...]
    full: AttentionGeometry | None
    swa: AttentionGeometry | None
    mamba: MambaGeometry | None
    sliding_window: int | None

    @property
    def components(self) -> tuple[str, ...]:
        """The cache components this model needs, in priority order (``full`` first)."""
        return tuple(name for name in ("full", "swa", "mamba") if getattr(self, name) is not None)

    @property
    def full_index_only(self) -> bool:
        """True when the ``full`` component holds no layers (the model has ``swa`` layers and no
        ``full`` ones): its page indices structure the tree, its pools hold no bytes."""
        return self.full is not None and self.full.num_layers == 0

    @classmethod
    def from_spec(cls, spec: DecoderSpec) -> ModelGeometry:
        def attention(kind: str) -> AttentionGeometry | None:
            n = spec.count(kind)
            return AttentionGeometry(n, spec.num_kv_heads, spec.head_dim, spec.dtype) if n else None

        full = attention("full")
        if full is None and spec.count("swa"):  # index-only: page indices, no layers (module doc)
            full = AttentionGeometry(0, spec.num_kv_heads, spec.head_dim, spec.dtype)
        n_mamba = spec.count("mamba")
        mamba = None
        if n_mamba:
            mamba = MambaGeometry(
                n_mamba,
                conv_shape=(spec.mamba_d_conv - 1, spec.mamba_d_inner),
                ssm_shape=(spec.mamba_d_inner, spec.mamba_state_size),
            )
        return cls(
            layer_kinds=spec.layer_kinds,
            full=full,
            swa=attention("swa"),
            mamba=mamba,
            sliding_window=spec.sliding_window if spec.count("swa") else None,
        )


def geometry_for(model: ModelConfig) -> ModelGeometry:
    """The geometry of the configured model (reads only config.json for ``hf``; no weights)."""
    return ModelGeometry.from_spec(spec_for(model))


def unsupported_reason(geometry: ModelGeometry) -> str | None:
    """None if the scheduler can serve a model of this geometry, else why not.

    The tree holds Full KV plus any auxiliary components (``SUPPORTED_COMPONENTS``), so a
    model needs at least one attention layer: ``full`` layers, ``swa`` layers (then the Full
    component is index-only when there is no ``full`` layer) or both, with or without
    ``mamba`` layers. A model of ``mamba`` layers only is refused.
    """
    comps = geometry.components
    if comps in SUPPORTED_COMPONENTS:
        return None
    kinds = ", ".join(sorted(set(geometry.layer_kinds)))
    if "full" not in comps:
        return (f"model layers ({kinds}): at least one attention layer (full or sliding-window) is required; "
                "mamba layers alone are not supported")
    return f"model layers ({kinds}): the component set {comps} is not supported"
