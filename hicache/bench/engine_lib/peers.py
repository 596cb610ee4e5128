"""The ``peers`` part of ``bench engine``: what vLLM on the CPU offers without hicache
(vLLM's own offloading connectors, and LMCache where it installs and starts).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import time
from typing import Any

from hicache.bench.engine_lib.harness import Bench, median, round_up
from hicache.bench.engine_lib.vllm_driver import VllmError, VllmProcess

LMCACHE_VERSION = "0.5.6"
LMCACHE_IMPORT_EXTRAS = ("aiofile", "caio", "aiofiles", "nvtx")
"""Pure-Python modules LMCache imports at start that are not otherwise installed here."""


def _refusal(text: str) -> str:
    """The root cause in an engine's log: the first specific exception line (vLLM repeats the
    worker's error under generic wrappers such as "Engine core initialization failed")."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    generic = re.compile(r"(?i)engine core initialization failed|see root cause|please check the stack trace")
    for pat in (r"\b(\w+Error|Exception): .+", r"(?i)not supported.*", r"(?i)error.*"):
        for ln in lines:
            m = re.search(pat, ln)
            if m and not generic.search(m.group(0)):
                return m.group(0)[:600]
    return (lines[-1] if lines else "(empty log)")[:600]


def _lmcache_site(b: Bench) -> tuple[str | None, str]:
    """A directory to put on PYTHONPATH so LMCache imports, and what was done to get it."""
    if importlib.util.find_spec("lmcache") is not None:
        return "", "installed in this environment"
    site = b.workdir / "lmcache-site"
    if (site / "lmcache").is_dir():
        return str(site), f"installed earlier into {site}"
    # Isolated: into a private directory and without dependencies, so this environment's torch
    # and vLLM stay as they are; only the pure-Python modules it imports at start are added.
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
           f"lmcache=={LMCACHE_VERSION}", *LMCACHE_IMPORT_EXTRAS]
    b.progress(f"peers: {' '.join(cmd[2:])}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"pip install lmcache=={LMCACHE_VERSION} failed: {exc}"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"pip install lmcache=={LMCACHE_VERSION} failed: {' | '.join(tail)}"
    return str(site), f"installed (no dependencies) into {site} with {', '.join(LMCACHE_IMPORT_EXTRAS)}"


def _peer_engine(b: Bench, name: str, kv_transfer: dict[str, Any], max_len: int, blocks: int
                 ) -> tuple[VllmProcess | None, dict[str, Any]]:
    """A vLLM engine with another connector (its prefix caching on), or None and its refusal
    (``started``, ``refusal``: the root cause in its log, ``after_s``)."""
    t0 = time.perf_counter()
    try:
        return b.engine(name, prefix_caching=True, max_model_len=max_len, num_blocks=blocks,
                        kv_transfer=kv_transfer), {}
    except VllmError as exc:
        log = b.workdir / "logs" / f"{name}.log"
        text = log.read_text(errors="replace") if log.is_file() else str(exc)
        return None, {"started": False, "refusal": _refusal(text), "after_s": time.perf_counter() - t0}


def _simple_cpu_offload(b: Bench, prompt_tokens: int, repeats: int, max_len: int, blocks: int) -> dict[str, Any]:
    """vLLM 0.32's own ``SimpleCPUOffloadConnector``: whether it starts on this CPU, and where
    it does, TTFT of a prompt served from its CPU tier (vLLM's prefix cache reset between
    the first request and the repeat, as for hicache's L2 case) against the first request."""
    cfg = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
    eng, refused = _peer_engine(b, "peer-simple-cpu-offload", cfg, max_len, blocks)
    if eng is None:
        return refused
    first: list[float] = []
    again: list[float] = []
    cached: list[int] = []
    same = True
    try:
        for ids in b.prompts(repeats, prompt_tokens, seed=13):
            r1 = eng.generate([ids], 1, timeout_s=1800)
            time.sleep(0.5)  # its stores run between steps
            eng.reset_prefix_cache()
            r2 = eng.generate([ids], 1, timeout_s=1800)
            first.append(float(r1["elapsed_s"]))
            again.append(float(r2["elapsed_s"]))
            cached.append(int(r2["cached"][0]))
            same = same and r1["outputs"] == r2["outputs"]
    finally:
        eng.stop()
    return {"started": True, "first_s": first, "repeat_s": again, "repeat_cached": cached,
            "same_output_tokens": same, "repeat_over_first": median(again) / median(first) if first else math.nan}


def run_peers(b: Bench, *, prompt_tokens: int, repeats: int) -> dict[str, Any]:
    """What vLLM on the CPU offers without hicache: vLLM's ``OffloadingConnector`` and
    ``SimpleCPUOffloadConnector`` (started, or their refusal reported; where the latter runs,
    TTFT of a repeat served from its CPU tier against the first request) and LMCache's
    ``LMCacheConnectorV1`` (installed if possible; if the engine starts, TTFT of a repeated prompt against its first request, vLLM's own prefix
    caching off so only LMCache could serve the repeat)."""
    max_len = round_up(prompt_tokens + b.block_size, b.block_size)
    blocks = max(64, 4 * max_len // b.block_size)
    out: dict[str, Any] = {}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
    peer, refused = _peer_engine(b, "peer-offloading", offload, max_len, blocks)
    if peer is None:
        out["offloading"] = refused
    else:
        res = peer.generate(b.prompts(1, 64, seed=7), 1)
        peer.stop()
        out["offloading"] = {"started": True, "note": "vLLM started with OffloadingConnector on the CPU",
                             "smoke_cached": res["cached"]}
    b.progress(f"peers: OffloadingConnector: {out['offloading']}")
    out["simple_cpu_offload"] = _simple_cpu_offload(b, prompt_tokens, repeats, max_len, blocks)
    b.progress(f"peers: SimpleCPUOffloadConnector: {out['simple_cpu_offload']}")

    site, how = _lmcache_site(b)
    lm: dict[str, Any] = {"version": LMCACHE_VERSION, "install": how}
    out["lmcache"] = lm
    if site is None:
        b.progress(f"peers: LMCache: {how}")
        return out
    env = {"LMCACHE_CHUNK_SIZE": str(b.block_size * 8), "LMCACHE_LOCAL_CPU": "True",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": "2", "LMCACHE_USE_EXPERIMENTAL": "True"}
    if site:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (site, os.environ.get("PYTHONPATH", "")) if x)
    lm["env"] = env
    saved = dict(b.engine_env)
    b.engine_env.update(env)
    try:
        eng = b.engine("peer-lmcache", prefix_caching=False, max_model_len=max_len, num_blocks=blocks,
                       kv_transfer={"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    except VllmError as exc:
        log = b.workdir / "logs" / "peer-lmcache.log"
        text = log.read_text(errors="replace") if log.is_file() else str(exc)
        lm.update(started=False, refusal=_refusal(text))
        b.progress(f"peers: LMCache: vLLM did not start: {lm['refusal']}")
        return out
    finally:
        b.engine_env.clear()
        b.engine_env.update(saved)
    try:
        first: list[float] = []
        again: list[float] = []
        cached: list[int] = []
        same = True
        for rep, ids in enumerate(b.prompts(repeats, prompt_tokens, seed=11)):
            r1 = eng.generate([ids], 1, timeout_s=1800)
            time.sleep(0.5)
            r2 = eng.generate([ids], 1, timeout_s=1800)
            first.append(float(r1["elapsed_s"]))
            again.append(float(r2["elapsed_s"]))
            cached.append(int(r2["cached"][0]))
            same = same and r1["outputs"] == r2["outputs"]
            b.progress(f"peers: LMCache prompt {rep}: first {r1['elapsed_s'] * 1000:.0f} ms, repeat "
                       f"{r2['elapsed_s'] * 1000:.0f} ms, repeat cached {r2['cached'][0]}")
        log_text = eng.log_path.read_text(errors="replace")
    finally:
        eng.stop()
    errors = [ln for ln in log_text.splitlines() if re.search(r"(?i)lmcache error|^\w*Error: ", ln)]
    warnings = list(dict.fromkeys(re.sub(r"\x1b\[[0-9;]*m", "", _refusal(ln)) for ln in errors))[:5]
    lm.update(started=True, first_s=first, repeat_s=again, repeat_cached=cached, same_output_tokens=same,
              repeat_over_first=median(again) / median(first) if first else math.nan, log_warnings=warnings)
    return out
