"""End to end: an L3 backend from another package, installed by pip and found by entry point.

The example plug-in (``examples/sqlite_store``: pages in one SQLite file) is installed into a
private directory that only the daemon's ``PYTHONPATH`` names. The daemon is configured for it
in YAML (``cache.l3.backend: sqlite``, ``cache.l3.options``) and nothing in hicache names it:
a prompt flushed from L1 and L2 comes back from the plug-in's store with the cold output, so
does it after a restart, ``PUT /cache/storage`` attaches another of its stores (one the config
names) at run time, and bad options are refused naming the key, at start.
"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.storage.plugin_install import install_sqlite_plugin
from tests.support.daemon import REPO, Daemon, check_served_from_l3_after_restart


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = install_sqlite_plugin(tmp_path_factory.mktemp("plugin") / "site")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


def _config(db: Path, other: Path | None = None, **options: object) -> dict:
    """``other``: a second store of the plug-in, ``cache.l3_stores.other``."""
    stores = {} if other is None else {"other": {"backend": "sqlite", "options": {"path": str(other)}}}
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 2048}, "l2": {"tokens": 8192},
                  "l3": {"backend": "sqlite", "options": {"path": str(db), **options}}, "l3_stores": stores},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "warning"},
    }


def _pages(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM pages").fetchone()[0])


def test_plugin_store_serves_l3_hits_after_a_flush_and_a_restart(tmp_path: Path, plugin_env: dict[str, str]) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(1, 250) for _ in range(768)]
    db = tmp_path / "store" / "l3.sqlite"
    other = tmp_path / "other" / "l3.sqlite"
    d = Daemon(tmp_path, _config(db, other), env=plugin_env)
    d.start()
    try:
        status, body = d.request("GET", "/cache/storage")
        assert status == 200 and body["backend"] == "sqlite" and body["up"], body
        first = d.generate(prompt, 4)
        d.wait_tiers_idle("write-through and backups done")
        assert _pages(db) >= 768 // 4, "the prompt's pages are not in the plug-in's store"
        status, _ = d.request("POST", "/cache/flush")
        assert status == 200
        again = d.generate(prompt, 4)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens_details"]["storage"] >= 700, again["meta_info"]

        status, body = d.request("PUT", "/cache/storage", {"store": "other"})
        assert status == 200, body
        d.generate([rng.randrange(1, 250) for _ in range(200)], 2)
        d.wait_tiers_idle("the backup to the attached store done")
        assert _pages(other) >= 200 // 4
    finally:
        assert d.stop() == 0, d.log()
    check_served_from_l3_after_restart(tmp_path, _config(db), prompt, first["output_ids"], 700, env=plugin_env)


def test_plugin_options_are_checked_by_the_plugin_before_start(tmp_path: Path, plugin_env: dict[str, str]) -> None:
    import yaml

    cfg = tmp_path / "bad.yaml"
    raw = _config(tmp_path / "l3.sqlite", timeout_s=-1)
    raw["cache"]["l3_stores"] = {"bad": {"backend": "sqlite", "options": {"file": "x.db"}}}  # attachable by name
    cfg.write_text(yaml.safe_dump(raw))
    env = {**os.environ, **plugin_env}
    out = subprocess.run([sys.executable, "-m", "hicache", "check-config", str(cfg)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cache.l3.options" in out.stderr + out.stdout and "timeout_s" in out.stderr + out.stdout
    assert "cache.l3_stores.bad.options" in out.stderr and "'file'" in out.stderr, out.stderr
    # the same config without the plug-in installed: the backend is unknown, by name
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "hicache", "check-config", str(cfg)],
                         cwd=REPO, env=bare, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown L3 backend 'sqlite'" in out.stderr + out.stdout, out.stderr
