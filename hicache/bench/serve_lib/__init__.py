"""The pieces of ``hicache bench serve``: workloads, load generation, the HTTP client,
results, plots and daemons started for ``--compare``.

``workloads``  what to send: multi-turn chat, generated shared prefix, long-document QA,
               Mooncake-format traces (pure data, seeded, no I/O but reading a trace)
``client``     the async HTTP client: streaming ``/generate`` with TTFT / inter-token timing
``driver``     when to send it: closed loop (N clients), open loop (Poisson rate), trace times
``prom``       ``/metrics`` snapshots and their deltas (per-tier cached tokens)
``results``    percentiles, throughput, per-tier hits, the JSON document and Markdown summary
``plots``      TTFT CDF and per-tier hit tokens over time (matplotlib, Agg)
``daemon``     a ``hicache serve`` subprocess on a free port, started and stopped in order

Nothing here is imported by ``hicache.bench.serve`` at module level, so ``hicache --help``
stays fast.
"""
