"""``hicache bench storage``: L3 backends against raw redis-py and raw file I/O.

For each page size (64 KiB, 256 KiB, 1 MiB by default) and each backend, one repetition
writes a batch of fresh pages through the backend and reads them back into preallocated
buffers, then does the same through the reference on the same server / file system:

- Redis reference: redis-py pipelined ``SET`` / ``GET`` of the same bytes (no header, no
  checksum), one pipeline per batch;
- file reference: plain buffered ``open/write/close`` to a temporary name and
  ``os.replace`` into place, and ``open/readinto`` of the same sizes into the same
  preallocated destination buffers the backend reads into (a reference that reads into a
  fresh, recycled ``bytes`` each time keeps the destination in the CPU cache, which no
  L3 read into L2 buffers can do, and would overstate raw speed about twofold).

Backend and reference alternate within each repetition; the table shows the median GB/s
of the repetitions and backend / reference. ``--json PATH`` writes the same figures. If
``--redis-url`` is not given, a private ``redis-server`` is started on a free loopback
port (and killed at the end) when one is installed. ``--cluster`` adds the backend on a
Redis Cluster (``--cluster-url``, or a private 3-master cluster started with
``redis-cli --cluster create``), measured against redis-py's ``RedisCluster`` pipeline
doing the same ``SET`` / ``GET`` on the same cluster.

``--parts scale`` measures instead the file store at 10^5 and 10^6 objects (its start-up
scan, its memory, and each ``hicache storage`` command): ``hicache.bench.storage_scale``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hicache.bench import storage_scale
from hicache.bench.local_redis import started, started_cluster

DEFAULT_SIZES = "64K,256K,1M"


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"page sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--batch-mb", type=float, default=32.0, help="MiB of pages per batch (default 32)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions; the median is reported (default 7)")
    parser.add_argument("--backends", default="file,redis", help="comma list of file, redis, redis-cluster (default file,redis)")
    parser.add_argument("--dir", help="directory for the file store (default: a temporary one)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private redis-server")
    parser.add_argument("--cluster", action="store_true", help="also benchmark Redis Cluster (backend redis-cluster)")
    parser.add_argument("--cluster-url", help="a node of the Redis Cluster to use instead of a private 3-master one")
    parser.add_argument("--parts", default="throughput",
                        help="comma list of throughput (backends vs raw I/O) and scale (the file store at "
                             "--objects page files) (default throughput)")
    storage_scale.add_arguments(parser)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the figures as JSON (with both parts, scale's to PATH-scale.json)")


@dataclass
class Row:
    backend: str
    op: str
    page_bytes: int
    batch_pages: int
    gbps: float
    reference: str
    ref_gbps: float
    ratio: float


def _private_dir(stack: contextlib.ExitStack, prefix: str) -> Path:
    """A temporary directory removed when ``stack`` closes."""
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True)))


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _hashes(n: int) -> list[str]:
    return [os.urandom(32).hex() for _ in range(n)]


def _time_backend(be: Any, n: int, pages: list[bytes], into: list[memoryview],
                  writes: list[float], reads: list[float]) -> None:
    """One timed ``batch_set`` and ``batch_get`` of ``n`` fresh pages through ``be`` (appended
    to ``writes`` / ``reads``); the pages are deleted afterwards."""
    hs = _hashes(n)
    writes.append(_timed(lambda: _check(be.batch_set(hs, pages))))
    reads.append(_timed(lambda: _check(be.batch_get(hs, into))))
    be.delete(hs)


def _bench_file(root: str, size: int, n: int, reps: int) -> tuple[list[float], ...]:
    from storage_backends import FileSettings, PageLayout, create_backend

    layout = PageLayout.for_bytes(size)
    pages = [os.urandom(size) for _ in range(n)]
    into = [memoryview(bytearray(size)) for _ in range(n)]
    store = os.path.join(root, "store")
    raw_root = os.path.join(root, "raw")
    be = create_backend(FileSettings(dir=store), layout)
    bw: list[float] = []
    br: list[float] = []
    rw: list[float] = []
    rr: list[float] = []
    try:
        for _ in range(reps):
            _time_backend(be, n, pages, into, bw, br)

            paths = [os.path.join(raw_root, h[:2], h + ".page") for h in _hashes(n)]
            for p in paths:
                os.makedirs(os.path.dirname(p), exist_ok=True)

            def raw_write(paths: list[str] = paths) -> None:
                for p, page in zip(paths, pages, strict=True):
                    tmp = p + ".tmp"
                    with open(tmp, "wb") as f:
                        f.write(page)
                    os.replace(tmp, p)

            def raw_read(paths: list[str] = paths) -> None:
                for p, buf in zip(paths, into, strict=True):
                    with open(p, "rb") as f:
                        f.readinto(buf)

            rw.append(_timed(raw_write))
            rr.append(_timed(raw_read))
            for p in paths:
                os.unlink(p)
    finally:
        be.close()
    return bw, br, rw, rr


def _bench_redis(url: str, size: int, n: int, reps: int, cluster: bool = False) -> tuple[list[float], ...]:
    import redis
    from redis.cluster import RedisCluster

    from storage_backends import PageLayout, RedisSettings, create_backend

    layout = PageLayout.for_bytes(size)
    pages = [os.urandom(size) for _ in range(n)]
    into = [memoryview(bytearray(size)) for _ in range(n)]
    prefix = f"hicache-bench-{os.getpid()}"
    be = create_backend(
        RedisSettings(
            url=url, cluster=cluster, key_prefix=prefix, pipeline_bytes=max(size * n + 1, 16 << 20), pipeline_max=n
        ),
        layout,
    )
    raw: Any = RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    bw: list[float] = []
    br: list[float] = []
    rw: list[float] = []
    rr: list[float] = []
    try:
        for _ in range(reps):
            _time_backend(be, n, pages, into, bw, br)

            keys = [f"{prefix}-raw:{h}" for h in _hashes(n)]

            def raw_write(keys: list[str] = keys) -> None:
                pipe = raw.pipeline(transaction=False)
                for k, page in zip(keys, pages, strict=True):
                    pipe.set(k, page)
                pipe.execute()

            def raw_read(keys: list[str] = keys) -> None:
                pipe = raw.pipeline(transaction=False)
                for k in keys:
                    pipe.get(k)
                pipe.execute()

            rw.append(_timed(raw_write))
            rr.append(_timed(raw_read))
            pipe = raw.pipeline(transaction=False)
            for k in keys:
                pipe.delete(k)  # one key per command: works across cluster slots
            pipe.execute()
    finally:
        be.close()
        raw.close()
    return bw, br, rw, rr


def _check(results: list[bool]) -> None:
    if not all(results):
        raise RuntimeError(f"{results.count(False)} of {len(results)} pages failed during the benchmark")


def run(args: argparse.Namespace) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - {"throughput", "scale"}:
        print(f"error: bad --parts {args.parts!r} (throughput, scale)", file=sys.stderr)
        return 2
    rc = 0
    if "throughput" in parts:
        rc = _run_throughput(args)
    if "scale" in parts and rc == 0:
        if "throughput" in parts and args.json:
            args = argparse.Namespace(**{**vars(args), "json": str(Path(args.json).with_suffix("")) + "-scale.json"})
        rc = storage_scale.run_scale(args)
    return rc


def _run_throughput(args: argparse.Namespace) -> int:
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.cluster and "redis-cluster" not in backends:
        backends.append("redis-cluster")
    unknown = set(backends) - {"file", "redis", "redis-cluster"}
    if unknown or not sizes or args.reps < 1:
        print(f"error: bad --backends {sorted(unknown)} / --sizes / --reps", file=sys.stderr)
        return 2
    rows: list[Row] = []
    # Private servers are killed, then their directories removed, when ``servers`` closes.
    with contextlib.ExitStack() as servers:
        url = args.redis_url
        if "redis" in backends and url is None:
            try:
                url = servers.enter_context(started(_private_dir(servers, "hicache-bench-redis-"))).url
            except RuntimeError as exc:
                print(f"skipping redis: {exc} (pass --redis-url)", file=sys.stderr)
                backends.remove("redis")
        cluster_url = args.cluster_url
        if "redis-cluster" in backends and cluster_url is None:
            try:
                cluster_url = servers.enter_context(
                    started_cluster(_private_dir(servers, "hicache-bench-cluster-"))
                )[0].url
            except RuntimeError as exc:
                print(f"skipping redis-cluster: {exc} (pass --cluster-url)", file=sys.stderr)
                backends.remove("redis-cluster")
        root = args.dir or servers.enter_context(
            tempfile.TemporaryDirectory(prefix="hicache-bench-file-", ignore_cleanup_errors=True)
        )
        for size in sizes:
            n = max(4, int(args.batch_mb * 2**20) // size)
            gb = size * n / 1e9
            for backend in backends:
                if backend == "file":
                    bw, br, rw, rr = _bench_file(root, size, n, args.reps)
                    ref = "file write+rename / read"
                elif backend == "redis":
                    bw, br, rw, rr = _bench_redis(url, size, n, args.reps)
                    ref = "redis-py pipelined SET / GET"
                else:
                    bw, br, rw, rr = _bench_redis(cluster_url, size, n, args.reps, cluster=True)
                    ref = "redis-py RedisCluster pipelined SET / GET"
                for op, mine, theirs in (("write", bw, rw), ("read", br, rr)):
                    g = gb / statistics.median(mine)
                    r = gb / statistics.median(theirs)
                    rows.append(Row(backend, op, size, n, g, ref, r, g / r))
                    print(f"  {backend:13} {op:5} {size // 1024:>5} KiB  {g:6.2f} GB/s  ref {r:6.2f} GB/s  x{g / r:.2f}",
                          file=sys.stderr, flush=True)  # fmt: skip
    _print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"benchmark": "storage", "reps": args.reps, "rows": [asdict(r) for r in rows]}, f, indent=2
            )
    return 0


def _print_table(rows: list[Row]) -> None:
    print(f"{'backend':13} {'op':6} {'page':>9} {'batch':>6} {'GB/s':>7} {'ref GB/s':>9} {'ratio':>6}  reference")
    for r in rows:
        page = f"{r.page_bytes // 1024} KiB"
        print(
            f"{r.backend:13} {r.op:6} {page:>9} {r.batch_pages:>6} {r.gbps:7.2f} {r.ref_gbps:9.2f} "
            f"{r.ratio:6.2f}  {r.reference}"
        )
