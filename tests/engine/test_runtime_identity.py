"""The engine's runtime identity from vLLM's own configs (``EngineArgs``; no engine starts).

Two engines on one model directory share pages only when they run the same weights the
same way: an engine that loads random weights (``--load-format dummy``) gets another
identity than one that loads the checkpoint, and an option of vLLM's ``LoadConfig`` that
hicache does not classify refuses the engine, naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm_engines import HAVE_VLLM, NO_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)

HEAD_SIZE = 32


def _config(model: Path, **kw: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), skip_tokenizer_init=True, block_size=32, enforce_eager=True,
                      max_model_len=2048, **kw).create_engine_config()


def _identity(config: Any) -> str:
    from hicache.connectors.runtime_identity import runtime_entries, runtime_identity

    return runtime_identity(runtime_entries(config, HEAD_SIZE), "")


def test_random_weights_on_the_same_model_directory_are_another_identity(checkpoints: dict[str, Path]) -> None:
    model = checkpoints["llama-bf16"]
    real = _identity(_config(model))
    assert _identity(_config(model)) == real  # the same engine options: the same identity
    assert _identity(_config(model, load_format="dummy")) != real
    # how fast the checkpoint is read changes no weight
    assert _identity(_config(model, safetensors_load_strategy=None, use_tqdm_on_load=False)) == real


def test_a_load_option_hicache_does_not_know_refuses_the_engine_by_name(checkpoints: dict[str, Path]) -> None:
    from hicache.connectors.runtime_identity import UnclassifiedOption

    config = _config(checkpoints["llama-bf16"])
    load = config.load_config
    names = [f.name for f in dataclasses.fields(load)]
    newer = dataclasses.make_dataclass("LoadConfig", [*names, "weight_transform"])  # a newer vLLM's
    newer_load = newer(**{n: getattr(load, n) for n in names}, weight_transform="x")

    class Other:  # vLLM's config with that LoadConfig
        def __getattr__(self, name: str) -> Any:
            return newer_load if name == "load_config" else getattr(config, name)

    with pytest.raises(UnclassifiedOption, match="load_config.weight_transform"):
        _identity(Other())
