"""End to end with models whose every layer is sliding-window: a real ``hicache serve`` of the
reference model with ``layers: [swa, swa]`` and of a Hugging Face Mistral checkpoint with
``sliding_window`` set (random weights, saved here: nothing is downloaded).

Such a model has no full-attention layer: its Full component is index-only (page indices
only, no KV bytes and no shared-memory segment) and all KV lives in the SWA pools. A
repeated prompt longer than the window must hit the cache and give the greedy output of the
cold run, bit for bit, also after its prefix went to L2 and came back, and (Mistral) after
it went to a file L3 and came back from there after a flush and after a restart; the
Mistral model's cold output must be the one ``transformers`` generates. In L3 each Full
page is an index marker under its page hash, the KV its SWA objects.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from controller.storage_io import INDEX_LAYOUT_ID
from storage_backends.page_format import parse_header
from tests.support.daemon import Daemon, shm_segments

PS = 4
WINDOW = 16


def _cache(l1_tokens: int = 256) -> dict[str, Any]:
    return {"page_size": PS, "l1": {"tokens": l1_tokens}, "l2": {"tokens": 4096}, "l3": {"backend": "none"}}


def _check_reuse(d: Daemon, prompt: list[int], others: list[list[int]], n: int = 8) -> list[int]:
    """Cold run, L1 hit, L2 hit after ``others`` pushed the prefix out of L1: one output."""
    assert d.proc is not None
    prefix = f"hicache-{d.proc.pid}-"
    segments = shm_segments(prefix)
    assert segments and not any("-full-" in s for s in segments), segments  # index-only Full: no segment
    first = d.generate(prompt, n)
    again = d.generate(prompt, n)
    assert again["output_ids"] == first["output_ids"]
    boundary = (len(prompt) - 1) // PS * PS
    assert boundary > WINDOW
    assert again["meta_info"]["cached_tokens"] == boundary
    assert again["meta_info"]["cached_tokens_details"]["device"] == boundary
    d.wait_for_stats("swa data written to L2", lambda s: s.get("l2", {}).get("swa", {}).get("used_tokens", 0) >= 2)
    for other in others:
        d.generate(other, n)
    third = d.generate(prompt, n)
    assert third["output_ids"] == first["output_ids"]
    details = third["meta_info"]["cached_tokens_details"]
    assert details["host"] > 0, details
    assert details["device"] + details["host"] == boundary, details
    return list(first["output_ids"])


def _stop(d: Daemon) -> None:
    assert d.proc is not None
    prefix = f"hicache-{d.proc.pid}-"
    code = d.stop()
    assert code == 0, d.log()
    assert not shm_segments(prefix), "shared memory left behind"


def test_all_swa_reference_model_reuses_its_prefix_from_l1_and_l2(tmp_path: Path) -> None:
    cfg = {"model": {"reference": {"preset": "tiny", "layers": ["swa", "swa"], "sliding_window": WINDOW}},
           "cache": {**_cache(), "l3_stores": {"run-time": {"backend": "file", "file": {"dir": str(tmp_path / "l3")}}}},
           "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
           "logging": {"level": "warning"}}
    d = Daemon(tmp_path, cfg)
    d.start()
    try:
        rng = random.Random(7)
        prompt = [rng.randrange(1, 250) for _ in range(99)]
        stats = d.get("/cache/stats")
        assert {"full", "swa"} <= set(stats["l1"]), stats["l1"]
        _check_reuse(d, prompt, [[rng.randrange(1, 250) for _ in range(99)] for _ in range(4)])
        # an L3 store attached at run time is taken (its Full pages are index markers)
        status, body = d.request("PUT", "/cache/storage", {"store": "run-time"})
        assert status == 200, (status, body)
        status, body = d.request("GET", "/cache/storage")
        assert status == 200 and body["backend"] == "file", body
    finally:
        _stop(d)


def _mistral_checkpoint(path: Path) -> Path:
    """A tiny random Mistral (every layer sliding-window), saved with ``save_pretrained``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (it is in the 'test' extra: pip install -e .[test])")
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        sliding_window=WINDOW)
    model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():  # random norms, so that every weight matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path)
    return path


def _transformers_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):].tolist()]


def test_hf_mistral_with_sliding_window_is_served_with_its_prefix_reused(tmp_path: Path) -> None:
    path = _mistral_checkpoint(tmp_path / "mistral")
    cfg = {"model": {"kind": "hf", "path": str(path)}, "cache": _cache(),
           "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
           "logging": {"level": "warning"}}
    rng = random.Random(8)
    prompt = [rng.randrange(1, 300) for _ in range(61)]
    want = _transformers_greedy(path, prompt, 8)
    d = Daemon(tmp_path, cfg)
    d.start()
    try:
        got = _check_reuse(d, prompt, [[rng.randrange(1, 300) for _ in range(99)] for _ in range(4)])
        assert got == want
    finally:
        _stop(d)


def _markers(l3: Path) -> int:
    """How many objects of the file store at ``l3`` are index markers."""
    return sum(parse_header(p.read_bytes()).layout_id == INDEX_LAYOUT_ID for p in l3.glob("*/*.page"))


def test_hf_mistral_prefix_comes_back_from_file_l3_after_a_flush_and_a_restart(tmp_path: Path) -> None:
    path = _mistral_checkpoint(tmp_path / "mistral")
    l3 = tmp_path / "l3"
    cfg = {"model": {"kind": "hf", "path": str(path)},
           "cache": {**_cache(), "l3": {"backend": "file", "file": {"dir": str(l3)}},
                     "prefetch": {"threshold_tokens": 1, "policy": "wait_complete"}},
           "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
           "logging": {"level": "warning"}}
    prompt = [random.Random(9).randrange(1, 300) for _ in range(61)]
    boundary = (len(prompt) - 1) // PS * PS
    d = Daemon(tmp_path, cfg, "a")
    d.start()
    try:
        cold = d.generate(prompt)
        assert cold["meta_info"]["cached_tokens"] == 0, cold["meta_info"]
        # every L2 page of the cold run backed up (L2 holds only what it wrote), no write or
        # backup still to come (a flush skips nodes with a transfer in flight)
        stats = d.wait_tiers_idle("the L2 pages backed up to L3")
        assert stats["l2"]["full"]["used_tokens"] > 0, stats
        assert _markers(l3) >= boundary // PS
        status, _ = d.request("POST", "/cache/flush")
        assert status == 200
        flushed = d.generate(prompt)
        assert flushed["output_ids"] == cold["output_ids"]
        assert flushed["meta_info"]["cached_tokens_details"]["storage"] > 0, flushed["meta_info"]
    finally:
        _stop(d)
    d2 = Daemon(tmp_path, cfg, "b")
    d2.start()
    try:
        again = d2.generate(prompt)
        assert again["output_ids"] == cold["output_ids"]
        assert again["meta_info"]["cached_tokens"] == boundary, again["meta_info"]
        assert again["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": boundary}
    finally:
        _stop(d2)
