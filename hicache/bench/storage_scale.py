"""``hicache bench storage --parts scale``: the file store at 10^5 and 10^6 objects.

For each count of ``--objects`` (default 100000,1000000) a fresh store is filled with that
many page files of the smallest page the store accepts (one ``uint8``: a 97-byte object),
written straight into the store's layout (``file_layout.page_path``, ``page_format``
headers), not through a backend. Then, on that store:

- ``start``: a ``FileBackend`` opened on it until its start-up scan is done (the index of
  every page built); ``start memory``: the same start again under ``tracemalloc``, the
  Python heap the backend holds once its scan is done (and the scan's peak, in the JSON);
- ``hicache storage stats``, ``verify``, ``gc`` (down to half the store's bytes: it scans,
  then evicts half the pages) and ``clear --yes`` (the other half), each run in-process
  through the command's own code, its output thrown away.

The reference of the commands is the file system's own cost of the same work, measured in
the same run on a second fresh store of the same count (``raw_reference``): list and stat
every file (``stats``), list and read every file (``verify``), list, stat, and unlink half
of them (``gc``: its scan, then its evictions), list, stat and unlink the rest (``clear``).
The file system's cost per file is not flat in the number of files (an unlink on ext4
costs several times more per file in a store of 10^5 objects than in one of 10^4), so the
commands' growth is compared with the raw operations' growth between the same two counts.

Goals: linear. The start-up scan's time and heap grow at most 1.1 x as fast as the number
of objects (11 for 10^6 against 10^5); each command's time grows at most 1.1 x as fast as
the raw operations' time. The page cache is warm (the files were just written). Every
store is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from typing import Any

DEFAULT_OBJECTS = "100000,1000000"
LINEAR_SLACK = 1.1
"""The goal: a figure grows at most this much faster than the number of objects."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--objects", default=DEFAULT_OBJECTS,
                        help=f"--parts scale: page files in the store, smallest first (default {DEFAULT_OBJECTS})")


def _layout() -> Any:
    from storage_backends import PageLayout

    return PageLayout.for_bytes(1)  # the smallest page: a one-byte payload


def populate(root: str, n: int) -> None:
    """Write ``n`` page files of random hashes under ``root`` in the store's own layout."""
    from storage_backends.file_layout import SHARDS, page_path
    from storage_backends.page_format import encode_header

    layout = _layout()
    payload = b"\x00"
    root_slash = os.path.join(root, "")
    for shard in SHARDS:
        os.makedirs(os.path.join(root, shard), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    raw = os.urandom(32 * n).hex()
    for i in range(n):
        h = raw[64 * i: 64 * i + 64]
        fd = os.open(page_path(root_slash, h), flags, 0o644)
        try:
            os.write(fd, encode_header(layout, payload, h) + payload)
        finally:
            os.close(fd)


def _timed(run: Any) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def raw_reference(root: str, n: int) -> dict[str, float]:
    """Seconds the file system takes for each command's own work (module doc) on a fresh
    store of ``n`` objects, each step listing the shards as the command does, every walk in
    directory order (``gc`` evicts in that order too: ``verify``'s reads set the access
    times its scan sorts by). The store is emptied."""
    from storage_backends.file_layout import SHARDS

    populate(root, n)
    shards = [os.path.join(root, shard) for shard in SHARDS]

    def listed() -> list[str]:
        return [os.path.join(d, name) for d in shards for name in os.listdir(d)]

    def read_all() -> None:
        for path in listed():
            with open(path, "rb") as f:
                f.read()

    def unlink(first: bool) -> None:
        paths = listed()
        for path in paths:
            os.stat(path)
        half = paths[:n // 2] if first else paths
        for path in half:
            os.unlink(path)

    return {"raw_stats_s": _timed(lambda: [os.stat(path) for path in listed()]),
            "raw_verify_s": _timed(read_all),
            "raw_gc_s": _timed(lambda: unlink(True)),
            "raw_clear_s": _timed(lambda: unlink(False))}


def _start(root: str) -> tuple[float, int]:
    """Seconds from opening the store until its start-up scan is done; pages indexed."""
    from storage_backends import FileSettings, create_backend

    t0 = time.perf_counter()
    be: Any = create_backend(FileSettings(dir=root), _layout())
    try:
        if not be.wait_scan(3600):
            raise RuntimeError("the start-up scan did not finish")
        took = time.perf_counter() - t0
        return took, be.page_count
    finally:
        be.close()


def _start_memory(root: str) -> tuple[int, int]:
    """(bytes the opened store holds once scanned, peak bytes during the scan), traced."""
    from storage_backends import FileSettings, create_backend

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        be: Any = create_backend(FileSettings(dir=root), _layout())
        try:
            be.wait_scan(3600)
            gc.collect()
            held, peak = tracemalloc.get_traced_memory()
        finally:
            be.close()
    finally:
        tracemalloc.stop()
    return held - base, peak - base


def _command(root: str, *action: str) -> float:
    """Seconds ``hicache storage --backend file --dir root ACTION...`` takes, in-process."""
    from hicache.cli.main import main

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["storage", "--backend", "file", "--dir", root, *action])
    took = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"hicache storage {' '.join(action)} exited {rc}")
    return took


def measure(root: str, n: int) -> dict[str, float]:
    """Every figure of one store of ``n`` objects (module doc); the store is emptied."""
    t0 = time.perf_counter()
    populate(root, n)
    out: dict[str, float] = {"objects": n, "populate_s": time.perf_counter() - t0}
    start_s, indexed = _start(root)
    if indexed != n:
        raise RuntimeError(f"the start-up scan indexed {indexed} of {n} pages")
    out["start_s"] = start_s
    held, peak = _start_memory(root)
    out["start_held_bytes"] = held
    out["start_peak_bytes"] = peak
    out["stats_s"] = _command(root, "stats")
    out["verify_s"] = _command(root, "verify")
    half_gb = n * _layout().object_size / 2 / 2**30
    out["gc_s"] = _command(root, "gc", "--to-gb", repr(half_gb))
    out["clear_s"] = _command(root, "clear", "--yes")
    return out


START_FIGURES = (
    ("start: open until the start-up scan is done", "s", "start_s"),
    ("start: Python heap held after the scan", "B", "start_held_bytes"),
    ("start: Python heap peak during the scan", "B", "start_peak_bytes"),
)
"""Grow at most ``LINEAR_SLACK`` x as fast as the number of objects."""
COMMAND_FIGURES = (
    ("hicache storage stats", "stats"),
    ("hicache storage verify", "verify"),
    ("hicache storage gc (half the store)", "gc"),
    ("hicache storage clear (the other half)", "clear"),
)
"""Grow at most ``LINEAR_SLACK`` x as fast as the file system's own operations (``raw_reference``)."""


def run_scale(args: argparse.Namespace) -> int:
    from hicache.bench.report import Figure, print_table, write_json

    counts = sorted({int(float(c)) for c in args.objects.split(",") if c.strip()})
    if len(counts) < 2 or counts[0] < 1:
        print("error: --objects needs two or more positive counts", file=sys.stderr)
        return 2
    results: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="hicache-bench-scale-", dir=args.dir,
                                     ignore_cleanup_errors=True) as tmp:
        for n in counts:
            root = os.path.join(tmp, f"store-{n}")
            print(f"  file store at {n:,} objects ...", file=sys.stderr, flush=True)
            try:
                res = measure(root, n)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(f"  the same work as raw file operations at {n:,} objects ...", file=sys.stderr, flush=True)
            try:
                res.update(raw_reference(root, n))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            results.append(res)
            print("    " + ", ".join(f"{k} {v:,.3f}" if isinstance(v, float) else f"{k} {v:,}"
                                     for k, v in res.items()), file=sys.stderr, flush=True)
    lo, hi = results[0], results[-1]
    span = f"{int(lo['objects']):,} to {int(hi['objects']):,} objects"
    figures = [Figure(f"{name} at {int(hi['objects']):,} objects", unit, hi[key],
                      f"same at {int(lo['objects']):,}", lo[key], higher_is_better=False,
                      goal=LINEAR_SLACK * hi["objects"] / lo["objects"])
               for name, unit, key in START_FIGURES]
    figures += [Figure(f"{name}: growth from {span}", "x", hi[f"{key}_s"] / lo[f"{key}_s"],
                       "raw file operations' growth", hi[f"raw_{key}_s"] / lo[f"raw_{key}_s"],
                       higher_is_better=False, goal=LINEAR_SLACK)
                for name, key in COMMAND_FIGURES]
    print_table("hicache bench storage --parts scale (references measured in the same run)", figures)
    for res in results:
        objects = res["objects"]
        print(f"  {int(objects):>9,} objects: {res['start_held_bytes'] / objects:,.0f} B/object held after the "
              f"scan, {res['start_peak_bytes'] / objects:,.0f} B/object at its peak; over raw file operations: "
              + ", ".join(f"{key} {res[f'{key}_s'] / res[f'raw_{key}_s']:.2f}x" for _, key in COMMAND_FIGURES))
    if args.json:
        write_json(args.json, "storage-scale", figures, {"per_size": results, "object_bytes": _layout().object_size})
    return 0
