"""The syscalls of one page file, and of the health probe's scratch file, for the file store
(docs/architecture.md §7).

Stateless functions; the caller (``file_backend``) owns the descriptors it passes, the
caller's buffers are only read (writes) or filled (reads) during the call, and none of
them takes a lock.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

from storage_backends.page_format import (
    HEADER_SIZE,
    NAME_OFFSET,
    PREFIX_SIZE,
    PageLayout,
    checksum,
    complete_object,
    describe_mismatch,
    describe_name_mismatch,
    page_name,
)

log = logging.getLogger(__name__)

NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV})
"""What ``link`` fails with on a file system without hard links (pages are then renamed)."""


def readv_full(fd: int, views: list[memoryview]) -> int:
    """``readv`` until every view is full or EOF; return bytes read."""
    total = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def writev_full(fd: int, views: list[memoryview]) -> None:
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def new_scratch() -> tuple[bytearray, list[memoryview]]:
    """A header buffer, and views of it plus a 1-byte overflow probe (one per thread)."""
    hdr = bytearray(HEADER_SIZE + 1)
    mv = memoryview(hdr)
    return hdr, [mv[:HEADER_SIZE], mv[HEADER_SIZE:]]


def read_verified(fd: int, scratch: tuple[bytearray, list[memoryview]], into: memoryview,
                  layout: PageLayout, key: str) -> str | None:
    """Read the object on ``fd`` (stored under ``key``) into ``into``; None when it is a
    verified page of ``layout``, else why not. Raises ``OSError``.

    One ``readv`` of header + payload + one probe byte (so a long or short file shows in
    the byte count without an ``fstat``). The header is verified by comparing its first
    ``PREFIX_SIZE`` bytes with the layout's constant prefix and its name field with
    ``key``'s, then the checksum."""
    hdr, (hdr_mv, probe) = scratch
    size = layout.object_size
    got = os.readv(fd, [hdr_mv, into, probe])
    if 0 < got < size:
        # A short read without EOF (rare on local file systems): finish it.
        rest = [hdr_mv[got:], into] if got < HEADER_SIZE else [into[got - HEADER_SIZE:]]
        got += readv_full(fd, [*rest, memoryview(bytearray(1))])
    if got != size:
        return f"object is {'more than ' if got > size else ''}{min(got, size)} bytes, expected {size}"
    if not hdr.startswith(layout.header_prefix):
        return describe_mismatch(layout, hdr_mv)
    if hdr_mv[NAME_OFFSET:HEADER_SIZE] != page_name(key):
        return describe_name_mismatch(hdr_mv, key)
    if int.from_bytes(hdr[PREFIX_SIZE:NAME_OFFSET], "little") != checksum(into):
        return "payload checksum mismatch"
    return None


def examine(path: str, key: str, layout: PageLayout | None) -> tuple[bool, os.stat_result | None]:
    """Whether the file at ``path`` is a whole object that names ``key`` (of ``layout``, or
    of the layout its header declares: ``complete_object``), and its stat (None: no file).
    Reads the header only. Raises ``OSError``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False, None
    try:
        st = os.fstat(fd)
        header = os.pread(fd, HEADER_SIZE, 0)
    finally:
        os.close(fd)
    return complete_object(header, st.st_size, key, layout), st


def write_file(fd: int, header: bytes, page: memoryview, fsync: bool) -> None:
    """Write a whole object to ``fd`` (fsynced when asked). Raises ``OSError``."""
    writev_full(fd, [memoryview(header), page])
    if fsync:
        os.fsync(fd)


def publish(tmp: str, path: str, hard_links: bool) -> tuple[bool, bool]:
    """Put the written ``tmp`` under ``path`` and remove the temporary name: (whether it was
    published, whether hard links work here). With hard links a page already at ``path``
    (another writer's) is left alone: not published, ``tmp`` removed; without them ``tmp``
    is renamed over it. Raises ``OSError``."""
    if hard_links:
        try:
            os.link(tmp, path)
        except FileExistsError:
            remove_quietly(tmp)
            return False, True
        except OSError as exc:
            if exc.errno not in NO_HARD_LINKS:
                raise
            log.info("file store: no hard links at %s (%s); pages are renamed into place", path, exc)
        else:
            remove_quietly(tmp)
            return True, True
    os.replace(tmp, path)
    return True, False


def remove_quietly(path: str) -> None:
    """Unlink ``path`` if it is there; a failure is logged, never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("file store: cannot remove %s: %s", path, exc)


def probe(root: str) -> bool:
    """Write, read back and remove a small file in the store ``root``; never raises."""
    path = os.path.join(root, f".probe.{os.getpid()}.{threading.get_ident()}")
    token = os.urandom(16)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
        with open(path, "rb") as f:
            ok = f.read() == token
        os.unlink(path)
        return ok
    except OSError as exc:
        log.debug("file store %s: probe failed: %s", root, exc)
        remove_quietly(path)
        return False
