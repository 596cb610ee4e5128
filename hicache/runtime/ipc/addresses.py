"""Where the daemon's sockets live: the private runtime directory and each endpoint's
address (docs/architecture.md §2).

``make_runtime_dir`` makes a fresh private directory (mode 0700) for the ``ipc://`` sockets,
so no other user can connect; ``FixedRuntimeDir`` is a configured ``ipc.dir``, which may be
shared; ``Endpoints`` gives each receiving process its address (``tcp://`` only when
configured). Nothing here holds state or locks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENDPOINT_NAMES = ("scheduler", "tokenizer", "controller", "launcher", "engine")
"""``engine``: the cache server's ROUTER for engine connectors (engine mode only)."""


def make_runtime_dir(base: str | None = None) -> Path:
    """Create a fresh private directory (mode 0700) for sockets; ``base`` None = the user's runtime dir.

    Raises PermissionError if the directory ends up accessible to other users.
    """
    parent = base or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="hicache-", dir=parent))
    os.chmod(path, 0o700)
    ensure_private(path)
    return path


@dataclass(frozen=True)
class FixedRuntimeDir:
    """A configured ``ipc.dir``, so a clean stop removes what the daemon puts there and
    nothing of anyone else (the directory may be shared, such as ``/run``).

    ``OWN_ENTRIES`` are the names the daemon creates there: its ``ipc://`` sockets,
    ``heartbeat/`` and ``metrics/``. ``clear`` removes those (also when a daemon that did not
    stop cleanly left them) and nothing else; the directory itself only if the daemon
    created it (``existed`` False) and it is empty by then."""

    path: Path
    existed: bool

    OWN_ENTRIES = ("heartbeat", "metrics", *(f"{name}.sock" for name in ENDPOINT_NAMES))

    @classmethod
    def before_start(cls, path: Path) -> FixedRuntimeDir:
        return cls(path, path.is_dir())

    def clear(self) -> None:
        for name in self.OWN_ENTRIES:
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
        if not self.existed:
            with contextlib.suppress(OSError):  # not empty: someone else's files are there
                self.path.rmdir()


def ensure_private(path: Path) -> None:
    """Raise PermissionError unless ``path`` is a directory only its owner can enter."""
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory")
    if st.st_mode & 0o077:
        raise PermissionError(f"{path} is accessible to other users (mode {oct(st.st_mode & 0o777)})")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by this user")


@dataclass(frozen=True)
class Endpoints:
    """The address each process binds for the messages it receives.

    ``ipc``: ``ipc://{dir}/{name}.sock``; ``tcp``: ``tcp://{host}:{base_port + i}``.
    ``curve_keys_dir``: CURVE on (see ``open_context``); None = plain sockets.
    """

    transport: str
    dir: str | None = None
    tcp_host: str = "127.0.0.1"
    tcp_base_port: int = 0
    curve_keys_dir: str | None = None

    def address(self, name: str) -> str:
        if name not in ENDPOINT_NAMES:
            raise ValueError(f"unknown endpoint {name!r}; known: {', '.join(ENDPOINT_NAMES)}")
        if self.transport == "ipc":
            if not self.dir:
                raise ValueError("ipc endpoints need a directory")
            return f"ipc://{os.path.join(self.dir, name)}.sock"
        if self.transport == "tcp":
            return f"tcp://{self.tcp_host}:{self.tcp_base_port + ENDPOINT_NAMES.index(name)}"
        raise ValueError(f"unknown transport {self.transport!r}")
