"""``hicache check-config [FILE] [--set key=value ...]``: validate and print the resolved config.

Exit 0 with the resolved config on stdout; exit 2 with every problem (its dotted key path
and the reason) on stderr. The checks are those ``hicache serve`` makes before it starts
anything: ``load_config``'s, then ``hicache.daemon.startup_checks.startup_problems`` (the model,
its layer pattern, the memory its pools need; the engines' model in engine mode).
"""

from __future__ import annotations

import argparse
import sys

from hicache.config import ConfigError, dump_yaml, load_config
from hicache.daemon.startup_checks import startup_problems


def add_config_arguments(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """The ``--config`` / ``--set`` pair every config-reading subcommand shares."""
    if positional:
        parser.add_argument("config", nargs="?", default=None,
                            help="YAML config file (default: $HICACHE_CONFIG, else built-in defaults)")
    else:
        parser.add_argument("--config", default=None,
                            help="YAML config file (default: $HICACHE_CONFIG, else built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key, e.g. --set cache.page_size=32 (repeatable)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, positional=True)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"hicache: {exc}", file=sys.stderr)
        return 2
    problems = startup_problems(cfg)
    if problems:
        print(f"hicache: {ConfigError(problems)}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_yaml(cfg))
    return 0
