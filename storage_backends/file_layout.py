"""What a file store's directory holds, and the one walk over it (docs/architecture.md §7).

======================================  ================================================
``{root}/{h[0:2]}/{h}.page``             a page object (``page_format``), 256 shards
``{root}/{h[0:2]}/.{h}.{token}.{n}.tmp`` a page being written by writer ``token``
``{root}/.usage``                        the shared usage record (``file_usage``)
``{root}/.writers/{token}``              one lock file per live writer (``file_usage``)
``{root}/.probe.*``                      the health probe's scratch file
======================================  ================================================

A writer's ``token`` is ``{pid}-{8 hex}`` (``WriterRegistry``); temporary files of older
builds are named ``.{h}.{pid}.{n}.tmp`` and have no token. Paths are built only from
validated page hashes.

Directories are made durable by whoever creates them: with ``durable``, ``make_dirs``
fsyncs the parent of every directory it creates (or finds just created by another
process), so a directory, and every page in it reported durable, survives a power loss.

``list_shard`` lists one shard; ``walk`` lists every shard once: the pages with their sizes
and access times (or only their count and bytes), the temporary files, and (when
``reclaim`` says so) removes the leftovers of dead writers, telling ``progress`` after
each shard.
Nothing here holds state or locks.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from storage_backends.keys import is_page_hash

log = logging.getLogger(__name__)

PAGE_SUFFIX = ".page"
TMP_SUFFIX = ".tmp"
SHARDS = tuple(f"{i:02x}" for i in range(256))


def page_path(root_slash: str, h: str) -> str:
    """The page file of ``h`` under a root given with its trailing slash."""
    return f"{root_slash}{h[:2]}/{h}{PAGE_SUFFIX}"


def tmp_path(shard_dir: str, h: str, token: str, n: int) -> str:
    return f"{shard_dir}/.{h}.{token}.{n}{TMP_SUFFIX}"


def tmp_token(name: str) -> str | None:
    """The writer token in a temporary file's name; None for an older build's (``pid`` only)
    or a name that is not ours."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] or parts[4] != TMP_SUFFIX[1:]:
        return None
    token = parts[2]
    pid, sep, tag = token.partition("-")
    return token if sep and pid.isdigit() and len(tag) == 8 else None


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str, durable: bool) -> None:
    """``os.makedirs(path, exist_ok=True)``; with ``durable``, the parent of each directory
    made (by us, or by another process between our look and our ``mkdir``) is fsynced
    after it. Raises ``OSError``."""
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
        if durable:
            fsync_dir(os.path.dirname(d))


def list_shard(root: str, shard: str) -> list[tuple[str, str]] | None:
    """(name, path) of every entry of one shard ([] when there is no such directory); None,
    logged, when it cannot be listed."""
    try:
        with os.scandir(os.path.join(root, shard)) as it:
            return [(e.name, e.path) for e in it]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        log.warning("file store: cannot list shard %s: %s", shard, exc)
        return None


Progress = Callable[[int, int], None]
"""Called after each shard a walk lists: (shards listed, pages found so far)."""


@dataclass
class Walk:
    """What one walk over the shards found."""

    pages: list[tuple[float, str, int]] = field(default_factory=list)
    """(access time, hash, bytes) of every page file, oldest first (empty unless collected)."""
    page_count: int = 0
    page_bytes: int = 0
    temp_files: int = 0
    temp_bytes: int = 0
    """Temporary files still there after the walk (live writers', or not yet stale)."""
    reclaimed: int = 0
    """Temporary files of dead writers the walk removed."""
    complete: bool = True
    """False when a shard could not be listed or the walk was stopped."""

    @property
    def bytes(self) -> int:
        return self.page_bytes + self.temp_bytes


def walk(root: str, reclaim: Callable[[str, os.stat_result], bool] | None = None,
         stop: Callable[[], bool] = lambda: False, collect: bool = True,
         progress: Progress | None = None) -> Walk:
    """List every shard of the store at ``root``.

    ``reclaim(name, stat)`` decides for each temporary file whether it is a dead writer's
    leftover, which the walk then removes (None: remove nothing). ``collect``: keep every
    page (``Walk.pages``, sorted); without it the walk only counts, in memory that does not
    grow with the store. A shard that cannot be listed is logged and makes the walk
    incomplete; ``stop()`` is asked before each shard, ``progress`` told after each.
    Never raises for store trouble."""
    out = Walk()
    for i, shard in enumerate(SHARDS):
        if stop():
            out.complete = False
            break
        try:
            it = os.scandir(os.path.join(root, shard))
        except (FileNotFoundError, NotADirectoryError):
            it = None
        except OSError as exc:
            log.warning("file store %s: cannot list shard %s: %s", root, shard, exc)
            out.complete = False
            it = None
        if it is not None:
            with it:
                for entry in _entries(it, root, shard, out):
                    _take(entry, out, reclaim, collect)
        if progress is not None:
            progress(i + 1, out.page_count)
    out.pages.sort(key=_ATIME)  # on the float alone: a fifth of the time of comparing tuples
    return out


_ATIME = operator.itemgetter(0)
"""A page's sort key in ``Walk.pages``: its access time."""


def _entries(it: Iterator[os.DirEntry[str]], root: str, shard: str, out: Walk) -> Iterator[os.DirEntry[str]]:
    try:
        yield from it
    except OSError as exc:
        log.warning("file store %s: listing shard %s failed: %s", root, shard, exc)
        out.complete = False


def _take(entry: os.DirEntry[str], out: Walk, reclaim: Callable[[str, os.stat_result], bool] | None,
          collect: bool) -> None:
    name = entry.name
    try:
        if name.endswith(PAGE_SUFFIX):
            h = name[: -len(PAGE_SUFFIX)]
            if is_page_hash(h):
                st = entry.stat(follow_symlinks=False)
                if collect:
                    out.pages.append((max(st.st_atime, st.st_mtime), h, st.st_size))
                out.page_count += 1
                out.page_bytes += st.st_size
        elif name.endswith(TMP_SUFFIX):
            st = entry.stat(follow_symlinks=False)
            if reclaim is not None and reclaim(name, st):
                os.unlink(entry.path)
                out.reclaimed += 1
            else:
                out.temp_files += 1
                out.temp_bytes += st.st_size
    except FileNotFoundError:
        pass  # removed since it was listed
    except OSError as exc:
        log.warning("file store: cannot look at %s: %s", entry.path, exc)
