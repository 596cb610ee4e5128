"""``hicache bench events``: what KV events cost serving, and how late they reach a router.

The same workload (``hicache bench serve``'s workload and load flags) runs against a daemon
started from ``--config`` with ``events.enabled`` false (the reference) and true, alternating
``--repeats`` times (off, on, off, on, ...) so that drift hits both alike. With events on, a
subscriber (vLLM's own ``KVEventBatch`` decoder when vLLM is installed, else hicache's)
follows the stream and records, per batch, its receive time minus the batch's ``ts`` (the
wall-clock time of the batch's oldest change in the tree): the lag from a tier's change to a
router's socket.

Reported: throughput with events on against off (requests/s; the median of the per-pair
ratios; goal >= 0.97); the daemon's own lag from a tier change to its batch on the socket
(its ``hicache_kv_event_lag_seconds`` histogram: the p50 and p99 are bucket bounds; goal:
p99 <= 10 ms); and the subscriber's lag from the change to its receipt, p50 / p99 / max,
over the batches that announce a page's arrival in L2 and over every batch (on a small host
this adds the subscriber's wait for a core); the events and batches seen. A batch dropped by the daemon's queue shows as a
sequence gap (counted). Exit codes as ``hicache bench serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hicache.bench.serve import UsageError, bench_once
from hicache.bench.serve import add_arguments as add_serve_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the daemon's YAML (its events section is overridden)")
    parser.add_argument("--repeats", type=int, default=3, help="runs with events off and on, alternating")
    add_serve_arguments(parser)


class LagMeter:
    """A subscriber in a process of its own (so that the load generator's work in this
    process cannot delay its reads): per batch, receive time minus ``ts``; sequence gaps
    counted. ``close`` stops it and fills in the figures."""

    def __init__(self, endpoint: str, out: Path) -> None:
        import multiprocessing as mp

        self._out = out
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        ready = ctx.Event()
        self._proc = ctx.Process(target=_follow, args=(endpoint, str(out), self._stop, ready), daemon=True)
        self._proc.start()
        if not ready.wait(60):
            raise RuntimeError("the event subscriber did not start")
        self.lags: list[float] = []
        self.l2_lags: list[float] = []  # batches with a page's arrival in L2 (BlockStored, CPU)
        self.events = 0
        self.gaps = 0
        self.daemon_lag: dict[float, float] = {}  # the daemon's lag histogram at the end of the run

    def close(self) -> None:
        import json

        self._stop.set()
        self._proc.join(30)
        got = json.loads(self._out.read_text())
        self.lags, self.l2_lags, self.events, self.gaps = got["lags"], got["l2_lags"], got["events"], got["gaps"]


def _follow(endpoint: str, out: str, stop: Any, ready: Any) -> None:
    """The subscriber process of ``LagMeter``."""
    import json

    import zmq

    decode = _decoder()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    ready.set()
    lags: list[float] = []
    l2_lags: list[float] = []
    events = gaps = 0
    expect: int | None = None
    while not stop.is_set():
        if not sub.poll(50):
            continue
        _topic, seq_frame, payload = sub.recv_multipart()
        now = time.time()
        ts, n, l2 = decode(payload)
        seq = int.from_bytes(seq_frame, "big")
        if expect is not None and seq > expect:
            gaps += seq - expect
        expect = seq + 1
        lags.append(now - ts)
        if l2:
            l2_lags.append(now - ts)
        events += n
    sub.close(0)
    ctx.term()
    Path(out).write_text(json.dumps({"lags": lags, "l2_lags": l2_lags, "events": events, "gaps": gaps}))


def _decoder() -> Any:
    """``payload -> (ts, number of events, whether a page arrived in L2)``, with vLLM's
    classes when vLLM is installed."""
    try:
        import msgspec
        from vllm.distributed.kv_events import BlockStored, KVEventBatch
    except ImportError:
        from hicache.kv_events import format as ours

        def decode_ours(payload: bytes) -> tuple[float, int, bool]:
            b = ours.decode_batch(payload)
            return b.ts, len(b.events), any(isinstance(e, ours.BlockStored) and e.medium == "CPU" for e in b.events)
        return decode_ours
    dec = msgspec.msgpack.Decoder(KVEventBatch)

    def decode_vllms(payload: bytes) -> tuple[float, int, bool]:
        b = dec.decode(payload)
        return b.ts, len(b.events), any(isinstance(e, BlockStored) and e.medium == "CPU" for e in b.events)
    return decode_vllms


def _one(args: argparse.Namespace, label: str, folder: Path, overrides: list[str], box: dict[str, Any],
         endpoint: str | None) -> tuple[dict[str, Any], LagMeter | None]:
    from hicache.bench.serve_lib.daemon import ManagedDaemon

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    overrides = [*overrides, f"cache.l3.file.dir={(folder / 'l3').resolve()}"]
    if endpoint is not None:
        overrides += ["events.enabled=true", f"events.endpoint={endpoint}"]
    else:
        overrides.append("events.enabled=false")
    meter = LagMeter(endpoint, folder / "lags.json") if endpoint is not None else None
    daemon = ManagedDaemon(args.config, overrides, log_path=folder / "daemon.log")
    try:
        daemon.start(args.start_timeout)
        summary = asyncio.run(bench_once(daemon.url, label, args, box))
        time.sleep(0.5)  # the last batches
        if meter is not None:
            meter.daemon_lag = _lag_histogram(daemon.url)
    finally:
        code = daemon.stop() if daemon.proc is not None else -1
        daemon.kill()
        if meter is not None:
            meter.close()
    if code != 0:
        raise RuntimeError(f"the {label} daemon exited with {code}; log {daemon.log_path}")
    if summary["requests"]["failed"]:
        raise RuntimeError(f"{summary['requests']['failed']} requests failed ({label}); log {daemon.log_path}")
    return summary, meter


def _lag_histogram(url: str) -> dict[float, float]:
    """The daemon's ``hicache_kv_event_lag_seconds`` buckets: upper bound -> cumulative count."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "hicache_kv_event_lag_seconds_bucket":
                out[float(sample.labels["le"])] = out.get(float(sample.labels["le"]), 0.0) + sample.value
    return out


def _bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the bucket that holds quantile ``q`` (a bound, not an estimate)."""
    total = buckets.get(float("inf"), 0.0)
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return float("nan")


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run(args: argparse.Namespace) -> int:
    from hicache.bench.report import Figure, print_table, write_json
    from hicache.config import ConfigError, load_config

    if args.repeats < 1:
        print("hicache bench events: --repeats must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("bench_events_results") / time.strftime("%Y%m%d-%H%M%S")
    try:
        cfg = load_config(args.config, args.set_both)
    except (ConfigError, OSError) as exc:
        print(f"hicache bench events: {exc}", file=sys.stderr)
        return 2
    if cfg.cache.l3.backend not in ("none", "file"):
        print("hicache bench events: use a config with no L3 or a file L3 (each run gets a fresh one)",
              file=sys.stderr)
        return 2
    box: dict[str, Any] = {}
    ratios: list[float] = []
    lags: list[float] = []
    l2_lags: list[float] = []
    daemon_lag: dict[float, float] = {}
    events = gaps = batches = 0
    try:
        for i in range(args.repeats):
            off, _ = _one(args, f"off-{i}", out / f"off-{i}", list(args.set_both), box, None)
            endpoint = f"ipc://{(out / f'events-{i}.sock').resolve()}"
            on, meter = _one(args, f"on-{i}", out / f"on-{i}", list(args.set_both), box, endpoint)
            assert meter is not None
            a, b = off["throughput"]["requests_per_s"], on["throughput"]["requests_per_s"]
            ratios.append(b / a)
            lags += meter.lags
            l2_lags += meter.l2_lags
            for bound, n in meter.daemon_lag.items():
                daemon_lag[bound] = daemon_lag.get(bound, 0.0) + n
            events += meter.events
            gaps += meter.gaps
            batches += len(meter.lags)
            print(f"repeat {i}: {a:.3g} req/s off, {b:.3g} req/s on ({b / a:.3f}x); "
                  f"{len(meter.lags)} batches, {meter.events} events, lag p99 "
                  f"{_quantile(meter.lags, 0.99) * 1000:.2f} ms", flush=True)
    except (UsageError, RuntimeError, OSError) as exc:
        print(f"hicache bench events: {exc}", file=sys.stderr)
        return 1
    if not l2_lags:
        print("hicache bench events: the subscriber saw no page arrive in L2", file=sys.stderr)
        return 1
    ms = [x * 1000 for x in lags]
    l2_ms = [x * 1000 for x in l2_lags]
    daemon_p99 = _bucket_quantile(daemon_lag, 0.99) * 1000
    figures = [
        Figure("throughput, events on", "x", statistics.median(ratios), "events off", 1.0, goal=0.97),
        Figure("lag p99, change to socket (bound)", "ms", daemon_p99, "goal 10 ms", 10.0, higher_is_better=False,
               goal=1.0),
    ]
    print_table(f"hicache bench events ({args.repeats} pairs, {batches} batches, {events} events, "
                f"{gaps} missed batches)", figures)
    print(f"daemon: change to socket, per batch: p50 <= {_bucket_quantile(daemon_lag, 0.5) * 1000:g} ms, "
          f"p99 <= {daemon_p99:g} ms (histogram bucket bounds, {daemon_lag.get(float('inf'), 0):.0f} batches)")
    print(f"subscriber: change to receipt, L2 arrivals ({len(l2_ms)} batches): p50 {_quantile(l2_ms, 0.5):.2f}, p99 "
          f"{_quantile(l2_ms, 0.99):.2f}, max {max(l2_ms):.2f}; every batch: p50 {_quantile(ms, 0.5):.2f}, "
          f"p99 {_quantile(ms, 0.99):.2f}, max {max(ms):.2f}; throughput ratios {', '.join(f'{r:.3f}' for r in ratios)}")
    extra = {"ratios": ratios,
             "lag_ms": {"p50": _quantile(ms, 0.5), "p99": _quantile(ms, 0.99), "max": max(ms)},
             "daemon_lag_ms_bound": {"p50": _bucket_quantile(daemon_lag, 0.5) * 1000, "p99": daemon_p99},
             "l2_lag_ms": {"p50": _quantile(l2_ms, 0.5), "p99": _quantile(l2_ms, 0.99), "max": max(l2_ms)},
             "batches": batches, "events": events, "missed_batches": gaps}
    write_json(str(out / "events.json"), "events", figures, extra=extra)
    if args.json:
        write_json(args.json, "events", figures, extra=extra)
    return 0
