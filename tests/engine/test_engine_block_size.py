"""``hicache check-config`` in engine mode: the block vLLM runs ``engine.model`` with, from
vLLM's own code (``hicache.connectors.vllm.block_size``; no engine starts), and what to set
when it is not ``cache.page_size``.

The model is a Qwen3-Next-style hybrid (random weights saved here): two gated-delta-net
layers with two 128-wide linear heads beside two full-attention layers of two KV heads of
128. vLLM raises its attention block until one attention page holds a GDN layer's state; how
far depends on the host (its CPU build keeps the SSM state in float32 where the CPU has
AVX-512 BF16, else in the model's dtype), so the reference is computed here from vLLM's own
page sizes of the state and of one token's attention KV.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.bench.engine_lib.vllm_driver import save_random_model
from hicache.config import config_from_dict
from tests.support.vllm_engines import HAVE_VLLM, NO_VLLM, engine_config

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)

REPO = Path(__file__).resolve().parents[2]
ASKED = 64  # the daemon's cache.page_size, and so the --block-size check-config assumes


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("ckpt") / "qwen3-next", arch="qwen3_next", layers=4,
                             hidden=256, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16", seed=3,
                             linear_heads=2)


def _vllm_config(model: Path, block_size: int | None) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), dtype="bfloat16", block_size=block_size, enable_prefix_caching=True,
                      skip_tokenizer_init=True, enforce_eager=True).create_engine_config()


def _reference_block(model: Path, asked: int) -> int:
    """vLLM's rule for a hybrid, with vLLM's sizes: the smallest multiple of the block asked
    (or of the CPU attention kernel's block, if larger) whose attention page, one layer's K
    and V, holds one GDN layer's state (``MambaSpec``'s page, as vLLM keeps the state)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    config = _vllm_config(model, asked)
    mc = config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    state = MambaSpec(shapes=cls.get_mamba_state_shape_from_config(config),
                      dtypes=cls.get_mamba_state_dtype_from_config(config), block_size=-1).page_size_bytes
    token = FullAttentionSpec(block_size=1, num_kv_heads=mc.get_num_kv_heads(config.parallel_config),
                              head_size=mc.get_head_size(), dtype=mc.dtype).page_size_bytes
    step = max(asked, *(s.base for s in CPUAttentionBackend.get_supported_kernel_block_sizes()))
    return step * -(-state // (step * token))


def _advise(model: Path, tmp: Path, page_size: int) -> Any:
    from hicache.cli.check_config import advise
    from hicache.connectors.vllm.block_size import supported_near, vllm_block_size

    l2_tokens = 16384 // page_size * page_size  # a whole number of pages, whatever block the host gives
    cfg = config_from_dict(engine_config(model, tmp / "run", page_size=page_size, l2_tokens=l2_tokens))
    return advise(cfg, None, "bfloat16", vllm_block_size, supported_near)


def test_check_config_prints_the_block_vllm_runs_a_hybrid_with_and_the_page_size_to_set(
        hybrid: Path, tmp_path: Path) -> None:
    want = _reference_block(hybrid, ASKED)
    assert want != ASKED  # vLLM raised the block: the advice is needed
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(engine_config(hybrid, tmp_path / "run", page_size=ASKED, l2_tokens=16384)))
    out = subprocess.run([sys.executable, "-m", "hicache", "check-config", str(path)], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr  # the daemon starts on it; it refuses the engines
    assert yaml.safe_load(out.stdout)["cache"]["page_size"] == ASKED  # stdout: the resolved config only
    got = re.search(r"^hicache: engine block size: (\d+) ", out.stderr, re.M)
    assert got is not None, out.stderr
    assert int(got.group(1)) == want, out.stderr
    assert f"--block-size {ASKED}" in out.stderr  # what it assumed
    assert f"block_size: daemon {ASKED}, engine {want}" in out.stderr  # the refusal it would meet
    assert f"    cache.page_size: {want}\n" in out.stderr
    l2 = int(re.search(r"^ +cache\.l2\.tokens: (\d+)", out.stderr, re.M).group(1))  # type: ignore[union-attr]
    assert l2 > 0 and l2 % want == 0 and l2 <= 16384
    assert f"start the engines with --block-size {want}" in out.stderr


def test_the_advised_block_is_one_vllm_keeps(hybrid: Path, tmp_path: Path) -> None:
    """Set as advised (``cache.page_size`` and the engines' ``--block-size``), vLLM keeps the
    block and check-config has nothing to change."""
    first = _advise(hybrid, tmp_path, ASKED)
    assert first.page_size == first.start_with == _reference_block(hybrid, ASKED)
    again = _advise(hybrid, tmp_path, first.page_size)
    assert again.block_size == first.page_size and again.page_size is None and again.unsupported is None


def test_a_plain_model_block_the_cpu_kernel_does_not_take_is_rounded_up(checkpoints: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """Llama: vLLM keeps the block asked, but its CPU attention kernel takes multiples of 32
    only; 128 tokens without ``--block-size``."""
    small = _advise(checkpoints["llama-bf16"], tmp_path, 16)
    assert small.block_size == 16 and small.default == 128
    assert small.unsupported is not None and "a multiple of 32" in small.unsupported
    assert small.page_size == small.start_with == 32
    fine = _advise(checkpoints["llama-bf16"], tmp_path, 32)
    assert fine.page_size is None and fine.unsupported is None
