"""Encoding and decoding of messages: msgpack maps ``{"v": version, "t": tag, field: value...}``.

Decoding is the boundary where untrusted bytes become messages, so it checks everything:
frame size, msgpack validity, the version, the tag (looked up in the explicit ``MESSAGE_TYPES``
table, never by class name), that every required field is present, that no unknown field
is, and the type of each field, nested dataclasses included. Any failure is a
``ProtocolError`` naming the problem; nothing else escapes ``decode``.

The checks are compiled once per class from its type hints into small closures, so a
decode costs little more than ``msgpack.unpackb`` itself.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import msgpack

from protos.base import MAX_FRAME_BYTES, PROTOCOL_VERSION, Message, ProtocolError
from protos.table import ROUTES

__all__ = ["MESSAGE_TYPES", "decode", "encode"]

MESSAGE_TYPES: tuple[type[Message], ...] = tuple(route.message for route in ROUTES)
"""Every message type, from the protocol table (``protos.table``): the only tags decoded."""

# A checker validates one decoded value and returns it (converted where needed, e.g. int ->
# float or a nested dict -> dataclass); it raises _FieldError with the reason.
Checker = Callable[[Any], Any]


class _FieldError(Exception):
    pass


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", bytes: "bytes"}
_PLURALS = {int: "integers", str: "strings", bytes: "byte strings"}


def _describe(value: Any) -> str:
    return {dict: "a map", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", bytes: "bytes", type(None): "nil"}.get(type(value), type(value).__name__)


def _scalar(kind: type) -> Checker:
    def check(value: Any) -> Any:
        if type(value) is not kind:
            raise _FieldError(f"must be {_NAMES[kind]}, got {_describe(value)}")
        return value

    check.passes_through = True  # type: ignore[attr-defined]
    return check


def _float(value: Any) -> float:
    t = type(value)
    if t is float:
        return float(value)
    if t is int:
        return float(value)
    raise _FieldError(f"must be a number, got {_describe(value)}")


def _scalar_list(kind: type) -> Checker:
    expected = {kind}

    def check(value: Any) -> list[Any]:
        if type(value) is not list:
            raise _FieldError(f"must be a list, got {_describe(value)}")
        # set(map(type, ...)) runs in C: far cheaper than a Python loop over page lists.
        if value and set(map(type, value)) != expected:
            bad = next(x for x in value if type(x) is not kind)
            raise _FieldError(f"must be a list of {_PLURALS[kind]}, got an element that is {_describe(bad)}")
        return value

    check.passes_through = True  # type: ignore[attr-defined]
    return check


def _list_of(inner: Checker) -> Checker:
    def check(value: Any) -> list[Any]:
        if type(value) is not list:
            raise _FieldError(f"must be a list, got {_describe(value)}")
        return [inner(x) for x in value]

    return check


def _dict_of(inner: Checker | None) -> Checker:
    def check(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise _FieldError(f"must be a map, got {_describe(value)}")
        if value and set(map(type, value)) != {str}:
            raise _FieldError("must be a map with string keys")
        if inner is None:
            return value
        if getattr(inner, "passes_through", False):
            for v in value.values():
                inner(v)
            return value
        return {k: inner(v) for k, v in value.items()}

    return check


def _optional(inner: Checker) -> Checker:
    def check(value: Any) -> Any:
        return None if value is None else inner(value)

    return check


def _one_of(values: tuple[Any, ...]) -> Checker:
    """A ``Literal[...]`` field: exactly one of ``values`` (same type: ``True`` is not ``1``)."""
    allowed = {(type(v), v) for v in values}
    shown = ", ".join(repr(v) for v in values)

    def check(value: Any) -> Any:
        if (type(value), value) not in allowed:
            raise _FieldError(f"must be one of {shown}, got {value!r:.60}")
        return value

    check.passes_through = True  # type: ignore[attr-defined]
    return check


def _checker_for(hint: Any) -> Checker:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Literal:
        return _one_of(args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"unsupported union {hint!r}")
        return _optional(_checker_for(inner[0]))
    if hint is float:
        return _float
    if hint in (int, str, bool, bytes):
        return _scalar(hint)
    if hint is Any:
        return lambda value: value
    if origin is list:
        if args[0] in (int, str, bytes):
            return _scalar_list(args[0])
        return _list_of(_checker_for(args[0]))
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"map keys must be str: {hint!r}")
        return _dict_of(None if args[1] is Any else _checker_for(args[1]))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _struct(hint)
    raise TypeError(f"unsupported field type {hint!r}")


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    check: Checker
    required: bool


def _fields_of(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(_Field(f.name, _checker_for(hints[f.name]), required))
    return tuple(out)


def _build(cls: type, fields: tuple[_Field, ...], data: dict[str, Any], skip: int) -> Any:
    """Construct ``cls`` from ``data``; ``skip`` keys of ``data`` are envelope keys (v, t)."""
    kwargs = {}
    for f in fields:
        if f.name in data:
            try:
                kwargs[f.name] = f.check(data[f.name])
            except _FieldError as exc:
                raise _FieldError(f"field {f.name!r} {exc}") from None
        elif f.required:
            raise _FieldError(f"missing field {f.name!r}")
    if len(kwargs) + skip != len(data):
        known = {f.name for f in fields} | {"v", "t"}
        unknown = sorted(str(k) for k in data if k not in known)
        raise _FieldError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    return cls(**kwargs)


def _struct(cls: type) -> Checker:
    fields = _fields_of(cls)

    def check(value: Any) -> Any:
        if type(value) is not dict:
            raise _FieldError(f"must be a map, got {_describe(value)}")
        return _build(cls, fields, value, 0)

    return check


def _to_wire(value: Any) -> Any:
    """Nested dataclasses (alone or in a list) become maps; everything else is already
    msgpack-native."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if type(value) is list:
        return [_to_wire(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class _Spec:
    cls: type[Message]
    tag: str
    fields: tuple[_Field, ...]
    names: tuple[str, ...]
    nested: frozenset[str]


def _compile(classes: tuple[type[Message], ...]) -> tuple[dict[type, _Spec], dict[str, _Spec]]:
    by_cls: dict[type, _Spec] = {}
    by_tag: dict[str, _Spec] = {}
    for cls in classes:
        if not cls.TAG or cls.TAG in by_tag:
            raise TypeError(f"message {cls.__name__} has a missing or duplicate tag {cls.TAG!r}")
        hints = typing.get_type_hints(cls)
        nested = frozenset(
            f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]  # every message is a dataclass
            if any(dataclasses.is_dataclass(a) for a in (hints[f.name], *typing.get_args(hints[f.name])))
        )
        fields = _fields_of(cls)
        spec = _Spec(cls, cls.TAG, fields, tuple(f.name for f in fields), nested)
        by_cls[cls] = by_tag[cls.TAG] = spec
    return by_cls, by_tag


_BY_CLASS, _BY_TAG = _compile(MESSAGE_TYPES)
_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack


def encode(msg: Message) -> bytes:
    """One message to one frame. Raises ProtocolError for an unregistered or unencodable message."""
    spec = _BY_CLASS.get(type(msg))
    if spec is None:
        raise ProtocolError(f"{type(msg).__name__} is not a registered message type")
    data: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": spec.tag}
    nested = spec.nested
    for name in spec.names:
        value = getattr(msg, name)
        data[name] = _to_wire(value) if name in nested else value
    try:
        frame = _packb(data)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {spec.tag}: {exc}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{spec.tag} frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return bytes(frame)


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """One frame to one message; any problem is a ProtocolError naming it."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        data = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for garbage; all mean the same here
        raise ProtocolError(f"frame is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if type(data) is not dict:
        raise ProtocolError(f"frame must be a map, got {_describe(data)}")
    version = data.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(f"protocol version {version!r} is not the supported version {PROTOCOL_VERSION}")
    tag = data.get("t")
    spec = _BY_TAG.get(tag) if type(tag) is str else None
    if spec is None:
        raise ProtocolError(f"unknown message tag {tag!r}")
    try:
        msg: Message = _build(spec.cls, spec.fields, data, 2)
    except _FieldError as exc:
        raise ProtocolError(f"{tag}: {exc}") from None
    return msg


def tag_of(cls: type[Message]) -> str:
    return _BY_CLASS[cls].tag
