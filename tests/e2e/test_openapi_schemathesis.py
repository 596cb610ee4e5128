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

The operations are parametrized from the document the code builds
(``openapi_document``), and each test runs Hypothesis over its operation's strategy from
the live document. This uses schemathesis as a library only, not its pytest plugin (whose
lazy fixture loader depends on pytest internals), so it runs under any pytest the test
extra allows; a test checks that the live document has exactly the operations tested.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.api_server.openapi import openapi_document
from hicache.api_server.validation import ModelLimits
from tests.support.daemon import Daemon

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
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


EXCLUDED = {("PUT", "/cache/storage")}


def _operations(document: dict[str, Any]) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation in ``document`` but the excluded ones."""
    ops = [(method.upper(), path) for path, item in document["paths"].items() for method in item
           if method in {"get", "put", "post", "delete", "patch"}]
    return sorted(op for op in ops if op not in EXCLUDED)


# The limits only shape the bodies' bounds; the set of operations does not depend on them.
OPERATIONS = _operations(openapi_document(ModelLimits(name="tiny", vocab_size=256, max_context=512,
                                                      max_new_tokens_limit=8, default_max_new_tokens=4)))


def test_the_live_document_has_exactly_the_tested_operations(api_schema: Any) -> None:
    assert _operations(api_schema.raw_schema) == OPERATIONS


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_generated_requests_conform(api_schema: Any, method: str, path: str) -> None:
    operation = api_schema[path][method]
    statuses: list[int] = []

    @given(case=operation.as_strategy())
    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def conforms(case: Any) -> None:
        statuses.append(case.call_and_validate(checks=CHECKS, timeout=60).status_code)

    conforms()
    assert statuses, "no request was generated"
    print(f"{method} {path}: {len(statuses)} requests, statuses {sorted(set(statuses))}")


def test_daemon_is_healthy_and_unchanged_afterwards(served: tuple[Daemon, list[int]]) -> None:
    d, before = served
    assert d.get("/health")["status"] == "ok"
    assert d.generate(PROMPT)["output_ids"] == before
    assert d.proc is not None and d.proc.poll() is None
