"""The ``lookup`` part of ``bench engine``: the connector's side of a lookup whose pages L2
holds, at several prompt lengths. No vLLM runs in this part.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import protos
from hicache.bench.engine_lib.harness import Bench, median, percentile, round_up
from hicache.bench.report import Figure

LOOKUP_GOAL_MS = 1.0
"""The connector-side time a lookup of the longest prompt should take at most."""


def _reserve_msg(items: list[protos.SaveRange]) -> Callable[[int, protos.EngineRegistered], protos.Reserve]:
    def make(req: int, reg: protos.EngineRegistered) -> protos.Reserve:
        return protos.Reserve(req, reg.session, reg.run, items)

    return make


def _lookup_msg(rid: str, ids: bytes, base: int) -> Callable[[int, protos.EngineRegistered], protos.Lookup]:
    def make(req: int, reg: protos.EngineRegistered) -> protos.Lookup:
        return protos.Lookup(req, reg.session, reg.run, rid, ids, "", True, base)

    return make


def run_lookup(b: Bench, *, lengths: list[int], repeats: int) -> tuple[list[Figure], dict[str, Any]]:
    """The connector's side of a lookup whose pages L2 holds, at several prompt lengths.

    A session of the daemon's own protocol client (``CacheSession``, what the connector
    uses) saves each prompt's pages (reserved and committed: a lookup reads no page bytes),
    then times, as the connector does them: a request's first ask (its prompt packed once,
    ``PackedTokens``, and sent up to its last full page; the daemon's match and lease; the
    answer decoded) and an ask again of a waiting request (``base``: no token sent), each
    followed by the lease's release (not timed). Medians (and the longest's p99) over
    ``repeats``; the reference is the shortest length, in the same run; the goal for the
    longest is 1 ms."""
    from hicache.cache_server.geometry import geometry_from_config, sliding_window_from_config
    from hicache.config import load_config
    from hicache.connectors.engine_client import CacheSession
    from hicache.connectors.token_pack import PackedTokens
    from hicache.connectors.vllm import engine_address

    longest = max(lengths)
    daemon = b.daemon("lookup-hicache", round_up(sum(lengths) + 4096, b.block_size))
    rows: list[dict[str, Any]] = []
    try:
        cfg = load_config(str(daemon.config))
        g = geometry_from_config(cfg)
        register = protos.EngineRegister(0, "bench-lookup", os.getpid(), g, g.page_bytes, "b" * 64,
                                         window_tokens=sliding_window_from_config(cfg))
        session = CacheSession(engine_address(cfg), 5000, register)
        try:
            for n in sorted(lengths):
                tokens = b.prompts(1, n + 1, seed=n)[0]
                usable = n // b.block_size * b.block_size
                saved = session.call(_reserve_msg([protos.SaveRange(f"save-{n}", protos.pack_tokens(tokens[:usable]),
                                                                     0)]))
                assert isinstance(saved, protos.ReserveResult) and saved.items[0].lease, saved
                reg = session.registered
                assert reg is not None
                session.send(protos.Commit(reg.session, reg.run, saved.items[0].lease, True))
                row: dict[str, Any] = {"tokens": n, "first_s": [], "again_s": [], "hit_pages": 0}
                for r in range(repeats):
                    rid = f"ask-{n}-{r}"
                    packed = PackedTokens()  # the request's, kept from its first ask on
                    for case, base in (("first_s", 0), ("again_s", usable)):
                        t0 = time.perf_counter()
                        packed.extend(tokens, len(tokens))
                        ids = packed.span(base, usable)
                        ans = session.call(_lookup_msg(rid, ids, base))
                        row[case].append(time.perf_counter() - t0)
                        assert isinstance(ans, protos.LookupResult) and not ans.pending, ans
                        row["hit_pages"] = len(ans.host_pages)
                        session.send(protos.Release(reg.session, reg.run, ans.lease, 0))
                    session.send(protos.Finished(reg.session, reg.run, rid))
                rows.append(row)
                b.progress(f"lookup {n:6d} tokens: first ask {median(row['first_s']) * 1e3:.3f} ms, ask again "
                           f"{median(row['again_s']) * 1e3:.3f} ms, hit {row['hit_pages']} pages")
        finally:
            session.close()
    finally:
        daemon.stop()
    ref = rows[0]
    figures = []
    for row in rows[1:]:
        for case, label in (("first_s", "first ask"), ("again_s", "ask again")):
            figures.append(Figure(f"lookup: {label}, {row['tokens']}-token L2 hit", "ms", median(row[case]) * 1e3,
                                  f"{ref['tokens']}-token L2 hit", median(ref[case]) * 1e3, higher_is_better=False))
    top = next(r for r in rows if r["tokens"] == longest)
    return figures, {"rows": rows, "repeats": repeats, "longest": longest,
                     "longest_first_ask_ms": median(top["first_s"]) * 1e3,
                     "longest_first_ask_p99_ms": percentile(top["first_s"], 0.99) * 1e3,
                     "longest_ask_again_ms": median(top["again_s"]) * 1e3, "goal_ms": LOOKUP_GOAL_MS}
