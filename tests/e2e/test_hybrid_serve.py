"""End to end with hybrid models: a real ``hicache serve`` of a Full + Mamba, a Full + SWA
and a Full + SWA + Mamba reference model.

Greedy outputs must be identical whether the prompt's prefix (Full KV and the Mamba state
or SWA KV) came from L1, from L2 (both components loaded back by the controller) or was
computed on a cold cache, and the hits must be reported.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, shm_segments

PS = 4


def _config(tmp: Path, layers: list[str]) -> dict:
    return {
        "model": {"reference": {"preset": "tiny", "layers": layers, "sliding_window": 16}},
        "cache": {"page_size": PS, "l1": {"tokens": 256, "state_slots": 16},
                  "l2": {"tokens": 4096, "state_slots": 64},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "warning"},
    }





LAYERS = {"mamba": ["full", "mamba"], "swa": ["full", "swa"], "swa+mamba": ["full", "swa", "mamba", "full"]}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_hybrid_model_reuses_its_prefix_from_l1_and_l2(tmp_path: Path, kind: str) -> None:
    d = Daemon(tmp_path, _config(tmp_path, LAYERS[kind]))
    d.start()
    assert d.proc is not None
    prefix = f"hicache-{d.proc.pid}-"
    try:
        rng = random.Random(5)
        prompt = [rng.randrange(1, 250) for _ in range(99)]
        first = d.generate(prompt)
        again = d.generate(prompt)
        assert again["output_ids"] == first["output_ids"]
        boundary = (len(prompt) - 1) // PS * PS  # the prompt's last page boundary before its last token
        assert again["meta_info"]["cached_tokens"] == boundary
        assert again["meta_info"]["cached_tokens_details"]["device"] == boundary
        for aux in (a for a in ("swa", "mamba") if a in LAYERS[kind]):
            used = "used_slots" if aux == "mamba" else "used_tokens"
            stats = d.wait_for_stats(f"{aux} data written to L2",
                              lambda s, aux=aux, used=used: s.get("l2", {}).get(aux, {}).get(used, 0) >= 2)
            assert stats["l1"][aux]["cached_states" if aux == "mamba" else "cached_tokens"] >= 2
        # other prompts push it out of L1 (64 pages, 27 per request); its L2 copy stays
        for _ in range(4):
            d.generate([rng.randrange(1, 250) for _ in range(99)])
        third = d.generate(prompt)
        assert third["output_ids"] == first["output_ids"]
        details = third["meta_info"]["cached_tokens_details"]
        assert details["host"] > 0, details
        assert details["device"] + details["host"] == boundary, details
    finally:
        code = d.stop()
    assert code == 0, d.log()
    assert not shm_segments(prefix), "shared memory left behind"
