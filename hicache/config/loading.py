"""Loading: YAML (a file, ``$HICACHE_CONFIG`` or nothing) and ``--set dotted.key=value``
overrides -> a typed, resolved, validated ``HicacheConfig``; and back out as YAML with the
secrets redacted. Every problem is collected into one ``ConfigError`` (the CLI prints it
and exits 2). See docs/architecture.md §10.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from hicache.config.schema import ConfigError, ConfigProblem, HicacheConfig, L3Config
from hicache.config.sizing import resolve
from hicache.config.validation import validate

CONFIG_ENV = "HICACHE_CONFIG"


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> HicacheConfig:
    """Read, override, validate. ``path`` None falls back to ``$HICACHE_CONFIG``, then to defaults.

    Raises ``ConfigError`` (every problem at once) for a bad file, key or value.
    """
    if path is None:
        path = os.environ.get(CONFIG_ENV) or None
    raw: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError([ConfigProblem("", f"cannot read {path}: {exc.strerror or exc}")]) from exc
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError([ConfigProblem("", f"{path} is not valid YAML: {exc}")]) from exc
        if raw is None:
            raw = {}
    return config_from_dict(raw, overrides)


def config_from_dict(raw: Any, overrides: list[str] | None = None) -> HicacheConfig:
    problems: list[ConfigProblem] = []
    if not isinstance(raw, dict):
        raise ConfigError([ConfigProblem("", f"the top level must be a mapping, got {_type_name(raw)}")])
    raw = _deep_copy(raw)
    for item in overrides or []:
        _apply_override(raw, item, problems)
    cfg = resolve(_build(HicacheConfig, raw, "", problems))
    # Keys with a type problem fell back to their defaults above; check the relations of the
    # rest too, so that one run reports every problem, but once per key.
    reported = {p.path for p in problems}
    problems.extend(p for p in validate(cfg) if p.path not in reported)
    if problems:
        raise ConfigError(problems)
    return cfg


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"cache.page_size=32"`` -> (["cache", "page_size"], 32); values are parsed as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} is not of the form key.path=value")
    parts = [p.strip() for p in key.split(".")]
    if any(not p for p in parts):
        raise ValueError(f"override {item!r} has an empty key segment")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return parts, parsed


def _apply_override(raw: dict[str, Any], item: str, problems: list[ConfigProblem]) -> None:
    try:
        parts, value = parse_override(item)
    except ValueError as exc:
        problems.append(ConfigProblem("--set", str(exc)))
        return
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.append(ConfigProblem(".".join(parts[: i + 1]), "is not a section; cannot set a key below it"))
            return
        node = child
    node[parts[-1]] = value


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_MISSING = object()


def _build(cls: type, data: Any, path: str, problems: list[ConfigProblem]) -> Any:
    """Build dataclass ``cls`` from a mapping, appending a problem for each bad key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(ConfigProblem(path, f"must be a mapping, got {_type_name(data)}"))
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            known = ", ".join(sorted(names))
            problems.append(ConfigProblem(_join(path, str(key)), f"unknown key (known keys here: {known})"))
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        if f.metadata.get("secret"):  # a problem must not quote the value
            found: list[ConfigProblem] = []
            value = _convert(hints[f.name], data[f.name], _join(path, f.name), found)
            problems.extend(ConfigProblem(p.path, f"must be a string (quote it in YAML), got "
                                                  f"{_type_name(data[f.name])}") for p in found)
        else:
            value = _convert(hints[f.name], data[f.name], _join(path, f.name), problems)
        if value is not _MISSING:
            kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # pragma: no cover - conversion already checked types
        problems.append(ConfigProblem(path, str(exc)))
        return cls()


def _convert(hint: Any, value: Any, path: str, problems: list[ConfigProblem]) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, problems)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, path, problems)
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            choices = ", ".join(str(a) for a in args)
            problems.append(ConfigProblem(path, f"must be one of {choices}; got {value!r}"))
            return _MISSING
        return value
    if origin is dict:  # a mapping of names: to sections (dataclasses), or free (a plug-in's settings)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            problems.append(ConfigProblem(path, f"must be a mapping with string keys, got {_type_name(value)}"))
            return _MISSING
        if len(args) == 2 and isinstance(args[1], type) and dataclasses.is_dataclass(args[1]):
            return {k: _build(args[1], v, _join(path, k), problems) for k, v in value.items()}
        return dict(value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            problems.append(ConfigProblem(path, f"must be a list, got {_type_name(value)}"))
            return _MISSING
        items = [_convert(args[0], v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return _MISSING if any(v is _MISSING for v in items) else tuple(items)
    if hint is bool:
        if not isinstance(value, bool):
            problems.append(ConfigProblem(path, f"must be true or false, got {value!r}"))
            return _MISSING
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(ConfigProblem(path, f"must be an integer, got {_type_name(value)} {value!r}"))
            return _MISSING
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(ConfigProblem(path, f"must be a number, got {_type_name(value)} {value!r}"))
            return _MISSING
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            problems.append(ConfigProblem(path, f"must be a string, got {_type_name(value)} {value!r}"))
            return _MISSING
        return value
    raise TypeError(f"config field {path} has an unsupported type {hint!r}")  # pragma: no cover


def to_dict(cfg: Any) -> Any:
    """The config as plain YAML-ready data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: HicacheConfig) -> str:
    """The config as YAML, for people: secrets (the Redis password, inline or in the URL, of
    ``cache.l3`` and of every ``cache.l3_stores`` entry, ``server.api_key``, the inline keys
    of ``server.api_keys`` and ``server.operator``, and a plug-in backend's secret options)
    show as ``***``."""
    from hicache.storage_settings import redacted_options
    from storage_backends.settings import redact_url

    data = to_dict(cfg)

    def redact_l3(section: dict[str, Any], l3: L3Config) -> None:
        redis_section = section["redis"]
        if redis_section.get("password") is not None:
            redis_section["password"] = "***"
        redis_section["url"] = redact_url(redis_section["url"])
        section["options"] = redacted_options(l3)

    redact_l3(data["cache"]["l3"], cfg.cache.l3)
    for name, store in cfg.cache.l3_stores.items():
        redact_l3(data["cache"]["l3_stores"][name], store)
    if data["server"].get("api_key") is not None:
        data["server"]["api_key"] = "***"
    for entry in [*(data["server"].get("api_keys") or []), data["server"].get("operator") or {}]:
        if entry.get("key") is not None:
            entry["key"] = "***"
    return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
