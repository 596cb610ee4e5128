"""Layer-wise loads (``hicache_copy: layer``): a step's hits copied layer by layer beside its forward pass.

The worker hands a step's loads to ``start`` before the forward pass; one thread copies
layer 0 of every load, then layer 1, and so on, while vLLM computes: before each attention
layer vLLM calls ``wait_for_layer_load``, which waits here (``wait``) for that layer only.
After the forward pass the worker calls ``finish`` and ends each load's lease itself.

=====================  ================================================================
what                   rule
=====================  ================================================================
order                  layers in model order; within a layer, the loads in the order given
a copy that raises     that load copies nothing more (its later layers are left as they
                       are) and ends ``ok=False``; the others go on. The worker reports its
                       blocks as load errors: vLLM recomputes them (as for a synchronous
                       load that failed)
the forward pass       waits for layer ``i`` when it reaches it, never for a later layer
one step at a time     ``start`` only once the last step's loads are ``finish``ed (the
                       worker finishes them after the forward pass, and before the next
                       step's loads)
what a load writes     the blocks vLLM gave the hitting request in this step: no save reads
                       them (the fence ran before ``start``), no other request reads them
=====================  ================================================================

Locks: one ``threading.Condition`` guards the step's layer count; copies run without it.
docs/engine-mode.md, "Copy modes".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("hicache.connector")


@dataclass(eq=False)
class LayerLoad:
    """One plan's load split by layer: ``layers[i]()`` copies layer ``i`` and returns its
    bytes (``BlockCopier.layer_loads``). The thread fills in the outcome."""

    rid: str
    pages: int
    layers: list[Callable[[], int]]
    ok: bool = True
    copied: int = 0
    error: str = ""
    payload: object = field(default=None, repr=False)
    """The caller's own (the worker keeps the plan here)."""


class LayerLoads:
    """The layer-wise loader of one worker (see the module docstring)."""

    def __init__(self, num_layers: int, *, before_layer: Callable[[], None] | None = None) -> None:
        """``before_layer``: called on the thread before each layer's copies (a fault point)."""
        self.num_layers = num_layers
        self._before_layer = before_layer
        self._cond = threading.Condition()
        self._loads: list[LayerLoad] = []
        self._copied_layers = num_layers  # of the step's loads; num_layers: none in flight
        self._queue: queue.SimpleQueue[list[LayerLoad] | None] = queue.SimpleQueue()
        self._seconds = 0.0  # the step's copying time, written by the thread before its last layer's count
        self._thread = threading.Thread(target=self._run, name="hicache-layer-loads", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        with self._cond:
            return bool(self._loads)

    def start(self, loads: list[LayerLoad]) -> None:
        """Copy ``loads`` layer by layer; raises if the last step's are not finished."""
        if not loads:
            return
        if any(len(load.layers) != self.num_layers for load in loads):
            raise ValueError(f"a layer-wise load must name a copy for each of the {self.num_layers} layers")
        with self._cond:
            if self._loads:
                raise RuntimeError("the last step's layer-wise loads are not finished")
            self._loads, self._copied_layers = list(loads), 0
        self._queue.put(self._loads)

    def wait(self, layer: int) -> float:
        """Wait until layer ``layer`` of every load of the step is copied (or its load
        failed); the seconds waited (0.0: none)."""
        with self._cond:
            if self._copied_layers > layer:
                return 0.0
            began = time.perf_counter()
            while self._copied_layers <= layer:
                self._cond.wait()
        return time.perf_counter() - began

    def finish(self) -> tuple[list[LayerLoad], float]:
        """Wait for every layer of the step's loads; returns them with their outcomes (none
        when no step is in flight) and the seconds the thread spent copying them."""
        self.wait(self.num_layers - 1)
        with self._cond:
            done, self._loads = self._loads, []
            seconds, self._seconds = self._seconds, 0.0
        return done, seconds

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(30.0)

    def _run(self) -> None:
        with torch.inference_mode():  # thread-local: vLLM's KV tensors are inference tensors
            while (loads := self._queue.get()) is not None:
                seconds = 0.0
                for i in range(self.num_layers):
                    began = time.perf_counter()
                    if self._before_layer is not None:
                        self._before_layer()
                    for load in loads:
                        if load.ok:
                            self._copy(load, i)
                    seconds += time.perf_counter() - began
                    with self._cond:  # the forward pass waits for this count
                        if i + 1 == self.num_layers:
                            self._seconds = seconds
                        self._copied_layers = i + 1
                        self._cond.notify_all()

    @staticmethod
    def _copy(load: LayerLoad, layer: int) -> None:
        try:
            load.copied += load.layers[layer]()
        except Exception as exc:  # nothing more of this load: the worker reports its blocks
            load.ok = False
            load.error = str(exc) or type(exc).__name__
