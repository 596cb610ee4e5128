"""``hicache check-config [FILE] [--set key=value ...]``: validate and print the resolved config.

Exit 0 with the resolved config on stdout; exit 2 with every problem (its dotted key path
and the reason) on stderr. The checks are those ``hicache serve`` makes before it starts
anything: ``load_config``'s, then ``hicache.daemon.startup_checks.startup_problems`` (the model,
its layer pattern, the memory its pools need; the engines' model in engine mode).

Engine mode, on a config that passes: the block size vLLM will run ``engine.model`` with
(``block_size_advice``, from vLLM's own code where vLLM imports) goes to stderr and, where
it is not ``cache.page_size``, the ``cache.page_size`` and ``cache.l2.tokens`` to set and the
engines' ``--block-size``. The daemon starts on such a config (it refuses the engines when
they register), so the exit code stays 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache.config import ConfigError, HicacheConfig, dump_yaml, load_config
from hicache.daemon.startup_checks import startup_problems

if TYPE_CHECKING:
    from hicache.connectors.vllm.block_size import BlockChoice


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


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, positional=True)
    parser.add_argument("--engine-block-size", type=_positive, default=None, metavar="N",
                        help="engine mode: the --block-size the vLLM engines are started with "
                             "(default: assumed to be cache.page_size)")
    parser.add_argument("--no-block-check", action="store_true",
                        help="engine mode: do not ask vLLM which block size it runs engine.model with "
                             "(that check imports vLLM, which takes seconds)")


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
    if cfg.engine.kind == "vllm" and not getattr(args, "no_block_check", False):
        for line in block_size_advice(cfg, getattr(args, "engine_block_size", None)):
            print(line, file=sys.stderr)
    return 0


@dataclass(frozen=True)
class BlockAdvice:
    """What ``check-config`` says of the engines' block: vLLM runs ``engine.model`` with
    ``block_size`` tokens when started with ``--block-size asked`` (``default`` without one).
    ``page_size`` and ``l2_tokens``: what to set where ``block_size`` is not
    ``cache.page_size``; ``start_with``: the engines' ``--block-size`` then."""

    asked: int
    block_size: int
    default: int
    assumed: str
    unsupported: str | None = None
    page_size: int | None = None
    l2_tokens: int | None = None
    start_with: int | None = None

    def lines(self, cfg: HicacheConfig) -> list[str]:
        """The lines printed (stderr), the first ``hicache: engine block size: N ...``."""
        out = [f"hicache: engine block size: {self.block_size} (vLLM runs engine.model with "
               f"{self.block_size}-token blocks when started with --block-size {self.asked}; "
               f"{self.default} without --block-size)",
               f"  assumed: {self.assumed}"]
        if self.unsupported:
            out.append(f"  {self.unsupported}")
        if self.page_size is None:
            out.append(f"  cache.page_size: {cfg.cache.page_size} matches it")
            return out
        if self.unsupported is None:
            out.append(f"  cache.page_size is {cfg.cache.page_size}: the daemon would refuse these engines "
                       f"(block_size: daemon {cfg.cache.page_size}, engine {self.block_size}); set")
        else:
            out.append("  set")
        out += [f"    cache.page_size: {self.page_size}",
                f"    cache.l2.tokens: {self.l2_tokens}  # a multiple of {self.page_size}",
                f"  and start the engines with --block-size {self.start_with}"]
        return out


def block_size_advice(cfg: HicacheConfig, engine_block_size: int | None = None) -> list[str]:
    """Engine mode: the lines saying which block vLLM runs ``engine.model`` with and, when
    it is not ``cache.page_size``, what to set (``BlockAdvice``); one line saying why not
    where vLLM does not import or cannot size the model. Starts no engine, reads no weights;
    vLLM's log goes to stderr."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the resolved config only
        try:
            from hicache.connectors.vllm import block_size as vbs
        except Exception as exc:  # any failure to import: vLLM is not usable here
            return [f"hicache: vLLM does not import here ({type(exc).__name__}: {exc}); the block size "
                    f"vLLM runs engine.model with is not checked: cache.page_size must be that block"]
        try:
            dtype = vbs.engine_dtype(str(cfg.engine.model), cfg.engine.kv_dtype)
            return advise(cfg, engine_block_size, dtype, vbs.vllm_block_size, vbs.supported_near).lines(cfg)
        except vbs.BlockSizeError as exc:
            return [f"hicache: vLLM cannot size engine.model's blocks here ({exc}); the block size is not checked"]


def advise(cfg: HicacheConfig, engine_block_size: int | None, dtype: str, pick: Any, near: Any) -> BlockAdvice:
    """``BlockAdvice`` for ``cfg`` and engines whose KV is ``dtype``: ``pick(model, dtype,
    block_size)`` is vLLM's choice (``vllm_block_size``), ``near(choice, tokens)`` the
    smallest block of at least ``tokens`` its backend takes (``supported_near``)."""
    model = str(cfg.engine.model)
    asked = engine_block_size or cfg.cache.page_size
    choice: BlockChoice = pick(model, dtype, asked)
    default: BlockChoice = pick(model, dtype, None)
    where = ("(check-config --engine-block-size)" if engine_block_size
             else "(cache.page_size; --engine-block-size N for another)")
    assumed = (f"--block-size {asked} {where}, --dtype {dtype}, prefix caching on, one rank, "
               f"this host's {choice.backend} attention backend")
    unsupported = None
    target = choice
    if not choice.supported:
        needs = " or ".join([f"a multiple of {b}" for b in choice.multiples_of] + [str(s) for s in choice.exact_sizes])
        unsupported = (f"vLLM's {choice.backend} attention backend needs the block size to be {needs}, not "
                       f"{choice.block_size}: an engine started with --block-size {asked} fails")
        fixed = near(choice, asked)
        target = pick(model, dtype, fixed) if fixed is not None else default
    if target.block_size == cfg.cache.page_size and choice.supported:
        return BlockAdvice(asked, choice.block_size, default.block_size, assumed)
    page = target.block_size
    l2 = max(page, cfg.cache.l2.tokens // page * page)
    return BlockAdvice(asked, choice.block_size, default.block_size, assumed, unsupported, page, l2, page)
