"""README.md and docs/*.md stay true to the code.

(a) Every ```yaml block that is a hicache config (a top-level key is a section of the
    config: model, engine, cache, server, ...) passes what ``hicache check-config`` checks:
    ``load_config`` and the start checks. A block whose first line is
    ``# fragment: a.b.c`` is checked nested under that key, over the defaults. Other YAML
    (a Kubernetes manifest, a vLLM setting) has no such key and is not a config.
    The one thing a doc may not bring is the reader's machine: variables named by
    ``key_env`` / ``password_env`` are set here, and a problem that only says a named file,
    directory, checkpoint or plug-in is absent on this machine is accepted.
(b) Every ``hicache ...`` command line in ```sh / ```bash / ```console blocks parses with
    the real parser (``hicache.cli.main.build_parser``; nothing runs).
(c) Every repository path named in backticks (``hicache/...``, ``tests/...``, ...) exists.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.cli.main import build_parser
from hicache.config import ConfigError, load_config
from hicache.daemon.startup_checks import startup_problems

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = {f.name for f in dataclasses.fields(load_config(os.devnull))}  # the defaults' sections
REPO_DIRS = ("hicache", "tests", "docs", "deploy", "storage_backends", "controller", "protos", "examples")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Reasons that name something absent from this machine, not a mistake in the block.
MACHINE_BOUND = re.compile(
    r"cannot read .*No such file|is not a directory|must be a local checkpoint directory"
    r"|no installed package provides it"
)


def blocks(langs: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) in langs:
                line = text[: m.start()].count("\n") + 1
                yield f"{doc.relative_to(ROOT)}:{line}", m.group(2)


def config_blocks() -> list[tuple[str, dict]]:
    found = []
    for where, body in blocks(("yaml", "yml")):
        fragment = re.match(r"#\s*fragment:\s*([\w.]+)", body)
        raw = yaml.safe_load(body)
        if fragment:
            for key in reversed(fragment.group(1).split(".")):
                raw = {key: raw}
        if isinstance(raw, dict) and SECTIONS & set(raw):
            found.append((where, raw))
    return found


def _env_names(raw: object) -> Iterator[str]:
    if isinstance(raw, dict):
        for key, value in raw.items():
            if key.endswith("_env") and isinstance(value, str):
                yield value
            yield from _env_names(value)
    elif isinstance(raw, list):
        for item in raw:
            yield from _env_names(item)


def config_problems(raw: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    for i, name in enumerate(_env_names(raw)):
        monkeypatch.setenv(name, f"doc-secret-{i}")
    path = tmp_path / "hicache.yaml"
    path.write_text(yaml.safe_dump(raw))
    try:
        problems = startup_problems(load_config(path))
    except ConfigError as exc:
        problems = exc.problems
    return [p for p in problems if not MACHINE_BOUND.search(p.reason)]


CONFIGS = config_blocks()


def test_the_docs_hold_config_blocks() -> None:
    assert len(CONFIGS) >= 8


@pytest.mark.parametrize("where,raw", CONFIGS, ids=[w for w, _ in CONFIGS])
def test_config_block_passes_check_config(where: str, raw: dict, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_problems(raw, tmp_path, monkeypatch) == [], where


def test_a_bad_config_block_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = {"cache": {"page_size": 3, "l3": {"backend": "file", "file": {"max_size_gb": "big"}}}}
    assert {p.path for p in config_problems(bad, tmp_path, monkeypatch)} == {
        "cache.page_size", "cache.l3.file.max_size_gb"}


def command_lines() -> list[tuple[str, str]]:
    found = []
    for where, body in blocks(("sh", "bash", "console", "shell")):
        console = "$ " in body
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            if console:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            for command in re.split(r"&&|;|\|", line.split(" #", 1)[0]):
                words = shlex.split(command, comments=True)
                if words[:1] == ["hicache"]:
                    found.append((where, command.strip()))
    return found


COMMANDS = command_lines()


def test_the_docs_hold_command_lines() -> None:
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("where,line", COMMANDS, ids=[f"{w} {c[:40]}" for w, c in COMMANDS])
def test_command_line_parses(where: str, line: str) -> None:
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert getattr(args, "_run", None) is not None, f"{where}: {line} names no command"


def test_a_bad_command_line_is_caught() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--no-such-flag"])


def named_paths() -> list[tuple[str, str]]:
    found = []
    pattern = re.compile(r"`((?:" + "|".join(REPO_DIRS) + r")/[^`\s]*)`")
    for doc in DOCS:
        for m in pattern.finditer(doc.read_text()):
            path = m.group(1)
            if not any(ch in path for ch in "*{}<>"):  # patterns and placeholders
                found.append((str(doc.relative_to(ROOT)), path))
    return found


def test_named_repository_paths_exist() -> None:
    paths = named_paths()
    assert len(paths) > 50
    missing = [f"{doc}: {path}" for doc, path in paths if not (ROOT / path.rstrip("/")).exists()]
    assert missing == []


def _slug(heading: str) -> str:
    """The anchor a heading gets on the usual renderers (lowercase, punctuation dropped)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_reach_a_file_and_heading() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"\w+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            file = (doc.parent / path) if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []
