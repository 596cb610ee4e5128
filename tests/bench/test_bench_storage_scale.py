"""``hicache bench storage --parts scale`` at toy sizes: it runs through the CLI, every
command's figure has the raw file operations' growth as its reference, and no store is left
behind."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.cli.main import main


def test_bench_storage_scale_writes_its_figures_against_raw_file_operations(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    work = tmp_path / "stores"
    work.mkdir()
    assert main(["bench", "storage", "--parts", "scale", "--objects", "300,1500", "--dir", str(work),
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "storage-scale"
    figures = {f["name"]: f for f in doc["figures"]}
    for f in figures.values():
        assert {"value", "reference", "ratio", "goal", "meets_goal"} <= set(f)
        assert f["value"] > 0 and f["reference"] > 0
    gc = figures["hicache storage gc (half the store): growth from 300 to 1,500 objects"]
    assert gc["reference_name"] == "raw file operations' growth" and gc["goal"] == 1.1
    small, big = doc["per_size"]
    assert (small["objects"], big["objects"]) == (300, 1500)
    for key in ("stats", "verify", "gc", "clear"):
        assert big[f"{key}_s"] > 0 and big[f"raw_{key}_s"] > 0
    assert gc["value"] == big["gc_s"] / small["gc_s"]
    assert gc["reference"] == big["raw_gc_s"] / small["raw_gc_s"]
    assert list(work.iterdir()) == []  # every store removed
