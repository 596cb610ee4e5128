"""The KV block size vLLM runs a model with, from vLLM's own code, without starting an engine.

vLLM does not always keep the engine's ``--block-size``: without one its CPU build picks 128
tokens (16 for MLA, which its CPU kernel needs whatever is asked), and for a hybrid model
(attention beside Mamba / gated-delta-net layers) it raises the attention block until one
attention page holds a layer's recurrent state (``Platform.update_block_size_for_backend``,
run by the engine after it built its layers). The daemon's ``cache.page_size`` must be the
block the engine ends up with, so ``hicache check-config`` asks this module.

``vllm_block_size`` builds the engine's ``VllmConfig`` as ``EngineArgs`` would (no weights
read, no tokenizer, no worker) and runs the platform's block-size step on it, handing it the
attention backend that vLLM's selector picks for the model's layers on this host instead of
the one of built layers. It leans on vLLM 0.32's internals (``SUPPORTED_VLLM``), as the
connector does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from unittest import mock

import vllm

from hicache.cache_server.geometry import checkpoint_dtype, read_hf_config
from hicache.connectors.vllm.layout import SUPPORTED_VLLM


@dataclass(frozen=True)
class BlockChoice:
    """What vLLM does with one ``--block-size`` for a model (``asked`` None: none given).

    ``block_size``: the block it runs with; ``supported``: whether its attention backend
    (``backend``) takes that block (an engine with a block it does not take fails at start);
    the backend takes the blocks in ``exact_sizes`` and the multiples of each of
    ``multiples_of`` (both empty: any block)."""

    asked: int | None
    block_size: int
    supported: bool
    backend: str
    exact_sizes: tuple[int, ...] = ()
    multiples_of: tuple[int, ...] = ()


class BlockSizeError(RuntimeError):
    """vLLM cannot size the model's blocks (its message, or a vLLM this module was not written for)."""


def engine_dtype(model: str, kv_dtype: str) -> str:
    """The engines' KV dtype as the daemon expects it: ``engine.kv_dtype``, ``auto`` being the
    checkpoint's (raises EngineModelError naming a bad config.json)."""
    return checkpoint_dtype(read_hf_config(model)) if kv_dtype == "auto" else kv_dtype


def vllm_block_size(model: str, dtype: str, block_size: int | None) -> BlockChoice:
    """The block vLLM runs ``model`` (a local checkpoint directory) with when an engine is
    started with ``--dtype dtype``, prefix caching on, one rank and ``--block-size
    block_size`` (None: not given). Raises BlockSizeError where vLLM refuses the model or
    the block, naming why."""
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise BlockSizeError(f"vLLM {vllm.__version__} is installed; this check knows vLLM "
                             f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)}")
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    try:
        vllm_dtype: Any = dtype  # one of KV_DTYPE_BYTES' names, each one of vLLM's
        config = EngineArgs(model=model, dtype=vllm_dtype, block_size=block_size, enable_prefix_caching=True,
                            skip_tokenizer_init=True, enforce_eager=True).create_engine_config()
        mc = config.model_config
        model_dtype: Any = mc.dtype  # a torch.dtype once the config is built
        with set_current_vllm_config(config):
            backend = get_attn_backend(mc.get_head_size(), model_dtype, config.cache_config.cache_dtype,
                                       use_mla=mc.use_mla)
        platform = type(current_platform)
        # the engine asks its built layers for their backends; none are built here
        with mock.patch.object(platform, "_find_non_ssm_backends", classmethod(lambda cls, cfg: [backend])):
            platform.update_block_size_for_backend(config)
            chosen = config.cache_config.block_size
            with set_current_vllm_config(config):
                supported = bool(backend.supports_block_size(chosen))
                sizes = list(backend.get_supported_kernel_block_sizes())
    except (ValueError, TypeError, OSError) as exc:
        raise BlockSizeError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    bases = tuple(int(s.base) for s in sizes if hasattr(s, "base"))
    exact = tuple(int(s) for s in sizes if not hasattr(s, "base"))
    return BlockChoice(block_size, int(chosen), supported, backend.get_name(), exact, bases)


def supported_near(choice: BlockChoice, tokens: int) -> int | None:
    """The smallest block of at least ``tokens`` that ``choice``'s backend states it takes
    (a multiple of its ``MultipleOf`` base, or one of its exact sizes); None if none does."""
    out = [b * math.ceil(tokens / b) for b in choice.multiples_of]
    out += [s for s in choice.exact_sizes if s >= tokens]
    return min(out) if out else None
