"""End to end: pinned prefixes (``cache.pinned``, ``/cache/pinned``) on a real daemon.

The configured prefix is pinned before the port opens, so the first request already hits
it; a flood of other prompts larger than L1 and L2 together does not evict it; run-time pins
are refused by name past their share; after a restart the set is back from L3 before the
first request, and answers exactly as a daemon without it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tests.support.daemon import Daemon, DaemonFactory

SYSTEM = ("You are a careful assistant for the hicache test suite. Answer in one short line, cite the "
          "document you used, and never invent a page number. Tools: search(query), open(doc), "
          "quote(doc, line). ")
PAGE = 16


def _config(tmp: Path, **cache: Any) -> dict[str, Any]:
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": PAGE, "l1": {"tokens": 1024}, "l2": {"tokens": 2048},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}},
                  "prefetch": {"threshold_tokens": 64},  # a pin comes from L3 by the rule every request follows
                  "pinned": [{"name": "system", "text": SYSTEM}], **cache},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "info"},
    }


def _generate(d: Daemon, text: str) -> dict[str, Any]:
    status, out = d.request("POST", "/generate", {"text": text, "sampling_params": {"max_new_tokens": 4,
                                                                                     "temperature": 0}})
    assert status == 200, (status, out, d.log())
    return out["meta_info"] | {"output_ids": out["output_ids"]}


def _pinned_tokens() -> int:
    return (len(SYSTEM.encode()) + 1) // PAGE * PAGE  # byte-level ids and a BOS


def test_pins_hit_from_the_first_request_survive_floods_and_restarts(daemons: DaemonFactory, tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    d = daemons(cfg, "pinned")
    first = _generate(d, SYSTEM + "Which tier is fastest?")
    assert first["cached_tokens"] == _pinned_tokens()  # the very first request
    status, listing = d.request("GET", "/cache/pinned")
    assert status == 200
    (pin,) = listing["pinned"]
    assert pin["name"] == "system" and pin["state"] == "pinned" and pin["tiers"] == ["l1", "l2"]
    assert pin["tenant"] is None and pin["cache_salt"] == ""
    assert pin["tokens"] == _pinned_tokens() and pin["loaded"]["storage"] == 0

    rng = random.Random(3)
    for i in range(40):  # 40 x ~300 tokens: far past L1 (1,024) and L2 (2,048)
        _generate(d, "".join(chr(rng.randrange(97, 123)) for _ in range(300)) + str(i))
    again = _generate(d, SYSTEM + "Which tier is slowest?")
    assert again["cached_tokens_details"]["device"] >= _pinned_tokens()

    # run time: too large for L1's share (512 of 1,024 tokens), refused by name; a small one fits
    status, err = d.request("PUT", "/cache/pinned", {"name": "manual", "text": "x" * 400})
    assert status == 400 and "pinned prefix 'manual'" in err["error"]["message"]
    assert "does not fit L1's share" in err["error"]["message"] and "by system" in err["error"]["message"]
    status, ok = d.request("PUT", "/cache/pinned", {"name": "tools", "input_ids": list(range(40, 90)),
                                                    "tiers": ["l2"]})
    assert status == 200 and ok["tokens"] == 48 and ok["tiers"] == ["l2"]
    status, err = d.request("PUT", "/cache/pinned", {"name": "bad name", "input_ids": [1] * 20})
    assert status == 400 and "name must be" in err["error"]["message"]
    status, err = d.request("PUT", "/cache/pinned", {"name": "both", "text": "a", "input_ids": [1]})
    assert status == 400
    assert d.request("DELETE", "/cache/pinned/tools")[0] == 200
    assert d.request("DELETE", "/cache/pinned/tools")[0] == 404
    assert d.stop() == 0

    # a restart: the set is back (from L3) before the first request, with the same answers
    d2 = daemons(cfg, "restarted")
    status, listing = d2.request("GET", "/cache/pinned")
    (pin,) = listing["pinned"]
    assert pin["loaded"]["storage"] == _pinned_tokens()
    after = _generate(d2, SYSTEM + "Which tier is fastest?")
    assert after["cached_tokens"] == _pinned_tokens()
    assert after["output_ids"] == first["output_ids"]


def test_a_configured_set_too_large_stops_the_start_naming_it(tmp_path: Path) -> None:
    cfg = _config(tmp_path, pinned=[{"name": "system", "text": SYSTEM},
                                    {"name": "handbook", "text": "y" * 600, "tiers": ["l1"]}])
    d = Daemon(tmp_path, cfg, "too-large")
    try:
        d.launch()
        assert d.proc is not None
        code = d.proc.wait(timeout=180)
    finally:
        d.kill_all()
    assert code == 1
    log = d.log()
    assert "cache.pinned[1] (handbook)" in log and "does not fit L1's share" in log
