"""Hugging Face checkpoints: logits and greedy tokens against ``transformers`` (CPU, no
downloads), and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hicache.config import ModelConfig
from hicache.model.fingerprint import model_identity
from hicache.model.geometry import geometry_for
from hicache.model.hf_config import CheckpointError
from hicache.model.loader import load_model
from hicache.model.sampling_params import SamplingParams
from tests.model.conftest import Driver, Req

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (it is in the 'test' extra: pip install -e .[test])"
)

COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
PROMPTS = [[5, 17, 33, 250, 2, 9, 14], [1, 2, 3], list(range(40, 80)), [299, 0, 7, 7, 7, 7, 7, 100, 3]]


def build(kind: str, path: Path, **extra: object) -> Path:
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**COMMON, rope_theta=10000.0, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, rope_theta=1000000.0, **extra)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=16, **extra)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(**COMMON, sliding_window=6, **extra)
        model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():  # random norms and biases, so that every weight matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_and_greedy_match_transformers(kind: str, tmp_path: Path) -> None:
    path = build(kind, tmp_path / kind)
    loaded = load_model(ModelConfig(kind="hf", path=str(path)))
    if kind == "mistral":
        assert set(loaded.spec.layer_kinds) == {"swa"} and loaded.spec.sliding_window == 6
    drv = Driver(loaded, page_size=4)
    # logits for every prompt position, the whole batch in one pass
    from hicache.model.runner import ForwardItem

    items = []
    for p in PROMPTS:
        pages = [drv.free_pages.pop(0) for _ in range(-(-len(p) // 4))]
        swa = [drv.free_swa.pop(0) for _ in range(len(pages))]
        geo = loaded.geometry
        items.append(ForwardItem(p, 0, pages if geo.full else (), swa if geo.swa else (), logits="all"))
    ours = drv.runner.forward(items)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # saved in float32
    for p, got in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            want = hf_model(torch.tensor([p])).logits[0].float()
        assert got is not None
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"{kind}: max abs logit difference {err}"
    # greedy generation, token for token
    p = PROMPTS[0]
    req = Req(p, SamplingParams(max_new_tokens=10))
    drv.run([req])
    with torch.no_grad():
        gen = hf_model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert req.out == gen[0, len(p):].tolist()


def test_identity_and_geometry(tmp_path: Path) -> None:
    path = build("llama", tmp_path / "m")
    cfg = ModelConfig(kind="hf", path=str(path))
    geo = geometry_for(cfg)
    assert geo.components == ("full",) and geo.full is not None and geo.full.num_layers == 3
    ident = model_identity(cfg)
    assert ident == model_identity(cfg) and len(ident) == 64
    assert model_identity(ModelConfig(kind="hf", path=str(path), dtype="bfloat16")) != ident
    other = build("llama", tmp_path / "m2")  # same seed: same bytes, same identity
    assert model_identity(ModelConfig(kind="hf", path=str(other))) == ident
    from hicache.model.safetensors_io import SafetensorsFile

    f = SafetensorsFile(other / "model.safetensors")
    info = f.tensors["model.layers.0.mlp.down_proj.weight"]
    data = bytearray((other / "model.safetensors").read_bytes())
    data[info.begin] ^= 0xFF
    (other / "model.safetensors").write_bytes(bytes(data))
    assert model_identity(ModelConfig(kind="hf", path=str(other))) != ident


def test_sharded_checkpoint_and_missing_shard(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**COMMON)
    model = transformers.LlamaForCausalLM(cfg)
    path = tmp_path / "sharded"
    model.save_pretrained(path, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    loaded = load_model(ModelConfig(kind="hf", path=str(path)))
    assert loaded.spec.num_layers == 3
    (path / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=shards[1]):
        load_model(ModelConfig(kind="hf", path=str(path)))


def test_wrong_shape_missing_tensor_and_bad_files(tmp_path: Path) -> None:
    path = build("llama", tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad_shape"
    shutil.copytree(path, bad)
    (bad / "config.json").write_text(json.dumps({**raw, "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight.*shape \[112, 64\].*\[128, 64\]"):
        load_model(ModelConfig(kind="hf", path=str(bad)))

    arch = tmp_path / "arch"
    shutil.copytree(path, arch)
    (arch / "config.json").write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(ModelConfig(kind="hf", path=str(arch)))

    tied = tmp_path / "untied_missing_head"
    shutil.copytree(path, tied)
    from hicache.model.safetensors_io import SafetensorsFile

    f = SafetensorsFile(tied / "model.safetensors")
    tensors = {n: f.read(n, torch.float32) for n in f.tensors if n != "lm_head.weight"}
    f.close()
    _save(tensors, tied / "model.safetensors")
    with pytest.raises(CheckpointError, match="'lm_head.weight' is missing"):
        load_model(ModelConfig(kind="hf", path=str(tied)))

    trunc = tmp_path / "truncated"
    shutil.copytree(path, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(ModelConfig(kind="hf", path=str(trunc)))

    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(ModelConfig(kind="hf", path=str(tmp_path)))
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(ModelConfig(kind="hf", path=str(empty)))


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    header: dict[str, object] = {}
    blobs = []
    off = 0
    for name, t in tensors.items():
        b = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))
