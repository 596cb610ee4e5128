"""The model identity: a digest of config and weights that namespaces page hashes (docs/architecture.md §6).

Computed once at start and cheaply, without loading the weights:

- reference model: the reference architecture version, the resolved ``DecoderSpec`` (which
  includes the dtype) and the seed — the weights are a pure function of those;
- hf checkpoint: ``config.json``, the dtype the model runs in, then for every weight file
  (in name order) its name, its safetensors header (names, dtypes, shapes, offsets) and,
  for every tensor, 64 bytes at its start, middle and end. Changing any tensor's shape or
  dtype, adding or removing one, or rewriting one changes the identity (a rewrite that
  leaves all three samples alike does not — the price of not hashing gigabytes).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from hicache.config import ModelConfig
from hicache.model.spec import spec_for

IDENTITY_VERSION = b"hicache-model-identity-v1"


def model_identity(model: ModelConfig) -> str:
    """64 hex characters naming the model (config + weights) for the page-hash namespace."""
    h = hashlib.sha256(IDENTITY_VERSION)
    if model.kind == "reference":
        spec = spec_for(model)
        h.update(b"reference\0")
        h.update(spec.to_json().encode())
        h.update(f"\0seed={model.reference.seed}".encode())
        return h.hexdigest()
    from hicache.model.checkpoint_files import weight_files
    from hicache.model.safetensors_io import SafetensorsFile

    root = Path(model.path or "")
    h.update(b"hf\0")
    h.update((root / "config.json").read_bytes())
    h.update(f"\0dtype={model.dtype}\0".encode())
    for path in weight_files(root):
        f = SafetensorsFile(path)
        h.update(path.name.encode() + b"\0")
        h.update(f.header_bytes)
        for name in sorted(f.tensors):
            h.update(f.sample(name))
    return h.hexdigest()
