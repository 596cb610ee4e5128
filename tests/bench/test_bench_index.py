"""``hicache bench index`` at toy sizes: it runs through the CLI, writes its figures, and its
heap figure counts what the tree holds (a node per decode step costs more than one leaf)."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.cli.main import main


def test_bench_index_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "index.json"
    assert main(["bench", "index", "--sizes", "1500,3000", "--ops", "5", "--prefix", "8", "--suffix", "8",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "index"
    names = {f["name"] for f in doc["figures"]}
    assert "decode: heap per page at 3,000 pages" in names and "shared: evict at 3,000 pages" in names
    for f in doc["figures"]:
        assert {"value", "reference", "ratio", "goal", "meets_goal"} <= set(f)
    runs = doc["per_config"]
    assert runs["decode/3000/now"]["nodes"] < runs["decode/3000/legacy"]["nodes"]
    assert runs["decode/3000/now"]["bytes_per_page"] < runs["decode/3000/legacy"]["bytes_per_page"]
