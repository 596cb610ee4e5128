"""The L1 tensors the runner reads and writes, handed to it from outside.

In the daemon the memory pools allocate these tensors (in shared memory) and own them; the
runner only indexes into them. ``allocate_pools`` builds plain tensors of the same layout
for tests and benchmarks. See ``hicache.model.geometry`` for the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.model.geometry import ModelGeometry

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (supported: {', '.join(_DTYPES)})") from None


@dataclass
class KVPools:
    """Views of the L1 pools. The runner never allocates or frees pages or slots.

    - ``full_kv``: ``[full_layers, 2, S_full, kv_heads, head_dim]``; ``S_full`` a multiple of
      ``page_size``.
    - ``swa_kv``: same for the SWA layers, with its own page numbering.
    - ``mamba_conv`` / ``mamba_ssm``: ``[mamba_layers, num_state_slots, *shape]``.

    A tensor is None exactly when the model has no layer of that kind, except ``full_kv``:
    a model with ``swa`` but no ``full`` layers has an index-only Full component
    (``ModelGeometry.full_index_only``) whose tensor has zero layers (no bytes); its page
    tables are checked as usual and no layer reads or writes it.
    """

    page_size: int
    full_kv: torch.Tensor | None = None
    swa_kv: torch.Tensor | None = None
    mamba_conv: torch.Tensor | None = None
    mamba_ssm: torch.Tensor | None = None

    @property
    def num_full_pages(self) -> int:
        return 0 if self.full_kv is None else self.full_kv.shape[2] // self.page_size

    @property
    def num_swa_pages(self) -> int:
        return 0 if self.swa_kv is None else self.swa_kv.shape[2] // self.page_size

    @property
    def num_state_slots(self) -> int:
        return 0 if self.mamba_ssm is None else self.mamba_ssm.shape[1]

    def validate(self, geometry: ModelGeometry) -> None:
        """Raise ValueError naming the first tensor whose presence, shape or dtype is wrong."""
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        for name, attn in (("full_kv", geometry.full), ("swa_kv", geometry.swa)):
            t = getattr(self, name)
            if attn is None:
                if t is not None:
                    raise ValueError(f"{name}: the model has no such layers, but a tensor was given")
                continue
            if t is None:
                raise ValueError(f"{name}: the model needs this pool, but none was given")
            if t.dim() != 5 or t.shape[2] % self.page_size:
                raise ValueError(f"{name}: expected [layers, 2, num_pages*page_size, heads, dim], got {tuple(t.shape)}")
            want = attn.l1_shape(t.shape[2] // self.page_size, self.page_size)
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
            if t.dtype != torch_dtype(attn.dtype):
                raise ValueError(f"{name}: expected dtype {attn.dtype}, got {t.dtype}")
        m = geometry.mamba
        for name, shape_of in (("mamba_conv", "conv_l1_shape"), ("mamba_ssm", "ssm_l1_shape")):
            t = getattr(self, name)
            if m is None:
                if t is not None:
                    raise ValueError(f"{name}: the model has no mamba layers, but a tensor was given")
                continue
            if t is None:
                raise ValueError(f"{name}: the model has mamba layers, but none was given")
            want = getattr(m, shape_of)(t.shape[1] if t.dim() > 1 else 0)
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
            if t.dtype != torch_dtype(m.dtype):
                raise ValueError(f"{name}: expected dtype {m.dtype}, got {t.dtype}")
        conv, ssm = self.mamba_conv, self.mamba_ssm  # both given when m is not None (checked above)
        if m is not None and conv is not None and ssm is not None and conv.shape[1] != ssm.shape[1]:
            raise ValueError("mamba_conv and mamba_ssm must have the same number of state slots")


def allocate_pools(
    geometry: ModelGeometry,
    num_pages: int,
    page_size: int,
    num_state_slots: int = 0,
    num_swa_pages: int | None = None,
    device: str | torch.device = "cpu",
) -> KVPools:
    """Plain zero-filled pools of the contract layout (tests and benchmarks; the daemon's
    memory pools allocate their own, shared, tensors)."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
    pools = KVPools(page_size=page_size)
    if geometry.full is not None:
        pools.full_kv = torch.zeros(
            geometry.full.l1_shape(num_pages, page_size), dtype=torch_dtype(geometry.full.dtype), device=device
        )
    if geometry.swa is not None:
        pools.swa_kv = torch.zeros(
            geometry.swa.l1_shape(num_swa_pages or num_pages, page_size),
            dtype=torch_dtype(geometry.swa.dtype),
            device=device,
        )
    if geometry.mamba is not None:
        if num_state_slots < 1:
            raise ValueError("a model with mamba layers needs num_state_slots >= 1")
        dt = torch_dtype(geometry.mamba.dtype)
        pools.mamba_conv = torch.zeros(geometry.mamba.conv_l1_shape(num_state_slots), dtype=dt, device=device)
        pools.mamba_ssm = torch.zeros(geometry.mamba.ssm_l1_shape(num_state_slots), dtype=dt, device=device)
    return pools
