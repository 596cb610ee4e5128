"""``hicache serve``: load the config, set up logging, and run the ``Launcher``
(``hicache.daemon.launcher``) until the daemon stops; the exit code is the launcher's."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hicache.cli.check_config import add_config_arguments

    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from hicache.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"hicache: {exc}", file=sys.stderr)
        return 2
    from hicache.runtime.logging_setup import setup_logging

    setup_logging("launcher", cfg.logging.level, cfg.logging.json)
    from hicache.daemon.launcher import Launcher

    launcher = Launcher(cfg)
    return launcher.serve()
