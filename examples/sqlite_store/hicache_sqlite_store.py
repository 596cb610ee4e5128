"""An L3 store in one SQLite file: a small, complete hicache storage plug-in.

Installed beside hicache, it adds the kind ``sqlite`` (``pyproject.toml`` names ``PLUGIN``
under the entry-point group ``hicache.storage_backends``); configure it with::

    cache:
      l3:
        backend: sqlite
        options: {path: /var/lib/hicache/l3.sqlite, timeout_s: 2.0}

Objects are hicache's page objects (``storage_backends.page_format``: header + payload),
one row per page hash. It keeps the contract of ``storage_backends.base``: store trouble
(a locked or unreadable database) makes reads misses and writes ``False`` and is counted;
a row is written in one transaction, so a reader sees a whole page or none; each thread and
each process (after ``fork``) opens its own connection. It evicts nothing by itself.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from storage_backends import (
    BackendPlugin,
    PageLayout,
    StorageBackend,
    StorageConfigError,
    StorageStats,
    StoreUsage,
)
from storage_backends.base import Buffer
from storage_backends.errors import PageFormatError, StorageError
from storage_backends.keys import check_hashes
from storage_backends.page_format import check_object, encode_header
from storage_backends.stats import StatsCounter

_CHUNK = 500
"""Hashes per ``IN (...)`` query (SQLite allows 32766 parameters; smaller keeps statements short)."""


@dataclass(frozen=True)
class SqliteSettings:
    """``cache.l3.options`` of the ``sqlite`` backend.

    ``path``: the database file (created with its directory); ``timeout_s``: how long a call
    waits for another writer's lock before it counts as store trouble."""

    path: str
    timeout_s: float = 2.0

    kind = "sqlite"

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path.strip():
            raise StorageConfigError(f"path must be a non-empty string, got {self.path!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0:
            raise StorageConfigError(f"timeout_s must be a number > 0, got {self.timeout_s!r}")


class SqliteBackend(StorageBackend):
    """Page objects as rows ``(hash, object)`` of one table in ``settings.path``."""

    kind = "sqlite"

    def __init__(self, settings: SqliteSettings, layout: PageLayout | None) -> None:
        super().__init__(layout)
        self.settings = settings
        self._stats = StatsCounter()
        self._closed = False
        self._local = threading.local()
        self._inherited: list[sqlite3.Connection] = []  # a parent's connections: never used, never closed
        directory = os.path.dirname(os.path.abspath(settings.path))
        try:
            os.makedirs(directory, exist_ok=True)
            with self._db() as db:
                db.execute("CREATE TABLE IF NOT EXISTS pages (h TEXT PRIMARY KEY, obj BLOB NOT NULL) WITHOUT ROWID")
        except (OSError, sqlite3.Error) as exc:
            from storage_backends import StorageUnavailable

            raise StorageUnavailable(f"sqlite store {settings.path}: {exc}") from exc

    # -- connections ----------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        """This thread's connection in this process (opened on first use)."""
        pid = os.getpid()
        held = getattr(self._local, "conn", None)
        if held is not None and held[0] == pid:
            return held[1]
        if held is not None:
            self._inherited.append(held[1])
        conn = sqlite3.connect(self.settings.path, timeout=self.settings.timeout_s, isolation_level=None,
                               check_same_thread=True)
        conn.execute("PRAGMA journal_mode=WAL")
        self._local.conn = (pid, conn)
        return conn

    def _trouble(self, exc: Exception) -> None:
        self._stats.add(errors=1, timeouts=int("locked" in str(exc)))

    # -- data path ------------------------------------------------------------------

    def _present(self, hashes: list[str]) -> set[str]:
        db = self._db()
        found: set[str] = set()
        for i in range(0, len(hashes), _CHUNK):
            part = hashes[i:i + _CHUNK]
            marks = ",".join("?" * len(part))
            found.update(row[0] for row in db.execute(f"SELECT h FROM pages WHERE h IN ({marks})", part))
        return found

    def batch_exists(self, hashes: Sequence[str]) -> int:
        checked = check_hashes(hashes)
        if self._closed or not checked:
            return 0
        try:
            present = self._present(checked)
        except sqlite3.Error as exc:
            self._trouble(exc)
            return 0
        n = 0
        while n < len(checked) and checked[n] in present:
            n += 1
        return n

    def exists_each(self, hashes: Sequence[str]) -> list[bool]:
        checked = check_hashes(hashes)
        if self._closed:
            return [False] * len(checked)
        try:
            present = self._present(checked)
        except sqlite3.Error as exc:
            self._trouble(exc)
            return [False] * len(checked)
        return [h in present for h in checked]

    def batch_get(self, hashes: Sequence[str], into: Sequence[memoryview],
                  layout: PageLayout | None = None) -> list[bool]:
        layout = layout or self._require_layout()
        checked, views = self._read_targets(hashes, into, layout)
        if self._closed:
            self._stats.add(misses=len(checked))
            return [False] * len(checked)
        rows: dict[str, bytes] = {}
        try:
            db = self._db()
            for i in range(0, len(checked), _CHUNK):
                part = checked[i:i + _CHUNK]
                marks = ",".join("?" * len(part))
                rows.update(db.execute(f"SELECT h, obj FROM pages WHERE h IN ({marks})", part))
        except sqlite3.Error as exc:
            self._trouble(exc)
            self._stats.add(misses=len(checked))
            return [False] * len(checked)
        out: list[bool] = []
        bad: list[str] = []
        for h, view in zip(checked, views, strict=True):
            obj = rows.get(h)
            if obj is None:
                out.append(False)
                continue
            try:
                payload = check_object(layout, obj, h)
            except PageFormatError:
                bad.append(h)
                out.append(False)
                continue
            view[:] = payload
            out.append(True)
        hits = sum(out)
        self._stats.add(hits=hits, misses=len(out) - hits, corrupt=len(bad), bytes_read=hits * layout.payload_size)
        if bad:
            self.delete(bad)
        return out

    def batch_set(self, hashes: Sequence[str], pages: Sequence[Buffer],
                  layout: PageLayout | None = None) -> list[bool]:
        layout = layout or self._require_layout()
        checked, views = self._write_sources(hashes, pages, layout)
        if not checked:
            return []
        if self._closed:
            self._stats.add(dropped_writes=len(checked))
            return [False] * len(checked)
        rows = [(h, encode_header(layout, view, h) + view.tobytes()) for h, view in zip(checked, views, strict=True)]
        try:
            db = self._db()
            with db:  # one transaction: every row or none
                db.execute("BEGIN IMMEDIATE")
                db.executemany("INSERT OR IGNORE INTO pages (h, obj) VALUES (?, ?)", rows)
        except sqlite3.Error as exc:
            self._trouble(exc)
            self._stats.add(dropped_writes=len(checked))
            return [False] * len(checked)
        self._stats.add(writes=len(checked), bytes_written=len(checked) * layout.payload_size)
        return [True] * len(checked)

    def delete(self, hashes: Sequence[str]) -> int:
        checked = check_hashes(hashes)
        if self._closed or not checked:
            return 0
        removed = 0
        try:
            db = self._db()
            for i in range(0, len(checked), _CHUNK):
                part = checked[i:i + _CHUNK]
                marks = ",".join("?" * len(part))
                removed += db.execute(f"DELETE FROM pages WHERE h IN ({marks})", part).rowcount
        except sqlite3.Error as exc:
            self._trouble(exc)
        return removed

    def clear(self) -> int:
        if self._closed:
            return 0
        try:
            return int(self._db().execute("DELETE FROM pages").rowcount)
        except sqlite3.Error as exc:
            self._trouble(exc)
            return 0

    def stats(self) -> StorageStats:
        return self._stats.snapshot(self.kind, not self._closed)

    def health(self) -> bool:
        if self._closed:
            return False
        try:
            self._db().execute("SELECT 1").fetchone()
        except sqlite3.Error:
            return False
        return True

    def close(self) -> None:
        self._closed = True
        held = getattr(self._local, "conn", None)
        if held is not None and held[0] == os.getpid():
            held[1].close()
            self._local.conn = None

    # -- administration -------------------------------------------------------------

    def iter_hashes(self) -> Iterator[str]:
        try:
            hashes = [row[0] for row in self._db().execute("SELECT h FROM pages")]
        except sqlite3.Error as exc:
            raise StorageError(f"sqlite store {self.settings.path}: {exc}") from exc
        yield from hashes

    def read_object(self, h: str) -> bytes | None:
        (checked,) = check_hashes([h])
        try:
            row = self._db().execute("SELECT obj FROM pages WHERE h = ?", (checked,)).fetchone()
        except sqlite3.Error as exc:
            raise StorageError(f"sqlite store {self.settings.path}: {exc}") from exc
        return None if row is None else bytes(row[0])

    def usage(self) -> StoreUsage:
        try:
            pages, size = self._db().execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(obj)), 0) FROM pages").fetchone()
        except sqlite3.Error as exc:
            raise StorageError(f"sqlite store {self.settings.path}: {exc}") from exc
        return StoreUsage(int(pages), int(size))


def _build(settings: SqliteSettings, layout: PageLayout | None) -> SqliteBackend:
    return SqliteBackend(settings, layout)


PLUGIN = BackendPlugin(kind="sqlite", settings_class=SqliteSettings, factory=_build,
                       summary="page objects in one SQLite file (options: path, timeout_s)")
