"""The ``hicache`` command line.

Every subcommand lives in its own module exposing two functions:

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> int          # the process exit code

Those modules keep their module-level imports light (no torch, no zmq): heavy imports go
inside ``run`` so that ``hicache --help`` and ``hicache check-config`` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("hicache.cli.serve", "start the daemon (tokenizer, scheduler, cache controller)"),
    "check-config": ("hicache.cli.check_config", "validate a config file and print the resolved config"),
    "replay": ("hicache.cli.replay", "replay a request trace offline through the real tree and tier policies"),
    "advise": ("hicache.cli.advise", "tier sizes, policy and a config from a trace of the operator's own traffic"),
    "storage": ("hicache.cli.storage", "inspect, verify, clear or gc the configured L3 store"),
    "events": ("hicache.cli.events", "subscribe to a KV event publisher and print its events"),
    "keygen": ("hicache.cli.keygen", "write the CURVE key pairs that ipc.transport: tcp needs"),
    "version": ("hicache.cli.version", "print the version"),
}

BENCHMARKS: dict[str, tuple[str, str]] = {
    "codec": ("hicache.bench.codec", "wire codec and page hashing against raw msgpack / hashlib"),
    "tree": ("hicache.bench.tree", "radix tree operations on a seeded chat workload"),
    "index": ("hicache.bench.index", "the radix tree at millions of pages: heap per page, op times, gc pauses"),
    "storage": ("hicache.bench.storage", "L3 backends against raw redis-py / file I/O"),
    "transfer": ("hicache.bench.transfer", "L1<->L2 copies and backups through the controller"),
    "model": ("hicache.bench.model", "reference model prefill/decode against a KV page copy"),
    "serve": ("hicache.bench.serve", "drive a running daemon with realistic workloads"),
    "ttft": ("hicache.bench.ttft", "time to first token of a long prompt from each tier vs cold"),
    "engine": ("hicache.bench.engine", "vLLM with hicache beside it against vLLM alone"),
    "events": ("hicache.bench.events", "serving with KV events on against off, and the events' lag"),
    "soak": ("hicache.bench.soak", "mixed traffic with faults on a schedule, checked against a cold daemon"),
    "capacity": ("hicache.bench.capacity", "one engine-mode daemon under a node of simulated engines, to the knee"),
    "reserve": ("hicache.bench.reserve", "the engine-mode cache server's work per step: by context, and under a thrashing L2"),
}


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _add(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str, module: str, help_text: str) -> None:
    if not _available(module):
        return
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    mod = importlib.import_module(module)
    mod.add_arguments(parser)
    parser.set_defaults(_run=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache", description="Tiered KV-cache daemon for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text)
    bench = sub.add_parser(
        "bench",
        help="benchmarks, each against a reference measured in the same run",
        description="Benchmarks. Each prints a table of figures, each with its reference and ratio.",
    )
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        _add(bench_sub, name, module, help_text)

    def bench_help(_args: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(_run=bench_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
