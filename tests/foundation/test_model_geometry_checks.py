"""The model-geometry rules the start checks apply (``hicache.model.geometry``), and that
making them needs no torch (``hicache check-config`` and the launcher stay light)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.model.geometry import (
    SUPPORTED_COMPONENTS,
    AttentionGeometry,
    MambaGeometry,
    ModelGeometry,
    unsupported_reason,
)
from hicache.model.spec import DecoderSpec
from tests.deploy.deploy_helpers import write_tiny_llama


def _geometry(kinds: tuple[str, ...]) -> ModelGeometry:
    """The geometry ``ModelGeometry.from_spec`` makes for ``kinds`` (one layer of each kind)."""
    spec = DecoderSpec("test", kinds, hidden_size=16, num_heads=2, num_kv_heads=2, head_dim=8, intermediate_size=32,
                       vocab_size=300, max_context=64, sliding_window=8 if "swa" in kinds else None,
                       mamba_d_inner=16, mamba_state_size=4, mamba_dt_rank=1)
    return ModelGeometry.from_spec(spec)


@pytest.mark.parametrize("kinds", [("full",), ("full", "swa", "full"), ("mamba", "full"), ("full", "swa", "mamba"),
                                   ("mamba", "swa", "full", "full"), ("swa",), ("swa", "swa"), ("swa", "mamba"),
                                   ("mamba", "swa", "mamba")])
def test_supported_layer_patterns_pass(kinds: tuple[str, ...]) -> None:
    g = _geometry(kinds)
    assert g.components in SUPPORTED_COMPONENTS
    assert unsupported_reason(g) is None
    assert g.full_index_only == ("full" not in kinds)


@pytest.mark.parametrize("kinds", [("swa",), ("swa", "swa", "swa"), ("swa", "mamba")])
def test_without_a_full_layer_the_full_component_is_index_only(kinds: tuple[str, ...]) -> None:
    """The tree's first component is always Full; with no full layer it holds no KV."""
    g = _geometry(kinds)
    assert g.components[:2] == ("full", "swa")
    assert g.full == AttentionGeometry(0, 2, 8, "float32")
    assert g.full.bytes_per_token == 0 and g.full.l1_shape(4, 16) == (0, 2, 64, 2, 8)
    assert g.swa is not None and g.swa.num_layers == kinds.count("swa")
    assert g.sliding_window == 8


def test_a_model_with_full_layers_has_a_full_component_holding_them() -> None:
    g = _geometry(("full", "swa", "full"))
    assert not g.full_index_only and g.full is not None and g.full.num_layers == 2


@pytest.mark.parametrize(("kinds", "says"), [
    (("mamba",), "at least one attention layer"),
    (("mamba", "mamba"), "at least one attention layer"),
])
def test_unsupported_layer_patterns_say_why(kinds: tuple[str, ...], says: str) -> None:
    reason = unsupported_reason(_geometry(kinds))
    assert reason is not None and says in reason
    assert ", ".join(sorted(set(kinds))) in reason


def test_mamba_geometry_is_read_from_the_spec() -> None:
    assert _geometry(("mamba", "mamba")).mamba == MambaGeometry(2, (3, 16), (16, 4))


def test_full_swa_and_mamba_together_need_all_three_components_in_order() -> None:
    assert _geometry(("mamba", "swa", "full")).components == ("full", "swa", "mamba")


def test_a_mamba_state_slot_holds_conv_and_ssm_state_of_every_layer() -> None:
    m = MambaGeometry(3, (3, 16), (16, 4))
    assert m.bytes_per_slot == 3 * (3 * 16 + 16 * 4) * 4  # float32 states


@pytest.mark.parametrize("model", ["reference", "checkpoint"])
def test_the_start_checks_do_not_import_torch(model: str, tmp_path: Path) -> None:
    """Neither for the reference model nor for a checkpoint (its config and weight files are
    checked, no weight is loaded): the launcher and ``check-config`` stay torch-free."""
    sets = []
    if model == "checkpoint":
        sets = ["model.kind=hf", f"model.path={write_tiny_llama(tmp_path / 'tiny-llama')}"]
    code = ("import sys\n"
            "from hicache.config import load_config\n"
            "from hicache.daemon.startup_checks import startup_problems\n"
            f"print(startup_problems(load_config(None, {sets!r})))\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_CONFIG"}  # the default config
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env=env)
    assert out.stdout.splitlines() == ["[]", "[]"], out.stdout[:300]
