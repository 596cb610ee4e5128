"""The metrics of one process and the directory all processes share (docs/architecture.md §11).

prometheus-client's multiprocess mode: each process writes its samples to memory-mapped
files in one shared directory, and the tokenizer process renders the union of all of them.

Lifecycle (who calls what)::

    launcher   prepare_multiprocess_dir(path)   before spawning anything: creates/wipes the
                                                directory and sets PROMETHEUS_MULTIPROC_DIR,
                                                which spawned children inherit
               init_process_metrics(cfg, "launcher")   to count restarts
               mark_process_dead(pid)           after reaping any child (dead or restarted)
    each child init_process_metrics(cfg, name)  once at start, before recording anything
    tokenizer  render_metrics() -> bytes        the body of GET /metrics

Gauges use ``livemostrecent``: the value is the one last set by a live process, and a dead
process's values disappear once the launcher calls ``mark_process_dead``. Counters and
histograms are summed over all processes, dead ones included, so a restarted controller's
totals keep counting from where the dead one stopped.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from hicache.config import MetricsConfig
from hicache.metrics.recording import NOOP, Metrics

log = logging.getLogger("hicache.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""The environment variable prometheus-client reads for the shared sample directory."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The media type of ``render_metrics()`` output (Prometheus text exposition 0.0.4)."""


def prepare_multiprocess_dir(path: str | os.PathLike[str]) -> Path:
    """Make ``path`` an empty private directory and export it as ``PROMETHEUS_MULTIPROC_DIR``.

    The launcher calls this before spawning the processes (they inherit the environment) and
    before its own ``init_process_metrics``. Stale sample files of an earlier run are removed,
    so counters start at zero. Returns the directory.
    """
    p = Path(path)
    if p.exists():
        for child in p.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ[MULTIPROC_ENV] = str(p)
    return p


def mark_process_dead(pid: int) -> None:
    """Drop the gauge values of a dead process (its counters keep counting in the totals).

    The launcher calls this after reaping a child, before restarting it. A no-op outside
    multiprocess mode.
    """
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]  # unannotated in prometheus_client


_current: Metrics | None = None


def init_process_metrics(config: MetricsConfig, process: str) -> Metrics:
    """Create this process's metrics (once per process; a second call returns the first result).

    With ``config.enabled`` and ``PROMETHEUS_MULTIPROC_DIR`` set, samples go to the shared
    directory. Enabled without the variable (a process started on its own), samples stay in
    this process and ``render_metrics`` shows only them. Disabled: a no-op ``Metrics``.
    The series ``process`` owns (``SERIES_OWNERS``) are created at zero.
    """
    global _current
    if _current is not None:
        return _current
    if not config.enabled:
        _current = Metrics(None)
        return _current
    from prometheus_client import CollectorRegistry, values

    if os.environ.get(MULTIPROC_ENV):
        # prometheus-client picks its value class when it is first imported; if that happened
        # before the directory was exported (a launcher that imported it early), switch now,
        # before any metric of this process exists.
        if not getattr(values.ValueClass, "_multiprocess", False):
            values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]  # unannotated in prometheus_client
    else:
        log.warning("%s is not set: /metrics shows the metrics of the %s process only", MULTIPROC_ENV, process)
    _current = Metrics(CollectorRegistry(auto_describe=True))
    _current.init_series(process)
    return _current


def get_metrics() -> Metrics:
    """This process's metrics; a no-op instance before ``init_process_metrics``."""
    return _current if _current is not None else NOOP


def render_metrics() -> bytes | None:
    """The exposition text of all processes' metrics; None when metrics are disabled."""
    m = get_metrics()
    if not m.enabled:
        return None
    from prometheus_client import CollectorRegistry, generate_latest

    path = os.environ.get(MULTIPROC_ENV)
    if path:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]  # unannotated in prometheus_client
        return generate_latest(registry)
    return generate_latest(m.registry) if m.registry is not None else None
