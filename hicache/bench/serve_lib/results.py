"""Results of ``hicache bench serve``: the summary document, its Markdown form, comparisons.

``summarize`` turns the request records of one run into one JSON-ready dict (``FIELDS``
lists its top-level keys, ``LATENCY_KEYS`` / ``STAT_KEYS`` the latency block):

- ``latency``: ``ttft_s``, ``itl_s``, ``e2e_s``, each ``{count, mean, p50, p90, p99, max}``
  over successful requests (None values when there are none);
- ``server_timings_ms``: the scheduler's TTFT breakdown per request (``queue`` waiting for
  admission, ``load`` bringing cached KV back to L1, ``prefill`` computing the rest), each
  ``{count, mean, p50, p90, p99, max}`` over the requests whose response carried it;
- ``throughput``: requests/s, input, output and total tokens/s over the run's wall time;
- ``cache.responses``: prompt tokens per tier summed from the responses' ``meta_info``
  (``device`` L1, ``host`` L2, ``storage`` L3, ``cached`` their sum, ``prompt``,
  ``computed`` = prompt - cached, ``hit_rate``); ``cache.metrics``: the same from the
  ``/metrics`` deltas (None when metrics are off); ``cache.metrics_match``: whether both agree
  per tier (None without metrics);
- ``timeline``: per-tier prompt tokens by completion time, in ``bin_s`` bins;
- ``records``: every request (``RequestRecord.to_json``).

``compare_figures`` sets a run B against a run A (the reference) as ``report.Figure``s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.bench.report import Figure
from hicache.bench.serve_lib.client import RequestRecord
from hicache.bench.serve_lib.driver import LoadSpec, RunRecords
from hicache.bench.serve_lib.prom import TIERS, CounterSnapshot
from hicache.bench.serve_lib.workloads import Workload

__all__ = ["FIELDS", "LATENCY_KEYS", "STAT_KEYS", "compare_figures", "compare_markdown", "markdown",
           "stats", "summarize"]

FIELDS = ("label", "url", "model", "workload", "load", "duration_s", "requests", "latency",
          "server_timings_ms", "throughput", "tokens", "cache", "timeline", "records")
LATENCY_KEYS = ("ttft_s", "itl_s", "e2e_s")
STAT_KEYS = ("count", "mean", "p50", "p90", "p99", "max")


def stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean, p50/p90/p99 (linear interpolation) and max; None values when empty."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return {"count": int(a.size), "mean": float(a.mean()), "p50": p50, "p90": p90, "p99": p99,
            "max": float(a.max())}


def _tiers(device: int, host: int, storage: int, prompt: int) -> dict[str, Any]:
    cached = device + host + storage
    return {"device": device, "host": host, "storage": storage, "cached": cached, "prompt": prompt,
            "computed": prompt - cached, "hit_rate": cached / prompt if prompt else None}


def _timeline(ok: list[RequestRecord], duration: float, bins: int | None = None) -> dict[str, Any]:
    n = bins or min(40, max(1, len(ok) // 2))
    width = duration / n if duration > 0 else 1.0
    rows = {k: [0] * n for k in (*TIERS, "computed")}
    for r in ok:
        i = min(n - 1, int((r.end_s or 0.0) / width))
        rows["device"][i] += r.cached_device
        rows["host"][i] += r.cached_host
        rows["storage"][i] += r.cached_storage
        rows["computed"][i] += r.prompt_tokens - r.cached_tokens
    return {"bin_s": width, "t": [round((i + 1) * width, 6) for i in range(n)], **rows}


def summarize(run: RunRecords, workload: Workload, load: LoadSpec, *, label: str, url: str,
              model: dict[str, Any], metrics_delta: CounterSnapshot | None) -> dict[str, Any]:
    """The summary document of one run (see the module docstring for its fields)."""
    ok = [r for r in run.records if r.ok]
    failed = [r for r in run.records if not r.ok]
    dur = run.duration_s
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    responses = _tiers(sum(r.cached_device for r in ok), sum(r.cached_host for r in ok),
                       sum(r.cached_storage for r in ok), prompt)
    per_request_cached = sum(r.cached_tokens for r in ok)
    metrics: dict[str, Any] | None = None
    match: bool | None = None
    if metrics_delta is not None:
        m = metrics_delta.to_json()
        metrics = _tiers(m["device"], m["host"], m["storage"], m["prompt"])
        metrics["generation"] = m["generation"]
        match = all(metrics[t] == responses[t] for t in TIERS)
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown")[:200]
        errors[key] = errors.get(key, 0) + 1
    return {
        "label": label,
        "url": url,
        "model": model,
        "workload": {"name": workload.name, "requests": workload.requests,
                     "conversations": len(workload.conversations),
                     "working_set_tokens": workload.working_set_tokens, **workload.params},
        "load": load.to_json(),
        "duration_s": dur,
        "requests": {"planned": workload.requests, "sent": len(run.records), "completed": len(ok),
                     "failed": len(failed), "skipped": run.skipped, "errors": errors},
        "latency": {
            "ttft_s": stats([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_s": stats([x for r in ok for x in r.itl_s]),
            "e2e_s": stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        },
        "server_timings_ms": {
            "queue": stats([r.queue_ms for r in ok if r.queue_ms is not None]),
            "load": stats([r.load_ms for r in ok if r.load_ms is not None]),
            "prefill": stats([r.prefill_ms for r in ok if r.prefill_ms is not None]),
        },
        "throughput": {
            "requests_per_s": len(ok) / dur if dur > 0 else None,
            "input_tokens_per_s": prompt / dur if dur > 0 else None,
            "output_tokens_per_s": completion / dur if dur > 0 else None,
            "total_tokens_per_s": (prompt + completion) / dur if dur > 0 else None,
        },
        "tokens": {"prompt": prompt, "completion": completion, "cached_per_request_sum": per_request_cached},
        "cache": {"responses": responses, "metrics": metrics, "metrics_match": match},
        "timeline": _timeline(ok, dur),
        "records": [r.to_json() for r in sorted(run.records, key=lambda r: r.start_s)],
    }


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:,.1f}"


def _num(x: float | int | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def _sig(x: float) -> str:
    """Three significant digits, without exponents for the sizes a benchmark prints."""
    if math.isnan(x):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def markdown(s: dict[str, Any], files: dict[str, str] | None = None) -> str:
    """A Markdown summary of one run's document."""
    w, req, lat, tp, c = s["workload"], s["requests"], s["latency"], s["throughput"], s["cache"]
    lines = [f"# hicache bench serve: {s['label']}", "",
             f"- daemon: `{s['url']}`, model `{s['model'].get('name')}` (context {s['model'].get('max_context')})",
             f"- workload: **{w['name']}**, {w['requests']} requests in {w['conversations']} conversations, "
             f"working set about {w['working_set_tokens']:,} tokens",
             f"- load: {s['load']['mode']}" + "".join(f", {k} {v}" for k, v in s["load"].items()
                                                       if k != "mode" and v is not None),
             f"- {req['completed']} completed, {req['failed']} failed, {req['skipped']} skipped, "
             f"in {s['duration_s']:.1f} s", "",
             "| latency (ms) | mean | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    for name, key in (("TTFT", "ttft_s"), ("inter-token", "itl_s"), ("end-to-end", "e2e_s")):
        st = lat[key]
        lines.append(f"| {name} | {_ms(st['mean'])} | {_ms(st['p50'])} | {_ms(st['p90'])} | "
                     f"{_ms(st['p99'])} | {_ms(st['max'])} |")
    timings = s["server_timings_ms"]
    lines += ["", "| scheduler's TTFT breakdown (ms) | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    for name in ("queue", "load", "prefill"):
        st = timings[name]
        lines.append(f"| {name} | {_num(st['mean'], 1)} | {_num(st['p50'], 1)} | {_num(st['p90'], 1)} | "
                     f"{_num(st['p99'], 1)} |")
    lines += ["", "| throughput | |", "|---|---|",
              f"| requests/s | {_num(tp['requests_per_s'], 3)} |",
              f"| input tokens/s | {_num(tp['input_tokens_per_s'], 1)} |",
              f"| output tokens/s | {_num(tp['output_tokens_per_s'], 1)} |",
              f"| total tokens/s | {_num(tp['total_tokens_per_s'], 1)} |", "",
              "| prompt tokens | L1 device | L2 host | L3 storage | cached | computed | prompt | hit rate |",
              "|---|---|---|---|---|---|---|---|"]
    for name, t in (("responses", c["responses"]), ("/metrics delta", c["metrics"])):
        if t is None:
            lines.append(f"| {name} | – | – | – | – | – | – | – |")
            continue
        rate = "–" if t["hit_rate"] is None else f"{t['hit_rate']:.1%}"
        lines.append(f"| {name} | {t['device']:,} | {t['host']:,} | {t['storage']:,} | {t['cached']:,} | "
                     f"{t['computed']:,} | {t['prompt']:,} | {rate} |")
    if c["metrics_match"] is not None:
        lines += ["", "Responses and /metrics deltas " + ("agree." if c["metrics_match"] else
                                                          "DISAGREE (was something else using the daemon?)")]
    if req["errors"]:
        lines += ["", "Errors:", *(f"- {n} x {e}" for e, n in req["errors"].items())]
    if files:
        lines += ["", "Files:", *(f"- {k}: `{v}`" for k, v in files.items())]
    return "\n".join(lines) + "\n"


def compare_figures(a: dict[str, Any], b: dict[str, Any]) -> list[Figure]:
    """Run B against run A (the reference): TTFT p50 (goal B/A <= 0.4), throughput in
    requests/s (goal >= 2), and, without goals, TTFT p90, end-to-end p50, output tokens/s and
    the p50 of the scheduler's queue / load / prefill times (where both runs report them)."""
    def lat(s: dict[str, Any], key: str, q: str) -> float:
        v = s["latency"][key][q]
        return float("nan") if v is None else v * 1000

    def thr(s: dict[str, Any], key: str) -> float:
        v = s["throughput"][key]
        return float("nan") if v is None else v

    def timing(s: dict[str, Any], name: str) -> float | None:
        p50: float | None = (s.get("server_timings_ms") or {}).get(name, {}).get("p50")
        return p50

    la, lb = a["label"], b["label"]
    breakdown = []
    for name in ("queue", "load", "prefill"):
        ta, tb = timing(a, name), timing(b, name)
        if ta and tb is not None:  # a reference of 0 ms (no load-back in L1-only) has no ratio
            breakdown.append(Figure(f"{name} p50 {lb}", "ms", tb, la, ta, higher_is_better=False))
    return [
        Figure(f"TTFT p50 {lb}", "ms", lat(b, "ttft_s", "p50"), la, lat(a, "ttft_s", "p50"),
               higher_is_better=False, goal=0.4),
        Figure(f"throughput {lb}", "req/s", thr(b, "requests_per_s"), la, thr(a, "requests_per_s"), goal=2.0),
        Figure(f"TTFT p90 {lb}", "ms", lat(b, "ttft_s", "p90"), la, lat(a, "ttft_s", "p90"),
               higher_is_better=False),
        Figure(f"e2e p50 {lb}", "ms", lat(b, "e2e_s", "p50"), la, lat(a, "e2e_s", "p50"), higher_is_better=False),
        Figure(f"output tokens/s {lb}", "tok/s", thr(b, "output_tokens_per_s"), la, thr(a, "output_tokens_per_s")),
        *breakdown,
    ]


def compare_markdown(a: dict[str, Any], b: dict[str, Any], figures: Sequence[Figure],
                     files: dict[str, str] | None = None) -> str:
    """A Markdown table of the comparison, with both runs' cache figures."""
    lines = [f"# hicache bench serve --compare: {b['label']} vs {a['label']}", "",
             f"Workload **{a['workload']['name']}**, {a['workload']['requests']} requests, "
             f"working set about {a['workload']['working_set_tokens']:,} tokens; load {a['load']['mode']}.", "",
             f"| figure | {b['label']} | {a['label']} | ratio | goal |", "|---|---|---|---|---|"]
    for f in figures:
        goal = "" if f.goal is None else (">= " if f.higher_is_better else "<= ") + f"{f.goal:g}x"
        if f.meets_goal is not None:
            goal += " ok" if f.meets_goal else " missed"
        lines.append(f"| {f.name.removesuffix(' ' + b['label'])} ({f.unit}) | {_sig(f.value)} | "
                     f"{_sig(f.reference)} | {f.ratio:.2f}x | {goal} |")
    lines += ["", "| run | L1 device | L2 host | L3 storage | computed | hit rate | duration (s) |",
              "|---|---|---|---|---|---|---|"]
    for s in (a, b):
        t = s["cache"]["responses"]
        rate = "–" if t["hit_rate"] is None else f"{t['hit_rate']:.1%}"
        lines.append(f"| {s['label']} | {t['device']:,} | {t['host']:,} | {t['storage']:,} | {t['computed']:,} | "
                     f"{rate} | {s['duration_s']:.1f} |")
    if files:
        lines += ["", "Files:", *(f"- {k}: `{v}`" for k, v in files.items())]
    return "\n".join(lines) + "\n"
