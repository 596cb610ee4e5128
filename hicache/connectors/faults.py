"""Fault points of the connector, for tests: read once from the environment at start.

Each one set is logged as a warning when the connector starts. None is set in production.

==================================  ==========================================================
variable                            effect
==================================  ==========================================================
``HICACHE_FAULT_FAIL_LOADS=N``      the worker's first ``N`` load plans fail as a copy error
                                    would (vLLM recomputes their blocks); a layer-wise one
                                    (``hicache_copy: layer``) at its last layer, once the
                                    forward pass has read the layers copied before it
``HICACHE_FAULT_RUNTIME={...}``     a JSON object replacing entries of the engine's runtime
                                    identity (e.g. ``{"isa": "amx"}``: an engine that models
                                    another host; ``hicache.connectors.runtime_identity``)
``HICACHE_FAULT_STALL_SAVES_RANK=R``  the worker of tensor-parallel rank ``R`` stops before
                                    its first save and never copies again (a rank that
                                    hangs or is killed mid-save; the other ranks commit)
``HICACHE_FAULT_SLOW_COPIES_S=X``  the copy thread (``hicache_copy: async``) sleeps ``X``
                                    seconds before each save's copy (a copy that lags
                                    behind the steps: the blocks it reads are reused), and
                                    the layer loader (``layer``) before each layer (the
                                    forward pass reaches layers not copied yet)
``HICACHE_FAULT_SLOW_PENDING_ASKS=N``  the scheduler half's first ``N`` asks again about a
                                    request whose lookup was answered pending do not wait
                                    for their answer (as against a daemon loop that answers
                                    late: the answer arrives after the call gave up)
==================================  ==========================================================
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("hicache.connector")

FAIL_LOADS_ENV = "HICACHE_FAULT_FAIL_LOADS"
RUNTIME_ENV = "HICACHE_FAULT_RUNTIME"
STALL_SAVES_RANK_ENV = "HICACHE_FAULT_STALL_SAVES_RANK"
SLOW_PENDING_ASKS_ENV = "HICACHE_FAULT_SLOW_PENDING_ASKS"
SLOW_COPIES_ENV = "HICACHE_FAULT_SLOW_COPIES_S"
STALL_S = 3600.0
"""How long a stalled rank sleeps: until the test kills it."""


class FaultConfigError(ValueError):
    """A fault variable that does not parse; the message names it."""


def _int_env(env: dict[str, str], name: str) -> int | None:
    """The integer variable ``name`` (None when unset or empty); FaultConfigError otherwise."""
    raw = env.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise FaultConfigError(f"{name} must be an integer, got {raw!r}") from None


@dataclass
class ConnectorFaults:
    fail_loads: int = 0
    runtime: dict[str, Any] = field(default_factory=dict)
    stall_saves_rank: int | None = None
    slow_pending_asks: int = 0
    slow_copies_s: float = 0.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ConnectorFaults:
        env = dict(os.environ) if env is None else env
        out = cls()
        out.fail_loads = _int_env(env, FAIL_LOADS_ENV) or 0
        raw = env.get(RUNTIME_ENV)
        if raw:
            try:
                runtime = json.loads(raw)
            except ValueError as exc:
                raise FaultConfigError(f"{RUNTIME_ENV} is not JSON: {exc}") from None
            if not isinstance(runtime, dict):
                raise FaultConfigError(f"{RUNTIME_ENV} must be a JSON object")
            out.runtime = runtime
        out.stall_saves_rank = _int_env(env, STALL_SAVES_RANK_ENV)
        out.slow_pending_asks = _int_env(env, SLOW_PENDING_ASKS_ENV) or 0
        raw = env.get(SLOW_COPIES_ENV)
        if raw:
            try:
                out.slow_copies_s = float(raw)
            except ValueError:
                raise FaultConfigError(f"{SLOW_COPIES_ENV} must be a number of seconds, got {raw!r}") from None
        for name in (FAIL_LOADS_ENV, RUNTIME_ENV, STALL_SAVES_RANK_ENV, SLOW_PENDING_ASKS_ENV, SLOW_COPIES_ENV):
            if env.get(name):
                log.warning("hicache: fault point %s=%r is set (testing only)", name, env[name])
        return out

    def take_load_failure(self) -> bool:
        """Whether the next load plan is to fail (counts it down)."""
        if self.fail_loads <= 0:
            return False
        self.fail_loads -= 1
        return True

    def take_slow_pending_ask(self) -> bool:
        """Whether the next ask about a pending request is not to wait for its answer (counts it down)."""
        if self.slow_pending_asks <= 0:
            return False
        self.slow_pending_asks -= 1
        return True

    def stall_saves(self, rank: int) -> None:
        """Stop here (for ``STALL_S``) if rank ``rank`` is the one whose saves stall."""
        if self.stall_saves_rank == rank:
            log.warning("hicache: fault point %s: rank %d stalls before its save", STALL_SAVES_RANK_ENV, rank)
            time.sleep(STALL_S)

    def slow_copy(self) -> None:
        """Sleep ``slow_copies_s`` (the copy threads' fault point: before each save's copy, each layer of a load)."""
        if self.slow_copies_s > 0:
            time.sleep(self.slow_copies_s)
