"""Markers by what a test needs, set at collection so a new test gets them without a decorator.

| marker      | set when                                                                           |
|-------------|------------------------------------------------------------------------------------|
| `processes` | it uses a fixture in `PROCESS_FIXTURES`, or its module holds a class in            |
|             | `PROCESS_CLASSES` (the daemon, its HTTP process, the controller, vLLM, bench's     |
|             | managed daemon); a test that runs one through a command is marked by hand          |
| `redis`     | it uses a `redis_*` fixture, runs with an L3 parameter `redis*`, or skips without  |
|             | `redis-server` (a `skipif` whose reason names it)                                  |
| `vllm`      | it skips without vLLM (`NO_VLLM`), or runs real engines (the `engines` fixture:    |
|             | also `processes` and `slow`)                                                       |
| `deploy`    | it is in tests/deploy (promtool, prometheus, systemd-analyze, hadolint ...)        |
| `slow`      | over 1.5 s here: every test with real engines, and those in tests/slow_tests.txt   |

An explicit `@pytest.mark.<marker>` adds to these where a rule cannot tell (a test that starts
processes through a command, say). ``python -m pytest -m "not slow"`` is the fast loop; CI runs
everything. The markers are registered in pyproject.toml (``--strict-markers``).

Under ``pytest -n N`` (pytest-xdist; pyproject's addopts hand out whole files, in collection
order) each worker collects the files heaviest first, by ``file_weight``: the long vLLM modules
start at once on both workers, and the last files handed out are short, so neither worker idles
for long at the end of the run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.vllm_engines import NO_VLLM

TESTS = Path(__file__).resolve().parent
SLOW_LIST = TESTS / "slow_tests.txt"

PROCESS_FIXTURES = frozenset({"daemons", "live_daemon", "engines", "served"})
PROCESS_CLASSES = frozenset({  # by name: this file imports no harness
    "tests.support.daemon.Daemon",
    "tests.api_server.harness.TokenizerProcess",
    "tests.controller.controller_harness.ControllerHarness",
    "hicache.bench.engine_lib.vllm_driver.VllmProcess",
    "hicache.bench.serve_lib.daemon.ManagedDaemon",
})
VLLM_FIXTURES = frozenset({"engines"})


def slow_tests(path: Path = SLOW_LIST) -> frozenset[str]:
    """The measured slow tests: a node id without parameters per line (every parameter of the
    function), ``#`` starts a comment."""
    names = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return frozenset(n for n in names if n)


def _function_id(item: pytest.Item) -> str:
    """The node id without its parameters (``tests/<folder>/<file>.py::[Class::]function``):
    the slow list's key."""
    return item.nodeid.split("[", 1)[0]


def _skip_reasons(item: pytest.Item) -> str:
    return " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def _module_holds_process_class(item: pytest.Item, cache: dict[str, bool]) -> bool:
    module = getattr(item, "module", None)
    if module is None:
        return False
    if module.__name__ not in cache:
        cache[module.__name__] = any(
            isinstance(v, type) and f"{v.__module__}.{v.__qualname__}" in PROCESS_CLASSES
            for v in vars(module).values()
        )
    return cache[module.__name__]


def needs(item: pytest.Item, module_cache: dict[str, bool]) -> set[str]:
    """The need markers of ``item`` by the rules of the module docstring (``slow`` aside)."""
    fixtures = set(getattr(item, "fixturenames", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    reasons = _skip_reasons(item)
    found: set[str] = set()
    if fixtures & VLLM_FIXTURES:
        found |= {"vllm", "processes"}
    if NO_VLLM in reasons:
        found.add("vllm")
    if fixtures & PROCESS_FIXTURES or _module_holds_process_class(item, module_cache):
        found.add("processes")
    if (any(f.startswith("redis_") for f in fixtures) or "redis-server" in reasons
            or any(isinstance(v, str) and v.startswith("redis") for v in params.values())):
        found.add("redis")
    if Path(str(item.path)).resolve().is_relative_to(TESTS / "deploy"):
        found.add("deploy")
    return found


SECONDS_BY_MARK = {"vllm": 45.0, "slow": 12.0}
"""A rough cost of one test by its heaviest marker, measured here (a real-vLLM test with its
share of the module's engines, a listed slow test); any other test counts 0.1 s."""


def file_weight(items: list[pytest.Item]) -> float:
    """The rough seconds a file's tests take (``SECONDS_BY_MARK``): the order of xdist's work."""
    def cost(item: pytest.Item) -> float:
        marks = {m.name for m in item.iter_markers()}
        return next((s for m, s in SECONDS_BY_MARK.items() if m in marks), 0.1)
    return sum(cost(i) for i in items)


def heaviest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with whole files ordered by ``file_weight``, heaviest first; a file's own tests
    keep their order and stay together (module fixtures are set up once)."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    files = sorted(by_file.values(), key=file_weight, reverse=True)  # stable: ties keep their order
    return [item for f in files for item in f]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = slow_tests()
    module_cache: dict[str, bool] = {}
    for item in items:
        marks = needs(item, module_cache)
        if VLLM_FIXTURES & set(getattr(item, "fixturenames", ())) or _function_id(item) in slow:
            marks.add("slow")
        for name in sorted(marks - {m.name for m in item.iter_markers()}):
            item.add_marker(name)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = heaviest_files_first(items)
