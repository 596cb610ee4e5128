"""``hicache bench model`` runs for any combination of its sizes (tiny preset, so it is quick)."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.cli.main import main


def test_decode_context_longer_than_the_prompt(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    rc = main(["bench", "model", "--preset", "tiny", "--prompt-tokens", "32", "--decode-batch", "2",
               "--decode-context", "64", "--decode-steps", "2", "--page-size", "4", "--repeats", "1",
               "--json", str(out)])
    assert rc == 0
    names = {f["name"] for f in json.loads(out.read_text())["figures"]}
    assert {"prefill_tokens_per_s", "decode_tokens_per_s"} <= names
