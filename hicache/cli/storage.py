"""``hicache storage``: inspect, verify, clear or gc the configured L3 store.

The store comes from the config file (``--config``, ``--set cache.l3....``) or, to use the
command without a config, from ``--backend file --dir PATH`` / ``--backend redis --url URL``
(flags win over the config); a plug-in backend's store comes from the config's
``cache.l3.options``. Subcommands:

- ``stats``  pages and bytes in the store (a scan: for the file store, the bytes of pages and
  temporary files, and how many of those there are), plus server memory settings for Redis;
- ``verify`` re-check every object's header and checksum; ``--delete`` removes bad ones;
- ``clear``  remove every page of this store (``--yes`` required);
- ``gc``     file store only: evict least recently used pages down to ``--to-gb``.

A file store is opened without the config's ``max_size_gb``: only ``gc`` evicts (to its own
target), and only it runs the store's background scan (which reclaims what dead writers
left). ``stats`` and ``verify`` change nothing but the objects ``verify --delete`` proves
corrupt, whatever the store's size against the config's cap (another daemon's store, a
``--set`` override, a cap lowered since), so what they print is what the files hold.

On a terminal, every subcommand shows its progress on stderr (the file store's by shard:
a scan, ``clear``; ``verify`` and ``gc``'s evictions by page).

Exit codes: 0 success, 1 store trouble or (``verify``) bad objects found, 2 bad usage or
config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from hicache.storage_settings import storage_settings_from_config

if TYPE_CHECKING:
    from storage_backends.base import StorageBackend
    from storage_backends.file_backend import FileBackend
    from storage_backends.redis_backend import RedisBackend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="hicache YAML config (its cache.l3 section)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    parser.add_argument("--backend", choices=["file", "redis"], help="use this backend instead of the config's")
    parser.add_argument("--dir", help="file store directory (with --backend file)")
    parser.add_argument("--url", help="redis://, rediss:// or unix:// URL (with --backend redis)")
    parser.add_argument("--cluster", action="store_true", help="the URL names a Redis Cluster node")
    parser.add_argument("--password", help="Redis password")
    parser.add_argument("--key-prefix", help="Redis key prefix (default: the config's, else 'hicache')")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per store call")
    sub = parser.add_subparsers(dest="storage_command", metavar="ACTION", required=True)
    p = sub.add_parser("stats", help="count pages and bytes in the store")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p = sub.add_parser("verify", help="re-check every object's header and checksum")
    p.add_argument("--delete", action="store_true", help="delete the objects that fail")
    p = sub.add_parser("clear", help="delete every page of this store")
    p.add_argument("--yes", action="store_true", help="really delete everything")
    p = sub.add_parser("gc", help="file store: evict least recently used pages down to a size")
    p.add_argument("--to-gb", type=float, required=True, metavar="GB", help="target size in GiB")


def _settings(args: argparse.Namespace) -> Any:
    from storage_backends import FileSettings, RedisSettings, ResilienceSettings

    base: Any = None
    if args.config or args.overrides or not args.backend:
        from hicache.config import load_config

        base = storage_settings_from_config(load_config(args.config, list(args.overrides)).cache.l3)
    kind = args.backend or (base.kind if base is not None else None)
    res = ResilienceSettings(timeout_s=args.timeout) if args.timeout else None
    if kind == "file":
        if args.dir is None and not isinstance(base, FileSettings):
            raise ValueError("--backend file needs --dir (or a config whose cache.l3.backend is file)")
        b = base if isinstance(base, FileSettings) else None
        return FileSettings(
            dir=args.dir or (b.dir if b else ""),
            max_size_gb=0.0,  # no command evicts to the config's cap (module doc)
            fsync=b.fsync if b else False,
            scan_on_start=args.storage_command == "gc",
            resilience=res or ResilienceSettings(),
        )
    if kind == "redis":
        b2 = base if isinstance(base, RedisSettings) else None
        if args.url is None and b2 is None:
            raise ValueError("--backend redis needs --url (or a config whose cache.l3.backend is redis)")
        # the config's settings (TLS, password file or variable, ttl ...) with the flags given on top
        start = b2 if b2 is not None else RedisSettings(url=args.url)
        flagged: dict[str, Any] = {"url": args.url or start.url, "cluster": args.cluster or start.cluster,
                                   "key_prefix": args.key_prefix or start.key_prefix,
                                   "resilience": res or start.resilience}
        if args.password is not None:  # replaces every other password source
            flagged.update(password=args.password, password_file=None, password_env=None)
        return dataclasses.replace(start, **flagged)
    return base  # None (no L3), or a plug-in's settings from the config


def _progress(iterable: Any, desc: str, **kw: Any) -> Any:
    """A progress bar on stderr (shown on a terminal only)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, **{"unit": " pages", "file": sys.stderr, "disable": None, "mininterval": 0.5, **kw})


def _shard_progress(desc: str, done: str) -> Any:
    """A bar over the file store's 256 shards and a callback for it: (shards, pages)."""
    from storage_backends.file_layout import SHARDS

    bar = _progress(None, desc, total=len(SHARDS), unit=" shards")

    def update(shards: int, pages: int) -> None:
        bar.update(shards - bar.n)
        bar.set_postfix_str(f"{pages} pages {done}", refresh=False)

    return bar, update


def _file_store(be: StorageBackend) -> FileBackend:
    from storage_backends.file_backend import FileBackend

    if not isinstance(be, FileBackend):
        raise TypeError(f"a {be.kind} backend is not the file store")
    return be


def _redis_store(be: StorageBackend) -> RedisBackend:
    from storage_backends.redis_backend import RedisBackend

    if not isinstance(be, RedisBackend):
        raise TypeError(f"a {be.kind} backend is not a Redis store")
    return be


def _stats(be: StorageBackend, args: argparse.Namespace) -> int:
    if be.kind == "file":
        bar, update = _shard_progress("stats", "found")
        with bar:
            usage = _file_store(be).usage(progress=update)
    else:
        usage = be.usage()
    out: dict[str, Any] = {"backend": be.kind, "pages": usage.pages, "bytes": usage.bytes}
    if be.kind == "file":
        store = _file_store(be)
        out["temp_files"] = usage.temp_files
        out["dir"] = store.root
    elif be.kind == "redis":
        redis = _redis_store(be)
        out["url"] = redis.name
        out.update(redis.server_info())
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        for key, value in out.items():
            if key == "bytes":
                value = f"{value} ({value / 2**30:.3f} GiB)"
            print(f"{key:>18}: {value}")
    if out.get("maxmemory_policy") not in (None, "allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-lfu"):
        print(
            f"warning: redis maxmemory-policy is {out['maxmemory_policy']}; "
            "run it with maxmemory and allkeys-lru (or volatile-lru with ttl_s)",
            file=sys.stderr,
        )
    return 0


def _verify(be: StorageBackend, args: argparse.Namespace) -> int:
    from storage_backends.errors import PageFormatError, StorageUnavailable
    from storage_backends.page_format import verify_object

    good = bad = gone = deleted = 0
    layouts: dict[tuple[int, str, tuple[int, ...]], int] = {}
    for h in _progress(be.iter_hashes(), "verify"):
        try:
            obj = be.read_object(h)
        except StorageUnavailable as exc:
            print(f"{h}: unreadable: {exc}", file=sys.stderr)
            bad += 1
            continue
        if obj is None:
            gone += 1  # removed since the scan listed it
            continue
        try:
            hdr = verify_object(obj, h)
        except PageFormatError as exc:
            bad += 1
            print(f"{h}: {exc}")
            if args.delete:
                deleted += be.delete([h])
            continue
        good += 1
        key = (hdr.layout_id, hdr.dtype, hdr.shape)
        layouts[key] = layouts.get(key, 0) + 1
    for (layout_id, dtype, shape), n in sorted(layouts.items()):
        print(f"layout {layout_id} {dtype} {shape}: {n} pages")
    print(f"{good} ok, {bad} bad" + (f", {deleted} deleted" if args.delete else "") + (f", {gone} vanished" if gone else ""))
    return 1 if bad else 0


def _clear(be: StorageBackend, args: argparse.Namespace) -> int:
    if not args.yes:
        print("refusing to clear without --yes", file=sys.stderr)
        return 2
    if be.kind == "file":
        bar, update = _shard_progress("clear", "removed")
        with bar:
            removed = _file_store(be).clear(progress=update)
    else:
        removed = be.clear()
    print(f"removed {removed} pages")
    return 0


def _gc(be: StorageBackend, args: argparse.Namespace) -> int:
    if be.kind != "file":
        print("gc applies to the file store; Redis evicts by its maxmemory-policy", file=sys.stderr)
        return 2
    if args.to_gb < 0:
        print("--to-gb must be >= 0", file=sys.stderr)
        return 2
    store = _file_store(be)
    bar, update = _shard_progress("scan", "found")
    with bar:
        while not store.wait_scan(0.2):
            update(*store.scan_progress)
        update(*store.scan_progress)
    before = store.used_bytes
    with _progress(None, "gc", total=store.page_count) as evicted:
        pages, freed = store.gc(int(args.to_gb * 2**30), progress=lambda n: evicted.update(n - evicted.n))
    print(f"evicted {pages} pages, {freed / 2**30:.3f} GiB; {(before - freed) / 2**30:.3f} GiB remain")
    return 0


ACTIONS = {"stats": _stats, "verify": _verify, "clear": _clear, "gc": _gc}


def run(args: argparse.Namespace) -> int:
    from storage_backends import StorageError, create_backend

    try:
        settings = _settings(args)
    except (ValueError, StorageError) as exc:  # ConfigError and StorageConfigError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings is None:
        print("error: cache.l3.backend is none: there is no L3 store to act on", file=sys.stderr)
        return 2
    try:
        backend = create_backend(settings, None)
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        return ACTIONS[args.storage_command](backend, args)
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.close()
