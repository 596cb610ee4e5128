"""The spawn targets of the daemon's processes.

``multiprocessing`` pickles a target by its module and name, and pickling imports that
module in the launcher. These targets live here, in a module that imports nothing heavy,
and import their process's module only when they run (in the child): the launcher never
imports torch, and the three children import theirs side by side while it waits. A target
whose process stopped in order exits at once (``exit_after_orderly_stop``: no teardown of
torch's modules, which would hold up the launcher's stop of the next process); a failure
exits as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.runtime.proc import exit_after_orderly_stop

if TYPE_CHECKING:
    from controller.args import ControllerArgs
    from hicache.api_server.args import TokenizerArgs
    from hicache.scheduler.loop import SchedulerArgs


def run_controller(args: ControllerArgs) -> None:
    from controller.server import controller_main

    controller_main(args)
    exit_after_orderly_stop()


def run_scheduler(args: SchedulerArgs) -> None:
    from hicache.scheduler.process import scheduler_main

    scheduler_main(args)
    exit_after_orderly_stop()


def run_cache_server(args: SchedulerArgs) -> None:
    """Engine mode: the scheduler's place is taken by the cache server."""
    from hicache.cache_server.process import cache_server_main

    cache_server_main(args)
    exit_after_orderly_stop()


def run_tokenizer(args: TokenizerArgs) -> None:
    from hicache.api_server.process import tokenizer_main

    tokenizer_main(args)
    exit_after_orderly_stop()
