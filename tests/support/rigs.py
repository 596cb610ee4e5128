"""Scheduler test rigs: a ``Scheduler`` driven in-process, with its outputs collected.

``Rig`` runs the scheduler over plain tensors (every component's pools, no L2). ``L2Rig``
runs it over the daemon's shared-memory pools with the controller's copy engine executed
in-process (each copy acknowledged on the next ``pump``); ``L3AckRig`` also acknowledges
backups (as stored) and L3 queries (no hits); ``L3Rig`` executes the L3 ops too, through the
controller's ``StorageIO`` over a file store. Every ``run`` ends by checking that the
scheduler is idle and the tree exact (no leak, no stray reservation).
"""

from __future__ import annotations

import protos
from hicache.config import HicacheConfig
from hicache.model.loader import load_model
from hicache.model.pools import allocate_pools
from hicache.model.runner import ModelRunner
from hicache.scheduler.assembly import build_cache
from hicache.scheduler.scheduler import Scheduler


class Rig:
    """A scheduler over plain tensors, with every component's pools."""

    def __init__(self, cfg: HicacheConfig) -> None:
        self.cfg = cfg
        self.model = load_model(cfg.model)
        ps = cfg.cache.page_size
        pages = cfg.cache.l1.tokens // ps
        pools = allocate_pools(self.model.geometry, pages, ps, cfg.cache.l1.state_slots)
        self.cache, self.l1, _ = build_cache(cfg, self.model, pages, None, pools=pools)
        self.out: dict[str, list[protos.TokenOutput]] = {}
        self.sched = Scheduler(cfg, self.model, ModelRunner(self.model, pools), self.cache, self.l1, self._emit)

    def _emit(self, msg: protos.TokenizerMessage) -> None:
        assert isinstance(msg, protos.TokenOutput)
        self.out.setdefault(msg.rid, []).append(msg)

    def run(self, reqs: list[protos.GenerateRequest], max_steps: int = 3000) -> None:
        for r in reqs:
            self.sched.submit(r)
        for _ in range(max_steps):
            if not self.sched.busy:
                break
            self.sched.step()
        assert not self.sched.busy
        self.assert_idle()

    def assert_idle(self) -> None:
        """The scheduler's own idle checks (the tree's integrity and the L1 budget's: no
        stray reservation), then the exact tree check (no leaked page or slot)."""
        checks = self.sched.counters.integrity_checks
        self.sched.check_idle()
        assert self.sched.counters.integrity_checks == checks + 1, "the scheduler was not idle"
        self.cache.check_integrity(exact=True)

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.out[rid] for t in m.token_ids]

    def final(self, rid: str) -> protos.TokenOutput:
        assert self.out[rid][-1].finished
        return self.out[rid][-1]

    def cached(self, rid: str) -> int:
        usage = self.final(rid).usage
        assert usage is not None
        return usage.cached_device


def gen(rid: str, ids: list[int], n: int = 6, stream: bool = False, **sampling: object) -> protos.GenerateRequest:
    """A request for ``n`` tokens that ignores end-of-sequence (so it always makes ``n``)."""
    return protos.GenerateRequest(rid, ids, protos.SamplingParams(max_new_tokens=n, ignore_eos=True, **sampling),
                                  stream)


def cold_tokens(cfg: HicacheConfig, rid: str, ids: list[int], n: int = 6) -> list[int]:
    rig = Rig(cfg)
    rig.run([gen(rid, ids, n)])
    return rig.tokens(rid)


class L2Rig(Rig):
    """A scheduler over the daemon's shared-memory pools (every component, L1 and L2) with
    the controller's copy engine run in-process: each ``WriteToHost`` / ``LoadToDevice`` is
    executed and acknowledged on the next ``pump``, in order."""

    def __init__(self, cfg: HicacheConfig) -> None:
        from controller.transfer import CpuTransferEngine
        from hicache.daemon.launcher import Launcher
        from hicache.memory.pools import create_pools
        from hicache.scheduler.assembly import kv_pools_from_shared
        from hicache.scheduler.controller_driver import ControllerDriver

        self.cfg = cfg
        self.model = load_model(cfg.model)
        ps = cfg.cache.page_size
        self.layout = Launcher(cfg)._layout()
        self.shared = create_pools(self.layout)
        kv = kv_pools_from_shared(self.shared, ps)
        names = {c.name for c in self.layout.components}
        sizes: dict[str, int] = {}
        if "mamba" in names:
            sizes = {"l2_state_slots": self.layout.component("mamba").l2_pages}
        full = self.layout.component("full")
        self.cache, self.l1, _ = build_cache(cfg, self.model, full.l1_pages, full.l2_pages, pools=kv, **sizes)
        self.engine = CpuTransferEngine(self.shared)
        self.inbox: list[protos.ControllerMessage] = []
        self.tier = ControllerDriver(self.cache, self.inbox.append, load_back_threshold=0)
        self.out: dict[str, list[protos.TokenOutput]] = {}
        self.sched = Scheduler(cfg, self.model, ModelRunner(self.model, kv), self.cache, self.l1, self._emit,
                               tier=self.tier, controller_send=self.inbox.append)

    def pump(self) -> None:
        """Execute and acknowledge every message sent since the last pump, in order."""
        msgs, self.inbox[:] = list(self.inbox), []
        for msg in msgs:
            self.answer(msg)

    def answer(self, msg: protos.ControllerMessage) -> None:
        """The controller's part: copies are executed (``run`` checks them first) and acked."""
        if isinstance(msg, (protos.WriteToHost, protos.LoadToDevice)):
            self.engine.run(msg)
            self.sched.on_controller(protos.OpDone(msg.op_id, "ok"))

    def run(self, reqs: list[protos.GenerateRequest], max_steps: int = 3000) -> None:
        for r in reqs:
            self.sched.submit(r)
        for _ in range(max_steps):
            if not self.sched.busy and not self.tier.in_flight:
                break
            self.sched.step()
            self.pump()
        assert not self.sched.busy and not self.tier.in_flight
        self.assert_idle()

    def close(self) -> None:
        self.shared.close()
        self.shared.unlink()


class L3AckRig(L2Rig):
    """L2Rig whose controller also acknowledges backups (as stored) and L3 queries (no hits)."""

    def answer(self, msg: protos.ControllerMessage) -> None:
        if isinstance(msg, protos.BackupToStorage):
            self.sched.on_controller(protos.OpDone(msg.op_id, "ok", len(msg.hashes)))
        elif isinstance(msg, protos.PrefetchQuery):
            self.sched.on_controller(protos.PrefetchHits(msg.op_id, 0))
        else:
            super().answer(msg)


class L3Rig(L2Rig):
    """L2Rig whose L3 ops (backup, prefetch query and fetch, with their auxiliary objects) run
    through the controller's ``StorageIO`` over a file store at ``l3_dir``, with L3 on and
    prefetches of a page or more waited for (``wait_complete``)."""

    def __init__(self, cfg: HicacheConfig, l3_dir: str) -> None:
        from controller.storage_io import StorageIO
        from hicache.config import PrefetchConfig
        from storage_backends import FileSettings, create_backend

        super().__init__(cfg)
        self.io = StorageIO(self.shared, None)
        self.io.backend = create_backend(FileSettings(dir=l3_dir), self.io.default_layout())
        self.tier.l3_enabled = True
        self.tier.prefetch_cfg = PrefetchConfig(threshold_tokens=cfg.cache.page_size, policy="wait_complete")

    def answer(self, msg: protos.ControllerMessage) -> None:
        io = self.io
        if isinstance(msg, protos.BackupToStorage):
            done = io.backup(msg.component, msg.host_pages, msg.hashes)
            for name, units in msg.aux_pages.items():
                io.backup_aux(name, units, msg.aux_keys[name])
            self.sched.on_controller(protos.OpDone(msg.op_id, "ok" if done == len(msg.hashes) else "failed", done))
        elif isinstance(msg, protos.PrefetchQuery):
            n = io.query(msg.hashes)
            present = {k: [i for i, p in enumerate(io.query_aux(v[:n])) if p] for k, v in msg.aux_keys.items()}
            self.sched.on_controller(protos.PrefetchHits(msg.op_id, n, present))
        elif isinstance(msg, protos.PrefetchFetch):
            done = io.fetch(msg.component, msg.hashes, msg.host_pages)
            aux = {k: io.fetch_aux(k, msg.aux_keys[k], u) for k, u in msg.aux_pages.items()}
            self.sched.on_controller(protos.OpDone(msg.op_id, "ok" if done == len(msg.hashes) else "failed", done,
                                                   None, aux))
        else:
            super().answer(msg)

    def close(self) -> None:
        self.io.detach()
        super().close()
