"""Building a ready-to-run model from the ``model`` config section."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hicache.config import ModelConfig
from hicache.model.fingerprint import model_identity
from hicache.model.geometry import ModelGeometry
from hicache.model.hf_config import read_hf_config
from hicache.model.spec import DecoderSpec, spec_from_hf_config, spec_from_reference
from hicache.model.weights import DecoderWeights, init_reference_weights


@dataclass
class LoadedModel:
    """A model's architecture, weights (owned here, read-only), pool geometry and identity."""

    spec: DecoderSpec
    weights: DecoderWeights
    geometry: ModelGeometry
    identity: str


def load_model(model: ModelConfig) -> LoadedModel:
    """The reference model (seeded) or a local Hugging Face checkpoint, on the CPU.

    Raises ``CheckpointError`` for a missing/malformed/unsupported checkpoint.
    """
    if model.kind == "reference":
        spec = spec_from_reference(model.reference, model.dtype)
        weights = init_reference_weights(spec, model.reference.seed)
    else:
        from hicache.model.checkpoint import load_hf_weights
        from hicache.model.hf_config import CheckpointError

        if not model.path:
            raise CheckpointError("model.path is required when model.kind is hf")
        spec = spec_from_hf_config(read_hf_config(model.path), model.dtype,
                                   where=str(Path(model.path) / "config.json"))
        weights = load_hf_weights(model.path, spec)
    return LoadedModel(spec=spec, weights=weights, geometry=ModelGeometry.from_spec(spec),
                       identity=model_identity(model))
