"""Child-process hygiene shared by the daemon's processes.

``die_with_parent`` asks Linux to send SIGTERM to this process when its parent (the
launcher) dies, so a killed launcher never leaves orphans behind; each process then runs
its normal orderly stop. Elsewhere it is a no-op (the launcher's own cleanup still runs on
every stop it gets to handle).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Deliver ``sig`` to this process when its parent exits. True if the kernel accepted it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            return False
    except OSError:
        return False
    # The parent may have died before prctl took effect.
    if os.getppid() == 1:
        os.kill(os.getpid(), sig)
    return True
