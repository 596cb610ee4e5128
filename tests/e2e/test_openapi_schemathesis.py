"""A bounded schemathesis run against ``GET /openapi.json`` of a real daemon (tiny model).

Every operation of the document is called with requests generated from its schemas, and
every response must: not be a 5xx, have a documented status code and content type, and
match the documented schema. Afterwards the daemon is healthy and its greedy output for a
fixed prompt is the one it gave before the run.

``PUT /cache/storage`` is left out: a generated config would attach a file backend at a
generated path (writing outside the test's directory) or a Redis backend at a generated
address. The other admin mutations are kept: flushing L1/L2 and clearing or detaching L3
change where prefixes are cached, never what greedy decoding produces, which the last test
checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon import Daemon

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def _config(tmp: Path) -> dict[str, Any]:
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 2048}, "l2": {"tokens": 8192},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512, "max_new_tokens_limit": 8,
                      "default_max_new_tokens": 4},
        # n samples of a prompt as long as the context are n prefills: bounded, so that a
        # generated worst case stays well inside the per-request timeout on a small machine
        "server": {"max_samples": 4},
        "logging": {"level": "warning"},
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, list[int]]]:
    """The daemon and its greedy output for ``PROMPT`` before the run."""
    tmp = tmp_path_factory.mktemp("openapi")
    d = Daemon(tmp, _config(tmp))
    d.start()
    try:
        yield d, d.generate(PROMPT)["output_ids"]
    finally:
        code = d.stop()
    assert code == 0, d.log()


@pytest.fixture(scope="module")
def api_schema(served: tuple[Daemon, list[int]]) -> Any:
    return schemathesis.openapi.from_url(served[0].url("/openapi.json"))


lazy = schemathesis.pytest.from_fixture("api_schema").exclude(method="PUT", path="/cache/storage")


@lazy.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_generated_requests_conform(case: Any) -> None:
    case.call_and_validate(checks=CHECKS, timeout=60)


def test_daemon_is_healthy_and_unchanged_afterwards(served: tuple[Daemon, list[int]]) -> None:
    d, before = served
    assert d.get("/health")["status"] == "ok"
    assert d.generate(PROMPT)["output_ids"] == before
    assert d.proc is not None and d.proc.poll() is None
