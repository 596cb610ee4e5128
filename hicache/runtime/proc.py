"""Child-process hygiene shared by the daemon's processes.

``die_with_parent`` asks Linux to send SIGTERM to this process when its parent (the
launcher) dies, so a killed launcher never leaves orphans behind; each process then runs
its normal orderly stop. Elsewhere it is a no-op (the launcher's own cleanup still runs on
every stop it gets to handle).

``exit_after_orderly_stop`` ends a child whose orderly stop is done without the
interpreter's teardown of its modules: with torch loaded that teardown costs about a second
of CPU, and the launcher stops its processes one after another.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

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


def exit_after_orderly_stop(code: int = 0) -> NoReturn:
    """Exit now with ``code``, once the process has stopped in order: what a normal exit does
    that matters still happens (non-daemon threads are joined, ``atexit`` handlers run, logs
    and standard streams are flushed); the destruction of every module's objects, which
    changes nothing outside the process, is skipped."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush
            pass
    os._exit(code)
