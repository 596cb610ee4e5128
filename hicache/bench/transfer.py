"""``hicache bench transfer``: page moves through the cache controller against raw copies.

In one run, on the same shared-memory tensors:

- L1->L2 and L2->L1 through the controller process (message, copy, acknowledgement) against
  the raw torch copy of the same pages in this process (``index_select`` gather then a
  typed ``index_copy_`` scatter), as GB/s, for page sizes 16 and 64 and several batch sizes;
- the per-op overhead: a one-page op's round trip through the controller against a raw
  ZeroMQ round trip (PUSH/PULL over ipc to an echo process), p50;
- L2->L3 backup through the controller against the raw backend's ``batch_set`` of the same
  L2 pages (file store in a temporary directory, or Redis with ``--redis-url``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions per figure (median)")
    parser.add_argument("--page-sizes", default="16,64", help="comma-separated page sizes in tokens")
    parser.add_argument("--batch-mib", default="0.25,1,4,16", help="comma-separated batch sizes in MiB")
    parser.add_argument("--layers", type=int, default=4, help="KV geometry: layers")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV geometry: kv heads")
    parser.add_argument("--head-dim", type=int, default=64, help="KV geometry: head dim")
    parser.add_argument("--redis-url", default=None, help="back up to this Redis instead of a temp file store")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def _echo_main(pull_addr: str, push_addr: str) -> None:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(pull_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(push_addr)
    while True:
        frame = pull.recv()
        if frame == b"stop":
            break
        push.send(frame)
    push.close(linger=1000)
    pull.close(0)
    ctx.term()


def run(args: argparse.Namespace) -> int:
    import multiprocessing as mp
    import statistics
    import tempfile
    import time

    import torch
    from tqdm import tqdm

    import protos
    from controller.args import ControllerArgs
    from controller.server import controller_main
    from hicache.bench.report import Figure, print_table, write_json
    from hicache.hashing import HashNamespace, PageHasher
    from hicache.memory.layout import PoolLayout, default_directory, new_instance_id, paged_layout
    from hicache.memory.pools import create_pools
    from hicache.runtime.ipc import Endpoints, PullSocket, PushSocket, make_runtime_dir
    from storage_backends import FileSettings, PageLayout, RedisSettings, create_backend

    figures: list[Figure] = []
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    batches = [float(x) for x in args.batch_mib.split(",")]
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
    max_batch_pages = {ps: max(1, int(max(batches) * 2**20 // (per_token * ps))) for ps in page_sizes}
    tmp = tempfile.TemporaryDirectory(prefix="hicache-bench-")
    spawn = mp.get_context("spawn")

    for ps in page_sizes:
        inst = new_instance_id()
        pages = 2 * max_batch_pages[ps] + 8
        layout = PoolLayout(inst, default_directory(), (
            paged_layout(inst, "full", ps, pages, pages, args.layers, args.kv_heads, args.head_dim, "float32"),))
        pools = create_pools(layout)
        comp = pools["full"]
        for t in (*comp.l1, *comp.l2):
            t.normal_()
        endpoints = Endpoints("ipc", str(make_runtime_dir(tmp.name)))
        storage = (RedisSettings(url=args.redis_url) if args.redis_url
                   else FileSettings(dir=f"{tmp.name}/l3-{ps}", scan_on_start=False))
        import zmq

        ctx = zmq.Context()
        inbox: PullSocket[protos.Message] = PullSocket(
            ctx, endpoints.address("scheduler"), (protos.OpDone, protos.PrefetchHits, protos.ErrorReply))
        ready: PullSocket[protos.Message] = PullSocket(ctx, endpoints.address("launcher"), (protos.Ready,))
        outbox: PushSocket[protos.Message] = PushSocket(ctx, endpoints.address("controller"))
        proc = spawn.Process(target=controller_main, daemon=True, args=(ControllerArgs(
            layout, endpoints, storage, endpoints.address("launcher"), log_level="warning"),))
        proc.start()
        if ready.recv(120_000) is None:
            raise RuntimeError("the controller did not start")
        op_ids = iter(range(1, 10**9))

        def call(msg: protos.Message, outbox: PushSocket[protos.Message] = outbox,
                 inbox: PullSocket[protos.Message] = inbox) -> protos.Message:
            outbox.send(msg)
            answer = inbox.recv(60_000)
            if not isinstance(answer, protos.OpDone) or answer.status != "ok":
                raise RuntimeError(f"controller answered {answer}")
            return answer

        try:
            for mib in tqdm(batches, desc=f"copies ps={ps}", leave=False):
                n = max(1, int(mib * 2**20 // (per_token * ps)))
                gen = torch.Generator().manual_seed(n)
                dev = torch.randperm(pages, generator=gen)[:n].tolist()
                host = torch.randperm(pages, generator=gen)[:n].tolist()
                nbytes = n * comp.layout.l2_page_bytes
                dev_t, host_t = torch.tensor(dev), torch.tensor(host)
                src6 = comp.l1_paged[0]
                l2 = comp.l2[0]

                def raw_d2h(l2: torch.Tensor = l2, host_t: torch.Tensor = host_t, src6: torch.Tensor = src6,
                            dev_t: torch.Tensor = dev_t) -> None:
                    l2.index_copy_(0, host_t, torch.index_select(src6, 2, dev_t).movedim(2, 0))

                def raw_h2d(l2: torch.Tensor = l2, host_t: torch.Tensor = host_t, src6: torch.Tensor = src6,
                            dev_t: torch.Tensor = dev_t) -> None:
                    src6.index_copy_(2, dev_t, torch.index_select(l2, 0, host_t).movedim(0, 2))

                def to_host(ids: Iterator[int] = op_ids, d: list[int] = dev, h: list[int] = host) -> protos.Message:
                    return call(protos.WriteToHost(next(ids), {"full": d}, {"full": h}))

                def to_device(ids: Iterator[int] = op_ids, d: list[int] = dev, h: list[int] = host) -> protos.Message:
                    return call(protos.LoadToDevice(next(ids), {"full": h}, {"full": d}))

                for direction, ours, raw in (("L1->L2", to_host, raw_d2h), ("L2->L1", to_device, raw_h2d)):
                    ours()
                    raw()
                    t_ours, t_raw = [], []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        ours()
                        t_ours.append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        raw()
                        t_raw.append(time.perf_counter() - t0)
                    figures.append(Figure(
                        f"{direction} ps={ps} {n} pages ({nbytes / 2**20:.2f} MiB)", "GB/s",
                        nbytes / statistics.median(t_ours) / 1e9, "raw index_select/index_copy_",
                        nbytes / statistics.median(t_raw) / 1e9, goal=0.8 if nbytes >= 2**20 else None))

            # per-op overhead: one tiny op through the controller vs a raw zmq round trip
            lat_ours = []
            for _ in range(max(200, args.repeats * 30)):
                t0 = time.perf_counter()
                call(protos.WriteToHost(next(op_ids), {"full": [0]}, {"full": [0]}))
                lat_ours.append(time.perf_counter() - t0)
            echo_dir = make_runtime_dir(tmp.name)
            echo_in, echo_out = f"ipc://{echo_dir}/echo-in.sock", f"ipc://{echo_dir}/echo-out.sock"
            back = ctx.socket(zmq.PULL)
            back.bind(echo_out)
            echo = spawn.Process(target=_echo_main, args=(echo_in, echo_out), daemon=True)
            echo.start()
            to_echo = ctx.socket(zmq.PUSH)
            to_echo.connect(echo_in)
            frame = protos.encode(protos.WriteToHost(1, {"full": [0]}, {"full": [0]}))
            to_echo.send(frame)
            back.recv()
            lat_raw = []
            for _ in range(len(lat_ours)):
                t0 = time.perf_counter()
                to_echo.send(frame)
                back.recv()
                lat_raw.append(time.perf_counter() - t0)
            to_echo.send(b"stop")
            echo.join(10)
            to_echo.close(0)
            back.close(0)
            figures.append(Figure(f"op round trip p50 ps={ps} (1 page)", "us", statistics.median(lat_ours) * 1e6,
                                  "raw zmq ipc round trip", statistics.median(lat_raw) * 1e6,
                                  higher_is_better=False, goal=2.0))

            # L2 -> L3 backup through the controller vs the raw backend on the same pages
            n = max(1, int(4 * 2**20 // (per_token * ps)))
            hasher = PageHasher(HashNamespace("bench-transfer", "float32", ps))
            backend = create_backend(storage, PageLayout(1, "float32", comp.layout.l2_page_shape))
            t_ours, t_raw = [], []
            for rep in range(args.repeats + 1):
                toks = list(range(rep * 10**6, rep * 10**6 + n * ps))
                hashes = hasher.hash_pages(toks)
                raw_hashes = hasher.hash_pages([t + 5 * 10**8 for t in toks])
                host = list(range(n))
                t0 = time.perf_counter()
                call(protos.BackupToStorage(next(op_ids), host, hashes))
                t1 = time.perf_counter()
                backend.batch_set(raw_hashes, [comp.host_page_view(p) for p in host])
                t2 = time.perf_counter()
                if rep:
                    t_ours.append(t1 - t0)
                    t_raw.append(t2 - t1)
            backend.close()
            nbytes = n * comp.layout.l2_page_bytes
            figures.append(Figure(f"L2->L3 backup ps={ps} {n} pages ({storage.kind})", "GB/s",
                                  nbytes / statistics.median(t_ours) / 1e9, f"raw {storage.kind} batch_set",
                                  nbytes / statistics.median(t_raw) / 1e9, goal=0.8))
        finally:
            outbox.send(protos.Shutdown("bench done"))
            proc.join(30)
            for s in (inbox, ready, outbox):
                s.close()
            ctx.term()
            pools.close()
            pools.unlink()
    tmp.cleanup()
    print_table("hicache bench transfer (medians; raw reference measured alternately in the same run)", figures)
    if args.json:
        write_json(args.json, "transfer", figures)
    return 0
