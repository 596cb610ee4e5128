"""Reading a Hugging Face ``config.json``: the one reader both model paths use.

The builtin model worker (``hicache.model.spec``: a whole ``DecoderSpec``) and engine mode
(``hicache.cache_server.geometry``: the KV page of a model vLLM serves) read the same file
and the same attention sizes, with the same checks and messages, through this module.
Torch-free and config-free: the connector imports it inside vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A model directory, config.json or weight file is missing, malformed or unsupported."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a local checkpoint directory; CheckpointError naming the file."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist or is not a directory")
    cfg_path = path / "config.json"
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{cfg_path} is missing (a Hugging Face checkpoint needs config.json)") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_path} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object")
    return raw


def positive_int(raw: dict[str, Any], name: str, where: str) -> int:
    """``raw[name]`` if it is a positive integer, else CheckpointError naming it."""
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class AttentionSizes:
    """The attention sizes of a decoder's ``config.json`` (heads of grouped-query attention:
    ``num_key_value_heads`` defaults to ``num_attention_heads``, ``head_dim`` to
    ``hidden_size // num_attention_heads``)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def attention_sizes(raw: dict[str, Any], where: str = "config.json") -> AttentionSizes:
    """``AttentionSizes`` of ``raw``; CheckpointError naming a missing or bad key."""
    hidden = positive_int(raw, "hidden_size", where)
    heads = positive_int(raw, "num_attention_heads", where)
    return AttentionSizes(
        num_layers=positive_int(raw, "num_hidden_layers", where),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
    )
