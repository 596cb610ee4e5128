"""Prometheus metrics of every hicache process, served as one ``/metrics`` (docs/architecture.md §11).

==============  ===============================================================================
module          owns
==============  ===============================================================================
``catalogue``   every metric (``SPECS``), the values of each label, the series each process
                creates at zero (``SERIES_OWNERS``), and the table of who records what
``recording``   ``Metrics``, the recording API (no-op when disabled), and ``RequestTracker``
``process``     this process's ``Metrics`` (``init_process_metrics`` / ``get_metrics``), the
                shared multiprocess directory, and ``render_metrics``
==============  ===============================================================================

The names below are the package's face; import them from ``hicache.metrics``.
"""

from __future__ import annotations

from hicache.metrics.catalogue import (
    DIRECTIONS,
    KV_EVENT_OUTCOMES,
    PROCESSES,
    REQUEST_STATUSES,
    RESTARTABLE,
    SERIES_OWNERS,
    SPECS,
    STORAGE_OPS,
    TIERS,
    MetricSpec,
)
from hicache.metrics.process import (
    CONTENT_TYPE,
    MULTIPROC_ENV,
    get_metrics,
    init_process_metrics,
    mark_process_dead,
    prepare_multiprocess_dir,
    render_metrics,
)
from hicache.metrics.recording import (
    Metrics,
    RequestTracker,
    TokenCounts,
    TransferRecord,
)

__all__ = [
    "CONTENT_TYPE",
    "DIRECTIONS",
    "KV_EVENT_OUTCOMES",
    "MULTIPROC_ENV",
    "MetricSpec",
    "Metrics",
    "PROCESSES",
    "REQUEST_STATUSES",
    "RESTARTABLE",
    "RequestTracker",
    "SERIES_OWNERS",
    "SPECS",
    "STORAGE_OPS",
    "TIERS",
    "TokenCounts",
    "TransferRecord",
    "get_metrics",
    "init_process_metrics",
    "mark_process_dead",
    "prepare_multiprocess_dir",
    "render_metrics",
]
