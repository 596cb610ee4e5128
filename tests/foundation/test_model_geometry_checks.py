"""The model-geometry rules the start checks apply (``hicache.model.geometry``), and that
making them needs no torch (``hicache check-config`` and the launcher stay light)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hicache.model.geometry import (
    SUPPORTED_COMPONENTS,
    AttentionGeometry,
    MambaGeometry,
    ModelGeometry,
    unsupported_reason,
)


def _geometry(kinds: tuple[str, ...]) -> ModelGeometry:
    att = AttentionGeometry(1, 2, 8, "float32")
    return ModelGeometry(kinds, att if "full" in kinds else None, att if "swa" in kinds else None,
                         MambaGeometry(1, (3, 16), (16, 4)) if "mamba" in kinds else None,
                         8 if "swa" in kinds else None)


@pytest.mark.parametrize("kinds", [("full",), ("full", "swa", "full"), ("mamba", "full"), ("full", "swa", "mamba"),
                                   ("mamba", "swa", "full", "full")])
def test_supported_layer_patterns_pass(kinds: tuple[str, ...]) -> None:
    g = _geometry(kinds)
    assert g.components in SUPPORTED_COMPONENTS
    assert unsupported_reason(g) is None


@pytest.mark.parametrize(("kinds", "says"), [
    (("swa",), "at least one full-attention layer"),
    (("mamba", "mamba"), "at least one full-attention layer"),
    (("swa", "mamba"), "at least one full-attention layer"),
])
def test_unsupported_layer_patterns_say_why(kinds: tuple[str, ...], says: str) -> None:
    reason = unsupported_reason(_geometry(kinds))
    assert reason is not None and says in reason
    assert ", ".join(sorted(set(kinds))) in reason


def test_full_swa_and_mamba_together_need_all_three_components_in_order() -> None:
    assert _geometry(("mamba", "swa", "full")).components == ("full", "swa", "mamba")


def test_a_mamba_state_slot_holds_conv_and_ssm_state_of_every_layer() -> None:
    m = MambaGeometry(3, (3, 16), (16, 4))
    assert m.bytes_per_slot == 3 * (3 * 16 + 16 * 4) * 4  # float32 states


def test_the_start_checks_do_not_import_torch() -> None:
    code = ("import sys\n"
            "from hicache.config import load_config\n"
            "from hicache.startup_checks import startup_problems\n"
            "print(startup_problems(load_config(None, [])))\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_CONFIG"}  # the default config
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env=env)
    assert out.stdout.splitlines() == ["[]", "[]"], out.stdout[:300]
