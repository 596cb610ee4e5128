"""``hicache bench reserve``: a short run through the CLI (the cache server in process, no
daemon): every figure has its reference, and under a thrashing L2 the pages reserved stay
within the re-save bound of the new content."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.bench.reserve import RESAVE_GOAL
from hicache.cli.main import main


def test_a_short_run_reports_cpu_by_context_and_the_reserved_pages_against_new_content(tmp_path: Path) -> None:
    out = tmp_path / "reserve.json"
    assert main(["bench", "reserve", "--contexts", "64,1024", "--requests", "2", "--blocks", "4",
                 "--running", "4", "--decode", "64", "--finish", "12", "--max-prompt-tokens", "2048",
                 "--l2", "0.25,4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    figs = {f["name"]: f for f in doc["figures"]}
    assert figs["server CPU per block, 1024 tokens"]["reference"] > 0
    for frac in ("0.25", "4"):
        got = doc["thrash"][frac]
        assert got["new_pages"] > 0 and got["reserved_pages"] <= RESAVE_GOAL * got["new_pages"]
        assert figs[f"lookup hit pages, L2 {frac}x running"]["reference"] == got["prompt_pages"] > 0
    assert doc["thrash"]["4"]["hit_pages"] > 0  # an L2 that holds the running requests serves the trace's prefixes
