"""Geometry, pool validation, input validation and the batch-invariant primitives."""

from __future__ import annotations

import pytest
import torch

from hicache.config import ModelConfig, ReferenceModelConfig, load_config
from hicache.model import ops
from hicache.model.attention import attend
from hicache.model.fingerprint import model_identity
from hicache.model.geometry import geometry_for
from hicache.model.pools import allocate_pools
from hicache.model.runner import ForwardItem, ModelRunner
from tests.model.conftest import tiny_model


def test_geometry_matches_pool_contract() -> None:
    cfg = ModelConfig(reference=ReferenceModelConfig(layers=("full", "swa", "mamba", "full")))
    geo = geometry_for(cfg)
    assert geo.components == ("full", "swa", "mamba")
    assert geo.full is not None and geo.full.num_layers == 2 and geo.swa is not None and geo.swa.num_layers == 1
    assert geo.mamba is not None and geo.mamba.num_layers == 1
    pools = allocate_pools(geo, num_pages=5, page_size=4, num_state_slots=3, num_swa_pages=7)
    assert pools.full_kv is not None and tuple(pools.full_kv.shape) == (2, 2, 20, 2, 16)
    assert pools.swa_kv is not None and tuple(pools.swa_kv.shape) == (1, 2, 28, 2, 16)
    assert pools.mamba_ssm is not None and tuple(pools.mamba_ssm.shape) == (1, 3, *geo.mamba.ssm_shape)
    assert geo.full.bytes_per_token == 2 * 2 * 2 * 16 * 4
    # the preset-resolved config and the unresolved one describe the same model
    assert geometry_for(load_config(None, ["model.reference.layers=[full, swa, mamba, full]"]).model) == geo


def test_all_swa_model_has_an_index_only_full_pool() -> None:
    """No full layer: the Full pool has zero layers (page indices only), the KV is SWA's."""
    geo = geometry_for(ModelConfig(reference=ReferenceModelConfig(layers=("swa", "swa"))))
    assert geo.components == ("full", "swa") and geo.full_index_only
    pools = allocate_pools(geo, num_pages=5, page_size=4)
    assert pools.full_kv is not None and tuple(pools.full_kv.shape) == (0, 2, 20, 2, 16)
    assert pools.full_kv.numel() == 0 and pools.num_full_pages == 5
    model = tiny_model(("swa", "swa"))
    runner = ModelRunner(model, pools)
    out = runner.forward([ForwardItem([1, 2, 3, 4, 5], 0, full_pages=[0, 1], swa_pages=[3, 4])])
    assert out[0] is not None and pools.swa_kv is not None and pools.swa_kv[:, :, 12:17].abs().sum() > 0
    with pytest.raises(ValueError, match="full_pages holds a page index outside"):
        runner.forward([ForwardItem([1, 2, 3], 0, full_pages=[9], swa_pages=[0])])
    pools.full_kv = None
    with pytest.raises(ValueError, match="full_kv: the model needs this pool"):
        ModelRunner(model, pools)


def test_identity_depends_on_seed_config_dtype() -> None:
    base = ModelConfig()
    assert model_identity(base) == model_identity(ModelConfig())
    assert model_identity(base) != model_identity(ModelConfig(reference=ReferenceModelConfig(seed=1)))
    assert model_identity(base) != model_identity(ModelConfig(dtype="bfloat16"))
    assert model_identity(base) != model_identity(ModelConfig(reference=ReferenceModelConfig(layers=("full",))))


def test_runner_rejects_bad_pools_and_items() -> None:
    model = tiny_model(("full", "mamba"))
    pools = allocate_pools(model.geometry, 8, 4, 4)
    wrong = allocate_pools(tiny_model(("full",)).geometry, 8, 4)
    with pytest.raises(ValueError, match="mamba_conv"):
        ModelRunner(model, wrong)
    runner = ModelRunner(model, pools)
    cases = [
        (ForwardItem([1] * 5, 0, [0], state_slot=0), "full_pages has 1 pages, 2 needed"),
        (ForwardItem([1, 600], 0, [0], state_slot=0), "token id 600"),
        (ForwardItem([1], 0, [9], state_slot=0), "page index outside"),
        (ForwardItem([1], 0, [0]), "state_slot"),
        (ForwardItem([1], 0, [0], state_slot=0, snapshots=[(2, 1)]), "snapshot position 2"),
        (ForwardItem([], 0, [0], state_slot=0), "empty"),
    ]
    for item, msg in cases:
        with pytest.raises(ValueError, match=msg):
            runner.forward([item])
    with pytest.raises(ValueError, match="used by another item"):
        runner.forward([ForwardItem([1], 0, [0], state_slot=0), ForwardItem([1], 0, [1], state_slot=0)])


def test_primitives_are_batch_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, 96, generator=g) * 4
    w = torch.randn(80, 96, generator=g)
    full = ops.linear(x, w)
    for lo, hi in [(0, 1), (3, 4), (10, 75), (77, 150)]:
        assert torch.equal(ops.linear(x[lo:hi], w), full[lo:hi])
        assert torch.equal(ops.silu(x[lo:hi]), ops.silu(x)[lo:hi])
        assert torch.equal(ops.rms_norm(x[lo:hi], w[0], 1e-6), ops.rms_norm(x, w[0], 1e-6)[lo:hi])
    q = torch.randn(300, 4, 8, generator=g)
    k = torch.randn(512, 2, 8, generator=g)
    v = torch.randn(512, 2, 8, generator=g)
    for window in (None, 40):
        whole = attend(q, k, v, 100, 0, 0.3, window)
        for lo, hi in [(0, 1), (5, 6), (37, 200), (299, 300)]:
            assert torch.equal(attend(q[lo:hi], k, v, 100 + lo, 0, 0.3, window), whole[lo:hi])
