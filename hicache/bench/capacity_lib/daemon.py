"""The daemon under test of ``hicache bench capacity``: its model (a ``config.json`` and a
token weight file, no real weights), its config, and its processes' CPU and counters.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hicache.bench.capacity_lib.traffic import Profile


def write_model(folder: Path, page_size: int, page_bytes: int) -> Path:
    """A checkpoint directory with a ``config.json`` (one layer, one KV head, bfloat16, of a
    head size that makes a page ``page_bytes`` bytes, K and V) and a safetensors file of one
    small tensor (the daemon fingerprints the weight files; nothing reads them)."""
    per_dim = page_size * 2 * 2  # tokens x (K, V) x bfloat16
    if page_bytes % per_dim or page_bytes < per_dim:
        raise ValueError(f"--page-bytes must be a positive multiple of {per_dim} (4 x the page size)")
    head_dim = page_bytes // per_dim
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": head_dim,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": head_dim, "num_hidden_layers": 1,
        "intermediate_size": 4 * head_dim, "vocab_size": 2**32 - 1, "max_position_embeddings": 1 << 20,
        "torch_dtype": "bfloat16"}))
    header = json.dumps({"bench.weight": {"dtype": "BF16", "shape": [8], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-len(header) % 8)
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + os.urandom(16))
    return folder


def write_config(path: Path, model: Path, profile: Profile, workdir: Path, redis_url: str | None) -> Path:
    l3: dict[str, Any] = {"backend": "none"}
    if profile.l3 == "file":
        l3 = {"backend": "file", "file": {"dir": str(workdir / "l3")}}
    elif profile.l3 == "redis":
        l3 = {"backend": "redis", "redis": {"url": redis_url}}
    doc = {"engine": {"kind": "vllm", "model": str(model), "lookup_timeout_ms": 1000},
           "cache": {"page_size": profile.page_size, "l2": {"tokens": profile.l2_pages * profile.page_size}, "l3": l3},
           "ipc": {"dir": str(workdir / "ipc")}, "logging": {"level": "warning"}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Daemon:
    """The daemon under test, its processes' CPU and its stats."""

    def __init__(self, config: Path, overrides: list[str], log: Path, page_size: int) -> None:
        from hicache.bench.serve_lib.daemon import ManagedDaemon

        self.page_size = page_size
        self.managed = ManagedDaemon(config, overrides, log_path=log)
        self.pids: dict[str, int] = {}

    def start(self) -> None:
        self.managed.start()
        health = self.get("/health")
        self.pids = {"launcher": self.managed.proc.pid if self.managed.proc else 0, **health.get("processes", {})}

    def get(self, route: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.managed.url + route, timeout=30) as resp:
            return dict(json.loads(resp.read()))

    def cpu_s(self) -> dict[str, float]:
        from hicache.bench.capacity_lib.reference import process_cpu_s

        return {name: process_cpu_s(pid) or 0.0 for name, pid in self.pids.items()}

    def counters(self) -> dict[str, float]:
        stats = self.get("/cache/stats")
        engine, tiers = stats.get("engine", {}), stats.get("tiers", {})
        return {"committed": engine.get("committed_pages", 0),
                "loaded": engine.get("loaded_host_pages", 0) + engine.get("loaded_storage_pages", 0),
                "backed_up": tiers.get("backup_tokens", 0) / self.page_size,
                "prefetched": tiers.get("prefetch_tokens", 0) / self.page_size,
                "reserved": engine.get("reserved_pages", 0), "lookups": engine.get("lookups", 0)}

    def stop(self) -> None:
        try:
            self.managed.stop()
        finally:
            self.managed.kill()


@dataclass
class Sample:
    """The daemon's and the engines' CPU seconds and the daemon's counters at one moment."""

    at: float
    cpu_s: dict[str, float]
    engines_cpu_s: float
    counters: dict[str, float]

    @classmethod
    def take(cls, daemon: Daemon, engine_pids: list[int]) -> Sample:
        from hicache.bench.capacity_lib.reference import process_cpu_s

        return cls(time.monotonic(), daemon.cpu_s(), sum(process_cpu_s(pid) or 0.0 for pid in engine_pids),
                   daemon.counters())
