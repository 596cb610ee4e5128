"""Free loopback TCP ports for the servers that tests, benchmarks and ``local_redis`` start.

Contract of ``free_port``:

- the port (and each port of ``span``, and ``port + also`` when given) could be bound on
  ``127.0.0.1`` a moment ago; the caller's server binds it later, so a stranger may take it
  in between. Two rules keep that window harmless in practice:
- **outside the kernel's ephemeral range** (``/proc/sys/net/ipv4/ip_local_port_range``,
  32768-60999 by default) where possible: the source port of every outgoing connection
  (HTTP clients, Redis clients, vLLM) comes from that range, so a port picked there can be
  taken by any connect(); below it, only a process that binds on purpose can take it;
- **never handed out twice by one process**: several daemons configured before any of them
  binds get distinct ports (a port freed by the kernel may be given again at once).

Where the range below the ephemeral ports is too small, it falls back to ports the
kernel picks (still never repeated within this process).
"""

from __future__ import annotations

import random
import socket
import threading

__all__ = ["free_port"]

_LOWEST = 10000  # below this, ports are often well-known services'
_given: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    if not 0 < port <= 65535:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_pick() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port(*, span: int = 1, also: int | None = None) -> int:
    """A port P with P .. P+span-1 (and P+also, e.g. a Redis cluster bus port) free now.

    Raises ``RuntimeError`` if none is found after many tries.
    """
    if span < 1:
        raise ValueError(f"span must be >= 1, got {span}")
    reach = max(span - 1, also or 0)
    top = _ephemeral_low() - 1 - reach  # the highest P whose ports all stay below the range
    with _lock:
        for attempt in range(400):
            base = random.randint(_LOWEST, top) if top - _LOWEST >= 1000 and attempt < 300 else _kernel_pick()
            wanted = [*range(base, base + span), *([base + also] if also else [])]
            if any(p in _given for p in wanted) or not all(_bindable(p) for p in wanted):
                continue
            _given.update(wanted)
            return base
    raise RuntimeError(f"no free loopback port found (span {span}, also {also})")
