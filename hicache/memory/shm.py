"""Named shared-memory segments that several processes map (bytes only: no torch here).

A segment is a file in ``/dev/shm`` (a tmpfs: its pages are RAM), created once by the
process that owns the daemon's lifetime (the launcher, or a test harness) and attached by
name in every other process. Names carry a random instance id, so two daemons on one
machine never collide.

We use plain ``os.open`` + ``mmap`` rather than ``multiprocessing.shared_memory``: before
Python 3.13 every process that *attaches* a ``SharedMemory`` registers it with a resource
tracker that unlinks it when that process exits, which would pull the pools away from the
survivors when a cache controller is restarted.

Ownership:

=============  ==========================================  =============================
who            does                                        never
=============  ==========================================  =============================
creator        ``create``; ``unlink`` at shutdown (also    —
               after a crash of the others)
attacher       ``attach``; ``close`` when done             ``unlink``
=============  ==========================================  =============================

The mapping stays valid after ``unlink`` until every process closed it; tensors over a
segment (``hicache.memory.pools.segment_tensor``) view the mapping directly (no copy) and must
be dropped before ``close``.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}
"""The dtype names a ``TensorSpec`` may carry, and the bytes of one element of each."""


def shm_dir() -> str:
    """Where segments live: ``/dev/shm`` when present, else the temp dir (slower, but works)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class TensorSpec:
    """A tensor laid out at the start of one segment: everything a process needs to map it."""

    segment: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


class SharedSegment:
    """One mapped segment. Not thread-safe to close while another thread uses its tensors.

    ``mapping`` None: a handle on the name only (to ``unlink`` it), with nothing mapped."""

    def __init__(self, name: str, size: int, mapping: mmap.mmap | None, directory: str, owner: bool) -> None:
        self.name = name
        self.size = size
        self.directory = directory
        self.owner = owner
        self._mmap: mmap.mmap | None = mapping

    @staticmethod
    def _path(name: str, directory: str | None) -> str:
        if not _NAME.match(name):
            raise ValueError(f"bad segment name {name!r}")
        return os.path.join(directory or shm_dir(), name)

    @classmethod
    def create(cls, name: str, size: int, directory: str | None = None) -> SharedSegment:
        """Create a new zero-filled segment; raises FileExistsError if the name is taken."""
        if size <= 0:
            raise ValueError(f"segment size must be > 0, got {size}")
        path = cls._path(name, directory)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(name, size, mapping, os.path.dirname(path), owner=True)

    @classmethod
    def attach(cls, name: str, directory: str | None = None) -> SharedSegment:
        """Map an existing segment; raises FileNotFoundError if it does not exist."""
        path = cls._path(name, directory)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, mapping, os.path.dirname(path), owner=False)

    @property
    def buffer(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._mmap

    def close(self) -> None:
        """Unmap. Raises BufferError while tensors made by ``tensor`` are still alive."""
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def unlink(self) -> None:
        """Remove the name (creator only); mappings stay valid until closed."""
        try:
            os.unlink(os.path.join(self.directory, self.name))
        except FileNotFoundError:
            pass
