"""``hicache keygen --dir DIR``: write the CURVE keys for ``ipc.transport: tcp``.

Writes, each with mode 0600 (``DIR`` and ``DIR/authorized_clients`` are created 0700)::

    DIR/server.key            the daemon's public key (engine connectors need it)
    DIR/server.key_secret     the daemon's key pair
    DIR/client.key            the client public key
    DIR/client.key_secret     the client key pair: the daemon's own processes use it (the only
                              key its internal sockets admit), and engine connectors by default
    DIR/authorized_clients/client.key   the client public keys the engine socket admits

``--client NAME`` adds one more client key pair to an existing directory instead
(``DIR/NAME.key``, ``DIR/NAME.key_secret``) and admits it on the engine socket
(``authorized_clients/NAME.key``): one pair per engine host, so that one can be revoked by
deleting its ``authorized_clients`` file and restarting the daemon. Such a key opens the
engine socket only, never the daemon's internal sockets (``hicache.runtime.ipc``'s ZAP domains).
``--subscriber NAME`` adds a pair admitted on the KV events sockets only
(``authorized_subscribers/NAME.key``): one per router. Key files use ZeroMQ's certificate format; the keys come
from ``zmq.curve_keypair()``. Existing files are never overwritten without ``--force``.
Exit 0 on success, 1 when libzmq lacks CURVE or a file cannot be written (the message says
which), 2 for bad arguments. Secret keys are never printed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="the key directory to write (created with mode 0700)")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--client", metavar="NAME", default=None,
                     help="add an engine's key pair NAME to an existing key directory, admitted on the engine socket")
    who.add_argument("--subscriber", metavar="NAME", default=None,
                     help="add a KV event subscriber's key pair NAME, admitted on the events sockets only")
    parser.add_argument("--force", action="store_true", help="replace key files that exist")


def _key_file_text(public: bytes, secret: bytes | None) -> str:
    kind = "Secret" if secret is not None else "Public"
    lines = [
        f"#   ****  Generated on {datetime.datetime.now().isoformat(timespec='seconds')} by hicache keygen  ****",
        f"#   ZeroMQ CURVE **{kind}** Certificate",
    ]
    if secret is not None:
        lines.append("#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
    lines += ["", "metadata", "curve", f'    public-key = "{public.decode("ascii")}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str, force: bool) -> None:
    """Write ``text`` to ``path`` with mode 0600 (through a temporary file and a rename, so a
    reader never sees half a key). Raises FileExistsError unless ``force``."""
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (pass --force to replace it)")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fd = -1
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def write_key_pair(root: Path, name: str, *, force: bool = False, admitted_in: str | None = None) -> list[Path]:
    """Write ``root/name.key`` and ``root/name.key_secret`` (a fresh ``zmq.curve_keypair()``)
    and admit the pair in ``root/{admitted_in}/name.key`` (default ``authorized_clients``:
    the engine socket) when ``name`` is not ``server``. Returns the files written."""
    import zmq

    from hicache.runtime.ipc import AUTHORIZED_DIR

    public, secret = zmq.curve_keypair()
    paths = [root / f"{name}.key", root / f"{name}.key_secret"]
    for path in paths:  # check all first: never leave half a pair behind
        if path.exists() and not force:
            raise FileExistsError(f"{path} exists (pass --force to replace it)")
    _write_private(paths[1], _key_file_text(public, secret), force)
    _write_private(paths[0], _key_file_text(public, None), force)
    if name != "server":
        authorized = root / (admitted_in or AUTHORIZED_DIR)
        _private_dir(authorized)
        admitted = authorized / f"{name}.key"
        _write_private(admitted, _key_file_text(public, None), force)
        paths.append(admitted)
    return paths


def write_key_dir(root: str | os.PathLike[str], *, force: bool = False) -> list[Path]:
    """Write a complete key directory (server pair, ``client`` pair, ``authorized_clients``).
    Raises CurveKeyError without CURVE support, FileExistsError for a key file that exists
    (unless ``force``), OSError when a file cannot be written."""
    from hicache.runtime.ipc import (
        CLIENT_PUBLIC_FILE,
        CLIENT_SECRET_FILE,
        SERVER_PUBLIC_FILE,
        SERVER_SECRET_FILE,
        require_curve,
    )

    require_curve()
    path = Path(root)
    if not force:
        for name in (SERVER_PUBLIC_FILE, SERVER_SECRET_FILE, CLIENT_PUBLIC_FILE, CLIENT_SECRET_FILE):
            if (path / name).exists():
                raise FileExistsError(f"{path / name} exists (pass --force to replace the keys)")
    _private_dir(path)
    return write_key_pair(path, "server", force=force) + write_key_pair(path, "client", force=force)


def run(args: argparse.Namespace) -> int:
    from hicache.runtime.ipc import (
        AUTHORIZED_DIR,
        SERVER_SECRET_FILE,
        SUBSCRIBERS_DIR,
        CurveKeyError,
        load_curve_keys,
        require_curve,
    )

    root = Path(args.dir)
    name = args.client if args.client is not None else args.subscriber
    flag = "--client" if args.client is not None else "--subscriber"
    try:
        require_curve()
        if name is not None:
            if not _NAME.match(name) or name in ("server", "client"):
                print(f"hicache keygen: {flag} {name!r}: use letters, digits, '.', '_' or '-' (not "
                      "'server' or 'client', which the directory already has)", file=sys.stderr)
                return 2
            if not (root / SERVER_SECRET_FILE).is_file():
                print(f"hicache keygen: {root} holds no server key: run `hicache keygen --dir {root}` first",
                      file=sys.stderr)
                return 1
            written = write_key_pair(root, name, force=args.force,
                                     admitted_in=AUTHORIZED_DIR if args.client is not None else SUBSCRIBERS_DIR)
        else:
            written = write_key_dir(root, force=args.force)
        load_curve_keys(root)  # what was written loads, as the daemon will load it
    except (CurveKeyError, FileExistsError) as exc:
        print(f"hicache keygen: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"hicache keygen: cannot write {exc.filename or root}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    if name is None:
        print(f"\nin the daemon's config:\n  ipc:\n    transport: tcp\n    curve_keys_dir: {root.resolve()}")
    elif args.subscriber is not None:
        print(f"\nfor the KV event subscriber: the daemon's public key {(root / 'server.key').resolve()} and its "
              f"own key pair {(root / f'{name}.key_secret').resolve()}; restart the daemon to admit the key")
    else:
        print(f"\nfor the engine connector (kv_connector_extra_config): \"curve_client_secret_file\": "
              f"\"{(root / f'{args.client}.key_secret').resolve()}\"; restart the daemon to admit the key")
    return 0
