"""A real controller process over real shared memory, with the test playing the scheduler."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import torch
import zmq

import protos
from controller.args import ControllerArgs
from controller.server import controller_main
from hicache.memory.layout import PoolLayout, default_directory, new_instance_id, paged_layout, state_layout
from hicache.memory.pools import SharedPools, create_pools
from hicache.runtime.ipc import Endpoints, PullSocket, ResettablePush, make_runtime_dir

PAGE_SIZE = 4
L1_PAGES = 64
L2_PAGES = 128


def small_layout() -> PoolLayout:
    inst = new_instance_id()
    return PoolLayout(inst, default_directory(), (
        paged_layout(inst, "full", PAGE_SIZE, L1_PAGES, L2_PAGES, num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype="float32"),
        state_layout(inst, "mamba", 8, 16, num_layers=1, shapes=((3, 4), (4, 2)), dtype="float32"),
    ))


class ControllerHarness:
    """Creates the pools, spawns the controller, and talks to it like the scheduler would."""

    def __init__(self, tmp: Path, storage: object = None) -> None:
        self.layout = small_layout()
        self.pools: SharedPools = create_pools(self.layout)
        self.endpoints = Endpoints("ipc", str(make_runtime_dir(str(tmp))))
        self.ctx = zmq.Context()
        self.inbox: PullSocket[protos.Message] = PullSocket(
            self.ctx, self.endpoints.address("scheduler"),
            (protos.OpDone, protos.PrefetchHits, protos.StorageStatus, protos.ErrorReply))
        self.ready: PullSocket[protos.Message] = PullSocket(self.ctx, self.endpoints.address("launcher"), (protos.Ready,))
        self.outbox: ResettablePush[protos.Message] = ResettablePush(self.ctx, self.endpoints.address("controller"))
        self.storage = storage
        self.proc: mp.process.BaseProcess | None = None
        self.next_op = 1
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        args = ControllerArgs(self.layout, self.endpoints, self.storage, self.endpoints.address("launcher"),
                              log_level="warning")
        self.proc = mp.get_context("spawn").Process(target=controller_main, args=(args,), daemon=True)
        self.proc.start()
        ready = self.ready.recv(60_000)
        assert isinstance(ready, protos.Ready) and ready.pid == self.proc.pid, ready

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def op_id(self) -> int:
        self.next_op += 1
        return self.next_op

    def send(self, msg: protos.Message) -> None:
        self.outbox.send(msg)

    def recv(self, timeout_s: float = 30.0) -> protos.Message:
        msg = self.inbox.recv(int(timeout_s * 1000))
        if msg is None:
            raise TimeoutError("no answer from the controller")
        return msg

    def call(self, msg: protos.Message, timeout_s: float = 30.0) -> protos.Message:
        self.send(msg)
        return self.recv(timeout_s)

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.send(protos.Shutdown("test done"))
            self.proc.join(20)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        for s in (self.inbox, self.ready, self.outbox):
            s.close()
        self.ctx.term()
        self.pools.close()
        self.pools.unlink()


def fill_l1_pages(pools: SharedPools, component: str, pages: list[int], seed: int) -> None:
    """Deterministic bytes in the given L1 pages: a function of (seed, page position)."""
    comp = pools[component]
    gen = torch.Generator().manual_seed(seed)
    for pos, page in enumerate(pages):
        for t in comp.l1_paged:
            view = t.select(comp.l1_axis, page)
            view.copy_(torch.randn(view.shape, generator=gen) + pos)


def l1_pages(pools: SharedPools, component: str, pages: list[int]) -> list[torch.Tensor]:
    comp = pools[component]
    return [t.select(comp.l1_axis, p).clone() for p in pages for t in comp.l1_paged]


def l2_pages(pools: SharedPools, component: str, pages: list[int]) -> list[torch.Tensor]:
    comp = pools[component]
    return [t[p].clone() for p in pages for t in comp.l2]


def wait_until(pred, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False
