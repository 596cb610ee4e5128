"""Every import of the product follows the README's layout table.

The table ("## Layout" in README.md) is parsed here, so the doc and the check cannot drift:
each row's first cell names one folder or module, its last cell what it may import (the
paths in backticks, each meaning that row; "everything" allows all; no path allows nothing
of the project). A module belongs to the row whose path is the longest prefix of it, and may
always import its own row. Imports are read with ``ast``: module level, inside functions and under
``TYPE_CHECKING`` alike.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("protos", "storage_backends", "controller", "hicache")
SCANNED = (*PROJECT, "examples")

# (importing module, imported module) pairs allowed against the table, each with its reason.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Row:
    unit: str                    # dotted: "hicache.tree", "hicache.config", "examples"
    allowed: tuple[str, ...]
    everything: bool


def _dotted(path: str) -> str:
    path = path.strip().rstrip("/")
    if path.endswith(".py"):
        path = path[:-3]
    return path.replace("/", ".")


def layout_rows(readme: str) -> list[Row]:
    section = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        unit = re.findall(r"`([^`]+)`", cells[0])[0]
        last = cells[-1]
        rows.append(Row(_dotted(unit), tuple(_dotted(p) for p in re.findall(r"`([^`]+)`", last)),
                        "everything" in last))
    return rows


def _within(module: str, unit: str) -> bool:
    return module == unit or module.startswith(unit + ".")


def row_of(module: str, rows: list[Row]) -> Row | None:
    matches = [r for r in rows if _within(module, r.unit)]
    return max(matches, key=lambda r: len(r.unit), default=None)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The project modules ``path`` imports (``from pkg import sub`` names ``pkg.sub``)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if (ROOT / base.replace(".", "/") / a.name).exists()
                         or (ROOT / base.replace(".", "/") / f"{a.name}.py").exists())
    return {m for m in found if m.split(".")[0] in PROJECT}


def violations(rows: list[Row]) -> list[str]:
    bad = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = module_name(path)
            if module == "hicache":
                assert imports_of(path) == set(), "hicache/__init__.py is the face: it imports nothing"
                continue
            own = row_of(module, rows)
            assert own is not None, f"{module} is in no row of the README's layout table"
            for target in sorted(imports_of(path)):
                target_row = row_of(target, rows)
                if target == "hicache" or own.everything or target_row is own:
                    continue  # hicache's __init__ is the package's face, everyone's
                if target_row is not None and target_row.unit in own.allowed:
                    continue
                if (module, target) in KNOWN_EXCEPTIONS:
                    continue
                bad.append(f"{path.relative_to(ROOT)} ({own.unit} row) imports {target}")
    return bad


def test_every_import_is_allowed_by_the_readme_table() -> None:
    rows = layout_rows((ROOT / "README.md").read_text())
    assert len(rows) > 10
    assert violations(rows) == []


def test_table_paths_exist_and_rows_are_distinct() -> None:
    rows = layout_rows((ROOT / "README.md").read_text())
    units = [r.unit for r in rows]
    assert len(units) == len(set(units))
    for r in rows:
        for name in (r.unit, *r.allowed):
            base = ROOT / name.replace(".", "/")
            assert base.is_dir() or base.with_suffix(".py").is_file(), name


def test_the_check_catches_an_upward_import() -> None:
    # tree importing the scheduler would be upward: the same table must refuse it.
    rows = layout_rows((ROOT / "README.md").read_text())
    tree = row_of("hicache.tree.cache", rows)
    assert tree is not None and tree.unit == "hicache.tree"
    assert row_of("hicache.scheduler.process", rows).unit not in tree.allowed  # type: ignore[union-attr]
    assert row_of("hicache.daemon.launcher", rows).unit == "hicache.daemon"  # type: ignore[union-attr]
    assert row_of("hicache.daemon.startup_checks", rows).unit == "hicache.daemon.startup_checks"  # type: ignore[union-attr]
    assert row_of("hicache.runtime.ipc", rows).unit == "hicache.runtime"  # type: ignore[union-attr]
