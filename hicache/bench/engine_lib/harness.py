"""What every part of ``bench engine`` needs: ``Bench`` (where to work, the model, engines
and daemons started one at a time, progress) and the small statistics the parts share.
"""

from __future__ import annotations

import math
import random
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.bench.engine_lib.hicache_side import EngineDaemon, write_engine_config
from hicache.bench.engine_lib.vllm_driver import VllmProcess


@dataclass
class Bench:
    """What every part needs: where to work, the model, and how to report progress.

    ``dtype`` is passed to vLLM explicitly: on the CPU, ``auto`` runs a float32 checkpoint
    in bfloat16."""

    workdir: Path
    model: str
    block_size: int
    kv_bytes_per_token: int
    vocab: int
    dtype: str
    progress: Callable[[str], None]
    engine_env: dict[str, str] = field(default_factory=dict)
    tensor_parallel: int = 1
    """vLLM's ``--tensor-parallel-size`` for every engine of the run (its ranks share the cores)."""
    logs: list[str] = field(default_factory=list)

    def log_path(self, name: str) -> Path:
        path = self.workdir / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.logs.append(str(path))
        return path

    def prompts(self, n: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(1, self.vocab) for _ in range(length)] for _ in range(n)]

    def engine(self, name: str, env: dict[str, str] | None = None, **kw: Any) -> VllmProcess:
        self.progress(f"starting vLLM ({name})")
        kw.setdefault("tensor_parallel", self.tensor_parallel)
        eng = VllmProcess(self.model, self.log_path(name), block_size=self.block_size, dtype=self.dtype,
                          env={**self.engine_env, **(env or {})}, **kw)
        self.progress(f"vLLM ({name}) started in {eng.start_s:.0f} s")
        return eng

    def daemon(self, name: str, l2_tokens: int) -> EngineDaemon:
        base = self.workdir / name
        if base.exists():
            shutil.rmtree(base)
        cfg = write_engine_config(base / "hicache.yaml", model=self.model, page_size=self.block_size,
                                  l2_tokens=l2_tokens, l3_dir=base / "l3", ipc_dir=base / "run")
        d = EngineDaemon(cfg, self.log_path(f"{name}-daemon"))
        d.start()
        return d


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
