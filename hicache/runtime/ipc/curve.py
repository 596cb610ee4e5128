"""CURVE on the daemon's sockets: the key directory, the ZAP domains, the secure context
(docs/architecture.md §2).

CURVE (``ipc.curve_keys_dir``, a directory written by ``hicache keygen``): each process makes
its context with ``open_context(endpoints)``; the wrappers of ``ipc.sockets`` then make every socket they
bind a CURVE server (the server key pair) and every socket they connect a CURVE client (the
client key pair, the server's public key), and the context runs a ZAP authenticator. Each
bound socket names its ZAP domain, and each domain admits its own keys only:

==================  ==========================================  ================================
ZAP domain          sockets                                     admits the client keys
==================  ==========================================  ================================
``ZAP_INTERNAL``    scheduler, tokenizer, controller, launcher  ``client.key`` alone: the
                                                                daemon's own processes
``ZAP_ENGINE``      engine (the cache server's ROUTER)          ``authorized_clients/*.key``:
                                                                engines (``keygen --client``)
``ZAP_EVENTS``      KV events PUB and replay                    ``authorized_subscribers/*.key``
                                                                (``keygen --subscriber``)
==================  ==========================================  ================================

So an engine's key opens the engine socket only, and a router's the event stream only. A
peer without CURVE, with another server key, or with a key its socket's domain does not
admit never completes its handshake: none of its frames reaches ``recv``. A socket bound
without a domain admits no one. Secret keys are never logged and never appear in a ``repr``.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from hicache.runtime.ipc.addresses import Endpoints

SERVER_PUBLIC_FILE = "server.key"
SERVER_SECRET_FILE = "server.key_secret"
CLIENT_PUBLIC_FILE = "client.key"
CLIENT_SECRET_FILE = "client.key_secret"
AUTHORIZED_DIR = "authorized_clients"
SUBSCRIBERS_DIR = "authorized_subscribers"
"""The layout of a CURVE key directory (``hicache keygen --dir DIR`` writes it): the
daemon's server key pair; the client key pair its own processes use (engine connectors too,
by default: give each engine host its own pair instead, since this one opens the internal
sockets); ``authorized_clients/``, the public keys (``*.key``) the engine socket admits;
``authorized_subscribers/`` (optional), those the KV events sockets admit. Key files use
ZeroMQ's certificate format (``zmq.auth.load_certificate`` reads them)."""

ZAP_INTERNAL = "hicache-internal"
ZAP_ENGINE = "hicache-engine"
ZAP_EVENTS = "hicache-events"
"""The ZAP domains of the daemon's bound sockets (the table in the module docstring)."""

_Z85_KEY_LEN = 40


class CurveKeyError(ValueError):
    """A CURVE key directory or key file that cannot be used; the message names the file and
    the fix (it never contains key material)."""


def curve_available() -> bool:
    """Whether this libzmq was built with CURVE (``zmq.has("curve")``)."""
    return bool(zmq.has("curve"))


def require_curve() -> None:
    """Raise CurveKeyError unless this libzmq supports CURVE."""
    if not curve_available():
        raise CurveKeyError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE support "
                            "(zmq.has('curve') is false): install a pyzmq whose bundled libzmq has CURVE "
                            "(the standard wheels do), or use ipc.transport: ipc")


@dataclass(frozen=True)
class CurveClientKeys:
    """What a CURVE client needs: the server's public key and its own key pair (Z85 bytes)."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes = field(repr=False)


@dataclass(frozen=True)
class CurveKeys:
    """The daemon's CURVE keys, loaded from a key directory by ``load_curve_keys``.

    ``engine_clients``: the public keys (Z85) of ``authorized_clients/``; ``subscribers``:
    those of ``authorized_subscribers/``. ``admitted`` says which keys each ZAP domain takes.
    """

    dir: str
    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes = b""
    client_secret: bytes = field(default=b"", repr=False)
    engine_clients: frozenset[bytes] = frozenset()
    subscribers: frozenset[bytes] = frozenset()

    def client(self) -> CurveClientKeys:
        return CurveClientKeys(self.server_public, self.client_public, self.client_secret)

    def admitted(self) -> dict[str, frozenset[bytes]]:
        """Per ZAP domain, the client public keys it admits (the module docstring's table)."""
        return {ZAP_INTERNAL: frozenset({self.client_public}), ZAP_ENGINE: self.engine_clients,
                ZAP_EVENTS: self.subscribers}


def _check_private_file(path: Path) -> None:
    """Raise CurveKeyError unless ``path`` is a regular file of this user that no one else can read."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CurveKeyError(f"{path} does not exist (write the keys with `hicache keygen --dir {path.parent}`)") \
            from None
    except OSError as exc:
        raise CurveKeyError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CurveKeyError(f"{path} is not a regular file")
    if st.st_mode & 0o077:
        raise CurveKeyError(f"{path} holds a secret key but is accessible to other users "
                            f"(mode {oct(st.st_mode & 0o777)}): chmod 600 {path}")
    if st.st_uid != os.getuid():
        raise CurveKeyError(f"{path} holds a secret key but is owned by uid {st.st_uid}, not by this user")


def _read_key_file(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) from a ZeroMQ certificate file; with ``secret``, the file must be
    private and hold a secret key matching its public key."""
    import zmq.auth

    if secret:
        _check_private_file(path)
    elif not path.is_file():
        raise CurveKeyError(f"{path} does not exist or is not a file")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{path} is not a ZeroMQ CURVE key file: {exc}") from None
    if len(public) != _Z85_KEY_LEN:
        raise CurveKeyError(f"{path}: the public key is not a 40-character Z85 CURVE key")
    if secret:
        if not secret_key:
            raise CurveKeyError(f"{path} holds no secret key (a *.key_secret file from `hicache keygen` does)")
        if len(secret_key) != _Z85_KEY_LEN:
            raise CurveKeyError(f"{path}: the secret key is not a 40-character Z85 CURVE key")
        try:
            derived = zmq.curve_public(secret_key)
        except (zmq.ZMQError, ValueError) as exc:
            raise CurveKeyError(f"{path}: the secret key is not a valid CURVE key ({exc})") from None
        if derived != public:
            raise CurveKeyError(f"{path}: its secret key does not belong to its public key")
    return public, secret_key


def load_curve_client(server_public_file: str | os.PathLike[str],
                      client_secret_file: str | os.PathLike[str]) -> CurveClientKeys:
    """A client's keys from the server's public key file (``server.key``) and the client's
    secret key file (``*.key_secret``: private, mode 0600). Raises CurveKeyError."""
    require_curve()
    server_public, _ = _read_key_file(Path(server_public_file), secret=False)
    client_public, client_secret = _read_key_file(Path(client_secret_file), secret=True)
    assert client_secret is not None
    return CurveClientKeys(server_public, client_public, client_secret)


def load_curve_keys(keys_dir: str | os.PathLike[str]) -> CurveKeys:
    """The daemon's keys from a directory laid out as ``hicache keygen`` writes it.

    Raises CurveKeyError when libzmq lacks CURVE, a file is missing, unreadable, readable by
    other users (secret files) or malformed, ``authorized_clients/`` is missing, or it or
    ``authorized_subscribers/`` (optional) is writable by other users.
    """
    require_curve()
    root = Path(keys_dir)
    if not root.is_dir():
        raise CurveKeyError(f"{root} is not a directory (write one with `hicache keygen --dir {root}`)")
    server_public, server_secret = _read_key_file(root / SERVER_SECRET_FILE, secret=True)
    client_public, client_secret = _read_key_file(root / CLIENT_SECRET_FILE, secret=True)
    assert server_secret is not None and client_secret is not None
    engines = _admitted_keys(root / AUTHORIZED_DIR, "the client public keys (*.key) the engine socket admits")
    subscribers = (_admitted_keys(root / SUBSCRIBERS_DIR, "the subscriber keys the KV events sockets admit")
                   if (root / SUBSCRIBERS_DIR).exists() else frozenset())
    return CurveKeys(str(root), server_public, server_secret, client_public, client_secret, engines, subscribers)


def _admitted_keys(directory: Path, holds: str) -> frozenset[bytes]:
    """The public keys (``*.key``) in ``directory``, which only this user may write."""
    import zmq.auth

    if not directory.is_dir():
        raise CurveKeyError(f"{directory} is not a directory: it holds {holds}")
    st = directory.stat()
    if st.st_mode & 0o022 or st.st_uid != os.getuid():
        raise CurveKeyError(f"{directory} must be owned by this user and writable by no one else "
                            f"(mode {oct(st.st_mode & 0o777)}): anyone who can add a key there can connect")
    try:
        return frozenset(zmq.auth.load_certificates(directory))
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{directory}: cannot read the keys: {exc}") from None


def curve_server(socket: zmq.SyncSocket, keys: CurveKeys, domain: str) -> None:
    """Make ``socket`` a CURVE server with the daemon's key pair, authenticated in the ZAP
    ``domain`` (before it binds)."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    socket.setsockopt_string(zmq.ZAP_DOMAIN, domain)


def curve_client(socket: zmq.SyncSocket, keys: CurveClientKeys) -> None:
    """Make ``socket`` a CURVE client of the server whose public key ``keys`` holds (before it connects)."""
    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class _KeySet:
    """A ZAP credentials provider: admits the Z85 public keys it holds, nothing else."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class SecureContext(zmq.Context[zmq.Socket[bytes]]):
    """A context whose socket wrappers (``ipc.sockets``) use CURVE with ``curve_keys``.

    ``start`` runs a ZAP authenticator (``zmq.auth.thread.ThreadAuthenticator``) that admits,
    per ZAP domain, the keys ``CurveKeys.admitted`` lists and no other (a socket without a
    domain: none); ``term`` and ``destroy`` stop it first. ``engine_address``: the address
    whose bound socket is in ``ZAP_ENGINE``; every other socket the wrappers bind is in
    ``ZAP_INTERNAL``. Sockets made with ``ctx.socket`` directly (inproc pipes) are untouched.
    """

    curve_keys: CurveKeys | None = None
    engine_address: str | None = None
    _authenticator: Any = None

    def start(self, keys: CurveKeys, engine_address: str | None = None) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.curve_keys = keys
        self.engine_address = engine_address
        auth = ThreadAuthenticator(self, log=logging.getLogger("hicache.runtime.ipc.zap"))
        auth.start()
        for domain, admitted in keys.admitted().items():
            auth.configure_curve_callback(domain=domain, credentials_provider=_KeySet(admitted))
        self._authenticator = auth

    def domain_of(self, address: str) -> str:
        """The ZAP domain of a socket bound at ``address``."""
        return ZAP_ENGINE if address == self.engine_address else ZAP_INTERNAL

    def _stop_authenticator(self) -> None:
        auth, self._authenticator = self._authenticator, None
        if auth is not None:
            auth.stop()

    def term(self) -> None:
        self._stop_authenticator()
        super().term()

    def destroy(self, linger: int | None = None) -> None:
        self._stop_authenticator()
        super().destroy(linger)


def open_context(endpoints: Endpoints | None = None, *, keys: CurveKeys | None = None) -> zmq.SyncContext:
    """The ZeroMQ context of one process: a plain one, or, when ``keys`` is given or
    ``endpoints.curve_keys_dir`` is set, a ``SecureContext`` with its authenticator running
    (the keys are loaded from the directory here; CurveKeyError when they cannot be)."""
    if keys is None and endpoints is not None and endpoints.curve_keys_dir:
        keys = load_curve_keys(endpoints.curve_keys_dir)
    if keys is None:
        return zmq.Context()
    ctx = SecureContext()
    try:
        ctx.start(keys, _engine_address(endpoints))
    except BaseException:
        ctx.destroy(linger=0)
        raise
    return ctx


def _engine_address(endpoints: Endpoints | None) -> str | None:
    try:
        return None if endpoints is None else endpoints.address("engine")
    except ValueError:  # ipc endpoints without a directory: no sockets to bind at all
        return None
