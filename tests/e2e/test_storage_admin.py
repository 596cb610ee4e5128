"""End to end: the storage admin API attaches another L3 the config names at run time, and
pages go there; a body naming a store the config does not is refused."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.daemon import Daemon


def test_put_cache_storage_attaches_a_new_file_store(tmp_path: Path) -> None:
    first, second = tmp_path / "l3-a", tmp_path / "l3-b"
    d = Daemon(tmp_path, {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 1024}, "l2": {"tokens": 4096},
                  "l3": {"backend": "file", "file": {"dir": str(first)}},
                  "l3_stores": {"second": {"backend": "file", "file": {"dir": str(second)}}}},
        "logging": {"level": "warning"},
    })
    d.start()
    try:
        status, body = d.request("PUT", "/cache/storage", {"store": "second"})
        assert status == 200, body
        status, body = d.request("GET", "/cache/storage")
        assert status == 200 and body["backend"] == "file" and body["up"], body
        prompt = list(range(1, 65))
        first_answer = d.generate(prompt)["output_ids"]
        deadline = time.monotonic() + 30  # the L3 backup runs behind the request
        while not list(second.rglob("*.page")):
            assert time.monotonic() < deadline, "no page reached the newly attached store"
            time.sleep(0.2)
        assert d.generate(prompt)["output_ids"] == first_answer
        for body in ({"backend": "file", "file": {"dir": str(tmp_path / "third")}}, {"store": "third"}):
            status, answer = d.request("PUT", "/cache/storage", body)
            assert status == 400 and "(default, second)" in answer["error"]["message"], answer
        assert not (tmp_path / "third").exists()
    finally:
        assert d.stop() == 0, d.log()
