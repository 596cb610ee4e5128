"""How the daemon's processes talk: typed ZeroMQ sockets, their addresses, CURVE
(docs/architecture.md §2).

==============  ===============================================================================
module          owns
==============  ===============================================================================
``addresses``   the private runtime directory (or a configured ``ipc.dir``) and each
                endpoint's address (``Endpoints``)
``curve``       the CURVE key directory, the ZAP domains (its docstring's table) and the
                context that authenticates them (``open_context``)
``sockets``     the socket wrappers, each bound to the message types its endpoint accepts
==============  ===============================================================================

The names below are the package's face; import them from ``hicache.runtime.ipc``.
"""

from __future__ import annotations

from hicache.runtime.ipc.addresses import (
    ENDPOINT_NAMES,
    Endpoints,
    FixedRuntimeDir,
    ensure_private,
    make_runtime_dir,
)
from hicache.runtime.ipc.curve import (
    AUTHORIZED_DIR,
    CLIENT_PUBLIC_FILE,
    CLIENT_SECRET_FILE,
    SERVER_PUBLIC_FILE,
    SERVER_SECRET_FILE,
    SUBSCRIBERS_DIR,
    ZAP_ENGINE,
    ZAP_EVENTS,
    ZAP_INTERNAL,
    CurveClientKeys,
    CurveKeyError,
    CurveKeys,
    SecureContext,
    curve_available,
    curve_client,
    curve_server,
    load_curve_client,
    load_curve_keys,
    open_context,
    require_curve,
)
from hicache.runtime.ipc.sockets import (
    DealerSocket,
    PeerProtocolError,
    PullSocket,
    PushSocket,
    ResettablePush,
    RouterSocket,
)

__all__ = [
    "AUTHORIZED_DIR",
    "CLIENT_PUBLIC_FILE",
    "CLIENT_SECRET_FILE",
    "CurveClientKeys",
    "CurveKeyError",
    "CurveKeys",
    "DealerSocket",
    "ENDPOINT_NAMES",
    "Endpoints",
    "FixedRuntimeDir",
    "PeerProtocolError",
    "PullSocket",
    "PushSocket",
    "ResettablePush",
    "RouterSocket",
    "SERVER_PUBLIC_FILE",
    "SERVER_SECRET_FILE",
    "SUBSCRIBERS_DIR",
    "SecureContext",
    "ZAP_ENGINE",
    "ZAP_EVENTS",
    "ZAP_INTERNAL",
    "curve_available",
    "curve_client",
    "curve_server",
    "ensure_private",
    "load_curve_client",
    "load_curve_keys",
    "make_runtime_dir",
    "open_context",
    "require_curve",
]
