"""``hicache bench engine``: the ``copy`` part, in this process (no vLLM).

Runs ``--parts copy --quick`` through the CLI and checks the JSON (a figure with a ratio
per op, pattern and size; the bitwise checks passed), then loads L2 pages into KV blocks
with ``BlockCopier`` on a rig of the bench's own and compares them bitwise with the pages.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
from pathlib import Path

import torch

from hicache.bench.engine_lib.copy_bench import loaded_correctly, make_rig
from hicache.cli.main import main


def test_copy_part_writes_ratios(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--parts", "copy", "--quick", "--workdir", str(tmp_path / "w"),
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "engine"
    figs = doc["figures"]
    names = {f["name"] for f in figs}
    for op in ("load", "save"):
        for pattern in ("runs", "scattered"):
            assert any(n.startswith(f"copy {op} {pattern} ") for n in names)
    for f in figs:
        assert f["reference_name"] == "torch index copy"
        assert f["goal"] == 0.8
        assert f["value"] > 0 and f["reference"] > 0
        assert math.isclose(f["ratio"], f["value"] / f["reference"])
        assert isinstance(f["meets_goal"], bool)
    copy = doc["copy"]
    assert copy["checks"] and all(copy["checks"].values())
    assert len(copy["results"]) == len(figs)


def test_block_copier_load_is_bitwise_exact() -> None:
    rig = make_rig(num_layers=3, kv_heads=2, block_size=32, head_dim=64, num_blocks=24, l2_pages=20, seed=3)
    try:
        rng = random.Random(5)
        before = [t.clone() for t in rig.layers]
        pages = [4, 5, 6, 11, 2, 17]  # a run of three, then single pages
        blocks = [0, 1, 2, 20, 9, 13]
        moved = rig.copier.load(pages, [blocks])
        assert moved == len(pages) * rig.page_bytes
        assert loaded_correctly(rig, pages, blocks)
        untouched = [b for b in range(24) if b not in blocks]
        for layer, old in zip(rig.layers, before, strict=True):
            assert torch.equal(layer[untouched].view(torch.int16), old[untouched].view(torch.int16))
        # and back: new bytes in the blocks, saved to other pages
        for layer in rig.layers:
            layer[blocks] = torch.randint(-(1 << 14), 1 << 14, layer[blocks].shape, dtype=torch.int16).view(
                layer.dtype)
        targets = rng.sample([p for p in range(20) if p not in pages], len(blocks))
        rig.copier.save([blocks], targets)
        assert loaded_correctly(rig, targets, blocks)
        assert not loaded_correctly(rig, pages, blocks)
    finally:
        rig.close()


def test_lookup_part_times_the_connector_side_against_the_shortest_prompt(tmp_path: Path) -> None:
    """``--parts lookup --quick``: a real daemon, the protocol client the connector uses; each
    longer prompt's first ask and ask again against the shortest one's, and the longest one's
    time beside the 1 ms goal."""
    out = tmp_path / "engine.json"
    workdir = Path(tempfile.mkdtemp(prefix="hcb", dir="/tmp"))  # the daemon's sockets live under it: a
    try:                                                          # short path (sun_path is 107 bytes)
        assert main(["bench", "engine", "--parts", "lookup", "--quick", "--workdir", str(workdir),
                     "--json", str(out)]) == 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc = json.loads(out.read_text())
    names = {f["name"] for f in doc["figures"]}
    assert names == {"lookup: first ask, 8192-token L2 hit", "lookup: ask again, 8192-token L2 hit"}
    for f in doc["figures"]:
        assert f["reference_name"] == "1024-token L2 hit" and f["value"] > 0 and f["reference"] > 0
    lookup = doc["lookup"]
    assert [r["tokens"] for r in lookup["rows"]] == [1024, 8192]
    for row in lookup["rows"]:  # every ask hit the whole saved prompt (the last token is never cached)
        assert row["hit_pages"] == row["tokens"] // 32
        assert len(row["first_s"]) == len(row["again_s"]) == lookup["repeats"]
    assert lookup["longest"] == 8192 and lookup["goal_ms"] == 1.0


def test_multiturn_answers_in_batches_the_smaller_kv_space_runs_at_once() -> None:
    """Every run of the multi-turn part answers in the same batches: by default as many
    conversations as the smaller KV space holds in the last round (8 x 6 rounds of 256 + 16
    tokens: 52 blocks of 32 each, 136 blocks hold two), or what ``--answer-batch`` asks."""
    from hicache.bench.engine_lib.parts import ChatShape, answer_batch_for

    shape = ChatShape(8, 6, 256, 16)
    assert answer_batch_for(shape, 136, 32) == 2
    assert answer_batch_for(shape, 51, 32) == 1  # not even one fits: one at a time
    assert answer_batch_for(shape, 10_000, 32) == 8
    assert answer_batch_for(ChatShape(8, 6, 256, 16, answer_batch=3), 136, 32) == 3
    assert answer_batch_for(ChatShape(8, 6, 256, 16, answer_batch=20), 136, 32) == 8
