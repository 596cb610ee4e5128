"""``vllm_driver`` with two more knobs, for ``hicache bench engine``.

``python -m hicache.bench.engine_lib.engine_proc [--num-blocks N] [--kv-transfer-json JSON]
DRIVER-ARGS...`` runs ``hicache.bench.engine_lib.vllm_driver`` (same stdin/stdout protocol)
with ``vllm.LLM`` given two extra arguments:

* ``num_gpu_blocks_override=N``: vLLM's KV space in blocks. ``VLLM_CPU_KVCACHE_SPACE`` only
  takes whole GiB, far more than the small working sets a 2-core benchmark can afford to
  exceed; the block count sets the KV space exactly.
* ``kv_transfer_config=JSON``: any connector (vLLM's ``OffloadingConnector``, LMCache's
  ``LMCacheConnectorV1``), where the driver itself only knows ``HiCacheConnector``.

``EngineProcess`` is the parent side: a ``VllmProcess`` started through this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hicache.bench.engine_lib.vllm_driver import VllmError, VllmProcess

__all__ = ["EngineProcess", "VllmError"]


def _patch_llm(num_blocks: int | None, kv_transfer: dict[str, Any] | None) -> None:
    """Make ``from vllm import LLM`` return a subclass that adds the two arguments."""
    saved = os.dup(1)
    os.dup2(2, 1)  # vLLM may print while importing: keep it off the answer pipe
    try:
        import vllm

        base = vllm.LLM

        class SizedLLM(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                if num_blocks:
                    kwargs["num_gpu_blocks_override"] = num_blocks
                if kv_transfer is not None:
                    kwargs["kv_transfer_config"] = kv_transfer
                super().__init__(*args, **kwargs)

        vllm.LLM = SizedLLM  # type: ignore[misc]
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    num_blocks: int | None = None
    kv_transfer: dict[str, Any] | None = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--num-blocks":
            num_blocks = int(args[i + 1])
            i += 2
        elif args[i] == "--kv-transfer-json":
            kv_transfer = json.loads(args[i + 1])
            i += 2
        else:
            rest.append(args[i])
            i += 1
    _patch_llm(num_blocks, kv_transfer)
    from hicache.bench.engine_lib import vllm_driver

    return vllm_driver.main(rest)


class EngineProcess(VllmProcess):
    """A ``VllmProcess`` with ``num_blocks`` (vLLM's KV space, in blocks) and any connector
    (``kv_transfer``, vLLM's ``kv_transfer_config``; exclusive with ``hicache_config``)."""

    def __init__(self, model: str, log_path: str | Path, *, hicache_config: str | None = None,
                 block_size: int = 32, max_model_len: int = 2048, dtype: str = "auto", prefix_caching: bool = False,
                 max_num_seqs: int = 16, max_num_batched_tokens: int | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 300.0,
                 num_blocks: int | None = None, kv_transfer: dict[str, Any] | None = None) -> None:
        cmd = [sys.executable, "-m", "hicache.bench.engine_lib.engine_proc", "--model", model,
               "--block-size", str(block_size), "--max-model-len", str(max_model_len), "--dtype", dtype,
               "--max-num-seqs", str(max_num_seqs)]
        if num_blocks:
            cmd += ["--num-blocks", str(num_blocks)]
        if kv_transfer is not None:
            cmd += ["--kv-transfer-json", json.dumps(kv_transfer)]
        if hicache_config:
            cmd += ["--hicache-config", hicache_config]
        if prefix_caching:
            cmd.append("--prefix-caching")
        if max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        self.log_path = Path(log_path)
        child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                     "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=child_env, text=True, start_new_session=True)
        try:
            ready = self._read(start_timeout_s)
        except VllmError:
            self.kill()
            raise
        if not ready.get("ready"):
            self.kill()
            raise VllmError(f"vLLM did not start: {ready}")
        self.start_s = float(ready["start_s"])


if __name__ == "__main__":
    raise SystemExit(main())
