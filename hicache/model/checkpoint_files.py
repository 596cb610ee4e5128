"""A safetensors checkpoint's weight files: which they are, and that each exists.

Torch-free: the start checks (``hicache.daemon.startup_checks``, in the launcher and
``hicache check-config``) and the model fingerprint use it without loading any weight;
``hicache.model.checkpoint`` loads the tensors from these files.
"""

from __future__ import annotations

import json
from pathlib import Path

from hicache.model.hf_config import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order; checks that each exists."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is malformed (needs a 'weight_map' object): {exc}") from exc
        files = [root / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shard(s) listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in root.glob("*.bin"))
        hint = f" (found {', '.join(bins)}: only safetensors checkpoints are supported)" if bins else ""
        raise CheckpointError(f"no *.safetensors weight files in {root}{hint}")
    return files
