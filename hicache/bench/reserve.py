"""``hicache bench reserve``: what the cache server does per engine step, by context length
and under a thrashing L2 (docs/architecture.md, engine mode: "Reserve").

The engine-mode cache server (``CacheServer``) runs in this process, with no daemon around
it, so only its own work is measured (the message loop's decoding and the socket are a cost
per message, the same at any context):

- **CPU per generated block**: ``--requests`` running requests of each context in
  ``--contexts`` (tokens) decode ``--blocks`` blocks each; every step sends one ``Reserve``
  with each request's filled block (only its new tokens, by ``base``) and commits what it
  got (a step late, as a worker does). ``--node-tokens`` saves each context in pieces, a
  tree node each, as a long chat or decode leaves it (default: whole, one node). The figure
  is the server's CPU seconds per saved block (median of the steps; the contexts' steps run
  in turn, so drift hits them alike) against the first context's. Goal: flat (at most
  ``CPU_GOAL`` times the shortest context's).
- **Re-save under a thrashing L2**: one engine of ``--running`` requests with prompts from a
  Mooncake-format trace (the vendored conversation trace by default, as ``hicache bench
  capacity`` takes them: ``capacity_lib.traffic``), each looked up, computed in chunks of
  ``--chunk`` tokens a step, decoding ``--decode`` tokens and saving its full blocks as the
  connector does (from the pages it holds or saved, by ``base``), until ``--finish``
  requests finished; with L2 at each fraction in ``--l2`` of the running requests' tokens
  (about ``running`` times the mean prompt). Figures: pages reserved against pages of new
  content (those the engine computed: each save range from its ``start_page``), goal at
  most ``RESAVE_GOAL``; and the lookups' hit pages against their prompts' pages (the hit
  rate, no goal: compare it with a run of another version).

Writes the figures (``--json``) in the shape of the other benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import protos
from hicache.bench.capacity import default_trace
from hicache.bench.capacity_lib.traffic import DECODED_TOKENS_FROM, Prompts, load_prompts
from hicache.bench.report import Figure, print_table, write_json
from hicache.cache_server.leases import LeaseTable
from hicache.cache_server.server import CacheServer
from hicache.hashing import HashNamespace
from hicache.memory.allocator import PageAllocator
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.components import FullComponent

CPU_GOAL = 1.1
RESAVE_GOAL = 1.1
RUN = 1
RUNTIME = "f" * 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--contexts", default="1024,16384,65536", help="context lengths (tokens), comma-separated")
    parser.add_argument("--requests", type=int, default=16, help="running requests per context")
    parser.add_argument("--blocks", type=int, default=96, help="blocks each request decodes")
    parser.add_argument("--node-tokens", type=int, default=0,
                        help="save each context in pieces of this many tokens, a tree node each, as a long chat "
                             "or decode leaves it (default: the whole context at once, one node)")
    parser.add_argument("--running", type=int, default=32, help="running requests of the thrash run")
    parser.add_argument("--decode", type=int, default=512, help="tokens each request of the thrash run decodes")
    parser.add_argument("--chunk", type=int, default=8192, help="prompt tokens computed a step (chunked prefill)")
    parser.add_argument("--finish", type=int, default=300, help="requests finished per thrash run")
    parser.add_argument("--l2", default="0.25,0.5,1,4",
                        help="L2 sizes of the thrash runs, as fractions of the running requests' tokens")
    parser.add_argument("--trace", help="a Mooncake-format trace (default: the vendored conversation trace)")
    parser.add_argument("--max-prompt-tokens", type=int, default=16384)
    parser.add_argument("--parts", default="cpu,thrash", help="which parts to run: cpu, thrash")
    parser.add_argument("--json", help="write the figures here")


def make_server(page_size: int, l2_pages: int) -> tuple[CacheServer, int]:
    """A cache server over an index-only L2 of ``l2_pages`` pages, and a registered session."""
    geometry = protos.EngineKVGeometry("a" * 64, "bfloat16", page_size, 2, 2, 32, "LBHNC")
    comp = FullComponent(PageAllocator(0, "l1-full"), PageAllocator(l2_pages, "l2-full"))
    cache = UnifiedRadixCache([comp], page_size,
                              hasher=HashNamespace(geometry.model_identity, "bfloat16", page_size, "full"))
    pool = protos.L2PoolInfo("bench", "bench-full-l2-0", "/dev/shm", l2_pages, geometry.page_bytes)
    server = CacheServer(cache, None, geometry, pool, 3600.0, run=RUN, leases=LeaseTable(3600.0, gone=lambda _: False))
    reg = server.handle(protos.EngineRegister(1, "bench", 1, geometry, geometry.page_bytes, RUNTIME))
    assert isinstance(reg, protos.EngineRegistered), reg
    return server, reg.session


@dataclass
class Running:
    """One running request as the connector sees it."""

    rid: str
    tokens: array[int]
    prompt: int
    decode: int
    computed: int = 0
    saved: int = 0  # pages [0, saved) are in L2 or were asked for (the next range's start_page)
    known: int = 0  # tokens the server holds for it

    @property
    def done(self) -> bool:
        return self.computed >= self.prompt + self.decode


@dataclass
class Engine:
    """Saves through ``server`` as the connector does; counts the new content it asked for."""

    server: CacheServer
    session: int
    page: int
    req: int = 0
    new_pages: int = 0
    ranges: list[tuple[Running, protos.SaveRange, int]] = field(default_factory=list)
    copying: list[int] = field(default_factory=list)
    """Leases of the last step's reservations: committed after the next step's ``Reserve``
    (a worker copies a step's saves during its forward pass, while the scheduler plans the next)."""

    def ask(self, r: Running) -> None:
        """A save range of ``r``'s filled blocks past ``saved``, if any."""
        full = r.computed // self.page
        if full <= r.saved:
            return
        end = full * self.page
        base = min(r.known, end)
        self.ranges.append((r, protos.SaveRange(r.rid, protos.pack_tokens(r.tokens[base:end]), r.saved, "", base),
                            end))
        self.new_pages += full - r.saved
        r.saved = full

    def reserve(self) -> None:
        """One ``Reserve`` for the ranges asked; then the last step's reservations are committed."""
        done, self.copying = self.copying, []
        if self.ranges:
            self.req += 1
            ans = self.server.handle(protos.Reserve(self.req, self.session, RUN, [x[1] for x in self.ranges]))
            assert isinstance(ans, protos.ReserveResult), ans
            for (r, _, end), got in zip(self.ranges, ans.items, strict=True):
                assert not got.code, got
                r.known = end
                if got.lease:
                    self.copying.append(got.lease)
            self.ranges = []
        for lease in done:
            self.server.handle(protos.Commit(self.session, RUN, lease, True))


def cpu_per_block(page: int, contexts: list[int], requests: int, blocks: int, node_tokens: int = 0
                  ) -> dict[int, float]:
    """Median CPU seconds of the server per decoded block, per context length (each context
    saved in pieces of ``node_tokens``, or whole)."""
    engines: dict[int, tuple[Engine, list[Running]]] = {}
    for ctx in contexts:
        server, session = make_server(page, requests * (ctx // page + blocks + 2))
        eng = Engine(server, session, page)
        reqs = []
        for i in range(requests):
            first = (len(engines) * requests + i) * 2**22  # distinct prompts
            tokens = array("I", range(first, first + ctx))
            tokens.extend(DECODED_TOKENS_FROM + first + j for j in range(blocks * page))
            reqs.append(Running(f"c{ctx}-{i}", tokens, ctx, blocks * page))
        piece = node_tokens // page * page or ctx
        while any(r.computed < ctx for r in reqs):  # the contexts, not measured
            for r in reqs:
                r.computed = min(ctx, r.computed + piece)
                eng.ask(r)
            eng.reserve()
        eng.reserve()
        engines[ctx] = (eng, reqs)
    samples: dict[int, list[float]] = {ctx: [] for ctx in contexts}
    for _ in range(blocks):
        for ctx in contexts:
            eng, reqs = engines[ctx]
            t0 = time.process_time()
            for r in reqs:
                r.computed += page
                eng.ask(r)
            eng.reserve()
            samples[ctx].append((time.process_time() - t0) / len(reqs))
    return {ctx: statistics.median(s) for ctx, s in samples.items()}


def thrash(page: int, prompts: Prompts, running: int, decode: int, chunk: int, finish: int,
           l2_pages: int) -> dict[str, float]:
    """One engine's requests over an L2 of ``l2_pages`` pages: pages reserved, new content,
    hit and prompt pages (see the module docstring)."""
    server, session = make_server(page, l2_pages)
    eng = Engine(server, session, page)
    prompts.next_index = 0
    serial = finished = hit_pages = prompt_pages = 0
    live: list[Running] = []
    while finished < finish:
        while len(live) < running:
            serial += 1
            prompt = prompts.take()
            tokens = array("I", prompt)
            tokens.extend(DECODED_TOKENS_FROM + serial * 4096 + j for j in range(decode))
            r = Running(f"r{serial}", tokens, len(prompt), decode)
            usable = (len(prompt) - 1) // page * page
            if usable > 0:
                eng.req += 1
                ans = server.handle(protos.Lookup(eng.req, session, RUN, r.rid, protos.pack_tokens(prompt[:usable]), ""))
                assert isinstance(ans, protos.LookupResult), ans
                r.known = usable
                if ans.lease:
                    server.handle(protos.Release(session, RUN, ans.lease, len(ans.host_pages)))
                r.computed = len(ans.host_pages) * page
                r.saved = len(ans.host_pages)
                hit_pages += len(ans.host_pages)
                prompt_pages += usable // page
            live.append(r)
        budget = chunk
        for r in live:  # a decode token each, then prompt chunks within the budget
            if r.computed >= r.prompt:
                r.computed += 1
                budget -= 1
        for r in live:
            if budget <= 0:
                break
            if r.computed < r.prompt:
                n = min(budget, r.prompt - r.computed)
                r.computed += n
                budget -= n
        for r in live:
            eng.ask(r)
        eng.reserve()
        for r in [r for r in live if r.done]:
            server.handle(protos.Finished(session, RUN, r.rid))
            live.remove(r)
            finished += 1
    return {"reserved_pages": server.counters.reserved_pages, "new_pages": eng.new_pages,
            "hit_pages": hit_pages, "prompt_pages": prompt_pages,
            "refused_pages": getattr(server.counters, "resave_refused_pages", 0)}


def run(args: argparse.Namespace) -> int:
    page = args.page_size
    figures: list[Figure] = []
    extra: dict[str, Any] = {}
    parts = set(args.parts.split(","))
    if "cpu" in parts:
        contexts = [int(x) for x in args.contexts.split(",")]
        cpu = cpu_per_block(page, contexts, args.requests, args.blocks, args.node_tokens)
        ref = contexts[0]
        for ctx in contexts[1:]:
            figures.append(Figure(f"server CPU per block, {ctx} tokens", "us", cpu[ctx] * 1e6,
                                  f"{ref} tokens", cpu[ref] * 1e6, higher_is_better=False, goal=CPU_GOAL))
        extra["cpu_per_block_us"] = {str(c): v * 1e6 for c, v in cpu.items()}
        extra["node_tokens"] = args.node_tokens
    if "thrash" in parts:
        trace = args.trace or default_trace()
        if trace is None:
            raise SystemExit("no trace: pass --trace (a Mooncake-format trace)")
        prompts = load_prompts(trace, 0, 1, args.max_prompt_tokens)
        mean_prompt = statistics.fmean(len(p) for p in prompts.prompts)
        running_pages = int(args.running * (mean_prompt + args.decode) / page)
        extra["thrash"] = {}
        for frac in (float(x) for x in args.l2.split(",")):
            got = thrash(page, prompts, args.running, args.decode, args.chunk, args.finish,
                         max(1, int(running_pages * frac)))
            extra["thrash"][f"{frac:g}"] = got
            figures.append(Figure(f"pages reserved, L2 {frac:g}x running", "pages", got["reserved_pages"],
                                  "new content", got["new_pages"], higher_is_better=False, goal=RESAVE_GOAL))
            figures.append(Figure(f"lookup hit pages, L2 {frac:g}x running", "pages", got["hit_pages"],
                                  "prompt pages", got["prompt_pages"]))
        extra["running_pages"] = running_pages
    print_table("hicache bench reserve: the cache server's work per step", figures)
    if args.json:
        write_json(args.json, "reserve", figures, extra)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
