"""Loading Llama / Qwen2 / Qwen3 / Mistral weights from a local safetensors checkpoint.

Nothing is ever downloaded: ``model.path`` must be a directory holding ``config.json`` and
either ``model.safetensors.index.json`` plus the shards it names, or one or more
``*.safetensors`` files. Every missing file, missing tensor or wrong shape is a
``CheckpointError`` naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hicache.model.checkpoint_files import weight_files
from hicache.model.hf_config import CheckpointError
from hicache.model.pools import torch_dtype
from hicache.model.safetensors_io import SafetensorsFile
from hicache.model.spec import DecoderSpec
from hicache.model.weights import AttentionWeights, DecoderWeights, LayerWeights

log = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@contextmanager
def open_checkpoint(model_dir: str | Path) -> Iterator[dict[str, SafetensorsFile]]:
    """Map every tensor name to the open file that holds it."""
    files = [SafetensorsFile(p) for p in weight_files(model_dir)]
    try:
        where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                if name in where:
                    raise CheckpointError(f"tensor {name!r} appears in both {where[name].path} and {f.path}")
                where[name] = f
        yield where
    finally:
        for f in files:
            f.close()


def load_hf_weights(model_dir: str | Path, spec: DecoderSpec) -> DecoderWeights:
    """Read and check every weight ``spec`` needs; fuse q/k/v and gate/up."""
    dtype = torch_dtype(spec.dtype)
    h, d = spec.hidden_size, spec.head_dim
    used: set[str] = set()
    with open_checkpoint(model_dir) as where:

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            f = where.get(name)
            if f is None:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {model_dir}")
            got = f.tensors[name].shape
            if got != shape:
                raise CheckpointError(
                    f"tensor {name!r} in {f.path} has shape {list(got)}, but config.json implies {list(shape)}"
                )
            used.add(name)
            return f.read(name, dtype)

        embed = get("model.embed_tokens.weight", (spec.vocab_size, h))
        layers = []
        for i, kind in enumerate(spec.layer_kinds):
            if kind == "mamba":
                raise CheckpointError("mamba layers are not supported in Hugging Face checkpoints")
            p = f"model.layers.{i}."
            qd, kvd = spec.num_heads * d, spec.num_kv_heads * d
            q = get(p + "self_attn.q_proj.weight", (qd, h))
            k = get(p + "self_attn.k_proj.weight", (kvd, h))
            v = get(p + "self_attn.v_proj.weight", (kvd, h))
            attn = AttentionWeights(qkv=torch.cat([q, k, v]), o=get(p + "self_attn.o_proj.weight", (h, qd)))
            if spec.attention_bias:
                attn.qkv_bias = torch.cat([
                    get(p + "self_attn.q_proj.bias", (qd,)),
                    get(p + "self_attn.k_proj.bias", (kvd,)),
                    get(p + "self_attn.v_proj.bias", (kvd,)),
                ])
            if spec.o_proj_bias:
                attn.o_bias = get(p + "self_attn.o_proj.bias", (h,))
            if spec.qk_norm:
                attn.q_norm = get(p + "self_attn.q_norm.weight", (d,))
                attn.k_norm = get(p + "self_attn.k_norm.weight", (d,))
            inter = spec.intermediate_size
            layers.append(
                LayerWeights(
                    input_norm=get(p + "input_layernorm.weight", (h,)),
                    post_norm=get(p + "post_attention_layernorm.weight", (h,)),
                    gate_up=torch.cat([get(p + "mlp.gate_proj.weight", (inter, h)),
                                       get(p + "mlp.up_proj.weight", (inter, h))]),
                    down=get(p + "mlp.down_proj.weight", (h, inter)),
                    attention=attn,
                )
            )
        final_norm = get("model.norm.weight", (h,))
        if spec.tie_word_embeddings and "lm_head.weight" not in where:
            lm_head = embed
        else:
            lm_head = get("lm_head.weight", (spec.vocab_size, h))
        extra = sorted(n for n in where if n not in used and not n.endswith(_IGNORED_SUFFIXES))
        if extra:
            log.warning("ignoring %d unused tensor(s) in %s, e.g. %s", len(extra), model_dir, extra[:3])
    return DecoderWeights(embed=embed, final_norm=final_norm, lm_head=lm_head, layers=layers)
