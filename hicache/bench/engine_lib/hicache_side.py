"""The hicache half of ``bench engine``: an engine-mode daemon config, the daemon, its stats.

``write_engine_config`` writes the YAML that both ``hicache serve`` and the vLLM connector
read (``engine.kind: vllm``, the checkpoint, the block size as ``cache.page_size``, an L2 of
``l2_tokens``, a file L3 and the IPC directory where the engine socket lives).
``EngineDaemon`` runs it through ``ManagedDaemon`` and can restart it on the same config
(same IPC socket and L3 directory, an empty L2): engines reconnect and re-register.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from hicache.bench.serve_lib.daemon import ManagedDaemon


def write_engine_config(path: Path, *, model: str, page_size: int, l2_tokens: int, l3_dir: Path,
                        ipc_dir: Path) -> Path:
    """The engine-mode YAML at ``path`` (directories created)."""
    l3_dir.mkdir(parents=True, exist_ok=True)
    ipc_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "engine": {"kind": "vllm", "model": model},
        "cache": {"page_size": page_size, "l2": {"tokens": l2_tokens},
                  "l3": {"backend": "file", "file": {"dir": str(l3_dir)}}},
        "ipc": {"dir": str(ipc_dir)},
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class EngineDaemon:
    """``hicache serve`` in engine mode; ``restart`` empties L2 and keeps L3."""

    def __init__(self, config: Path, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.daemon: ManagedDaemon | None = None
        self.restarts = 0

    def start(self) -> None:
        self.daemon = ManagedDaemon(self.config, log_path=self.log_path)
        self.daemon.start()

    def stop(self) -> int:
        if self.daemon is None:
            return 0
        try:
            return self.daemon.stop()
        finally:
            self.daemon = None

    def kill(self) -> None:
        if self.daemon is not None:
            self.daemon.kill()
            self.daemon = None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def stats(self) -> dict[str, Any]:
        assert self.daemon is not None
        with urllib.request.urlopen(self.daemon.url + "/cache/stats", timeout=30) as resp:
            out: dict[str, Any] = json.load(resp)
        return out

    def flush(self) -> None:
        """Drop every unlocked L2 page (L3 keeps its copies)."""
        assert self.daemon is not None
        req = urllib.request.Request(self.daemon.url + "/cache/flush", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()

    def wait_backups(self, timeout_s: float = 60.0) -> bool:
        """Wait until every committed L2 page has been backed up to L3; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.stats()
            committed = st["engine"]["committed_pages"] * self._page_size(st)
            tiers = st.get("tiers", {})
            if tiers.get("backup_tokens", 0) >= committed and st["leases"]["open"] == 0:
                return True
            time.sleep(0.2)
        return False

    def _page_size(self, st: dict[str, Any]) -> int:
        cfg = yaml.safe_load(self.config.read_text())
        return int(cfg["cache"]["page_size"])
