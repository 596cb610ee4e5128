"""``hicache version``."""

from __future__ import annotations

import argparse
import platform

from hicache import __version__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="also print Python and torch versions")


def run(args: argparse.Namespace) -> int:
    print(f"hicache {__version__}")
    if args.verbose:
        import torch

        print(f"python {platform.python_version()}  torch {torch.__version__}")
    return 0
