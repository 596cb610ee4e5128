"""The marker rules of tests/conftest.py: the slow list names tests that exist, and each rule
marks what it says."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from tests.conftest import SLOW_LIST, TESTS, pytest_collection_modifyitems, slow_tests
from tests.support.daemon import Daemon
from tests.support.redis_servers import NO_REDIS
from tests.support.vllm_engines import NO_VLLM


def _defined(path: Path) -> set[str]:
    """The names a test file defines at its top level (``def``, ``class`` or ``X = ...``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_every_listed_slow_test_exists() -> None:
    """A renamed or removed test must leave the list, or a new one would never be marked."""
    missing = []
    for entry in sorted(slow_tests()):
        rel, _, names = entry.partition("::")
        path = TESTS.parent / rel
        if not path.is_file() or names.split("::")[0] not in _defined(path):
            missing.append(entry)
    assert not missing, f"{SLOW_LIST.name} names tests that do not exist: {missing}"


def test_slow_list_parsing_keeps_names_and_drops_comments(tmp_path: Path) -> None:
    listed = tmp_path / "slow.txt"
    listed.write_text("# a comment\n\ntests/e2e/test_a.py::test_b  # 12 s\n  tests/x/test_y.py::TestZ\n")
    assert slow_tests(listed) == {"tests/e2e/test_a.py::test_b", "tests/x/test_y.py::TestZ"}


class FakeItem:
    """What the rules read of a collected test."""

    def __init__(self, path: Path, name: str = "test_x", fixtures: tuple[str, ...] = (),
                 params: dict[str, object] | None = None, skip_reason: str | None = None,
                 module_globals: dict[str, object] | None = None) -> None:
        self.path, self.fixturenames = path, list(fixtures)
        self.nodeid = f"{path.relative_to(TESTS.parent).as_posix()}::{name}"
        if params is not None:
            self.callspec = SimpleNamespace(params=params)
        self.module = ModuleType(f"fake_{abs(hash((path, name)))}")
        self.module.__dict__.update(module_globals or {})
        self.marks = [pytest.mark.skipif(True, reason=skip_reason).mark] if skip_reason else []

    def iter_markers(self, name: str | None = None) -> list[pytest.Mark]:
        return [m for m in self.marks if name is None or m.name == name]

    def add_marker(self, name: str) -> None:
        self.marks.append(getattr(pytest.mark, name).mark)


UNIT = TESTS / "tree" / "test_basic.py"


@pytest.mark.parametrize("item, marks", [
    (FakeItem(UNIT), set()),
    (FakeItem(UNIT, fixtures=("tmp_path", "daemons")), {"processes"}),
    (FakeItem(UNIT, module_globals={"Daemon": Daemon}), {"processes"}),
    (FakeItem(UNIT, fixtures=("redis_cluster",)), {"redis"}),
    (FakeItem(UNIT, params={"kind": "redis-cluster"}), {"redis"}),
    (FakeItem(UNIT, params={"kind": "file"}), set()),
    (FakeItem(UNIT, skip_reason=NO_REDIS), {"redis"}),
    (FakeItem(UNIT, skip_reason=NO_VLLM), {"vllm"}),
    (FakeItem(UNIT, fixtures=("engines",)), {"vllm", "processes", "slow"}),
    (FakeItem(TESTS / "deploy" / "test_deploy_systemd.py"), {"deploy"}),
], ids=["unit", "daemons", "daemon-class", "redis-fixture", "redis-param", "file-param", "redis-skip",
        "vllm-skip", "engines", "deploy"])
def test_the_rules_mark_what_a_test_needs(item: FakeItem, marks: set[str]) -> None:
    pytest_collection_modifyitems(None, [item])  # type: ignore[arg-type, list-item]
    assert {m.name for m in item.iter_markers()} - {"skipif"} == marks


def test_a_listed_slow_test_is_marked_slow_in_every_parameter() -> None:
    entry = next(iter(sorted(slow_tests())), None)
    if entry is None:
        pytest.skip("the slow list is empty")
    item = FakeItem(TESTS.parent / entry.partition("::")[0])
    item.nodeid = f"{entry}[p1]"
    pytest_collection_modifyitems(None, [item])  # type: ignore[arg-type, list-item]
    assert "slow" in {m.name for m in item.iter_markers()}
