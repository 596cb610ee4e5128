"""What the processes sharing one file store agree on (docs/architecture.md §7).

``UsageRecord`` (``{root}/.usage``): the bytes and pages of the whole directory, so that
``max_size_gb`` bounds the store however many processes write to it. Every process that
changes the store updates it under ``flock``, in this order, so that a process killed
between two steps leaves the record counting *more* than the files (the safe side: the
store then holds a little less than its cap until the next scan measures it):

==========================  ==================================================================
a batch of writes            ``reserve`` every page's bytes before the first temporary file;
                             ``settle`` after the batch: give back what was not published
                             (existed, failed, timed out), count the pages published
eviction                     ``settle`` claims the bytes above the low-water mark (others no
                             longer see them, so two processes do not both evict for the same
                             excess); after the unlinks ``adjust`` gives back what was not
                             freed and takes off the pages that were
any other unlink             ``adjust`` after it succeeded (only the process whose ``unlink``
                             succeeded counts a file gone, so each file is counted out once)
a scan                       ``measured``: the record becomes what the scan found plus what
                             was reserved while it ran (``file_housekeeping``)
==========================  ==================================================================

The record is a cache of a measurement, not a source of truth: a missing or unreadable one
starts at zero and the next scan sets it. A failure to read or write it is logged and
leaves the caller's call working (without accounting).

``WriterRegistry`` (``{root}/.writers/{token}``): each process that writes holds ``flock``
on a lock file of its own for as long as it lives, and names its temporary files with its
token. A temporary file whose writer's lock can be taken (or whose lock file is gone) is
a dead writer's leftover: any process may remove it at once, without waiting for
``stale_tmp_s``; the lock is per open file, so it is released the moment a writer dies,
however it dies, and it works across pid namespaces on one host.

Locks: each class has a ``threading.Lock`` (``flock`` does not exclude the threads of one
process), held only around its own few syscalls and the ``then`` callbacks of ``read``,
``reserve`` and ``settle`` (the index's, ``file_index``: no I/O). Both are per process: a backend makes new
ones after ``fork``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from storage_backends.locks import ForkSafeLock

log = logging.getLogger(__name__)

RECORD_NAME = ".usage"
WRITERS_DIR = ".writers"
_MAGIC = b"HCUSAGE1"
_RECORD = struct.Struct("<8sqqqq")  # magic, bytes, pages, bytes reserved ever, pages published ever


@dataclass(frozen=True)
class Usage:
    """A reading of the record. ``added_*`` only grow: what a scan adds for the writes made
    while it ran."""

    bytes: int
    pages: int
    added_bytes: int
    added_pages: int


_ZERO = Usage(0, 0, 0, 0)


class UsageRecord:
    """The shared record of one store (module doc). Methods never raise."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, RECORD_NAME)
        self._lock = ForkSafeLock()
        self._fd: int | None = None
        self._failing = False

    @contextmanager
    def _locked(self) -> Iterator[list[int]]:
        """The record's four numbers, as a list the caller may change; written back after."""
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fd = self._fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(fd, _RECORD.size, 0)
                before: list[int] | None = None
                if len(raw) == _RECORD.size and raw.startswith(_MAGIC):
                    before = list(_RECORD.unpack(raw)[1:])
                elif raw:
                    log.warning("file store: usage record %s is unreadable; counting from zero until the "
                                "next scan", self.path)
                values = list(before) if before is not None else [0, 0, 0, 0]
                yield values
                if values != before:
                    os.pwrite(fd, _RECORD.pack(_MAGIC, *values), 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _failed(self, what: str, exc: OSError) -> None:
        if not self._failing:
            log.warning("file store: usage record %s: %s failed: %s; the store is not counted until it works",
                        self.path, what, exc)
        self._failing = True

    def read(self, then: Callable[[], None] | None = None) -> Usage:
        """The record's numbers. ``then`` runs under the record's lock right after the
        reading (after the failure, when it cannot be read): no count of this process's
        comes between the two."""
        ran = False
        try:
            with self._locked() as v:
                usage = Usage(*v)
                if then is not None:
                    ran = True
                    then()
        except OSError as exc:
            self._failed("read", exc)
            if then is not None and not ran:
                then()
            return _ZERO
        self._failing = False
        return usage

    def reserve(self, nbytes: int, then: Callable[[], None] | None = None) -> None:
        """Count ``nbytes`` about to be written (before the first temporary file); ``then``
        as ``read``'s."""
        ran = False
        try:
            with self._locked() as v:
                v[0] += nbytes
                v[2] += nbytes
                if then is not None:
                    ran = True
                    then()
        except OSError as exc:
            self._failed("reserve", exc)
            if then is not None and not ran:
                then()

    def settle(self, unused_bytes: int, pages: int, cap: int, low: int, at_least: int = 0,
               then: Callable[[], None] | None = None) -> int:
        """After a batch: give back ``unused_bytes`` of its reservation, count ``pages``
        published. Then claim the bytes to evict: those above ``low`` when the store is
        above ``cap`` (0: no cap), and at least ``at_least``, never more than the store
        holds. ``then`` runs under the record's lock once the counts are in (as ``read``'s).
        Returns the bytes claimed (the caller evicts them, then ``adjust``)."""
        ran = False
        try:
            with self._locked() as v:
                v[0] -= unused_bytes
                v[1] += pages
                v[3] += pages
                claim = max(at_least, v[0] - low if cap and v[0] > cap else 0)
                claim = max(0, min(claim, v[0]))
                v[0] -= claim
                if then is not None:
                    ran = True
                    then()
        except OSError as exc:
            self._failed("settle", exc)
            if then is not None and not ran:
                then()
            return 0
        return claim

    def claim_above(self, target: int) -> int:
        """Claim the bytes above ``target`` for eviction (``hicache storage gc``); returns them."""
        try:
            with self._locked() as v:
                claim = max(0, v[0] - max(0, target))
                v[0] -= claim
        except OSError as exc:
            self._failed("claim", exc)
            return 0
        return claim

    def adjust(self, nbytes: int, pages: int) -> None:
        """Add ``nbytes`` and ``pages`` (negative: files removed; positive: a claim given back)."""
        if not nbytes and not pages:
            return
        try:
            with self._locked() as v:
                v[0] += nbytes
                v[1] += pages
        except OSError as exc:
            self._failed("adjust", exc)

    def measured(self, nbytes: int, pages: int, since: Usage) -> Usage:
        """A scan that began at reading ``since`` found ``nbytes`` in ``pages``: the record
        becomes that plus what was reserved and published while it ran (counted twice where
        the scan also saw it: the safe side). Returns the new reading."""
        try:
            with self._locked() as v:
                v[0] = nbytes + max(0, v[2] - since.added_bytes)
                v[1] = pages + max(0, v[3] - since.added_pages)
                usage = Usage(*v)
        except OSError as exc:
            self._failed("repair", exc)
            return _ZERO
        return usage

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def forget_inherited(self) -> None:
        """In a forked child: drop the parent's descriptor (its lock is the parent's)."""
        self.close()


class WriterRegistry:
    """This process's writer token and lock, and the dead writers' (module doc)."""

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, WRITERS_DIR)
        self._lock = ForkSafeLock()
        self._token: str | None = None
        self._fd: int | None = None
        self._claimed: dict[str, int | None] = {}  # dead writers' tokens -> our fd holding their lock

    def token(self) -> str:
        """This process's token, registering it on first use. Raises ``OSError``."""
        token = self._token
        if token is None:
            with self._lock:
                if self._token is None:
                    os.makedirs(self.dir, exist_ok=True)
                    new = f"{os.getpid()}-{secrets.token_hex(4)}"
                    # Locked before it appears under its name: no one can take it for a dead one.
                    staged = os.path.join(self.dir, f".{new}.new")
                    fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        os.rename(staged, os.path.join(self.dir, new))
                    except OSError:
                        os.close(fd)
                        raise
                    self._fd, self._token = fd, new
                token = self._token
        return token

    def is_dead(self, token: str) -> bool:
        """Whether writer ``token`` is dead. A dead writer's lock is then held by us until
        ``release_dead``, so that only one process reclaims its leftovers."""
        with self._lock:
            if token == self._token:
                return False
            if token in self._claimed:
                return True
            try:
                fd = os.open(os.path.join(self.dir, token), os.O_RDWR)
            except FileNotFoundError:
                self._claimed[token] = None  # reclaimed already, or its lock file was removed
                return True
            except OSError as exc:
                log.debug("file store: cannot open the lock of writer %s: %s", token, exc)
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    log.debug("file store: cannot lock writer %s: %s", token, exc)
                return False
            self._claimed[token] = fd
            return True

    def find_dead(self) -> list[str]:
        """The writers registered in the store that are dead (their locks now held by us)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.debug("file store: cannot list %s: %s", self.dir, exc)
            return []
        return [t for t in names if not t.startswith(".") and self.is_dead(t)]

    def release_dead(self) -> None:
        """After their leftovers are gone: remove the dead writers' lock files."""
        with self._lock:
            claimed, self._claimed = self._claimed, {}
        for token, fd in claimed.items():
            if fd is None:
                continue
            try:
                os.unlink(os.path.join(self.dir, token))
            except OSError:
                pass
            os.close(fd)

    def close(self) -> None:
        """Unregister (no temporary file of ours is left once no write is in progress)."""
        self.release_dead()
        with self._lock:
            fd, token, self._fd, self._token = self._fd, self._token, None, None
        if fd is not None and token is not None:
            try:
                os.unlink(os.path.join(self.dir, token))
            except OSError:
                pass
            os.close(fd)

    def forget_inherited(self) -> None:
        """In a forked child: drop the parent's descriptors without touching its files (the
        child closing them keeps the parent's lock; the child registers anew)."""
        with self._lock:
            fds = [self._fd, *self._claimed.values()]
            self._fd, self._token, self._claimed = None, None, {}
        for fd in fds:
            if fd is not None:
                os.close(fd)
